//! Two small computations that are not training loops, on the runtime API.
//!
//! - [`sharded_sum_of_squares`]: a map-reduce. Four `Shard` actors of a mesh each own a slice of
//!   `0..n` as a burn tensor; one call to every member squares and sums its slice on its own
//!   device, and the program adds the four partial sums (eager calls, as Ray's tasks).
//! - [`producer_consumer`]: a loop recorded once as a compiled program (Pathways; Ray's compiled
//!   graphs). At run `k` the `Producer` makes `[k, 2k, 3k]`, its reply goes straight to the
//!   `Consumer` (never through the program), which adds it to an accumulator it keeps across
//!   runs and replies with the running total, the program's output.

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

use archipelago_actors::runtime::compiled::Recorder;
use archipelago_controller::prelude::*;

/// Shards of the map-reduce (one mesh member, one device each).
pub const SHARDS: usize = 4;

/// One slice `start..end` of the values, held on the actor's device.
pub struct Shard {
    values: Tensor<Flex, 1>,
}

impl Actor for Shard {
    /// The slice it owns: `start..end`.
    type Params = (usize, usize);
    async fn new((start, end): (usize, usize), _ctx: &Context<Self>) -> Result<Self, String> {
        let values: Vec<f32> = (start..end).map(|i| i as f32).collect();
        let len = values.len();
        Ok(Shard {
            values: Tensor::from_data(TensorData::new(values, [len]), &FlexDevice),
        })
    }
}

/// Σ x² over the shard's slice.
#[derive(Clone, Serialize, Deserialize)]
pub struct SquareSum;

impl Message for SquareSum {
    type Reply = f32;
}

impl Handler<SquareSum> for Shard {
    async fn handle(&mut self, _: SquareSum, _ctx: &Context<Self>) -> f32 {
        let x = self.values.clone();
        (x.clone() * x).sum().into_scalar()
    }
}

/// The types both computations would send across processes on a cluster (installed by each, so
/// that strict registration mode checks them in this one process too).
pub fn registry() -> Registry {
    Registry::new()
        .actor::<Shard>()
        .handles::<Shard, SquareSum>()
        .actor::<Producer>()
        .compiled::<Producer, Produce, u64>(Produce)
        .actor::<Consumer>()
        .compiled::<Consumer, Accumulate, Vec<f32>>(Accumulate)
}

/// Σ x² over `0..n`, as [`SHARDS`] shards on as many actors: each squares and sums its slice
/// with burn, and the program adds the partial sums.
pub fn sharded_sum_of_squares(n: usize) -> anyhow::Result<f32> {
    registry().install();
    let runtime = Runtime::local(DeviceSpec::cpus(SHARDS));
    let mesh = Mesh::new(&[("shard", SHARDS)])?;
    let shards = runtime
        .spawn_mesh::<Shard>(mesh, |coords| {
            (coords[0] * n / SHARDS, (coords[0] + 1) * n / SHARDS)
        })
        .get()?;
    // Every member computes at once; the program only waits for the four scalars.
    let mut total = 0.0f32;
    for partial in shards.call_all(SquareSum) {
        total += partial.get()?;
    }
    Ok(total)
}

/// Makes the vector `[k, 2k, 3k]` of run `k`.
pub struct Producer;

impl Actor for Producer {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Producer)
    }
}

/// Produce run `k`'s vector.
#[derive(Serialize, Deserialize)]
pub struct Produce(pub u64);

impl Message for Produce {
    type Reply = Vec<f32>;
}

impl Handler<Produce> for Producer {
    async fn handle(&mut self, Produce(k): Produce, _ctx: &Context<Self>) -> Vec<f32> {
        let k = k as f32;
        vec![k, 2.0 * k, 3.0 * k]
    }
}

/// Adds what it is given to an accumulator (a burn tensor) kept across runs.
pub struct Consumer {
    total: Option<Tensor<Flex, 1>>,
}

impl Actor for Consumer {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Consumer { total: None })
    }
}

/// Add a vector to the accumulator; replies with the running total.
#[derive(Serialize, Deserialize)]
pub struct Accumulate(pub Vec<f32>);

impl Message for Accumulate {
    type Reply = Vec<f32>;
}

impl Handler<Accumulate> for Consumer {
    async fn handle(&mut self, Accumulate(v): Accumulate, _ctx: &Context<Self>) -> Vec<f32> {
        let len = v.len();
        let incoming: Tensor<Flex, 1> = Tensor::from_data(TensorData::new(v, [len]), &FlexDevice);
        let total = match self.total.take() {
            Some(total) => total + incoming,
            None => incoming,
        };
        self.total = Some(total.clone());
        total.into_data().to_vec::<f32>().expect("f32 values")
    }
}

/// Records producer → consumer once, compiles it, and runs it `runs` times (run `k` hands the
/// producer `k`, from 1). Returns the consumer's running total after each run.
pub fn producer_consumer(runs: u64) -> anyhow::Result<Vec<Vec<f32>>> {
    registry().install();
    let runtime = Runtime::local(DeviceSpec::cpus(2));
    let producer = runtime.spawn::<Producer>(DeviceSpec::Cpu(0), ()).get()?;
    let consumer = runtime.spawn::<Consumer>(DeviceSpec::Cpu(1), ()).get()?;
    let mut recorder = Recorder::<u64>::new();
    let k = recorder.input();
    let produced = recorder.call(&producer, &k, Produce);
    let total = recorder.call(&consumer, &produced, Accumulate);
    let program = recorder.compile(&runtime, &total)?;
    let mut totals = Vec::new();
    for k in 1..=runs {
        totals.push(program.run(k).get()?);
    }
    Ok(totals)
}
