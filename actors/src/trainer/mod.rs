//! Training on burn: the compute half of an actor's training stream.
//!
//! Forward runs segment by segment; each segment's input is a fresh autodiff leaf, so the backward
//! of a segment is its own small graph: the last segment starts from the loss, every other one
//! from `sum(y ⊙ g)` with the upstream gradient `g` (exact: the vector–Jacobian product). A
//! segment's parameter gradients leave burn as one flat bucket as soon as its backward is done
//! (added up over micro-batches), so the bucket's all-reduce overlaps the backward of the segments
//! before it. The optimizer runs on flat slices and writes the parameters back into the modules.
//!
//! Pipeline stages: an actor builds only the blocks of its chunks. Activations and their
//! gradients that cross to another stage leave as [`TypedTensor`]s ([`Computation::export`]) and
//! arrive through the tensor table. Under activation checkpointing a forward keeps only the
//! segment's input and drops its graph; the backward recomputes the forward first (Chen et al.,
//! 2016). ZB-H1's split backward: `BackwardInput` runs burn's backward (which always yields input
//! and weight gradients together) and keeps the weight gradients; `BackwardWeight` moves them into
//! the gradient bucket.
//!
//! The parts: `parts.rs` (the blocks held, the step in flight, the training state), `build.rs`
//! (the trainer from the actor's plan), `data.rs` (batches), `passes.rs` (forward, loss, backward, gradient buckets),
//! `zero.rs` (the optimizer step, ZeRO shards and parameter loading), `norms.rs` (clipping's
//! global norm, LAMB's parameter norms, the parameter groups), `offload.rs` (handing gradients
//! to the offload actor and taking its updated parameters back), `fault.rs` (a test hook: the
//! faults of the equivalence suite's negative controls).

use archipelago_dataflow::TensorId;
use archipelago_dataflow::UpdateScope;
use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::{ActorPlan, ActorTraining, ComputeOp};

use crate::block::{Activation, Block};
use crate::executor::{Computation, HeldParams, StepMetrics, TensorTable};
use crate::host_tensor::from_burn;
use crate::typed_tensor::TypedTensor;

use data::Samples;
use fault::FaultHook;
use parts::{HeldStage, InFlight, TrainingState};
pub use zero::Sharding;
use zero::part_of;

mod build;
pub(crate) use build::local_block;
mod checkpoint;
mod cpu_buffers;
mod data;
mod device_lamb;
mod device_state;
mod fault;
mod full_vectors;
mod hpz;
mod kept_inputs;
mod norms;
mod parts;
mod passes;
mod seq_shards;
mod store;
mod store_device;
mod store_offload;
mod tied;
mod tp_grads;
mod vocab_loss;
mod zero;

/// The per-micro-batch copies of a segment's blocks (see [`Block::fresh_copy`]).
type BlockCopies<B> = Vec<Box<dyn Block<B>>>;

/// A segment's forward for one micro-batch, kept for its backward.
pub(super) struct Segment<B: AutodiffBackend> {
    /// The input (an autodiff leaf); `None` while checkpointed where the plan keeps it
    /// elsewhere (`kept`, or the table) until the backward's recompute.
    input: Option<Activation<B>>,
    /// The output; without its graph when `checkpointed`, and then dropped once the next
    /// segment's forward has read it (the backward recomputes it).
    output: Option<Activation<B>>,
    /// Sequence parallelism: the residual stream this segment passes on (its input), until the
    /// segment that adds it reads it.
    residual: Option<Activation<B>>,
    /// Sequence parallelism: the gradient of the stream it passed on, added to its input's.
    residual_grad: Option<Activation<B>>,
    checkpointed: bool,
    /// The model's last segment (its output, the logits, is read by the loss after any send).
    last: bool,
    /// This tp rank's part of a partitioned checkpointed input (ZeRO-R).
    kept: Option<kept_inputs::KeptPart<B>>,
    /// The per-micro-batch copies of the blocks the forward ran on (their gradients are read
    /// from these); empty when checkpointed (the recompute makes new ones).
    copies: BlockCopies<B>,
    /// The batch whose targets the loss uses (last segment only).
    batch: Option<TensorId>,
    /// Tensor parallelism, last segment: the group's all-reduced logits when this rank's
    /// output is a partial sum (f32 rows; Megatron's g), which the loss reads.
    summed: Option<burn::tensor::Tensor<B, 2>>,
    /// Tensor parallelism, last segment: the vocabulary-parallel loss's group statistics.
    vocab: Option<vocab_loss::VocabStats>,
}

