//! The program of docs/GUIDE.md ("Your first program"): one binary that runs on this process or,
//! unchanged, as the driver and the hosts of a cluster (`archipelago_controller::runtime::init`
//! reads the role from the environment).
//!
//! A `2 × 2` mesh of `Worker` actors each keeps a vector as a tensor in its store and hands out
//! a `TensorRef`; each worker is given its row partner's reference and computes a dot product,
//! fetching the partner's bytes straight from the partner (host to host on a cluster, never
//! through this program). Then: Ray's `wait` with a timeout (one slow call left pending, timed
//! out, and still run to the end by its actor), a `Flaky` actor whose handler panics (restarted
//! once, then ended for good), a compiled chain through all four workers run three times, and
//! the mesh stopped, with what its actors' ends, calls and tensors say afterwards.
//!
//! Results go to stdout, the same on this process and on a cluster; where the actors ran goes
//! to stderr (the hosts and devices differ). Run it with `cargo run` here, or on a cluster as
//! docs/GUIDE.md shows.

use std::time::Duration;

use archipelago_controller::prelude::*;
use serde::{Deserialize, Serialize};

/// Elements of each worker's vector.
const LEN: usize = 1024;

/// How long the slow call of the `wait` demonstration takes.
const SLOW: Duration = Duration::from_millis(3000);
/// How long `wait` waits for it (and for three quick calls).
const WAIT: Duration = Duration::from_millis(1500);

/// One member of the mesh: its rank, the reference to the vector it keeps, and counts of what
/// it has done.
struct Worker {
    rank: usize,
    mine: Option<TensorRef>,
    works_done: u32,
    steps: u64,
}

/// A worker's parameters: its rank in the mesh (row-major).
#[derive(Clone, Serialize, Deserialize)]
struct WorkerParams {
    rank: usize,
}

impl Actor for Worker {
    type Params = WorkerParams;
    async fn new(params: WorkerParams, _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Worker {
            rank: params.rank,
            mine: None,
            works_done: 0,
            steps: 0,
        })
    }
}

/// Make the vector `rank·len + i` (f32), keep it, and reply with a reference to it.
#[derive(Clone, Serialize, Deserialize)]
struct Fill {
    len: usize,
}

impl Message for Fill {
    type Reply = TensorRef;
}

impl Handler<Fill> for Worker {
    async fn handle(&mut self, Fill { len }: Fill, ctx: &Context<Self>) -> TensorRef {
        let values: Vec<f32> = (0..len).map(|i| (self.rank * len + i) as f32).collect();
        let tensor = ctx.put(TypedTensor::from_values(vec![len], &values));
        self.mine = Some(tensor.clone());
        tensor
    }
}

/// The dot product of this worker's vector with the one behind the reference.
#[derive(Serialize, Deserialize)]
struct Dot(TensorRef);

/// What [`Dot`] found: the product, and the bytes fetched from the other vector's owner.
#[derive(Serialize, Deserialize)]
struct DotReply {
    dot: f64,
    fetched: u64,
}

impl Message for Dot {
    type Reply = Result<DotReply, String>;
}

impl Handler<Dot> for Worker {
    async fn handle(&mut self, Dot(other): Dot, ctx: &Context<Self>) -> Result<DotReply, String> {
        let mine = self
            .mine
            .as_ref()
            .ok_or("this worker has no vector yet: send it `Fill` first")?;
        // Our own tensor comes from our own store; the other from its owner (no copy in one
        // process, raw bytes from the owner's host otherwise).
        let mine = ctx.fetch(mine).await.map_err(|e| e.to_string())?;
        let other = ctx.fetch(&other).await.map_err(|e| e.to_string())?;
        let dot = (mine.values::<f32>().iter())
            .zip(other.values::<f32>())
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        Ok(DotReply {
            dot,
            fetched: other.byte_len() as u64,
        })
    }
}

/// Sleep `millis` (without blocking the device's other actors), then reply with the rank.
#[derive(Clone, Serialize, Deserialize)]
struct Work {
    millis: u64,
}

impl Message for Work {
    type Reply = usize;
}

impl Handler<Work> for Worker {
    async fn handle(&mut self, Work { millis }: Work, _ctx: &Context<Self>) -> usize {
        tokio::time::sleep(Duration::from_millis(millis)).await;
        self.works_done += 1;
        self.rank
    }
}

/// How many `Work` messages this worker has finished.
#[derive(Clone, Serialize, Deserialize)]
struct WorksDone;

impl Message for WorksDone {
    type Reply = u32;
}

impl Handler<WorksDone> for Worker {
    async fn handle(&mut self, _: WorksDone, _ctx: &Context<Self>) -> u32 {
        self.works_done
    }
}

