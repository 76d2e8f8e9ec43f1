//! The trainer's optimizer step and ZeRO (Rajbhandari et al., SC 2020): which shard of each
//! gradient bucket this replica updates, the gathered parameters it loads, and under ZeRO-3 the
//! shards it keeps as its master copy and the modules it builds and drops around each segment.

use archipelago_dataflow::TensorId;
use archipelago_dataflow::UpdateScope;
use std::collections::BTreeMap;
use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::passes::optimizer::{GRAD_SQUARES, TRUST_SQUARES};
use archipelago_dataflow::{ActorTraining, SegmentPlan};

use super::Trainer;
use super::store::Gathered;
use crate::executor::{HeldParams, TensorTable};
use crate::typed_tensor::TypedTensor;

/// Where this actor sits in its data-parallel group, and its part of each segment (what it
/// holds, updates, receives and saves: the plan's [`SegmentPlan`], decided once by the compiler).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    /// This actor's position in its dp group (its shard).
    pub rank: usize,
    /// Its segments, by first block.
    pub(super) segments: BTreeMap<usize, SegmentPlan>,
}

impl Sharding {
    /// The segments the plan gives this actor (`training`), for a model whose block `i` lives at
    /// `offsets[i]..offsets[i + 1]` of the trained vectors of the blocks it holds.
    pub(super) fn of(training: &ActorTraining, offsets: &[usize]) -> Result<Sharding, String> {
        let mut segments = BTreeMap::new();
        for segment in &training.segments {
            let (start, end) = (segment.start, segment.end);
            if offsets[end] - offsets[start] != segment.params {
                return Err(format!(
                    "the plan's segment of blocks {start}..{end} has {} parameters, the model's blocks {}",
                    segment.params,
                    offsets[end] - offsets[start]
                ));
            }
            // A segment held whole lies in the held vector where its blocks lie in the trained
            // vectors (the modules are loaded from there).
            if segment.held.len() == segment.params && segment.held_at != offsets[start] {
                return Err(format!(
                    "the plan holds blocks {start}..{end} at {}, their parameters start at {}",
                    segment.held_at, offsets[start]
                ));
            }
            segments.insert(start, segment.clone());
        }
        Ok(Sharding {
            rank: training.replica,
            segments,
        })
    }

    /// The part `part` (of a segment, by [`part_of`]) that lies in block `index`, as (range in
    /// the block's trained vector, range in the concatenation `part` starts at `at` in); `None`
    /// when it has none of the block.
    pub(super) fn block_part(
        &self,
        index: usize,
        offsets: &[usize],
        part: fn(&SegmentPlan) -> (Range<usize>, usize),
    ) -> Option<(Range<usize>, Range<usize>)> {
        let segment = self
            .segments
            .values()
            .find(|s| (s.start..s.end).contains(&index))?;
        let (range, at) = part(segment);
        let base = offsets[segment.start];
        // The block's elements, relative to the segment, intersected with the part.
        let from = (offsets[index] - base).max(range.start);
        let to = (offsets[index + 1] - base).min(range.end);
        (from < to).then(|| {
            let block = offsets[index] - base;
            let into = at + from - range.start;
            (from - block..to - block, into..into + to - from)
        })
    }

    /// Whether block `index`'s segment is held whole (its module lives between steps).
    pub(super) fn holds_whole(&self, index: usize) -> bool {
        self.whole_segments().any(|blocks| blocks.contains(&index))
    }

    /// The blocks of each segment held whole: their modules live between steps (under ZeRO-3
    /// the stream gathers and builds them around each pass instead).
    pub(super) fn whole_segments(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (self.segments.values())
            .filter(|s| s.held.len() == s.params)
            .map(|s| s.start..s.end)
    }

    /// Optimizer state elements this actor keeps.
    pub(super) fn state_len(&self) -> usize {
        self.segments.values().map(|s| s.updated.len()).sum()
    }

    /// Parameters this actor keeps between steps.
    pub(super) fn held_len(&self) -> usize {
        self.segments.values().map(|s| s.held.len()).sum()
    }

    /// The segment starting at block `start`.
    pub(super) fn segment(&self, start: usize) -> Result<&SegmentPlan, String> {
        self.segments
            .get(&start)
            .ok_or_else(|| format!("no segment of this actor starts at block {start}"))
    }
}

