//! The executor: runs one actor's instruction stream for a step, walked by the one interpreter
//! of instruction streams (`actors/src/interpret.rs`; the training step is its participant in
//! `executor/walk.rs`).
//!
//! Sends, receives and collectives are the same for every job; local compute is delegated to a
//! [`Computation`] (training on burn). Every instruction is timed, a panic in
//! compute is caught and becomes an [`ActorFailure`] naming the instruction, and a failure aborts
//! the fabric so that no peer waits forever for this actor. Each instruction runs inside a
//! `tracing` span `instruction` with job, step, actor, device, index, instruction, micro-batch
//! (−1 when none) and bytes moved (exported over OTLP when a collector is configured).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use archipelago_dataflow::{ActorId, ComputeOp, DeviceSpec, Instruction, TensorId};

use crate::collectives::{CollectiveWorker, DEFAULT_CHUNK_ELEMS};
use crate::error::ActorFailure;
use crate::fabric::Fabric;
use crate::typed_tensor::TypedTensor;

mod walk;

/// An actor's host tensors by id (gradient buckets, received tensors, activations).
#[derive(Default)]
pub struct TensorTable {
    tensors: HashMap<TensorId, TypedTensor>,
}

impl TensorTable {
    /// Stores `tensor` under `id`.
    pub fn insert(&mut self, id: TensorId, tensor: TypedTensor) {
        self.tensors.insert(id, tensor);
    }
    /// Takes the tensor out.
    pub fn remove(&mut self, id: &TensorId) -> Option<TypedTensor> {
        self.tensors.remove(id)
    }
    /// Looks at a tensor.
    pub fn get(&self, id: &TensorId) -> Option<&TypedTensor> {
        self.tensors.get(id)
    }
    /// Keeps only the tensors `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&TensorId, &TypedTensor) -> bool) {
        self.tensors.retain(|id, t| keep(id, t));
    }
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.byte_len() as u64).sum()
    }
}

/// What a computation reports at the end of a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// This actor's share of the loss (summed over actors by the controller).
    pub loss: Option<f32>,
    /// Parameters + gradients + optimizer state held now.
    pub model_state_bytes: u64,
    /// Of which the optimizer's state (its moments).
    #[serde(default)]
    pub optimizer_state_bytes: u64,
    /// The most held during the step.
    pub peak_model_state_bytes: u64,
    /// Bytes of the weights the compute modules hold beside the f32 master parameters.
    pub compute_weight_bytes: u64,
    /// The most micro-batches whose activations were held at once (per chunk, summed).
    pub peak_microbatches_held: usize,
    /// The offload actor's figures (cumulative over the run), when the state is offloaded.
    pub offload: Option<crate::offload::OffloadStats>,
    /// The learning rate of the step's update (the schedule's), when the actor updates.
    #[serde(default)]
    pub lr: Option<f32>,
    /// The global gradient norm before clipping, when the step clips.
    #[serde(default)]
    pub grad_norm: Option<f32>,
    /// The scale this step's loss was multiplied by (f16's loss scaling), when the actor scales.
    #[serde(default)]
    pub loss_scale: Option<f32>,
    /// The step's gradients overflowed on some actor, and no actor updated (loss scaling).
    #[serde(default)]
    pub skipped: bool,
    /// The step's host ⇄ device bytes by kind (set by the executor from [`crate::transfer`]).
    #[serde(default)]
    pub transfers: crate::transfer::Transfers,
    /// The step's bytes read from peers on the fabric, by kind (set by the executor from
    /// [`crate::fabric::read_count`]).
    #[serde(default)]
    pub fabric: archipelago_dataflow::FabricBytes,
    /// Of `fabric`, the bytes read from peers on another island (the executor's, when its
    /// actor knows the islands: [`Executor::with_islands`]).
    #[serde(default)]
    pub fabric_crossing_islands: archipelago_dataflow::FabricBytes,
    /// Bytes of ZeRO++ hpZ's secondary copy held at the step's end.
    #[serde(default)]
    pub hpz_secondary_bytes: u64,
    /// The device's memory pool at the step's end (GPUs; set by the executor).
    #[serde(default)]
    pub device_memory: Option<crate::gpus::DeviceMemory>,
    /// The step's bytes to and from the offload tier (with `--offload`).
    #[serde(default)]
    pub offload_traffic: archipelago_dataflow::OffloadTraffic,
    /// The most bytes of activation checkpoints (segment inputs kept for recomputes) held at
    /// once in the step, on the device and in host memory.
    #[serde(default)]
    pub activation_checkpoints: archipelago_dataflow::CheckpointBytes,
}