/// One link of the compiled chain: `2x + rank + 1`.
#[derive(Serialize, Deserialize)]
struct Step(u64);

impl Message for Step {
    type Reply = u64;
}

impl Handler<Step> for Worker {
    async fn handle(&mut self, Step(x): Step, _ctx: &Context<Self>) -> u64 {
        self.steps += 1;
        2 * x + self.rank as u64 + 1
    }
}

/// How many chain links this worker has run.
#[derive(Clone, Serialize, Deserialize)]
struct Steps;

impl Message for Steps {
    type Reply = u64;
}

impl Handler<Steps> for Worker {
    async fn handle(&mut self, _: Steps, _ctx: &Context<Self>) -> u64 {
        self.steps
    }
}

/// An actor whose handler panics: on the second call of its first life, and on every
/// `Explode`.
struct Flaky {
    calls: u32,
}

impl Actor for Flaky {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Flaky { calls: 0 })
    }
}

/// Replies `(calls in this life, restarts so far)`.
#[derive(Serialize, Deserialize)]
struct Risky;

impl Message for Risky {
    type Reply = (u32, u32);
}

impl Handler<Risky> for Flaky {
    async fn handle(&mut self, _: Risky, ctx: &Context<Self>) -> (u32, u32) {
        self.calls += 1;
        if self.calls == 2 && ctx.restarts() == 0 {
            panic!("the second call of its first life");
        }
        (self.calls, ctx.restarts())
    }
}

/// Always panics.
#[derive(Serialize, Deserialize)]
struct Explode;

impl Message for Explode {
    type Reply = ();
}

impl Handler<Explode> for Flaky {
    async fn handle(&mut self, _: Explode, _ctx: &Context<Self>) {
        panic!("Explode always panics");
    }
}

/// Every type that crosses processes: the actors (spawned on hosts from their parameters), the
/// messages and replies (sent as bincode), and the compiled chain's call. Every role installs
/// the same registry: the hosts run this same binary.
fn registry() -> Registry {
    Registry::new()
        .actor::<Worker>()
        .handles::<Worker, Fill>()
        .handles::<Worker, Dot>()
        .handles::<Worker, Work>()
        .handles::<Worker, WorksDone>()
        .handles::<Worker, Steps>()
        .compiled::<Worker, Step, u64>(Step)
        .actor::<Flaky>()
        .handles::<Flaky, Risky>()
        .handles::<Flaky, Explode>()
}

/// The panic text of a failed call, or the error's own text for any other error (the full
/// error names job, actor, type, host and device, which differ between runs on this process
/// and on a cluster).
fn failure_text(error: &CallError) -> String {
    match error {
        CallError::Failed(failure) => format!("failed: {}", failure.message),
        CallError::Stopped { reason, .. } => format!("stopped: {reason}"),
        CallError::Timeout { message, after, .. } => {
            format!("timeout: no reply to `{message}` within {after:?}")
        }
        other => other.to_string(),
    }
}

/// How an actor ended, without the names that differ between runs.
fn end_text(end: &ActorEnd) -> String {
    match end {
        ActorEnd::Stopped { reason } => format!("stopped ({reason})"),
        ActorEnd::Failed(failure) => format!("failed ({})", failure.message),
    }
}

