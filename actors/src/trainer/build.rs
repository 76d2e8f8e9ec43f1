//! Building an actor's trainer from its plan: the blocks of its chunks, each parameter
//! initialised whole from `(seed, its name)` (or read from `--init`) and sliced to what this
//! actor keeps, the ZeRO shards and optimizer state the plan gives it, the offload actor, and
//! the training state moved onto the device when the plan says so.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::{
    ActorId, BlockInfo, ParamDesc, Program, SegmentPlan, StatePlacement, TrainedLayout, ZeroStage,
};

use super::cpu_buffers::is_cpu;
use super::data::samples;
use super::device_state::{DeviceState, SegmentPlace};
use super::fault::FaultHook;
use super::norms::{StageParams, UpdateState};
use super::parts::{HeldStage, InFlight, TrainingState};
use super::{Placement, Sharding, Trainer};
use crate::block::{Block, check_described, describe_shapes, init_param, init_range};
use crate::block_frozen::PartlyFrozen;
use crate::executor::Computation;
use crate::offload::OffloadActor;
use crate::optim::FlatOptimizer;
use crate::weights_file::InitWeights;
use crate::zoo::{BuildContext, ModelBuilder};

/// The parameters of block `index` (`info` in the model) as built (`block`), described one by
/// one: the model's descriptions, checked against the module, or ones made from the module for a
/// model that gives only counts.
fn described_params<B: AutodiffBackend>(
    index: usize,
    info: &BlockInfo,
    block: &dyn Block<B>,
) -> Result<Vec<ParamDesc>, String> {
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
    // `compile` refuses these first (the same rule); kept for a plan built by hand.
    if let Some(why) = described.iter().find_map(|p| p.not_trainable_yet()) {
        return Err(why);
    }
    Ok(described)
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
        // Offsets into the trained vectors (frozen parameters have no place in them).
        let mut offsets = vec![0];
        for (index, info) in desc.blocks.iter().enumerate() {
            let n = if held(index) {
                info.trained_params() as usize
            } else {
                0
            };
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
        let mut layouts = Vec::with_capacity(desc.blocks.len());
        let mut frozen = Vec::with_capacity(desc.blocks.len());
        for (index, info) in desc.blocks.iter().enumerate() {
            if !held(index) {
                blocks.push(None);
                param_descs.push(Vec::new());
                layouts.push(Arc::default());
                frozen.push(Arc::default());
                continue;
            }
            let ctx = BuildContext {
                seed: program.seed,
                actor,
                block: index,
            };
            let built = builder.build_block(&ctx, &device);
            let described = described_params(index, info, &*built)?;
            let layout = Arc::new(TrainedLayout::of(&described));
            let trained: Vec<ParamDesc> = described.iter().filter(|p| p.trainable).cloned().collect();
            // Each parameter drawn whole from (seed, name), then sliced to what is kept here: the
            // block, or under ZeRO-3 only this replica's shard of it; frozen ones kept whole.
            let from_file = match &init_file {
                Some(file) => Some(layout.split(&file.block(index)?)),
                None => None,
            };
            let frozen_values = Arc::new(match &from_file {
                Some((_, values)) => values.clone(),
                None => (described.iter().filter(|p| !p.trainable))
                    .flat_map(|p| init_param(p, program.seed))
                    .collect(),
            });
            let block = PartlyFrozen::hold(built, layout.clone(), &frozen_values);
            stage_params.push_block(offsets[index], &block.param_shapes(), program.param_groups);
            let init = |range: Range<usize>| match &from_file {
                Some((values, _)) => values[range].to_vec(),
                None => init_range(&trained, program.seed, range),
            };
            if sharded {
                if let Some((from, to)) = sharding.owned_part(index, &offsets) {
                    shard_master[to].copy_from_slice(&init(from));
                }
                blocks.push(None);
            } else {
                let init = init(0..layout.trained_len());
                blocks.push(Some(block.load_params(&init, false)));
                master.extend_from_slice(&init);
            }
            param_descs.push(trained);
            layouts.push(layout);
            frozen.push(frozen_values);
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
            stage: HeldStage {
                device,
                desc,
                blocks,
                offsets,
                chunk_starts: chunks.iter().map(|c| c.0).collect(),
                held_blocks,
                param_descs,
                layouts,
                frozen,
                builder,
                seed: program.seed,
                actor,
            },
            step: InFlight::default(),
            state: TrainingState {
                master,
                optimizer,
                update: UpdateState {
                    clip: program.clip_grad_norm,
                    ..UpdateState::default()
                },
                sharding,
                update_scope: training.update_scope(),
                shard_master,
                gather_pool: Vec::new(),
                offload,
                offload_params,
                handed_off: Vec::new(),
                steps_done: 0,
                device_state: None,
                tensor_op_update: false,
            },
            samples,
            global_batch: program.plan.batch,
            checkpoint: training.checkpoint_activations,
            batched_transfers: false,
            fault: FaultHook::new(program.test_fault, training.replica, program.plan.microbatches),
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
        let offsets = &self.stage.offsets;
        let sharding = &self.state.sharding;
        let segments: Vec<SegmentPlace> = sharding
            .segments
            .iter()
            .map(|(&start, shard)| {
                let range = offsets[start]..offsets[shard.end];
                let (update, state_at) = if sharding.zero.shards_optimizer() {
                    (shard.own.clone(), shard.state)
                } else {
                    (0..range.len(), range.start)
                };
                let held = if sharding.zero.shards_parameters() {
                    shard.own.clone()
                } else {
                    0..range.len()
                };
                SegmentPlace {
                    start,
                    range,
                    update,
                    held,
                    state_at,
                }
            })
            .collect();
        let optimizer = &self.state.optimizer;
        let device = self.stage.device.clone();
        let mut state = DeviceState::upload(
            optimizer.spec(),
            &segments,
            |place| self.held_params(place),
            |range| {
                let (m, v) = optimizer.state(range);
                (m.to_vec(), v.to_vec())
            },
            optimizer.layout(),
            &device,
            self.state.tensor_op_update,
        );
        state.grads_sharded = self.state.sharding.grads_sharded();
        self.state.device_state = Some(state);
        // The device's state is the state: no host mirror of the moments is kept (one is made
        // by `sync_host` for a checkpoint, and freed again at the next step's end).
        self.state.optimizer.release_state();
    }

    /// The host copy of the parameters `place` keeps on the device: its range of the master, or
    /// under ZeRO-3 its shard of the shard master.
    pub(super) fn held_params(&self, place: &SegmentPlace) -> Vec<f32> {
        if self.state.sharding.zero.shards_parameters() {
            let at = place.state_at;
            self.state.shard_master[at..at + place.held.len()].to_vec()
        } else {
            let at = place.range.start + place.held.start;
            self.state.master[at..at + place.held.len()].to_vec()
        }
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
        // Only the CPU backend has two ways to update: elsewhere the state already uploaded is
        // the one the flag asks for, and is not moved again.
        let changes = on != self.state.tensor_op_update && is_cpu::<B::InnerBackend>();
        self.state.tensor_op_update = on;
        if changes && self.state.device_state.is_some() {
            self.sync_host();
            self.upload_state();
        }
        self
    }
}