/// Local compute of an actor.
pub trait Computation: Send {
    /// Runs one compute instruction.
    fn compute(
        &mut self,
        step: u64,
        op: &ComputeOp,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String>;
    /// A tensor the computation holds outside the table (an activation or its gradient about to
    /// cross to another actor), moved into host memory; `None` when it has no such tensor.
    fn export(&mut self, id: &TensorId) -> Option<Result<TypedTensor, String>> {
        let _ = id;
        None
    }
    /// Called after the last instruction of a step.
    fn finish_step(&mut self) -> StepMetrics;
    /// A copy of every parameter this actor holds (training only): whole blocks where it holds
    /// them replicated, the owned parts of blocks where it holds only shards (ZeRO-3).
    fn block_params(&self) -> Vec<HeldParams> {
        Vec::new()
    }
    /// This actor's share of the trainable state for a checkpoint; `None` when another actor
    /// saves the same state (a replica of an unsharded model).
    fn save_state(&self) -> Result<Option<crate::checkpoint::ShardState>, String> {
        Err("this computation keeps no trainable state to checkpoint".into())
    }
    /// Brings host copies of state kept on the device up to date, before
    /// [`Computation::block_params`], [`Computation::block_squares`] or
    /// [`Computation::save_state`] read them (a no-op when the state lives in host memory).
    fn sync_host(&mut self) {}
    /// Sums of squares of parameters by block, for the parameters this actor answers for: summed
    /// over all actors of a job they give each block's squared L2 norm exactly once.
    fn block_squares(&self) -> Vec<(usize, f64)> {
        self.block_params()
            .iter()
            .map(|held| {
                (
                    held.block,
                    held.values.iter().map(|&x| (x as f64) * (x as f64)).sum(),
                )
            })
            .collect()
    }
}

/// A copy of a part of one block's parameters as one actor holds it: the whole block
/// (`range` = `0..len`) where the actor holds it replicated, its owned shard under ZeRO-3. The
/// equivalence tests put a job's parts together and check that every copy of an element agrees.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeldParams {
    /// The block's index in the model.
    pub block: usize,
    /// Which of the block's flat parameters these are (declaration order).
    pub range: std::ops::Range<usize>,
    /// Their values.
    pub values: Vec<f32>,
}

/// Time spent in one instruction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstructionTiming {
    /// Index in the stream.
    pub index: usize,
    /// The instruction, printed.
    pub label: String,
    /// Start, seconds after the step began on this actor.
    pub start_s: f64,
    /// Duration in seconds.
    pub seconds: f64,
}

/// What an actor reports for a finished step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// The actor.
    pub actor: ActorId,
    /// The step.
    pub step: u64,
    /// Metrics of the computation.
    pub metrics: StepMetrics,
    /// Wall time of the whole stream.
    pub seconds: f64,
    /// When the stream began, seconds since the Unix epoch (to line actors up on one timeline).
    pub began_unix_s: f64,
    /// Per-instruction timings.
    pub timings: Vec<InstructionTiming>,
    /// Peak resident memory of the actor's process, when it runs on a host other than the
    /// controller's (0 otherwise: the controller measures its own process).
    #[serde(default)]
    pub host_peak_rss_bytes: u64,
}

/// Runs one actor's stream step after step.
pub struct Executor {
    job: String,
    actor: ActorId,
    device: DeviceSpec,
    stream: Vec<Instruction>,
    computation: Box<dyn Computation>,
    fabric: Arc<dyn Fabric>,
    collectives: CollectiveWorker,
    table: TensorTable,
    progress: Arc<crate::progress::ActorProgress>,
    /// The running step's bytes read from peers.
    fabric_read: archipelago_dataflow::FabricBytes,
    /// Of those, read from peers on other islands.
    fabric_crossing: archipelago_dataflow::FabricBytes,
    /// Which actors are on another island (by id; none when empty).
    far: Arc<[bool]>,
}

impl Executor {
    /// An executor for `actor` running `stream` with `computation` over `fabric`.
    pub fn new(
        job: &str,
        actor: ActorId,
        device: DeviceSpec,
        stream: Vec<Instruction>,
        computation: Box<dyn Computation>,
        fabric: Arc<dyn Fabric>,
    ) -> Executor {
        let collectives = CollectiveWorker::spawn(actor, fabric.clone(), DEFAULT_CHUNK_ELEMS);
        Executor {
            job: job.to_string(),
            actor,
            device,
            stream,
            computation,
            fabric,
            collectives,
            table: TensorTable::default(),
            progress: Arc::default(),
            fabric_read: Default::default(),
            fabric_crossing: Default::default(),
            far: Arc::from(Vec::new()),
        }
    }