fn main() -> anyhow::Result<()> {
    // No ARCHIPELAGO_* variable: 4 CPU devices of this process. ARCHIPELAGO_CONTROLLER set: the
    // driver of a cluster with at least 4 devices. ARCHIPELAGO_ROLE=host too: a host (never
    // returns).
    let runtime = archipelago_controller::runtime::init(registry(), DeviceSpec::cpus(4))?;
    let slots = runtime.slots();
    eprintln!(
        "{} slots: {}",
        slots.len(),
        (slots.iter())
            .map(|s| format!("{} {}", s.host, s.device))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // A 2 × 2 mesh: member r (row-major) on slot r.
    let mesh = Mesh::new(&[("row", 2), ("col", 2)])?;
    let workers = runtime
        .spawn_mesh_with::<Worker>(
            mesh,
            |c| WorkerParams {
                rank: c[0] * 2 + c[1],
            },
            |c| SpawnOptions::named(format!("worker-{}-{}", c[0], c[1])),
        )
        .get()?;
    let members = workers.members();
    for worker in members {
        eprintln!(
            "{} on {} of {}",
            worker.info().name,
            worker.info().device,
            worker.info().host
        );
    }

    // Tensors stay with the actor that made them; the program holds references.
    let mut refs = Vec::new();
    for call in workers.call_all(Fill { len: LEN }) {
        refs.push(call.get()?);
    }
    for (rank, r) in refs.iter().enumerate() {
        println!(
            "worker {rank} keeps {} {:?} ({} bytes)",
            r.dtype(),
            r.shape(),
            r.byte_len()
        );
    }

    // Each worker dots its vector with its partner's along the `row` axis: the reference goes
    // to the worker, the bytes from the partner to the worker.
    for (rank, worker) in members.iter().enumerate() {
        let coords = workers.mesh().coords(rank);
        let partner = workers.mesh().rank(&[1 - coords[0], coords[1]]);
        let reply = worker.call(Dot(refs[partner].clone())).get()?;
        let reply = reply.map_err(anyhow::Error::msg)?;
        println!(
            "worker {rank} · worker {partner} = {} ({} bytes fetched from worker {partner})",
            reply.dot, reply.fetched
        );
    }

    // The program fetches explicitly; `link_bytes` counts what reached it.
    let last = runtime.fetch(&refs[3]).get()?;
    let sum: f64 = last.values::<f32>().iter().map(|v| f64::from(*v)).sum();
    println!("worker 3's vector sums to {sum}");
    println!(
        "tensor bytes that reached this program: {}",
        runtime.link_bytes().touching(DRIVER)
    );

    // Ray's `wait`: the first 4 of 4 calls, or those done within WAIT.
    let calls = (members.iter().enumerate())
        .map(|(rank, m)| {
            let millis = if rank == 3 {
                SLOW.as_millis() as u64
            } else {
                10 * rank as u64
            };
            m.call(Work { millis })
        })
        .collect();
    let waited = runtime.wait(calls, 4, Some(WAIT));
    let mut ready: Vec<String> = (waited.ready.iter())
        .map(|(index, result)| match result {
            Ok(rank) => format!("{index} (worker {rank})"),
            Err(e) => format!("{index} ({})", failure_text(e)),
        })
        .collect();
    ready.sort();
    let pending: Vec<usize> = waited.pending.iter().map(|(index, _)| *index).collect();
    println!("wait: ready {}; pending {pending:?}", ready.join(", "));
    // The slow call, timed out: the caller gives up, the actor finishes the handler it started.
    for (_, call) in waited.pending {
        let outcome = call.timeout(Duration::from_millis(100)).get();
        match outcome {
            Ok(rank) => println!("the slow call came back after all (worker {rank})"),
            Err(e) => println!("the slow call: {}", failure_text(&e)),
        }
    }
    println!(
        "worker 3 finished its Work anyway: {} done",
        members[3].call(WorksDone).get()?
    );

    // A panicking handler: the call fails with the panic; one restart, then the actor ends.
    let flaky = runtime
        .spawn_at::<Flaky>(0, (), SpawnOptions::named("flaky").restarts(1))
        .get()?;
    println!("flaky: {:?}", flaky.call(Risky).get()?);
    match flaky.call(Risky).get() {
        Ok(reply) => println!("flaky did not panic: {reply:?}"),
        Err(e) => println!("flaky: {}", failure_text(&e)),
    }
    println!(
        "flaky after its restart (calls, restarts): {:?}",
        flaky.call(Risky).get()?
    );
    match flaky.call(Explode).get() {
        Ok(()) => println!("Explode did not panic"),
        Err(e) => println!("flaky: {}", failure_text(&e)),
    }
    println!("flaky ended: {}", end_text(&flaky.ended().get()));
    match flaky.call(Risky).get() {
        Ok(reply) => println!("flaky answered after its end: {reply:?}"),
        Err(e) => println!("a call after its end: {}", failure_text(&e)),
    }

    // A compiled chain through the four workers (across both hosts on a cluster): recorded
    // once, then each run hands in the input and takes the output.
    let mut recorder = Recorder::<u64>::new();
    let input = recorder.input();
    let mut value = recorder.call(&members[0], &input, Step);
    for rank in [1, 3, 2] {
        value = recorder.call(&members[rank], &value, Step);
    }
    let chain = recorder.compile(&runtime, &value)?;
    for x in 1..=3 {
        println!("chain({x}) = {}", chain.run(x).get()?);
    }
    println!("worker 2 ran {} chain links", members[2].call(Steps).get()?);
    drop(chain);

    // Stop the mesh: every member ends after the message it is handling.
    workers.stop("the program is done");
    for (rank, worker) in members.iter().enumerate() {
        println!("worker {rank} ended: {}", end_text(&worker.ended().get()));
    }
    match members[0].call(WorksDone).get() {
        Ok(n) => println!("worker 0 answered after its end: {n}"),
        Err(e) => println!("a call to a stopped worker: {}", failure_text(&e)),
    }
    match runtime.fetch(&refs[0]).get() {
        Ok(_) => println!("worker 0's tensor outlived it"),
        Err(TensorError::OwnerGone { reason, .. }) => println!("worker 0's tensor is gone: {reason}"),
    }
    Ok(())
}