/// What an actor's plan gives its trainer: the chunks of blocks it holds and its training plan
/// (segments and shards, ZeRO stage in force, offload, checkpointing, where the state lives).
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Chunks of blocks (half-open ranges) this actor holds.
    pub chunks: Vec<(usize, usize)>,
    /// The plan's decisions about its training state.
    pub training: ActorTraining,
}

impl Placement {
    /// The placement `plan` gives its actor.
    pub fn of(plan: &ActorPlan) -> Placement {
        Placement {
            chunks: plan.chunks.clone(),
            training: plan.training.clone(),
        }
    }
}

/// One actor's trainer: the blocks it holds, the step in flight, its training state, and how
/// it reads batches and moves tensors.
pub struct Trainer<B: AutodiffBackend> {
    /// The model blocks this actor holds and how they are built.
    stage: HeldStage<B>,
    /// The tensors of the step in flight.
    step: InFlight<B>,
    /// Master parameters, optimizer, ZeRO shards, offload and device state.
    state: TrainingState<B>,
    samples: Samples,
    global_batch: usize,
    /// Activation checkpointing, and what it keeps of segment inputs where (the plan's).
    checkpoints: archipelago_dataflow::ActivationCheckpoints,
    /// Move each gradient bucket off the device and each block's parameters onto it in one
    /// transfer (GPUs; see `read_flat` and `Block::load_params`).
    batched_transfers: bool,
    /// Test hook: the fault the program names (`None` but in the equivalence suite's controls).
    fault: Option<FaultHook>,
}

impl<B: AutodiffBackend> Segment<B> {
    /// The output the forward left, while it is held.
    fn output(&self) -> Result<&Activation<B>, String> {
        self.output.as_ref().ok_or_else(|| {
            "the segment's output was dropped once the next segment read it (activation \
             checkpointing recomputes it in the backward)"
                .to_string()
        })
    }
}

impl<B: AutodiffBackend> Trainer<B> {
    pub(super) fn block(&self, index: usize) -> Result<&dyn Block<B>, String> {
        self.stage.blocks[index]
            .as_deref()
            .ok_or_else(|| format!("block {index} is not held by this actor"))
    }

    pub(super) fn chunk_of(&self, block: usize) -> usize {
        self.stage
            .chunk_starts
            .iter()
            .copied()
            .filter(|&s| s <= block)
            .max()
            .unwrap_or(0)
    }
}

fn to_host<B: AutodiffBackend>(a: &Activation<B>) -> Result<TypedTensor, String> {
    match a {
        Activation::Rows(t) => Ok(from_burn(t.clone().detach())),
        Activation::Seq(t) => Ok(from_burn(t.clone().detach())),
        Activation::Tokens(_) => Err("token ids do not cross stages; the first chunk loads them".into()),
    }
}