    /// Counts the bytes read from actors on another island than this one apart (`islands`: the
    /// island of each actor, by id; empty for one island).
    pub fn with_islands(mut self, islands: &[usize]) -> Executor {
        let mine = islands.get(self.actor).copied();
        self.far = islands.iter().map(|&i| Some(i) != mine).collect();
        self.collectives.set_far(self.far.clone());
        self
    }

    /// Records what it runs in `progress` (read by heartbeats).
    pub fn with_progress(mut self, progress: Arc<crate::progress::ActorProgress>) -> Executor {
        self.progress = progress;
        self
    }

    /// A copy of the parameters the computation holds (see [`Computation::block_params`]).
    pub fn block_params(&mut self) -> Vec<HeldParams> {
        self.computation.sync_host();
        self.computation.block_params()
    }

    /// The computation's block squares (see [`Computation::block_squares`]).
    pub fn block_squares(&mut self) -> Vec<(usize, f64)> {
        self.computation.sync_host();
        self.computation.block_squares()
    }

    /// Writes this actor's shard of the trainable state into checkpoint directory `dir`, and its
    /// top-k residuals beside it when it keeps any.
    pub fn save_checkpoint(
        &mut self,
        dir: &std::path::Path,
    ) -> Result<Option<crate::checkpoint::ShardFile>, String> {
        self.computation.sync_host();
        self.collectives.save_residuals(dir, self.actor)?;
        match self.computation.save_state()? {
            Some(state) => crate::checkpoint::write_shard(dir, self.actor, &state).map(Some),
            None => Ok(None),
        }
    }

    /// Takes top-k's error-feedback residuals this actor wrote into checkpoint directory `dir`
    /// (a resume of the layout that wrote them).
    pub fn restore_residuals(&mut self, dir: &std::path::Path) -> Result<(), String> {
        self.collectives.restore_residuals(dir, self.actor)
    }

    /// Runs the stream once as step `step` (walked by the one interpreter, `interpret.rs`). On failure the
    /// fabric is aborted.
    pub fn run_step(&mut self, step: u64) -> Result<StepReport, Box<ActorFailure>> {
        let began = Instant::now();
        let began_unix_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        // This step's host ⇄ device transfers only (not those of building or restoring).
        crate::transfer::take();
        self.fabric_read = archipelago_dataflow::FabricBytes::default();
        self.fabric_crossing = archipelago_dataflow::FabricBytes::default();
        crate::fabric::read_count::set_far(self.far.clone());
        let stream = std::mem::take(&mut self.stream);
        let mut run = walk::StepRun::new(self, step, began, stream.len());
        let walked = crate::interpret::block_on(crate::interpret::interpret(&stream, &mut run));
        let (timings, peak_in_use) = (std::mem::take(&mut run.timings), run.peak_in_use);
        drop(run);
        self.stream = stream;
        if let Err((index, (message, secondary))) = walked {
            let failure = Box::new(ActorFailure {
                job: self.job.clone(),
                step,
                actor: self.actor,
                device: self.device,
                index: Some(index),
                instruction: self.stream[index].to_string(),
                message,
                secondary,
                actor_type: String::new(),
                host: String::new(),
            });
            self.fabric
                .abort(&format!("actor {} failed at step {step}", self.actor));
            self.table = TensorTable::default();
            return Err(failure);
        }
        self.progress.set(step, None);
        // A micro-batch's tensors end with its step: an all-reduced activation a Send copied
        // from the table must not meet the next step's all-reduce of the same name.
        self.table.retain(|id, _| id.microbatch().is_none());
        let mut metrics = self.computation.finish_step();
        metrics.transfers = crate::transfer::take();
        metrics.fabric = self.fabric_read;
        metrics.fabric_crossing_islands = self.fabric_crossing;
        metrics.device_memory = crate::gpus::memory_usage(self.device).map(|now| crate::gpus::DeviceMemory {
            peak_in_use: peak_in_use.max(now.in_use),
            ..now
        });
        Ok(StepReport {
            actor: self.actor,
            step,
            metrics,
            seconds: began.elapsed().as_secs_f64(),
            began_unix_s,
            timings,
            host_peak_rss_bytes: 0,
        })
    }
}
