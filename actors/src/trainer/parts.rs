//! The parts of a trainer, one job each: the blocks an actor holds ([`HeldStage`]), the tensors
//! of the step in flight ([`InFlight`], emptied at the end of every step) and the training state
//! that outlives steps ([`TrainingState`]: master parameters, optimizer, ZeRO shards, offload,
//! the state on the device).

use archipelago_dataflow::TensorId;
use archipelago_dataflow::UpdateScope;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::{ActorId, ModelDesc, ParamDesc, TrainedLayout};

use super::data::Batch;
use super::norms::UpdateState;
use super::store::Store;
use super::{BlockCopies, Segment, Sharding};
use crate::block::{Activation, Block};
use crate::block_frozen::PartlyFrozen;
use crate::optim::FlatOptimizer;
use crate::zoo::{BuildContext, ModelBuilder};

/// The blocks an actor holds, on its device, and how to build them again (ZeRO-3).
pub(super) struct HeldStage<B: AutodiffBackend> {
    pub(super) device: B::Device,
    pub(super) desc: ModelDesc,
    /// The modules of the held blocks (`None` for other blocks, and under ZeRO-3 between a
    /// segment's drop and its next gather).
    pub(super) blocks: Vec<Option<Box<dyn Block<B>>>>,
    /// `offsets[i]..offsets[i + 1]`: block `i` in the local master vector (empty when not held).
    pub(super) offsets: Vec<usize>,
    /// First block of each chunk held, for counting micro-batches in flight per chunk.
    pub(super) chunk_starts: Vec<usize>,
    /// Which blocks this actor holds (under ZeRO-3 their modules come and go).
    pub(super) held_blocks: Vec<bool>,
    /// Each held block's trainable parameters, described one by one (the model's descriptions,
    /// or ones made from the built module for a model that gives only counts): the trained
    /// vector's, which checkpoints name; empty for other blocks.
    pub(super) param_descs: Vec<Vec<ParamDesc>>,
    /// Each block's trained vector within all its parameters (empty for blocks not held).
    pub(super) layouts: Vec<Arc<TrainedLayout>>,
    /// Each held block's frozen parameters' values, kept whole (never sharded or updated).
    pub(super) frozen: Vec<Arc<Vec<f32>>>,
    pub(super) builder: Arc<dyn ModelBuilder<B>>,
    /// The dtype the modules compute in (the plan's slices'): f32, or the 16-bit compute copy of
    /// mixed precision over the f32 master in `TrainingState::held`.
    pub(super) compute: burn::tensor::FloatDType,
    pub(super) seed: u64,
    pub(super) actor: ActorId,
    /// Its place in its tensor-parallel group (the blocks it builds are its slices).
    pub(super) tp: crate::zoo::tp::TpPlace,
    /// Whether the model is in its sequence-parallel form (its blocks differ).
    pub(super) sequence_parallel: bool,
    /// The model whole (`desc` is this rank's slices of it): where the slices sit globally.
    pub(super) whole: Arc<ModelDesc>,
}

/// The tensors of the step in flight: batches, segment forwards kept for their backward, losses,
/// upstream gradients, gradient buckets being filled, and the step's memory figures.
pub(super) struct InFlight<B: AutodiffBackend> {
    pub(super) batches: HashMap<TensorId, Batch<B>>,
    pub(super) segments: HashMap<(usize, usize), Segment<B>>,
    pub(super) by_name: HashMap<TensorId, (usize, usize)>,
    pub(super) losses: HashMap<TensorId, (usize, usize)>,
    pub(super) loss_sum: Option<f32>,
    pub(super) upstream: HashMap<TensorId, Activation<B>>,
    /// ZB-H1: weight gradients computed by `BackwardInput` (with the block copies they belong
    /// to), waiting for `BackwardWeight`.
    pub(super) pending_weights: HashMap<(usize, usize), (B::Gradients, BlockCopies<B>)>,
    pub(super) grad_ranges: HashMap<TensorId, Range<usize>>,
    pub(super) grads_started: HashSet<TensorId>,
    pub(super) peak_grad_bytes: u64,
    pub(super) optimizer_grad_bytes: u64,
    pub(super) live: HashMap<(usize, usize), usize>,
    pub(super) peak_live: usize,
    /// Gradient bucket buffers kept from the last step (no fresh allocation per step).
    pub(super) spare_buffers: Vec<Vec<f32>>,
    /// The step's bytes to and from the offload tier.
    pub(super) offload_traffic: archipelago_dataflow::OffloadTraffic,
    /// The job's step in flight (from 1).
    pub(super) job_step: u64,
    /// Partitioned checkpoints (ZeRO-R) by name: the segment `(start, mb)` keeping this rank's
    /// part.
    pub(super) checkpoints: HashMap<TensorId, (usize, usize)>,
    /// Checkpoints waiting whole in the table (`--offload-activations cpu`), by name: bytes.
    pub(super) offloaded_bytes: HashMap<TensorId, u64>,
    /// The most checkpoint bytes held at once this step.
    pub(super) checkpoint_peak: archipelago_dataflow::CheckpointBytes,
    /// Each tie's mirror's gradient so far this step (the micro-batches' sum), by the mirror's
    /// block.
    pub(super) tied_grads: HashMap<usize, Vec<f32>>,
}

