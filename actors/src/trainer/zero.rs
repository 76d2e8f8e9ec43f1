//! The trainer's optimizer step and ZeRO (Rajbhandari et al., SC 2020): which shard of each
//! gradient bucket this replica updates, the gathered parameters it loads, and under ZeRO-3 the
//! shards it keeps as its master copy and the modules it builds and drops around each segment.

use archipelago_dataflow::TensorId;
use archipelago_dataflow::UpdateScope;
use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::passes::optimizer::{GRAD_SQUARES, TRUST_SQUARES};
use archipelago_dataflow::{ActorTraining, ZeroStage};

use super::Trainer;
use crate::executor::{HeldParams, TensorTable};
use crate::typed_tensor::TypedTensor;

/// This replica's shard of one segment (gradient bucket).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SegmentShard {
    /// One past the segment's last block.
    pub(super) end: usize,
    /// The owned elements, relative to the segment's first parameter.
    pub(super) own: Range<usize>,
    /// Where the shard starts in the optimizer state (and, under ZeRO-3, in the shard master).
    pub(super) state: usize,
}

/// Where this actor sits in its data-parallel group, and what ZeRO shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    /// The ZeRO stage in force (the plan's: replicated when the group has one member).
    pub zero: ZeroStage,
    /// This actor's position in its dp group (its shard).
    pub rank: usize,
    /// Members of the dp group.
    pub members: usize,
    /// This replica's shard of each segment, by the segment's first block.
    pub(super) segments: HashMap<usize, SegmentShard>,
}

impl Sharding {
    /// The shards the plan gives this actor (`training`), for a model whose block `i` lives at
    /// `offsets[i]..offsets[i + 1]` of the flat parameters.
    pub(super) fn of(training: &ActorTraining, offsets: &[usize]) -> Result<Sharding, String> {
        let mut shards = HashMap::new();
        let mut state = 0;
        for segment in &training.segments {
            let (start, end) = (segment.start, segment.end);
            if offsets[end] - offsets[start] != segment.params {
                return Err(format!(
                    "the plan's segment of blocks {start}..{end} has {} parameters, the model's blocks {}",
                    segment.params,
                    offsets[end] - offsets[start]
                ));
            }
            let own = segment.own.clone();
            let len = own.len();
            shards.insert(start, SegmentShard { end, own, state });
            state += len;
        }
        Ok(Sharding {
            zero: training.zero,
            rank: training.replica,
            members: training.replicas,
            segments: shards,
        })
    }

    /// The range of the segment starting at `start` (of `len` parameters) this actor's
    /// optimizer updates: its shard under ZeRO ≥ 1, the whole segment otherwise.
    pub(super) fn optimizer_range(&self, start: usize, len: usize) -> Result<Range<usize>, String> {
        if self.zero.shards_optimizer() {
            Ok(self.segment(start)?.own.clone())
        } else {
            Ok(0..len)
        }
    }

    /// The part of block `index` this replica owns, as (range in the block's parameters, range
    /// in the concatenated shards); `None` when it owns none of it.
    pub(super) fn owned_part(&self, index: usize, offsets: &[usize]) -> Option<(Range<usize>, Range<usize>)> {
        let (&start, shard) = self
            .segments
            .iter()
            .find(|(start, shard)| (**start..shard.end).contains(&index))?;
        let base = offsets[start];
        // The block's elements, relative to the segment, intersected with the shard.
        let from = (offsets[index] - base).max(shard.own.start);
        let to = (offsets[index + 1] - base).min(shard.own.end);
        (from < to).then(|| {
            let block = offsets[index] - base;
            let state = shard.state + from - shard.own.start;
            (from - block..to - block, state..state + to - from)
        })
    }

    /// Optimizer state elements this actor keeps under ZeRO ≥ 1.
    pub(super) fn state_len(&self) -> usize {
        self.segments.values().map(|s| s.own.len()).sum()
    }

    /// The shard of the segment starting at block `start`.
    pub(super) fn segment(&self, start: usize) -> Result<&SegmentShard, String> {
        self.segments
            .get(&start)
            .ok_or_else(|| format!("no segment of this actor starts at block {start}"))
    }
}

