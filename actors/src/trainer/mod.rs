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
//! gradients that cross to another stage leave as [`HostTensor`]s ([`Computation::export`]) and
//! arrive through the tensor table. Under activation checkpointing a forward keeps only the
//! segment's input and drops its graph; the backward recomputes the forward first (Chen et al.,
//! 2016). ZB-H1's split backward: `BackwardInput` runs burn's backward (which always yields input
//! and weight gradients together) and keeps the weight gradients; `BackwardWeight` moves them into
//! the gradient bucket.
//!
//! The parts: `data.rs` (batches), `passes.rs` (forward, loss, backward, gradient buckets),
//! `zero.rs` (the optimizer step, ZeRO shards and parameter loading), `norms.rs` (clipping's
//! global norm, LAMB's parameter norms, the parameter groups), `offload.rs` (handing gradients
//! to the offload actor and taking its updated parameters back), `fault.rs` (a test hook: the
//! faults of the equivalence suite's negative controls).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::{
    ActorId, ActorPlan, ActorTraining, ComputeOp, DType, ModelDesc, ParamDesc, Program, SegmentPlan,
    StatePlacement, ZeroStage,
};

use crate::block::{Activation, Block, check_described, describe_shapes, init_range};
use crate::executor::{Computation, StepMetrics, TensorTable};
use crate::host_tensor::{HostTensor, from_burn};
use crate::offload::OffloadActor;
use crate::optim::FlatOptimizer;
use crate::weights_file::InitWeights;
use crate::zoo::{BuildContext, ModelBuilder};

use data::{Batch, Samples, samples};
use device_state::DeviceState;
use fault::FaultHook;
use norms::{StageParams, UpdateState};
pub use zero::Sharding;

mod checkpoint;
mod cpu_buffers;
mod data;
mod device_state;
mod fault;
mod norms;
mod offload;
mod passes;
mod zero;

/// The per-micro-batch copies of a segment's blocks (see [`Block::fresh_copy`]).
type BlockCopies<B> = Vec<Box<dyn Block<B>>>;

