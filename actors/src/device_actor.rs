//! The device actor: an actor of the runtime API ([`crate::runtime`]) that owns one device's
//! computation (burn module, training state) and runs its instruction stream, one step per
//! [`RunStep`] message.
//!
//! It is spawned like any other actor of the runtime, on its device's thread: the computation is
//! built there by the constructor (burn modules are made where they live) and every handler runs
//! there, so kernels stay single-threaded and compute never blocks another device. A step's
//! failure is its reply (an [`ActorFailure`] naming job, step, actor, device and instruction),
//! not a panic; a panic that escapes is the runtime's [`CallError`](crate::runtime::CallError).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use archipelago_dataflow::{ActorId, DeviceSpec, Instruction};

use crate::error::ActorFailure;
use crate::executor::{Computation, Executor, HeldParams, StepReport};
use crate::fabric::Fabric;
use crate::progress::ActorProgress;
use crate::runtime::{Actor, Context, Handler, Message};

/// Builds an actor's computation on its device's thread.
pub type ComputationFactory = Box<dyn FnOnce() -> Result<Box<dyn Computation>, String> + Send>;

/// What a device actor answers to [`SaveCheckpoint`].
pub type CheckpointResult = Result<Option<crate::checkpoint::ShardFile>, String>;

/// Everything a device actor needs to start. The factory is taken by the first construction:
/// a device actor is not restarted (its peers' streams would not wait for it).
#[derive(Clone)]
pub struct DeviceActorParams {
    /// The job's name.
    pub job: String,
    /// The actor's id.
    pub actor: ActorId,
    /// Its device.
    pub device: DeviceSpec,
    /// Its instruction stream.
    pub stream: Arc<Vec<Instruction>>,
    /// Builds its computation (taken once).
    pub computation: Arc<Mutex<Option<ComputationFactory>>>,
    /// The fabric to its peers.
    pub fabric: Arc<dyn Fabric>,
    /// Where the executor records the instruction it runs (read by heartbeats).
    pub progress: Arc<ActorProgress>,
    /// The checkpoint directory to take top-k's error-feedback residuals from (a resume of the
    /// layout that wrote it).
    pub residuals_from: Option<PathBuf>,
    /// The island of each actor, by id (empty: one island), for the bytes crossing islands.
    pub islands: Arc<Vec<usize>>,
}

impl DeviceActorParams {
    /// The failure of building the computation, as the gang reports it.
    pub fn start_failure(&self, message: String) -> ActorFailure {
        ActorFailure {
            job: self.job.clone(),
            step: 0,
            actor: self.actor,
            device: self.device,
            index: None,
            instruction: "building its blocks".into(),
            message,
            secondary: false,
            actor_type: String::new(),
            host: String::new(),
        }
    }
}

/// The device actor: its executor (stream, computation, collectives).
pub struct DeviceActor {
    executor: Executor,
}

impl Actor for DeviceActor {
    type Params = DeviceActorParams;

    async fn new(params: DeviceActorParams, _ctx: &Context<Self>) -> Result<Self, String> {
        let factory = params.computation.lock().map_err(|e| e.to_string())?.take();
        let Some(factory) = factory else {
            return Err(format!(
                "actor {}'s computation was already built once; a device actor is not restarted",
                params.actor
            ));
        };
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(factory))
            .unwrap_or_else(|p| Err(crate::error::panic_message(p.as_ref())));
        let computation = built.inspect_err(|_| {
            params
                .fabric
                .abort(&format!("actor {} failed to start", params.actor));
        })?;
        let mut executor = Executor::new(
            &params.job,
            params.actor,
            params.device,
            params.stream.to_vec(),
            computation,
            params.fabric.clone(),
        )
        .with_progress(params.progress)
        .with_islands(&params.islands);
        if let Some(dir) = &params.residuals_from {
            executor.restore_residuals(dir).inspect_err(|_| {
                (params.fabric).abort(&format!("actor {} failed to start", params.actor));
            })?;
        }
        Ok(DeviceActor { executor })
    }
}

/// Run the stream once as step `n`.
pub struct RunStep(pub u64);

impl Message for RunStep {
    type Reply = Result<StepReport, Box<ActorFailure>>;
}

impl Handler<RunStep> for DeviceActor {
    async fn handle(
        &mut self,
        RunStep(n): RunStep,
        _ctx: &Context<Self>,
    ) -> Result<StepReport, Box<ActorFailure>> {
        self.executor.run_step(n)
    }
}

/// The sums of squares of the parameters this actor answers for, by block index (summed over
/// all actors they give each block's squared norm once).
pub struct BlockSquares;

impl Message for BlockSquares {
    type Reply = Vec<(usize, f64)>;
}

impl Handler<BlockSquares> for DeviceActor {
    async fn handle(&mut self, _: BlockSquares, _ctx: &Context<Self>) -> Vec<(usize, f64)> {
        self.executor.block_squares()
    }
}

/// A copy of every parameter this actor holds, whole blocks or ZeRO-3 shards (the equivalence
/// tests' replica check; copies the bytes).
pub struct BlockParams;

impl Message for BlockParams {
    type Reply = Vec<HeldParams>;
}

impl Handler<BlockParams> for DeviceActor {
    async fn handle(&mut self, _: BlockParams, _ctx: &Context<Self>) -> Vec<HeldParams> {
        self.executor.block_params()
    }
}

/// Write this actor's shard of the trainable state into the checkpoint directory given; the
/// reply is the file written (`None` when another replica saves the same state).
pub struct SaveCheckpoint(pub PathBuf);

impl Message for SaveCheckpoint {
    type Reply = CheckpointResult;
}

impl Handler<SaveCheckpoint> for DeviceActor {
    async fn handle(
        &mut self,
        SaveCheckpoint(dir): SaveCheckpoint,
        _ctx: &Context<Self>,
    ) -> CheckpointResult {
        self.executor.save_checkpoint(&dir)
    }
}
