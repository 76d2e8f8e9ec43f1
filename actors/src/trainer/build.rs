//! Building an actor's trainer from its plan: the blocks of its chunks, each parameter
//! initialised whole from `(seed, its name)` (or read from `--init`) and sliced to what this
//! actor keeps, the ZeRO shards and optimizer state the plan gives it, the offload actor, and
//! the training state moved onto the device when the plan says so.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::{
    ActorId, BlockInfo, Compression, ParamDesc, Program, SegmentPlan, SliceState, TrainedLayout,
};

use super::data::samples;
use super::fault::FaultHook;
use super::norms::{StageParams, UpdateState};
use super::parts::{HeldStage, InFlight, TrainingState};
use super::store::{OffloadSpawn, Store};
use super::zero::part_of;
use super::{Placement, Sharding, Trainer};
use crate::block::{Block, check_described, describe_shapes, init_local_range};
use crate::block_frozen::PartlyFrozen;
use crate::optim::FlatOptimizer;
use crate::weights_file::{InitWeights, adapter_start};
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

/// The trainer as built against the plan's typed state layout (`slices`): the same parameters
/// of the same blocks, trainable or frozen, in order (`built`: block, name, trainable, and
/// whether the model names its parameters — a model that gives only counts has one slice per
/// block), and as many elements held, frozen and updated (`lens`). A plan compiled for another
/// model is refused here, naming the first parameter that differs.
fn check_layout(
    slices: &[SliceState],
    built: &[(usize, String, bool, bool)],
    (held, frozen, updated): (usize, usize, usize),
) -> Result<(), String> {
    let named = built.iter().filter(|b| b.3);
    let planned = slices
        .iter()
        .filter(|s| built.iter().any(|b| b.0 == s.block && b.3));
    for (b, s) in named.zip(planned) {
        if (b.0, &b.1, b.2) != (s.block, &s.param, s.trainable) {
            let kind = |t: bool| if t { "trainable" } else { "frozen" };
            return Err(format!(
                "the plan's state layout has {} `{}` of block {} where this actor built {} `{}` of block {}: \
                 the plan was compiled for another model",
                kind(s.trainable),
                s.param,
                s.block,
                kind(b.2),
                b.1,
                b.0
            ));
        }
    }
    let sum = |trainable: bool, of: fn(&SliceState) -> usize| -> usize {
        slices.iter().filter(|s| s.trainable == trainable).map(of).sum()
    };
    let planned = (
        sum(true, |s| s.held.len()),
        sum(false, |s| s.held.len()),
        sum(true, |s| s.updated.len()),
    );
    if planned != (held, frozen, updated) {
        return Err(format!(
            "the plan's state layout holds {} trained and {} frozen elements and updates {}; this actor built {held}, \
             {frozen} and {updated}",
            planned.0, planned.1, planned.2
        ));
    }
    Ok(())
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
        // A tensor-parallel rank builds, describes and holds its slice of every block.
        let tp = training.tp;
        let desc = archipelago_dataflow::tensor_parallel::local_model(&program.model, tp.size);
        let compute = crate::precision::compute_dtype(&training.slices)?;
        // The model whole, as this rank's slices are cut from it.
        let whole_model = super::fault::sliced_as(&program.model, program.test_fault);
        let held_block = |i: usize| chunks.iter().any(|&(s, e)| (s..e).contains(&i));
        // Offsets into the trained vectors (frozen parameters have no place in them).
        let mut offsets = vec![0];
        for (index, info) in desc.blocks.iter().enumerate() {
            let n = if held_block(index) {
                info.trained_params() as usize
            } else {
                0
            };
            offsets.push(offsets[index] + n);
        }
        let sharding = Sharding::of(training, &offsets)?;
        // Each parameter drawn whole from (seed, name), then sliced to the part the plan has
        // this actor hold: the block, or under ZeRO-3 only this replica's shard of it (as
        // DeepSpeed's `zero.Init`: the whole model never exists on one actor).
        let mut held = vec![0.0f32; sharding.held_len()];
        let mut blocks = Vec::with_capacity(desc.blocks.len());
        let mut stage_params = StageParams::default();
        let init_file = program
            .init
            .as_deref()
            .map(|path| InitWeights::open(std::path::Path::new(path), &desc, adapter_start(program)))
            .transpose()?;
        let mut param_descs = Vec::with_capacity(desc.blocks.len());
        let mut layouts = Vec::with_capacity(desc.blocks.len());
        let mut frozen = Vec::with_capacity(desc.blocks.len());
        let mut built_params = Vec::new();
        for (index, info) in desc.blocks.iter().enumerate() {
            if !held_block(index) {
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
                tp,
                sequence_parallel: program.plan.sequence_parallel,
            };
            let whole_params = &whole_model.blocks[index].param_descs;
            let built = builder.build_block(&ctx, &device);
            let described = described_params(index, info, &*built)?;
            let named = described.iter().map(|p| (p.name.clone(), p.trainable));
            built_params.extend(
                named.map(|(name, trainable)| (index, name, trainable, !info.param_descs.is_empty())),
            );
            let layout = Arc::new(TrainedLayout::of(&described));
            let trained: Vec<ParamDesc> = described.iter().filter(|p| p.trainable).cloned().collect();
            // The same parameters whole (a model that gives only counts is never split).
            let whole = |trainable: bool| -> Vec<ParamDesc> {
                if whole_params.is_empty() {
                    described
                        .iter()
                        .filter(|p| p.trainable == trainable)
                        .cloned()
                        .collect()
                } else {
                    whole_params
                        .iter()
                        .filter(|p| p.trainable == trainable)
                        .cloned()
                        .collect()
                }
            };
            let from_file = match &init_file {
                // A tp rank takes its slice of each whole parameter the file holds.
                Some(file) => {
                    Some(layout.split(&local_block(&whole_model.blocks[index], file.block(index)?, tp)))
                }
                None => None,
            };
            // Frozen ones kept whole.
            let frozen_values = Arc::new(match &from_file {
                Some((_, values)) => values.clone(),
                None => {
                    let frozen: Vec<ParamDesc> = described.iter().filter(|p| !p.trainable).cloned().collect();
                    let len = frozen.iter().map(ParamDesc::len).sum();
                    init_local_range(&frozen, &whole(false), program.seed, tp, 0..len)
                }
            });
            let block = PartlyFrozen::hold(
                built,
                layout.clone(),
                &frozen_values,
                &desc.tracked_mirrors(index),
            );
            let block = super::parts::in_compute_dtype(block, compute);
            stage_params.push_block(offsets[index], &block.param_shapes(), program.param_groups);
            let init = |range: Range<usize>| match &from_file {
                Some((values, _)) => values[range].to_vec(),
                None => init_local_range(&trained, &whole(true), program.seed, tp, range),
            };
            if let Some((from, to)) = sharding.block_part(index, &offsets, part_of::held) {
                held[to].copy_from_slice(&init(from));
            }
            // A module lives between steps where its segment is held whole (not under ZeRO-3,
            // whose stream gathers and builds it around each pass).
            blocks.push(sharding.holds_whole(index).then(|| {
                let at = offsets[index]..offsets[index + 1];
                block.load_params(&held[at], false)
            }));
            param_descs.push(trained);
            layouts.push(layout);
            frozen.push(frozen_values);
        }
        let frozen_len = frozen.iter().map(|f| f.len()).sum();
        check_layout(
            &training.slices,
            &built_params,
            (held.len(), frozen_len, sharding.state_len()),
        )?;
        let samples = samples(&program.data, desc.input)?;
        let held_blocks: Vec<bool> = (0..desc.blocks.len()).map(held_block).collect();
        // Where each updated part lies in the optimizer's state: the segments' updated parts,
        // concatenated (each maps positions of the trained vectors to state positions).
        let windows: Vec<(Range<usize>, usize)> = (sharding.segments.values())
            .map(|s| {
                let base = offsets[s.start];
                (base + s.updated.start..base + s.updated.end, s.state_at)
            })
            .collect();
        let offload_layout = |s: &SegmentPlan| {
            let base = offsets[s.start];
            stage_params.layout(
                &[(base + s.updated.start..base + s.updated.end, 0)],
                s.updated.len(),
            )
        };
        let spawn: OffloadSpawn = (actor, program.update_rule(), &offload_layout);
        let store = Store::of_plan(training, &sharding, &mut held, spawn)?;
        let state_len = store.optimizer_state_len(&sharding);
        let windows = if state_len == 0 { Vec::new() } else { windows };
        let mut optimizer = FlatOptimizer::new(program.update_rule(), state_len)
            .with_schedule(program.lr_schedule)
            .with_layout(stage_params.layout(&windows, state_len)?);
        if let Compression::OneBitAdam { freeze_step, .. } = program.compression {
            optimizer = optimizer.with_exchanged_momentum(freeze_step);
        }
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
                compute,
                seed: program.seed,
                actor,
                tp,
                sequence_parallel: program.plan.sequence_parallel,
                whole: Arc::new(whole_model),
            },
            step: InFlight::default(),
            state: TrainingState {
                held,
                optimizer,
                update: UpdateState {
                    clip: program.clip_grad_norm,
                    scaler: crate::precision::LossScaler::of(program.precision.loss_scaling()),
                    ..UpdateState::default()
                },
                sharding,
                update_scope: training.update_scope(),
                after_update: training.after_update(),
                gather_pool: Vec::new(),
                store,
                tensor_op_update: false,
                secondary: super::hpz::Secondary::new(training.secondary),
            },
            samples,
            global_batch: program.plan.batch,
            checkpoints: training.checkpoints,
            batched_transfers: false,
            fault: FaultHook::new(
                program.test_fault,
                (actor, training.replica),
                program.plan.microbatches,
            ),
        }
        .with_state_where_planned(training.state))
    }

    /// Reads each gradient bucket off the device in one transfer (concatenated on the device
    /// first) and writes each block's parameters onto it in one (sliced on the device), instead of
    /// tensor by tensor: for GPUs, where every copy between host and device has a fixed cost.
    pub fn with_batched_transfers(mut self, on: bool) -> Trainer<B> {
        self.batched_transfers = on;
        self
    }
}