impl<B: AutodiffBackend> Computation for Trainer<B> {
    fn compute(
        &mut self,
        step: u64,
        op: &ComputeOp,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let nth = |names: &[TensorId], i: usize| {
            names
                .get(i)
                .cloned()
                .ok_or_else(|| format!("{op} names too few tensors"))
        };
        self.step.job_step = step;
        match op {
            ComputeOp::LoadBatch { start, end } => {
                self.load_batch(step, *start..*end, &nth(outputs, 0)?);
                Ok(())
            }
            ComputeOp::Forward { start, end, mb } => self.forward(*start..*end, *mb, inputs, outputs, table),
            ComputeOp::Loss { .. } => self.compute_loss(inputs, &nth(outputs, 0)?, table),
            ComputeOp::LossMax { .. } => self.loss_max(&nth(inputs, 0)?, &nth(outputs, 0)?, table),
            ComputeOp::LossSums { .. } => {
                let (logits, batch, max) = (nth(inputs, 0)?, nth(inputs, 1)?, nth(inputs, 2)?);
                self.loss_sums(&logits, &batch, &max, &nth(outputs, 0)?, table)
            }
            ComputeOp::ReplicatedGrads { start, end } => {
                self.replicated_grads(*start..*end, inputs, outputs, table)
            }
            ComputeOp::Backward { start, end, mb } => {
                self.backward(*start..*end, *mb, inputs, outputs, table)
            }
            ComputeOp::BackwardInput { start, end, mb } => {
                self.backward_input(*start..*end, *mb, inputs, outputs, table)
            }
            ComputeOp::BackwardWeight { start, end, mb } => {
                self.backward_weight(*start..*end, *mb, outputs, table)
            }
            ComputeOp::OffloadGrads { .. } => self.offload_grads(&nth(inputs, 0)?, table),
            ComputeOp::AddTiedGrads { block } => self.add_tied_grads(*block, inputs, outputs, table),
            ComputeOp::TiedValues { block } => self.tied_values(*block, outputs, table),
            ComputeOp::LoadTied { block } => self.load_tied(*block, inputs, table),
            ComputeOp::GradNorm { .. } => self.grad_norm(inputs, outputs, table),
            ComputeOp::TrustNorms { .. } => self.trust_norms(inputs, outputs, table),
            ComputeOp::OptimizerStep { scope, .. } => {
                let planned = self.state.update_scope;
                if *scope != planned {
                    return Err(format!(
                        "the instruction updates `{scope}` but this actor's plan says `{planned}`: the stream \
                         was not compiled from this actor's plan"
                    ));
                }
                match scope {
                    UpdateScope::CollectOffloaded => self.collect_offloaded(outputs, table),
                    _ => self.optimizer_step(*scope, inputs, outputs, table),
                }
            }
            ComputeOp::LoadParams { start, end } => self.load_params(*start..*end, &nth(inputs, 0)?, table),
            ComputeOp::ShardParams { start, end } => {
                self.shard_params(*start..*end, &nth(outputs, 0)?, table)
            }
            ComputeOp::KeepSecondary { start, end } => {
                self.keep_secondary(*start..*end, &nth(inputs, 0)?, table)
            }
            ComputeOp::SecondaryShard { start, end } => {
                self.secondary_shard(*start..*end, &nth(outputs, 0)?, table)
            }
            ComputeOp::DropParams { start, end } => {
                (*start..*end).for_each(|i| self.stage.blocks[i] = None);
                Ok(())
            }
            ComputeOp::User { name } => Err(format!("a training actor has no user function `{name}`")),
            ComputeOp::Output { key } => Err(format!("a training actor does not output `{key}`")),
        }
    }

    fn export(&mut self, name: &TensorId) -> Option<Result<TypedTensor, String>> {
        if let Some(bucket) = self.state.store.export_bucket(name) {
            return Some(Ok(TypedTensor::flat(bucket)));
        }
        if let Some(checkpoint) = self.export_checkpoint(name) {
            return Some(checkpoint);
        }
        // Sent on, or into a collective of the group (a checkpointed output is then dropped once
        // all of it is read: the backward recomputes it).
        let own = match self.read_own(name, true) {
            Ok(Some(own)) => Some(own),
            Ok(None) => self.step.upstream.remove(name),
            Err(e) => return Some(Err(e)),
        }?;
        Some(to_host(&own).and_then(|t| self.for_all_gather(name, t)))
    }