/// A segment's forward for one micro-batch, kept for its backward.
pub(super) struct Segment<B: AutodiffBackend> {
    input: Activation<B>,
    /// The output; without its graph when `checkpointed`.
    output: Activation<B>,
    checkpointed: bool,
    /// The per-micro-batch copies of the blocks the forward ran on (their gradients are read
    /// from these); empty when checkpointed (the recompute makes new ones).
    copies: BlockCopies<B>,
    /// The batch whose targets the loss uses (last segment only).
    batch: Option<String>,
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

/// One actor's model, optimizer state and in-flight step.
pub struct Trainer<B: AutodiffBackend> {
    device: B::Device,
    desc: ModelDesc,
    blocks: Vec<Option<Box<dyn Block<B>>>>,
    /// `offsets[i]..offsets[i + 1]`: block `i` in the local master vector (empty when not held).
    offsets: Vec<usize>,
    /// First block of each chunk held, for counting micro-batches in flight per chunk.
    chunk_starts: Vec<usize>,
    /// f32 master parameters of the held blocks, flat in block order.
    master: Vec<f32>,
    optimizer: FlatOptimizer,
    /// Clipping, and the optimizer step in flight.
    update: UpdateState,
    /// Gradient bucket buffers kept from the last step (no fresh allocation per step).
    spare_buffers: Vec<Vec<f32>>,
    samples: Samples,
    global_batch: usize,
    checkpoint: bool,
    batches: HashMap<String, Batch<B>>,
    segments: HashMap<(usize, usize), Segment<B>>,
    by_name: HashMap<String, (usize, usize)>,
    losses: HashMap<String, (usize, usize)>,
    loss_sum: Option<f32>,
    upstream: HashMap<String, Activation<B>>,
    /// ZB-H1: weight gradients computed by `BackwardInput` (with the block copies they belong
    /// to), waiting for `BackwardWeight`.
    pending_weights: HashMap<(usize, usize), (B::Gradients, BlockCopies<B>)>,
    grad_ranges: HashMap<String, Range<usize>>,
    grads_started: HashSet<String>,
    peak_grad_bytes: u64,
    optimizer_grad_bytes: u64,
    live: HashMap<(usize, usize), usize>,
    peak_live: usize,
    /// ZeRO sharding over the dp group.
    sharding: Sharding,
    /// ZeRO-3: this replica's shards of the segments' parameters, concatenated (the master copy).
    shard_master: Vec<f32>,
    /// ZeRO-3: full-segment buffers kept for the next gathers.
    gather_pool: Vec<Vec<f32>>,
    /// Which blocks this actor holds (under ZeRO-3 their modules come and go).
    held_blocks: Vec<bool>,
    /// Each held block's parameters, described one by one (the model's descriptions, or ones
    /// made from the built module for a model that gives only counts); empty for other blocks.
    param_descs: Vec<Vec<ParamDesc>>,
    builder: Arc<dyn ModelBuilder<B>>,
    seed: u64,
    actor: ActorId,
    /// The offload actor holding the master shard and optimizer state (with `--offload`).
    offload: Option<OffloadActor>,
    /// ZeRO-3 with `--offload-params`: the parameter shards live with the offload actor too.
    offload_params: bool,
    /// Segments (by first block) handed to the offload actor this step, in order.
    handed_off: Vec<usize>,
    /// Optimizer steps taken (the offload actor's Adam step counter is this + 1).
    steps_done: i32,
    /// Move each gradient bucket off the device and each block's parameters onto it in one
    /// transfer (GPUs; see `read_flat` and `Block::load_params`).
    batched_transfers: bool,
    /// Test hook: the fault the program names (`None` but in the equivalence suite's controls).
    fault: Option<FaultHook>,
    /// `--state device`: the master parameters, optimizer state and gradient buckets on the
    /// device (authoritative; `master` and the optimizer's moments are then host copies brought
    /// up to date by [`Computation::sync_host`]).
    device_state: Option<DeviceState<B::InnerBackend>>,
    /// This actor's segments (first block, one past the last).
    segment_ranges: Vec<(usize, usize)>,
    /// Update the device state with tensor ops even where its buffers are host memory (CPU).
    tensor_op_update: bool,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Builds the blocks of `chunks` (half-open block ranges) of `program`'s model on `device`
    /// for `actor`, each parameter initialised whole from `(seed, its name)` and sliced to what
    /// this actor keeps (or read from the program's `--init` file), and the data source.
    pub fn new(
        program: &Program,
        builder: Arc<dyn ModelBuilder<B>>,
        actor: ActorId,
        device: B::Device,
        placement: &Placement,
    ) -> Result<Trainer<B>, String> {
        let chunks = &placement.chunks;
        let training = &placement.training;
        let desc = program.model.clone();
        let held = |i: usize| chunks.iter().any(|&(s, e)| (s..e).contains(&i));
        let mut offsets = vec![0];
        for (index, info) in desc.blocks.iter().enumerate() {
            let n = if held(index) { info.params as usize } else { 0 };
            offsets.push(offsets[index] + n);
        }
        let sharding = Sharding::of(training, &offsets)?;
        // ZeRO-3 initialises block by block and keeps only this replica's shard of each
        // segment (as DeepSpeed's `zero.Init`): the whole model never exists on one actor.
        let sharded = sharding.zero.shards_parameters();
        let mut shard_master = vec![0.0f32; if sharded { sharding.state_len() } else { 0 }];
        let mut blocks = Vec::with_capacity(desc.blocks.len());
        let mut master = Vec::new();
        let mut stage_params = StageParams::default();
        let init_file = program
            .init
            .as_deref()
            .map(|path| InitWeights::open(std::path::Path::new(path), &desc))
            .transpose()?;
        let mut param_descs = Vec::with_capacity(desc.blocks.len());
        for (index, info) in desc.blocks.iter().enumerate() {
            if !held(index) {
                blocks.push(None);
                param_descs.push(Vec::new());
                continue;
            }
            let ctx = BuildContext {
                seed: program.seed,
                actor,
                block: index,
            };
            let block = builder.build_block(&ctx, &device);
            if block.num_params() as u64 != info.params {
                return Err(format!(
                    "block {index} `{}` has {} parameters but the model description says {}",
                    info.name,
                    block.num_params(),
                    info.params
                ));
            }
            let shapes = block.param_shapes();
            let described = if info.param_descs.is_empty() {
                describe_shapes(&info.name, &shapes)
            } else {
                check_described(&info.name, &info.param_descs, &shapes)?;
                info.param_descs.clone()
            };
            if let Some(p) = described.iter().find(|p| !p.trainable || p.dtype != DType::F32) {
                return Err(format!(
                    "parameter `{}` is described as {}{:?}: the trainer holds every parameter as a \
                     trainable f32 for now (frozen and low-precision parameters are planned, not yet \
                     trained); describe it as trainable f32",
                    p.name,
                    if p.trainable { "" } else { "frozen " },
                    p.dtype
                ));
            }
            stage_params.push_block(offsets[index], &shapes, program.param_groups);
            // Each parameter drawn whole from (seed, name), then sliced to what is kept here: the
            // block, or under ZeRO-3 only this replica's shard of it.
            let init = |range: Range<usize>| match &init_file {
                Some(file) => file.block(index).map(|all| all[range].to_vec()),
                None => Ok(init_range(&described, program.seed, range)),
            };
            if sharded {
                if let Some((from, to)) = sharding.owned_part(index, &offsets) {
                    shard_master[to].copy_from_slice(&init(from)?);
                }
                blocks.push(None);
            } else {
                let init = init(0..info.params as usize)?;
                blocks.push(Some(block.load_params(&init, false)));
                master.extend_from_slice(&init);
            }
            param_descs.push(described);
        }
        let samples = samples(&program.data, desc.input)?;
        let held_blocks: Vec<bool> = (0..desc.blocks.len()).map(held).collect();
        let offload = if training.offload.is_some() {
            // The offload actor starts with each segment's optimizer range of the master copy.
            let mut shards = HashMap::new();
            let mut layouts = HashMap::new();
            for &SegmentPlan { start, end, .. } in &training.segments {
                let range = sharding.optimizer_range(start, offsets[end] - offsets[start])?;
                let window = offsets[start] + range.start..offsets[start] + range.end;
                layouts.insert(start, stage_params.layout(&[(window, 0)], range.len())?);
                let shard = if sharded {
                    let state = sharding.segment(start)?.state;
                    &shard_master[state..state + range.len()]
                } else {
                    &master[offsets[start] + range.start..offsets[start] + range.end]
                };
                shards.insert(start, shard.to_vec());
            }
            Some(OffloadActor::spawn(
                &training.offload,
                actor,
                program.optimizer,
                shards,
                layouts,
            )?)
        } else {
            None
        };
        let offload_params = offload.is_some() && training.offload_params;
        if offload_params {
            shard_master = Vec::new();
        }
        let state_len = match (&offload, sharding.zero) {
            (Some(_), _) => 0,
            (None, ZeroStage::Replicated) => master.len(),
            (None, _) => sharding.state_len(),
        };
        // Where each parameter's elements lie in the optimizer's state: the master vector, or
        // this replica's shard of each segment, concatenated.
        let windows: Vec<(Range<usize>, usize)> = match (&offload, sharding.zero) {
            (Some(_), _) => Vec::new(),
            (None, ZeroStage::Replicated) => vec![(0..master.len(), 0)],
            (None, _) => training
                .segments
                .iter()
                .map(|&SegmentPlan { start, .. }| {
                    let shard = sharding.segment(start)?;
                    let from = offsets[start] + shard.own.start..offsets[start] + shard.own.end;
                    Ok((from, shard.state))
                })
                .collect::<Result<_, String>>()?,
        };
        let optimizer = FlatOptimizer::new(program.optimizer, state_len)
            .with_schedule(program.lr_schedule)
            .with_layout(stage_params.layout(&windows, state_len)?);
        Ok(Trainer {
            device,
            desc,
            blocks,
            offsets,
            chunk_starts: chunks.iter().map(|c| c.0).collect(),
            optimizer,
            update: UpdateState {
                clip: program.clip_grad_norm,
                ..UpdateState::default()
            },
            master,
            spare_buffers: Vec::new(),
            samples,
            global_batch: program.plan.batch,
            checkpoint: training.checkpoint_activations,
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
            sharding,
            shard_master,
            gather_pool: Vec::new(),
            held_blocks,
            param_descs,
            builder,
            seed: program.seed,
            actor,
            offload,
            offload_params,
            handed_off: Vec::new(),
            steps_done: 0,
            batched_transfers: false,
            fault: FaultHook::new(program.test_fault, training.replica, program.plan.microbatches),
            device_state: None,
            segment_ranges: training.block_ranges(),
            tensor_op_update: false,
        }
        .with_state_on_device(training.state == StatePlacement::Device))
    }