impl<B: AutodiffBackend> HeldStage<B> {
    /// Block `index` built afresh (ZeRO-3 gathers) as the trainer holds it: frozen parameters
    /// out of its view ([`PartlyFrozen`]); load its trained vector next.
    pub(super) fn build_held(&self, index: usize) -> Box<dyn Block<B>> {
        let ctx = BuildContext {
            seed: self.seed,
            actor: self.actor,
            block: index,
            tp: self.tp,
            sequence_parallel: self.sequence_parallel,
        };
        let block = self.builder.build_block(&ctx, &self.device);
        let tied = self.desc.tracked_mirrors(index);
        let held = PartlyFrozen::hold(block, self.layouts[index].clone(), &self.frozen[index], &tied);
        in_compute_dtype(held, self.compute)
    }
}

/// `block` as the actor computes with it: cast to the compute dtype (untouched in f32).
pub(super) fn in_compute_dtype<B: AutodiffBackend>(
    block: Box<dyn Block<B>>,
    compute: burn::tensor::FloatDType,
) -> Box<dyn Block<B>> {
    if compute == burn::tensor::FloatDType::F32 {
        block
    } else {
        block.cast_params(compute)
    }
}

impl<B: AutodiffBackend> Default for InFlight<B> {
    fn default() -> Self {
        InFlight {
            batches: HashMap::new(),
            segments: HashMap::new(),
            by_name: HashMap::new(),
            losses: HashMap::new(),
            loss_sum: None,
            upstream: HashMap::new(),
            pending_weights: HashMap::new(),
            grad_ranges: HashMap::new(),
            grads_started: HashSet::new(),
            peak_grad_bytes: 0,
            optimizer_grad_bytes: 0,
            live: HashMap::new(),
            peak_live: 0,
            spare_buffers: Vec::new(),
            offload_traffic: Default::default(),
            job_step: 0,
            checkpoints: HashMap::new(),
            offloaded_bytes: HashMap::new(),
            checkpoint_peak: Default::default(),
            tied_grads: HashMap::new(),
        }
    }
}

impl<B: AutodiffBackend> InFlight<B> {
    /// Drops what the step held (the spare buffers and the figures stay for the report).
    pub(super) fn clear(&mut self) {
        self.batches.clear();
        self.segments.clear();
        self.by_name.clear();
        self.losses.clear();
        self.upstream.clear();
        self.pending_weights.clear();
        self.grads_started.clear();
        self.live.clear();
        self.checkpoints.clear();
        self.offloaded_bytes.clear();
        self.tied_grads.clear();
    }
}

/// What outlives a step: the held parameters and the optimizer, the plan's segments, and the
/// store that keeps the state (host, device or offload tier).
pub(super) struct TrainingState<B: AutodiffBackend> {
    /// The f32 parameters this actor keeps between steps: the held part of each segment (the
    /// whole segment; its shard under ZeRO-3), concatenated in segment order
    /// (`SegmentPlan::held_at`). Host copies when the state lives on the device; empty when the
    /// offload tier keeps them (`--offload-params`).
    pub(super) held: Vec<f32>,
    pub(super) optimizer: FlatOptimizer,
    /// Clipping, and the optimizer step in flight.
    pub(super) update: UpdateState,
    /// The plan's segments: what this actor holds, updates, receives and saves of each.
    pub(super) sharding: Sharding,
    /// The optimizer step the plan calls for (`ActorTraining::update_scope`, decided once).
    pub(super) update_scope: UpdateScope,
    /// What follows the update of a segment, wherever it ran (`ActorTraining::after_update`).
    pub(super) after_update: UpdateScope,
    /// Full-segment buffers kept for the next all-gathers.
    pub(super) gather_pool: Vec<Vec<f32>>,
    /// Where the optimizer state (and with `--offload-params` the parameters) lives.
    pub(super) store: Store<B::InnerBackend>,
    /// Update the device state with tensor ops even where its buffers are host memory (CPU).
    pub(super) tensor_op_update: bool,
    /// ZeRO++ hpZ's secondary copy (`super::hpz`).
    pub(super) secondary: super::hpz::Secondary,
}