    fn finish_step(&mut self) -> StepMetrics {
        self.step.clear();
        self.state.store.end_step(&mut self.state.optimizer);
        // Frozen values are kept whole beside the held parameters.
        let frozen: usize = (self.stage.frozen.iter()).map(|f| f.len()).sum();
        let state = (self.state.store).state_bytes(self.state.held.len(), frozen, &self.state.optimizer);
        let materialized: usize = (0..self.stage.blocks.len())
            .filter(|&i| self.stage.blocks[i].is_some())
            .map(|i| self.stage.offsets[i + 1] - self.stage.offsets[i] + self.stage.frozen[i].len())
            .sum();
        // The gradients the optimizer step consumed: whole buckets, or shards under ZeRO-2.
        let held_grads = std::mem::take(&mut self.step.optimizer_grad_bytes);
        let steps = self.state.store.steps(&self.state.optimizer);
        let metrics = StepMetrics {
            loss: self.step.loss_sum.take(),
            model_state_bytes: state + held_grads,
            optimizer_state_bytes: self.state.store.optimizer_bytes(&self.state.optimizer),
            peak_model_state_bytes: state + self.step.peak_grad_bytes.max(held_grads),
            compute_weight_bytes: (burn::tensor::DType::from(self.stage.compute).size() * materialized)
                as u64,
            peak_microbatches_held: self.step.peak_live,
            offload: self.state.store.offload_stats(),
            lr: (steps > 0 && !self.state.update.skipped)
                .then(|| self.state.optimizer.lr_at(self.state.optimizer.schedule_step())),
            grad_norm: self.state.update.grad_norm.take(),
            loss_scale: self.state.update.scale_used.take(),
            skipped: std::mem::take(&mut self.state.update.skipped),
            transfers: Default::default(), // the executor's count of the step
            fabric: Default::default(),    // the executor's count of the step
            fabric_crossing_islands: Default::default(), // the executor's count of the step
            hpz_secondary_bytes: self.state.secondary.bytes() as u64,
            device_memory: None, // the executor reads the device's pool
            offload_traffic: std::mem::take(&mut self.step.offload_traffic),
            activation_checkpoints: std::mem::take(&mut self.step.checkpoint_peak),
        };
        self.step.peak_grad_bytes = 0;
        self.step.peak_live = 0;
        self.state.update.begun = false;
        metrics
    }

    fn block_params(&self) -> Vec<HeldParams> {
        let held = self.held_block_params().unwrap_or_else(|e| {
            tracing::error!(actor = self.stage.actor, "held parameters unreadable: {e}");
            Vec::new()
        });
        self.in_global_coordinates(self.in_full_vectors(held))
    }

    fn save_state(&self) -> Result<Option<crate::checkpoint::ShardState>, String> {
        self.checkpoint_state()
    }

    fn sync_host(&mut self) {
        self.download_state();
    }

    fn block_squares(&self) -> Vec<(usize, f64)> {
        let sq = |v: &[f32]| v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        // Each element once over the group: a replica answers for the part of each segment the
        // plan has it report; frozen values, whole on every replica, the first one.
        let first = self.state.sharding.rank == 0;
        let frozen = (0..self.stage.blocks.len())
            .filter(|&i| first && self.stage.held_blocks[i] && !self.stage.frozen[i].is_empty())
            .map(|i| (i, self.frozen_squares(i)));
        let mut reported = Vec::new();
        let offsets = &self.stage.offsets;
        let read = self.for_each_held_part(|block, range, values| {
            let Some((part, _)) = (self.state.sharding).block_part(block, offsets, part_of::reported) else {
                return;
            };
            let (from, to) = (part.start.max(range.start), part.end.min(range.end));
            if from < to {
                let mut squares = sq(&values[from - range.start..to - range.start]);
                if !self.stage.tp.leads() {
                    // Replicated parameters, the same on every tp rank, count once.
                    for r in self.replicated_in_bucket(block..block + 1) {
                        let (a, b) = (r.start.max(from), r.end.min(to));
                        if a < b {
                            squares -= sq(&values[a - range.start..b - range.start]);
                        }
                    }
                }
                reported.push((block, squares));
            }
        });
        if let Err(e) = read {
            tracing::error!(actor = self.stage.actor, "held parameters unreadable: {e}");
        }
        reported.into_iter().chain(frozen).collect()
    }
}