/// Which part of a segment, and where its concatenation over the segments starts it.
pub(super) mod part_of {
    use super::*;

    /// The parameters kept between steps, in the held vector.
    pub(in super::super) fn held(s: &SegmentPlan) -> (Range<usize>, usize) {
        (s.held.clone(), s.held_at)
    }

    /// What it updates, placed as the held part is (which holds it).
    pub(in super::super) fn updated(s: &SegmentPlan) -> (Range<usize>, usize) {
        (s.updated.clone(), s.held_at)
    }

    /// What it answers for in the model's norms, placed as the held part is.
    pub(in super::super) fn reported(s: &SegmentPlan) -> (Range<usize>, usize) {
        (s.reported.clone(), s.held_at)
    }
}

/// The values `range` (of the segment) of gradient `name`, which arrives as the plan's `grads`
/// part of `segment`. A length other than the plan's is an error that names both, never a guess.
pub(super) fn grad_part<'g>(
    name: &TensorId,
    grad: &'g [f32],
    segment: &SegmentPlan,
    range: &Range<usize>,
) -> Result<&'g [f32], String> {
    let arrives = &segment.grads;
    if grad.len() != arrives.len() {
        let form = if arrives.len() == segment.params {
            "whole"
        } else {
            "as this replica's shard"
        };
        return Err(format!(
            "gradient `{name}` has {} values; the plan says it arrives {form} ({} values)",
            grad.len(),
            arrives.len()
        ));
    }
    if range.start < arrives.start || range.end > arrives.end {
        return Err(format!(
            "gradient `{name}` arrives as {arrives:?} of its segment, which does not hold {range:?}"
        ));
    }
    Ok(&grad[range.start - arrives.start..range.end - arrives.start])
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Takes the reduced gradient bucket `name` out of the table, with its block range.
    pub(super) fn take_bucket(
        &mut self,
        name: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(TypedTensor, Range<usize>), String> {
        let grad = table
            .remove(name)
            .ok_or_else(|| format!("gradient `{name}` missing"))?;
        let blocks = self
            .step
            .grad_ranges
            .remove(name)
            .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
        Ok((grad, blocks))
    }

    /// `OptimizerStep` (all but the offloaded one): each reduced bucket updates the part of its
    /// segment the plan gives this actor, then — as `scope` says — the modules take the whole
    /// updated segment, the updated shard goes to the all-gather, or the shard stays.
    pub(super) fn optimizer_step(
        &mut self,
        scope: UpdateScope,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        self.begin_update(table)?;
        if self.state.store.device().is_some() {
            return self.optimizer_step_on_device(scope, inputs, outputs, table);
        }
        self.take_trust_norms(table)?;
        let buckets = inputs
            .iter()
            .filter(|n| **n != GRAD_SQUARES && **n != TRUST_SQUARES);
        let skipped = self.state.update.skipped;
        for (k, name) in buckets.enumerate() {
            let (grad, blocks) = self.take_bucket(name, table)?;
            let segment = self.state.sharding.segment(blocks.start)?.clone();
            let grad = match skipped {
                false => self.update_segment(scope, name, grad, &segment)?,
                // An overflow somewhere (loss scaling): nothing changes, but the all-gather in
                // every member's stream still takes this replica's (unchanged) shard.
                true => grad,
            };
            if !(skipped && scope == UpdateScope::Whole) {
                self.after_update(scope, &segment, k, outputs, table)?;
            }
            if grad.elements() == segment.params {
                // Whole buckets are reused by the next backward; ZeRO-2 shards are not.
                self.step.spare_buffers.push(grad.into_f32_vec());
            }
        }
        Ok(())
    }

    /// Updates the part of `segment` this actor updates with bucket `name`'s gradient `grad`;
    /// gives the bucket back.
    fn update_segment(
        &mut self,
        scope: UpdateScope,
        name: &TensorId,
        mut grad: TypedTensor,
        segment: &SegmentPlan,
    ) -> Result<TypedTensor, String> {
        if let Some(fault) = &mut self.fault {
            let step = self.state.optimizer.steps() as u64;
            grad = fault.on_update(name, step, grad);
        }
        let updated = segment.updated.clone();
        let grads = grad_part(name, grad.f32s(), segment, &updated)?;
        let shifted = (self.fault.as_ref())
            .filter(|_| scope != UpdateScope::Whole)
            .and_then(|f| f.shard_gradient(grads));
        let grads = shifted.as_deref().unwrap_or(grads);
        let params = &mut self.state.held[segment.in_held(&updated)];
        self.state.optimizer.update(segment.state_at, params, grads);
        self.step.optimizer_grad_bytes += grad.byte_len() as u64;
        Ok(grad)
    }

    /// What follows the update of `segment` (the `k`th of this actor's), its updated part in
    /// the held parameters: the modules take the whole segment (`Whole`), the updated shard
    /// goes to the all-gather as output `k` (`ShardThenGather`), or it stays (`ShardKept`).
    pub(super) fn after_update(
        &mut self,
        after: UpdateScope,
        segment: &SegmentPlan,
        k: usize,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        match after {
            UpdateScope::Whole => self.reload(segment.start..segment.end),
            UpdateScope::ShardThenGather => {
                let updated = segment.updated.clone();
                let mut gathered = self.gather_buffer(segment.params);
                gathered[updated.clone()].copy_from_slice(&self.state.held[segment.in_held(&updated)]);
                let out = outputs.get(k).ok_or_else(|| {
                    let (start, end) = (segment.start, segment.end);
                    format!("the sharded optimizer step names no output for blocks {start}..{end}")
                })?;
                table.insert(out.clone(), TypedTensor::flat(gathered));
                Ok(())
            }
            // ZeRO-3: the shard stays until the next forward gathers it.
            UpdateScope::ShardKept => Ok(()),
            UpdateScope::CollectOffloaded => Err("an update cannot be followed by another collection".into()),
        }
    }

    /// ZeRO-3: this replica's shard of segment `blocks` in a buffer of the segment's length.
    pub(super) fn shard_params(
        &mut self,
        blocks: Range<usize>,
        output: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let segment = self.state.sharding.segment(blocks.start)?.clone();
        let full = self.gather_buffer(segment.params);
        let traffic = &mut self.step.offload_traffic;
        let full = (self.state.store).shard_for_gather(&self.state.held, &segment, full, traffic)?;
        table.insert(output.clone(), TypedTensor::flat(full));
        Ok(())
    }

    /// A buffer of `len` elements for an all-gather of parameters. The all-gather overwrites
    /// every shard but the own one, so a reused buffer needs no clearing (fresh buffers of this
    /// size page-fault on every use).
    pub(super) fn gather_buffer(&mut self, len: usize) -> Vec<f32> {
        match self.state.gather_pool.iter().position(|b| b.len() == len) {
            Some(i) => self.state.gather_pool.swap_remove(i),
            None => vec![0.0f32; len],
        }
    }

    /// `LoadParams`: the gathered parameters `name` of segment `blocks` become its held part
    /// (the whole segment under ZeRO-1/2; under ZeRO-3 the own shard, which they already hold)
    /// and go into its modules (built afresh where a drop let them go).
    pub(super) fn load_params(
        &mut self,
        blocks: Range<usize>,
        name: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let params = table
            .remove(name)
            .ok_or_else(|| format!("gathered parameters `{name}` missing"))?;
        let segment = self.state.sharding.segment(blocks.start)?.clone();
        if params.elements() != segment.params || segment.end != blocks.end {
            return Err(format!(
                "`{name}` has {} values, blocks {}..{} have {}",
                params.elements(),
                blocks.start,
                blocks.end,
                segment.params
            ));
        }
        let keep_own = self.stage.compute != burn::tensor::FloatDType::F32;
        let params = match self
            .state
            .store
            .take_gathered(&segment, params, keep_own, &self.stage.device)?
        {
            Gathered::OnDevice(master) => return self.load_modules_from(blocks, master),
            Gathered::OnHost(params) => params,
        };
        // A 16-bit gather (mixed precision) carries the compute copy: it may refresh the parts
        // this replica holds but does not update, never its f32 master of what it updates.
        let parts = match self.stage.compute {
            burn::tensor::FloatDType::F32 => vec![segment.held.clone()],
            _ => outside(&segment.held, &segment.updated),
        };
        for part in parts {
            let at = segment.in_held(&part);
            if let Some(into) = self.state.store.held_mut(&mut self.state.held, at) {
                into.copy_from_slice(&params.f32s()[part]);
            }
        }
        let base = self.stage.offsets[blocks.start];
        for index in blocks {
            let block = match self.stage.blocks[index].take() {
                Some(block) => block,
                None => self.stage.build_held(index),
            };
            let at = self.stage.offsets[index] - base..self.stage.offsets[index + 1] - base;
            self.stage.blocks[index] = Some(block.load_params(&params.f32s()[at], self.batched_transfers));
        }
        if self.state.gather_pool.len() < 2 {
            self.state.gather_pool.push(params.into_f32_vec());
        }
        Ok(())
    }

    /// The held parameters of each held block, as the parts of the blocks they cover (from the
    /// store: the offload tier keeps them under `--offload-params`).
    ///
    /// Under mixed precision only the parts it updates: a 16-bit gather (ZeRO-1/2) leaves the
    /// others as rounded copies of their owners' f32 masters, not masters of their own.
    pub(super) fn held_block_params(&self) -> Result<Vec<HeldParams>, String> {
        let mut out = Vec::new();
        let offsets = &self.stage.offsets;
        let rounded_copies = self.stage.compute != burn::tensor::FloatDType::F32;
        self.for_each_held_part(|block, range, values| {
            if !rounded_copies {
                out.push(HeldParams {
                    block,
                    range,
                    values: values.to_vec(),
                });
                return;
            }
            let Some((updated, _)) = (self.state.sharding).block_part(block, offsets, part_of::updated)
            else {
                return;
            };
            let (from, to) = (updated.start.max(range.start), updated.end.min(range.end));
            if from < to {
                out.push(HeldParams {
                    block,
                    range: from..to,
                    values: values[from - range.start..to - range.start].to_vec(),
                });
            }
        })?;
        Ok(out)
    }

    /// Calls `f(block, range in the block's trained vector, values)` for the held part of each
    /// held block, without copying what the held vector holds.
    pub(super) fn for_each_held_part(
        &self,
        mut f: impl FnMut(usize, Range<usize>, &[f32]),
    ) -> Result<(), String> {
        for segment in self.state.sharding.segments.values() {
            let values = self.state.store.held_values(&self.state.held, segment)?;
            for index in segment.start..segment.end {
                let part = (self.state.sharding).block_part(index, &self.stage.offsets, part_of::held);
                if let Some((range, at)) = part {
                    f(
                        index,
                        range,
                        &values[at.start - segment.held_at..at.end - segment.held_at],
                    );
                }
            }
        }
        Ok(())
    }

    /// Loads the held parameters into the modules that live between steps (those of the
    /// segments held whole; the others are built at their next gather).
    pub(super) fn reload_held(&mut self) -> Result<(), String> {
        let whole: Vec<Range<usize>> = self.state.sharding.whole_segments().collect();
        whole.into_iter().try_for_each(|blocks| self.reload(blocks))
    }

    /// Loads the held parameters of `blocks` (held whole) into their modules.
    pub(super) fn reload(&mut self, blocks: Range<usize>) -> Result<(), String> {
        if let Some(fault) = &self.fault {
            let at = self.stage.offsets[blocks.start]..self.stage.offsets[blocks.end];
            if !fault.on_reload(&mut self.state.held[at], self.stage.compute) {
                return Ok(());
            }
        }
        for index in blocks {
            let block = self.stage.blocks[index]
                .take()
                .ok_or_else(|| format!("block {index} is not held by this actor"))?;
            let params = &self.state.held[self.stage.offsets[index]..self.stage.offsets[index + 1]];
            self.stage.blocks[index] = Some(block.load_params(params, self.batched_transfers));
        }
        Ok(())
    }
}

/// The parts of `whole` outside `part` (before it and after it; empty ones left out).
fn outside(whole: &Range<usize>, part: &Range<usize>) -> Vec<Range<usize>> {
    if part.is_empty() {
        return vec![whole.clone()];
    }
    [
        whole.start..part.start.max(whole.start),
        part.end.min(whole.end)..whole.end,
    ]
    .into_iter()
    .filter(|r| r.start < r.end)
    .collect()
}
