//! Typed actors on the runtime API, the smallest real program: two `Projector` actors on two
//! CPU devices each hold a burn weight matrix; a `Reducer` on a third device is handed the
//! *futures* of their projections (not the tensors), awaits them, fetches each output straight
//! from the actor that made it, and sums them. A `Flaky` actor panics once, which fails that
//! call with a named error; its restart policy rebuilds it and the next call works.

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::tensor::{Tensor, TensorData};

use archipelago_actors::fabric::DRIVER;
use archipelago_controller::prelude::*;

/// A weight matrix `[d_in, d_out]` (burn's layout) that projects inputs.
pub struct Projector {
    weights: Tensor<Flex, 2>,
}

/// Parameters of a [`Projector`]: input and output width, and which seed fills its weights.
#[derive(Clone)]
pub struct ProjectorParams {
    /// Input width.
    pub d_in: usize,
    /// Output width.
    pub d_out: usize,
    /// Weight seed.
    pub seed: u64,
}

/// The weights a projector built from `p` holds (a simple deterministic fill).
pub fn projector_weights(p: &ProjectorParams) -> Vec<f32> {
    (0..p.d_in * p.d_out)
        .map(|i| ((i as u64 * 7 + p.seed * 13) % 17) as f32 / 17.0 - 0.5)
        .collect()
}

impl Actor for Projector {
    type Params = ProjectorParams;
    async fn new(p: ProjectorParams, _ctx: &Context<Self>) -> Result<Self, String> {
        let data = TensorData::new(projector_weights(&p), [p.d_in, p.d_out]);
        Ok(Projector {
            weights: Tensor::from_data(data, &FlexDevice),
        })
    }
}

/// Projects a batch `[rows, d_in]`; the output stays on the projector, the caller gets a
/// reference.
pub struct Project(pub TypedTensor);

impl Message for Project {
    type Reply = Result<TensorRef, String>;
}

impl Handler<Project> for Projector {
    async fn handle(&mut self, Project(x): Project, ctx: &Context<Self>) -> Result<TensorRef, String> {
        let [rows, d_in] =
            <[usize; 2]>::try_from(x.shape()).map_err(|_| "expected a [rows, d_in] input".to_string())?;
        let x: Tensor<Flex, 2> = Tensor::from_data(TensorData::new(x.to_f32(), [rows, d_in]), &FlexDevice);
        let y = x.matmul(self.weights.clone());
        let shape = y.dims().to_vec();
        let values = y.into_data().to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
        Ok(ctx.put(TypedTensor::from_values(shape, &values)))
    }
}

/// Sums tensors it is handed futures of.
pub struct Reducer;

impl Actor for Reducer {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Reducer)
    }
}

/// The futures of the tensors to sum (calls still in flight when this message is sent).
pub struct SumOf(pub Vec<Call<Result<TensorRef, String>>>);

impl Message for SumOf {
    type Reply = Result<Vec<f32>, String>;
}

impl Handler<SumOf> for Reducer {
    async fn handle(&mut self, SumOf(parts): SumOf, ctx: &Context<Self>) -> Result<Vec<f32>, String> {
        let mut total: Option<Vec<f32>> = None;
        for part in parts {
            let tensor = part.await.map_err(|e| e.to_string())??;
            let values = ctx.fetch(&tensor).await.map_err(|e| e.to_string())?;
            let values = values.values::<f32>();
            match &mut total {
                None => total = Some(values.to_vec()),
                Some(t) => t.iter_mut().zip(values).for_each(|(a, b)| *a += b),
            }
        }
        total.ok_or_else(|| "nothing to sum".to_string())
    }
}

/// Counts calls and panics on the third of its life.
pub struct Flaky {
    calls: u32,
}

impl Actor for Flaky {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Flaky { calls: 0 })
    }
}

/// One call to [`Flaky`]; replies `(calls in this life, restarts so far)`.
pub struct Risky;

impl Message for Risky {
    type Reply = (u32, u32);
}

impl Handler<Risky> for Flaky {
    async fn handle(&mut self, _: Risky, ctx: &Context<Self>) -> (u32, u32) {
        self.calls += 1;
        if self.calls == 3 && ctx.restarts() == 0 {
            panic!("the third call of its first life");
        }
        (self.calls, ctx.restarts())
    }
}

/// What the example found.
#[derive(Debug)]
pub struct Outcome {
    /// The reducer's sum of both projections.
    pub sum: Vec<f32>,
    /// The same sum computed here with plain loops.
    pub expected: Vec<f32>,
    /// Tensor bytes that reached the program (0: it only passed futures along).
    pub bytes_through_program: u64,
    /// Tensor bytes from each projector to the reducer.
    pub bytes_to_reducer: [u64; 2],
    /// The error of the call that panicked.
    pub error: String,
    /// `Risky`'s reply after the restart: `(calls in the new life, restarts)`.
    pub after_restart: (u32, u32),
}

/// Runs the example on a runtime of 4 CPU devices.
pub fn run(rows: usize, d_in: usize, d_out: usize) -> anyhow::Result<Outcome> {
    let runtime = Runtime::local(DeviceSpec::cpus(4));
    // A one-process example: its types are not registered (`tensor_exchange` has registered
    // ones, a `Call` passed across hosts included), so strict registration mode is off for it.
    runtime.set_strict_registry(false);
    let params = |seed| ProjectorParams { d_in, d_out, seed };
    let projectors = [
        runtime.spawn::<Projector>(DeviceSpec::Cpu(0), params(1)).get()?,
        runtime.spawn::<Projector>(DeviceSpec::Cpu(1), params(2)).get()?,
    ];
    let reducer = runtime.spawn::<Reducer>(DeviceSpec::Cpu(2), ()).get()?;
    let input: Vec<f32> = (0..rows * d_in).map(|i| (i % 5) as f32 - 2.0).collect();
    let x = TypedTensor::from_values(vec![rows, d_in], &input);
    // Futures go into the reducer's call: the program never waits for or holds the outputs.
    let parts = projectors.iter().map(|p| p.call(Project(x.clone()))).collect();
    let sum = reducer.call(SumOf(parts)).get()?.map_err(anyhow::Error::msg)?;

    let mut expected = vec![0.0f32; rows * d_out];
    for seed in [1, 2] {
        let w = projector_weights(&params(seed));
        for r in 0..rows {
            for c in 0..d_out {
                let dot: f32 = (0..d_in).map(|k| input[r * d_in + k] * w[k * d_out + c]).sum();
                expected[r * d_out + c] += dot;
            }
        }
    }
    let links = runtime.link_bytes();
    let reducer_id = reducer.info().id;

    let flaky = runtime
        .spawn_with::<Flaky>(DeviceSpec::Cpu(3), (), SpawnOptions::named("flaky").restarts(1))
        .get()?;
    flaky.call(Risky).get()?;
    flaky.call(Risky).get()?;
    let error = flaky.call(Risky).get().expect_err("the third call panics");
    let after_restart = flaky.call(Risky).get()?;
    Ok(Outcome {
        sum,
        expected,
        bytes_through_program: links.touching(DRIVER),
        bytes_to_reducer: [
            links.between(projectors[0].info().id, reducer_id),
            links.between(projectors[1].info().id, reducer_id),
        ],
        error: error.to_string(),
        after_restart,
    })
}
