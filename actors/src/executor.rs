//! The executor: runs one actor's instruction stream for a step.
//!
//! Sends, receives and collectives are the same for every job; local compute is delegated to a
//! [`Computation`] (training on burn). Every instruction is timed, a panic in
//! compute is caught and becomes an [`ActorFailure`] naming the instruction, and a failure aborts
//! the fabric so that no peer waits forever for this actor. Each instruction runs inside a
//! `tracing` span `instruction` with job, step, actor, device, index, instruction, micro-batch
//! (−1 when none) and bytes moved (exported over OTLP when a collector is configured).

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use archipelago_dataflow::{ActorId, ComputeOp, DType, DeviceSpec, FabricKind, Instruction, TensorId};

use crate::collectives::{CollectiveWorker, DEFAULT_CHUNK_ELEMS, PendingCollective};
use crate::error::{ActorFailure, panic_message};
use crate::fabric::{Fabric, FabricError, Tag};
use crate::progress::Waiting;
use crate::typed_tensor::TypedTensor;

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
        }
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

    /// Writes this actor's shard of the trainable state into checkpoint directory `dir`.
    pub fn save_checkpoint(
        &mut self,
        dir: &std::path::Path,
    ) -> Result<Option<crate::checkpoint::ShardFile>, String> {
        self.computation.sync_host();
        match self.computation.save_state()? {
            Some(state) => crate::checkpoint::write_shard(dir, self.actor, &state).map(Some),
            None => Ok(None),
        }
    }

    /// Runs the stream once as step `step`. On failure the fabric is aborted.
    pub fn run_step(&mut self, step: u64) -> Result<StepReport, Box<ActorFailure>> {
        let began = Instant::now();
        let began_unix_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut timings = Vec::with_capacity(self.stream.len());
        // This step's host ⇄ device transfers only (not those of building or restoring).
        crate::transfer::take();
        self.fabric_read = archipelago_dataflow::FabricBytes::default();
        let mut pending: HashMap<u64, (PendingCollective, Vec<ActorId>, DType)> = HashMap::new();
        // GPUs: the most live bytes of the device's pool seen at an instruction's end.
        let mut peak_in_use = 0u64;
        for index in 0..self.stream.len() {
            let started = Instant::now();
            self.progress.set(step, Some(index));
            let instruction = &self.stream[index];
            let span = tracing::info_span!(
                "instruction",
                job = %self.job,
                step,
                actor = self.actor,
                device = %self.device,
                index,
                instruction = %instruction,
                mb = instruction.microbatch().map_or(-1, |m| m as i64),
                bytes = tracing::field::Empty,
            );
            let entered = span.enter();
            let outcome = self.run_one(step, index, &mut pending);
            if let Ok(bytes) = &outcome {
                span.record("bytes", bytes);
            }
            drop(entered);
            if outcome.is_ok()
                && let Some(memory) = crate::gpus::memory_usage(self.device)
            {
                peak_in_use = peak_in_use.max(memory.in_use);
            }
            if let Err((message, secondary)) = outcome {
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
            timings.push(InstructionTiming {
                index,
                label: self.stream[index].to_string(),
                start_s: (started - began).as_secs_f64(),
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        self.progress.set(step, None);
        // A micro-batch's tensors end with its step: an all-reduced activation a Send copied
        // from the table must not meet the next step's all-reduce of the same name.
        self.table.retain(|id, _| id.microbatch().is_none());
        let mut metrics = self.computation.finish_step();
        metrics.transfers = crate::transfer::take();
        metrics.fabric = self.fabric_read;
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

    /// A tensor the computation holds outside the table (on its device), moved into host memory
    /// for a send or a collective.
    fn exported(computation: &mut dyn Computation, tensor: &TensorId) -> Result<TypedTensor, (String, bool)> {
        match catch_unwind(AssertUnwindSafe(|| computation.export(tensor))) {
            Ok(Some(result)) => result.map_err(|m| (m, false)),
            Ok(None) => Err((format!("`{tensor}` is not here"), false)),
            Err(payload) => Err((panic_message(payload.as_ref()), false)),
        }
    }

    /// Adds `bytes` read from peers for `tensor` (`kind`: its receive's or its collective's) to
    /// the step's fabric figures `read`.
    fn count_read(read: &mut archipelago_dataflow::FabricBytes, kind: Option<FabricKind>, bytes: u64) {
        if let Some(kind) = kind {
            read.add(kind, bytes);
        }
    }

    /// Runs instruction `index`; returns the bytes it moved (sends, receives, collectives).
    fn run_one(
        &mut self,
        step: u64,
        index: usize,
        pending: &mut HashMap<u64, (PendingCollective, Vec<ActorId>, DType)>,
    ) -> Result<u64, (String, bool)> {
        let edge = |tag: u64| (step << 32) | tag;
        let fabric_err = |e: FabricError| {
            let secondary = matches!(e, FabricError::Aborted(_));
            (e.to_string(), secondary)
        };
        match &self.stream[index] {
            Instruction::Compute { op, inputs, outputs } => {
                let (computation, table) = (&mut self.computation, &mut self.table);
                match catch_unwind(AssertUnwindSafe(|| {
                    computation.compute(step, op, inputs, outputs, table)
                })) {
                    Ok(result) => result.map(|()| 0).map_err(|m| (m, false)),
                    Err(payload) => Err((panic_message(payload.as_ref()), false)),
                }
            }
            Instruction::Send { tensor, to, tag } => {
                let value = match self.table.get(tensor) {
                    Some(t) => t.clone(),
                    None => Self::exported(self.computation.as_mut(), tensor)?,
                };
                let bytes = value.byte_len() as u64;
                self.fabric
                    .send(
                        self.actor,
                        *to,
                        Tag {
                            edge: edge(*tag),
                            seq: 0,
                        },
                        value,
                    )
                    .map(|()| bytes)
                    .map_err(fabric_err)
            }
            Instruction::Recv { tensor, from, tag } => {
                self.progress.wait_on(Waiting::Recv {
                    from: *from,
                    tag: *tag,
                });
                crate::fabric::read_count::take();
                let received = self.fabric.recv(
                    self.actor,
                    *from,
                    Tag {
                        edge: edge(*tag),
                        seq: 0,
                    },
                );
                self.progress.wait_on(Waiting::Nothing);
                let value = received.map_err(fabric_err)?;
                let read = crate::fabric::read_count::take();
                Self::count_read(&mut self.fabric_read, FabricKind::of(tensor), read);
                let bytes = value.byte_len() as u64;
                self.table.insert(tensor.clone(), value);
                Ok(bytes)
            }
            Instruction::StartCollective {
                kind,
                tensor,
                group,
                tag,
                dtype,
            } => {
                let value = match self.table.remove(tensor) {
                    Some(t) => t,
                    None => Self::exported(self.computation.as_mut(), tensor)?,
                };
                // Mixed precision: an f32 buffer crosses in the edge's 16 bits and is widened
                // back when the collective ends (masters and buckets stay f32).
                let held = value.dtype();
                let value = match value.cast_float(*dtype) {
                    Ok(cast) if held == DType::F32 || held == *dtype => cast,
                    _ => {
                        let why =
                            format!("`{tensor}` is {held} here, the plan reduces it as {dtype} (tag {tag})");
                        return Err((why, false));
                    }
                };
                let bytes = value.byte_len() as u64;
                let started = self.collectives.start(*kind, edge(*tag), group.clone(), value);
                pending.insert(*tag, (started, group.clone(), held));
                Ok(bytes)
            }
            Instruction::WaitCollective { tensor, tag } => {
                let (started, group, held) = pending
                    .remove(tag)
                    .ok_or_else(|| (format!("collective {tag} was not started"), false))?;
                self.progress.wait_on(Waiting::Collective { tag: *tag, group });
                let (finished, read) = started.wait();
                self.progress.wait_on(Waiting::Nothing);
                let value = finished.map_err(fabric_err)?;
                Self::count_read(&mut self.fabric_read, FabricKind::of_collective(tensor), read);
                let bytes = value.byte_len() as u64;
                let value = match value.cast_float(held) {
                    Ok(widened) => widened,
                    Err(value) => {
                        let why = format!(
                            "collective {tag} gave `{tensor}` as {}, not a float",
                            value.dtype()
                        );
                        return Err((why, false));
                    }
                };
                self.table.insert(tensor.clone(), value);
                Ok(bytes)
            }
        }
    }
}