/// The values of gradient `name` this replica updates: `range` of the whole bucket (`len`
/// values), or — where the plan's ZeRO stage reduce-scatters (`sharded`,
/// `ZeroStage::shards_gradients`) — the shard it received, which is `range` itself. A
/// length other than the plan's is an error that names both, never a guess.
fn bucket_part<'g>(
    name: &TensorId,
    grad: &'g [f32],
    sharded: bool,
    len: usize,
    range: &Range<usize>,
) -> Result<&'g [f32], String> {
    let (expected, form) = if sharded {
        (range.len(), "as this replica's shard")
    } else {
        (len, "whole")
    };
    if grad.len() != expected {
        return Err(format!(
            "gradient `{name}` has {} values; the plan says it arrives {form} ({expected} values)",
            grad.len()
        ));
    }
    Ok(if sharded { grad } else { &grad[range.clone()] })
}

impl Sharding {
    /// Whether reduced gradients arrive as this replica's shard (ZeRO-2/3), as the plan says.
    pub(super) fn grads_sharded(&self) -> bool {
        self.zero.shards_gradients()
    }

    /// `bucket_part` with the form the plan gives this actor's gradients.
    pub(super) fn part<'g>(
        &self,
        name: &TensorId,
        grad: &'g [f32],
        len: usize,
        range: &Range<usize>,
    ) -> Result<&'g [f32], String> {
        bucket_part(name, grad, self.grads_sharded(), len, range)
    }
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

    pub(super) fn optimizer_step(
        &mut self,
        scope: UpdateScope,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        self.begin_update(table)?;
        if self.state.device_state.is_some() {
            return self.optimizer_step_on_device(scope, inputs, outputs, table);
        }
        self.take_trust_norms(table)?;
        for (k, name) in inputs.iter().enumerate() {
            if *name == GRAD_SQUARES || *name == TRUST_SQUARES {
                continue; // read by begin_update and take_trust_norms
            }
            let (mut grad, blocks) = self.take_bucket(name, table)?;
            if let Some(fault) = &mut self.fault {
                let step = self.state.optimizer.steps() as u64;
                grad = fault.on_update(name, step, grad);
            }
            let range = self.stage.offsets[blocks.start]..self.stage.offsets[blocks.end];
            if scope == UpdateScope::Whole {
                self.state
                    .optimizer
                    .update(range.start, &mut self.state.master[range.clone()], grad.f32s());
                self.reload(blocks.clone())?;
            } else {
                // ZeRO: update only this replica's shard; the all-gather brings the others.
                let SegmentShard {
                    own: shard, state, ..
                } = self.state.sharding.segment(blocks.start)?.clone();
                let own = range.start + shard.start..range.start + shard.end;
                let grads = self.state.sharding.part(name, grad.f32s(), range.len(), &shard)?;
                let shifted = self.fault.as_ref().and_then(|f| f.shard_gradient(grads));
                let grads = shifted.as_deref().unwrap_or(grads);
                if scope == UpdateScope::ShardKept {
                    // The master copy is the shard itself; it stays sharded until the next gather.
                    let at = state..state + shard.len();
                    self.state
                        .optimizer
                        .update(state, &mut self.state.shard_master[at], grads);
                    self.step.optimizer_grad_bytes += grad.byte_len() as u64;
                    continue;
                }
                self.state
                    .optimizer
                    .update(state, &mut self.state.master[own.clone()], grads);
                let mut gathered = self.gather_buffer(range.len());
                gathered[shard].copy_from_slice(&self.state.master[own]);
                let out = outputs
                    .get(k)
                    .ok_or_else(|| format!("the sharded optimizer step names no output for `{name}`"))?;
                table.insert(out.clone(), TypedTensor::flat(gathered));
            }
            self.step.optimizer_grad_bytes += grad.byte_len() as u64;
            if !self.state.sharding.grads_sharded() {
                // Whole buckets are reused by the next backward; ZeRO-2 shards are not.
                self.step.spare_buffers.push(grad.into_f32_vec());
            }
        }
        Ok(())
    }

    /// ZeRO-3: this replica's shard of segment `blocks` in a buffer of the segment's length.
    pub(super) fn shard_params(
        &mut self,
        blocks: Range<usize>,
        output: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let len = self.stage.offsets[blocks.end] - self.stage.offsets[blocks.start];
        let SegmentShard { own, state, .. } = self.state.sharding.segment(blocks.start)?.clone();
        let mut full = self.gather_buffer(len);
        if self.state.offload_params {
            let offload = self
                .state
                .offload
                .as_ref()
                .ok_or("parameters offloaded without an offload actor")?;
            self.step.offload_traffic.from_tier += 4 * own.len() as u64;
            full = offload.read_params(blocks.start, full, own)?;
        } else if let Some(device) = &self.state.device_state {
            let (at, values) = device.updated_shard(blocks.start)?;
            full[at].copy_from_slice(&values);
        } else {
            full[own.clone()].copy_from_slice(&self.state.shard_master[state..state + own.len()]);
        }
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

    /// ZeRO-3: builds the modules of `blocks` from their gathered parameters.
    pub(super) fn materialize(&mut self, blocks: Range<usize>, params: &[f32]) -> Result<(), String> {
        let base = self.stage.offsets[blocks.start];
        for index in blocks {
            if !self.stage.held_blocks[index] {
                return Err(format!("block {index} is not held by this actor"));
            }
            let block = self.stage.build_held(index);
            let at = self.stage.offsets[index] - base..self.stage.offsets[index + 1] - base;
            self.stage.blocks[index] = Some(block.load_params(&params[at], self.batched_transfers));
        }
        Ok(())
    }

    /// Loads the gathered parameters `name` of `blocks`: into the master copy and the modules
    /// (ZeRO-1/2), or into freshly built modules (ZeRO-3, whose master copy stays sharded).
    pub(super) fn load_params(
        &mut self,
        blocks: Range<usize>,
        name: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let params = table
            .remove(name)
            .ok_or_else(|| format!("gathered parameters `{name}` missing"))?;
        let range = self.stage.offsets[blocks.start]..self.stage.offsets[blocks.end];
        if params.elements() != range.len() {
            return Err(format!(
                "`{name}` has {} values, blocks {}..{} have {}",
                params.elements(),
                blocks.start,
                blocks.end,
                range.len()
            ));
        }
        if self.state.sharding.zero.shards_parameters() {
            self.materialize(blocks, params.f32s())?;
        } else if let Some(state) = &mut self.state.device_state {
            // ZeRO-1/2 with the state on the device: the gathered segment is its new master.
            let master = state.load_gathered(blocks.start, params.into_f32_vec(), &self.stage.device)?;
            return self.load_modules_from(blocks, master);
        } else {
            self.state.master[range].copy_from_slice(params.f32s());
            self.reload(blocks)?;
        }
        if self.state.gather_pool.len() < 2 {
            self.state.gather_pool.push(params.into_f32_vec());
        }
        Ok(())
    }

    /// ZeRO-3: the sums of squares of this replica's shard of each segment, by block.
    pub(super) fn shard_squares(&self) -> Vec<(usize, f64)> {
        let square = |v: &[f32]| v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        (self.owned_shard_params().iter())
            .map(|held| (held.block, square(&held.values)))
            .collect()
    }

    /// ZeRO-3: a copy of this replica's shard of each segment, as the parts of the blocks it
    /// covers (from the offload actor under `--offload-params`).
    pub(super) fn owned_shard_params(&self) -> Vec<HeldParams> {
        let fetched;
        let shards = match &self.state.offload {
            Some(offload) if self.state.offload_params => {
                fetched = self.fetch_shards(offload).unwrap_or_else(|e| {
                    tracing::error!(actor = self.stage.actor, "offloaded parameters unreadable: {e}");
                    vec![f32::NAN; self.state.sharding.state_len()]
                });
                &fetched[..]
            }
            _ => &self.state.shard_master[..],
        };
        (0..self.stage.blocks.len())
            .filter(|&i| self.stage.held_blocks[i])
            .filter_map(|i| {
                let (range, at) = self.state.sharding.owned_part(i, &self.stage.offsets)?;
                let values = shards[at].to_vec();
                Some(HeldParams {
                    block: i,
                    range,
                    values,
                })
            })
            .collect()
    }

    /// `--offload-params`: this replica's shards of every segment, read back from the offload
    /// actor and concatenated as the shard master would hold them.
    fn fetch_shards(&self, offload: &crate::offload::OffloadActor) -> Result<Vec<f32>, String> {
        let mut shards = vec![0.0f32; self.state.sharding.state_len()];
        for (&start, shard) in &self.state.sharding.segments {
            let len = shard.own.len();
            let params = offload.read_params(start, vec![0.0; len], 0..len)?;
            shards[shard.state..shard.state + len].copy_from_slice(&params);
        }
        Ok(shards)
    }

    /// The update with the state on the device: each bucket (on the device, or reduced by a
    /// collective and moved back onto it) updates its segment there (this replica's shard of it
    /// under ZeRO-1/2), and the segment's modules take their parameters as slices of the new
    /// master tensor — under ZeRO-1/2 after the all-gather, for which the updated shard is
    /// written to the step's output.
    fn optimizer_step_on_device(
        &mut self,
        scope: UpdateScope,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let ctx = self.state.optimizer.context();
        // LAMB's moments were updated by TrustNorms; its phase 2 needs the reduced norms.
        let lamb = self.state.optimizer.spec().needs_param_norms();
        if lamb {
            self.take_trust_norms(table)?;
        }
        let trust = self.state.optimizer.trust().to_vec();
        // The clipping norm was read by begin_update.
        let buckets = inputs
            .iter()
            .filter(|n| **n != GRAD_SQUARES && **n != TRUST_SQUARES);
        for (k, name) in buckets.enumerate() {
            let blocks = self
                .step
                .grad_ranges
                .remove(name)
                .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
            let state = self.state.device_state.as_mut().ok_or("no device state")?;
            let master = if lamb {
                state.lamb_apply(blocks.start, &trust, &ctx)?
            } else {
                let reduced = table.remove(name).map(TypedTensor::into_f32_vec);
                let grad = state.bucket(name, reduced, &self.stage.device)?;
                self.step.optimizer_grad_bytes += 4 * grad.shape().num_elements() as u64;
                state.update(blocks.start, grad, &ctx)?
            };
            match scope {
                UpdateScope::Whole => self.load_modules_from(blocks, master)?,
                UpdateScope::ShardThenGather => {
                    let (own, shard) = state.updated_shard(blocks.start)?;
                    let len = self.stage.offsets[blocks.end] - self.stage.offsets[blocks.start];
                    let mut gathered = self.gather_buffer(len);
                    gathered[own].copy_from_slice(&shard);
                    let out = outputs
                        .get(k)
                        .ok_or_else(|| format!("the sharded optimizer step names no output for `{name}`"))?;
                    table.insert(out.clone(), TypedTensor::flat(gathered));
                }
                // ZeRO-3: the shard stays on the device until the next forward gathers it.
                UpdateScope::ShardKept => {}
                other => return Err(format!("the device state has no `{other}` update")),
            }
        }
        Ok(())
    }

    /// The modules of `blocks` take their parameters as slices of `master` (the segment's
    /// master tensor on the device).
    fn load_modules_from(
        &mut self,
        blocks: Range<usize>,
        master: burn::tensor::Tensor<B::InnerBackend, 1>,
    ) -> Result<(), String> {
        let base = self.stage.offsets[blocks.start];
        for index in blocks {
            let block = self.stage.blocks[index]
                .take()
                .ok_or_else(|| format!("block {index} is not held by this actor"))?;
            let at = self.stage.offsets[index] - base..self.stage.offsets[index + 1] - base;
            self.stage.blocks[index] = Some(block.load_params_from(master.clone().slice([at])));
        }
        Ok(())
    }

    /// Loads the master parameters of `blocks` into their modules.
    pub(super) fn reload(&mut self, blocks: Range<usize>) -> Result<(), String> {
        for index in blocks {
            let block = self.stage.blocks[index]
                .take()
                .ok_or_else(|| format!("block {index} is not held by this actor"))?;
            let params = &self.state.master[self.stage.offsets[index]..self.stage.offsets[index + 1]];
            self.stage.blocks[index] = Some(block.load_params(params, self.batched_transfers));
        }
        Ok(())
    }
}