/// Block `whole`'s parameters as tp rank `tp` holds them, from `values`, the whole block's (its
/// parameters in order, as a weights file holds them): each split parameter's local slice.
pub(crate) fn local_block(whole: &BlockInfo, values: Vec<f32>, tp: crate::zoo::tp::TpPlace) -> Vec<f32> {
    if tp.size == 1 || whole.param_descs.is_empty() {
        return values;
    }
    let mut local = Vec::with_capacity(values.len());
    let mut at = 0;
    for p in &whole.param_descs {
        let end = (at + p.len()).min(values.len());
        local.extend(archipelago_dataflow::tensor_parallel::take_local(
            p,
            &values[at..end],
            tp.rank,
            tp.size,
        ));
        at = end;
    }
    local
}

#[cfg(test)]
mod tests {
    use super::*;
    use archipelago_dataflow::{ModelSpec, ParallelPlan, compile};

    /// The layout of a compiled plan passes against what it describes; one that freezes what
    /// the actor built trainable, or holds other counts, is refused.
    #[test]
    fn a_layout_for_another_model_is_refused() {
        let program = Program::new(ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap()).with_plan(
            ParallelPlan {
                batch: 4,
                ..ParallelPlan::default()
            },
        );
        let plan = compile(&program).unwrap();
        let slices = &plan.actors[0].training.slices;
        let built: Vec<(usize, String, bool, bool)> = slices
            .iter()
            .map(|s| (s.block, s.param.clone(), true, true))
            .collect();
        let held: usize = slices.iter().map(|s| s.held.len()).sum();
        check_layout(slices, &built, (held, 0, held)).unwrap();
        let mut frozen = built.clone();
        frozen[1].2 = false;
        let refused = check_layout(slices, &frozen, (held, 0, held)).unwrap_err();
        assert!(
            refused.contains("compiled for another model") && refused.contains(&built[1].1),
            "{refused}"
        );
        let refused = check_layout(slices, &built, (held + 1, 0, held)).unwrap_err();
        assert!(refused.contains("this actor built"), "{refused}");
    }
}