    /// Moves the master parameters and optimizer state onto the device (`--state device`) from
    /// the host copies, or leaves them in host memory.
    fn with_state_on_device(mut self, on: bool) -> Trainer<B> {
        if on {
            self.upload_state();
        }
        self
    }

    /// (Re)builds the device state from the host copies (at start, and after a restore).
    pub(super) fn upload_state(&mut self) {
        let segments: Vec<(usize, Range<usize>)> = self
            .segment_ranges
            .iter()
            .map(|&(start, end)| (start, self.offsets[start]..self.offsets[end]))
            .collect();
        let optimizer = &self.optimizer;
        let device = self.device.clone();
        self.device_state = Some(DeviceState::upload(
            optimizer.spec(),
            &segments,
            &self.master,
            |range| {
                let (m, v) = optimizer.state(range);
                (m.to_vec(), v.to_vec())
            },
            optimizer.layout(),
            &device,
            self.tensor_op_update,
        ));
    }

    /// Reads each gradient bucket off the device in one transfer (concatenated on the device
    /// first) and writes each block's parameters onto it in one (sliced on the device), instead of
    /// tensor by tensor: for GPUs, where every copy between host and device has a fixed cost.
    pub fn with_batched_transfers(mut self, on: bool) -> Trainer<B> {
        self.batched_transfers = on;
        self
    }

    /// With the state on the device, updates it with tensor ops even on the CPU backend (whose
    /// buffers the optimizer's flat loops otherwise update in place): the GPU path, for tests.
    pub fn with_tensor_op_update(mut self, on: bool) -> Trainer<B> {
        self.tensor_op_update = on;
        if self.device_state.is_some() {
            self.upload_state();
        }
        self
    }

    /// Flat parameters of block `index` (empty when this actor does not hold it).
    pub fn block_params(&self, index: usize) -> &[f32] {
        &self.master[self.offsets[index]..self.offsets[index + 1]]
    }

    pub(super) fn block(&self, index: usize) -> Result<&dyn Block<B>, String> {
        self.blocks[index]
            .as_deref()
            .ok_or_else(|| format!("block {index} is not held by this actor"))
    }

    pub(super) fn chunk_of(&self, block: usize) -> usize {
        self.chunk_starts
            .iter()
            .copied()
            .filter(|&s| s <= block)
            .max()
            .unwrap_or(0)
    }
}

fn to_host<B: AutodiffBackend>(a: &Activation<B>) -> Result<HostTensor, String> {
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
        inputs: &[String],
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let nth = |names: &[String], i: usize| {
            names
                .get(i)
                .cloned()
                .ok_or_else(|| format!("{op} names too few tensors"))
        };
        match op {
            ComputeOp::LoadBatch { start, end } => {
                self.load_batch(step, *start..*end, &nth(outputs, 0)?);
                Ok(())
            }
            ComputeOp::Forward { start, end, mb } => {
                self.forward(*start..*end, *mb, &nth(inputs, 0)?, &nth(outputs, 0)?, table)
            }
            ComputeOp::Loss { .. } => {
                self.compute_loss(&nth(inputs, 0)?, &nth(inputs, 1)?, &nth(outputs, 0)?)
            }
            ComputeOp::Backward { start, end, mb } => {
                self.backward(*start..*end, *mb, &nth(inputs, 0)?, outputs, table)
            }
            ComputeOp::BackwardInput { start, end, mb } => {
                self.backward_input(*start..*end, *mb, &nth(inputs, 0)?, outputs, table)
            }
            ComputeOp::BackwardWeight { start, end, mb } => {
                self.backward_weight(*start..*end, *mb, outputs, table)
            }
            ComputeOp::OffloadGrads { .. } => self.offload_grads(&nth(inputs, 0)?, table),
            ComputeOp::GradNorm { .. } => self.grad_norm(inputs, outputs, table),
            ComputeOp::TrustNorms { .. } => self.trust_norms(inputs, outputs, table),
            ComputeOp::OptimizerStep { .. } if self.offload.is_some() => {
                self.collect_offloaded(outputs, table)
            }
            ComputeOp::OptimizerStep { .. } => self.optimizer_step(inputs, outputs, table),
            ComputeOp::LoadParams { start, end } => self.load_params(*start..*end, &nth(inputs, 0)?, table),
            ComputeOp::ShardParams { start, end } => {
                self.shard_params(*start..*end, &nth(outputs, 0)?, table)
            }
            ComputeOp::DropParams { start, end } => {
                (*start..*end).for_each(|i| self.blocks[i] = None);
                Ok(())
            }
            ComputeOp::User { name } => Err(format!("a training actor has no user function `{name}`")),
            ComputeOp::Output { key } => Err(format!("a training actor does not output `{key}`")),
        }
    }

    fn export(&mut self, name: &str) -> Option<Result<HostTensor, String>> {
        if let Some(bucket) = self.device_state.as_mut().and_then(|d| d.export_bucket(name)) {
            return Some(Ok(HostTensor::flat(bucket)));
        }
        if let Some(key) = self.by_name.get(name) {
            return Some(to_host(&self.segments.get(key)?.output));
        }
        self.upstream.remove(name).map(|g| to_host(&g))
    }

    fn finish_step(&mut self) -> StepMetrics {
        self.batches.clear();
        self.segments.clear();
        self.by_name.clear();
        self.losses.clear();
        self.upstream.clear();
        self.pending_weights.clear();
        self.grads_started.clear();
        self.live.clear();
        let params = 4 * (self.master.len() + self.shard_master.len()) as u64;
        let state = match &self.device_state {
            Some(device) => device.bytes(),
            None => params + self.optimizer.state_bytes(),
        };
        let materialized: usize = (0..self.blocks.len())
            .filter(|&i| self.blocks[i].is_some())
            .map(|i| self.offsets[i + 1] - self.offsets[i])
            .sum();
        // The gradients the optimizer step consumed: whole buckets, or shards under ZeRO-2.
        let held_grads = std::mem::take(&mut self.optimizer_grad_bytes);
        let steps = if self.offload.is_some() {
            self.steps_done
        } else {
            self.optimizer.steps()
        };
        let metrics = StepMetrics {
            loss: self.loss_sum.take(),
            model_state_bytes: state + held_grads,
            peak_model_state_bytes: state + self.peak_grad_bytes.max(held_grads),
            compute_weight_bytes: 4 * materialized as u64,
            peak_microbatches_held: self.peak_live,
            offload: self.offload.as_ref().map(OffloadActor::stats),
            lr: (steps > 0).then(|| self.optimizer.lr_at(self.optimizer.schedule_step())),
            grad_norm: self.update.grad_norm.take(),
            transfers: Default::default(), // the executor's count of the step
        };
        self.peak_grad_bytes = 0;
        self.peak_live = 0;
        self.update.begun = false;
        metrics
    }

    fn block_params(&self) -> Vec<(usize, Vec<f32>)> {
        if self.sharding.zero.shards_parameters() {
            return Vec::new(); // only shards here; see block_squares
        }
        (0..self.blocks.len())
            .filter(|&i| self.held_blocks[i])
            .map(|i| (i, Trainer::block_params(self, i).to_vec()))
            .collect()
    }

    fn save_state(&self) -> Result<Option<crate::checkpoint::ShardState>, String> {
        self.checkpoint_state()
    }

    fn sync_host(&mut self) {
        let Some(state) = &self.device_state else {
            return;
        };
        let (master, optimizer) = (&mut self.master, &mut self.optimizer);
        state.download_into(|range, params, m, v| {
            master[range.clone()].copy_from_slice(&params);
            optimizer.set_state(range.start, &m, &v);
        });
    }

    fn block_squares(&self) -> Vec<(usize, f64)> {
        let sq = |v: &[f32]| v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        if !self.sharding.zero.shards_parameters() {
            // Every replica holds every parameter: the first one answers for the group.
            if self.sharding.rank != 0 {
                return Vec::new();
            }
            return (0..self.blocks.len())
                .filter(|&i| self.held_blocks[i])
                .map(|i| (i, sq(Trainer::block_params(self, i))))
                .collect();
        }
        self.shard_squares()
    }
}
