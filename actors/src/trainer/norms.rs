//! The trainer's side of the reductions an update may need first (see the plan's
//! `passes::optimizer`): clipping's global gradient norm (`GradNorm`, Pascanu et al., ICML 2013,
//! as `torch.nn.utils.clip_grad_norm_`) and LAMB's per-parameter norms (`TrustNorms`, You et al.,
//! ICLR 2020), each a partial sum over what this actor owns, summed by the plan's all-reduce
//! before the update reads it. Also the parameter groups of the optimizer's state: which
//! elements belong to which parameter of the stage and whether they take weight decay (from the
//! blocks' parameter shapes; no decay for biases and LayerNorm under the default groups).
//!
//! Loss scaling (f16) reads the same reduced sum of squares as its overflow vote: a total that is
//! not finite means some actor's gradients overflowed, and every actor, reading the same total,
//! skips the step — the optimizer's step count and the schedule stay where they were — while the
//! scale halves ([`crate::precision::LossScaler`]); otherwise the gradients are unscaled by `1/S`
//! inside the update (the clipping factor's multiplier, so they are not copied).

use archipelago_dataflow::TensorId;
use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::ParamGroups;
use archipelago_dataflow::passes::optimizer::{GRAD_SQUARES, TRUST_SQUARES};

use super::Trainer;
use super::zero::grad_part;
use crate::executor::TensorTable;
use crate::optim::{ParamLayout, ParamPart, clip_factor, sum_of_squares};
use crate::precision::LossScaler;
use crate::typed_tensor::TypedTensor;

/// The parameters of an actor's stage in its flat master coordinates, in order, with whether
/// each takes weight decay; their index is the parameter's number in LAMB's norm vector (the
/// same on every replica of the stage, which holds the same blocks).
#[derive(Debug, Clone, Default)]
pub(super) struct StageParams {
    ranges: Vec<(Range<usize>, bool)>,
}

impl StageParams {
    /// Adds block parameters of `shapes` starting at flat position `at`; returns the position
    /// after them.
    pub(super) fn push_block(
        &mut self,
        at: usize,
        shapes: &[(String, Vec<usize>)],
        groups: ParamGroups,
    ) -> usize {
        let mut at = at;
        for (_, shape) in shapes {
            let n: usize = shape.iter().product();
            self.ranges.push((at..at + n, groups.decays(shape)));
            at += n;
        }
        at
    }

    /// The layout of a state of `len` elements made of `windows`: each maps flat master
    /// positions `from` to state positions starting at `to` (the whole master under ZeRO-0, the
    /// owned shard of each segment under ZeRO ≥ 1, one segment's region with offload).
    pub(super) fn layout(
        &self,
        windows: &[(Range<usize>, usize)],
        len: usize,
    ) -> Result<ParamLayout, String> {
        let mut windows = windows.to_vec();
        windows.sort_by_key(|w| w.1);
        let mut parts = Vec::new();
        for (from, to) in windows {
            for (param, (range, decay)) in self.ranges.iter().enumerate() {
                let (a, b) = (range.start.max(from.start), range.end.min(from.end));
                if a < b {
                    parts.push(ParamPart {
                        range: to + a - from.start..to + b - from.start,
                        param,
                        decay: *decay,
                    });
                }
            }
        }
        let layout = ParamLayout::new(parts, self.ranges.len().max(1))?;
        if layout.len() != len {
            return Err(format!(
                "the parameters cover {} of the optimizer's {len} state elements",
                layout.len()
            ));
        }
        Ok(layout)
    }
}

/// The optimizer step in flight: clipping's bound, whether the step has begun (its first
/// instruction starts it), and what the report shows of it.
#[derive(Debug, Clone, Default)]
pub(super) struct UpdateState {
    /// Clip the gradients to this global norm.
    pub(super) clip: Option<f32>,
    /// The step's optimizer update has begun (step counter advanced, clipping factor set).
    pub(super) begun: bool,
    /// This step's global gradient norm (when clipping).
    pub(super) grad_norm: Option<f32>,
    /// With offload and clipping: the sum of squares of this actor's share of the buckets
    /// already staged with the offload actor (they left before `GradNorm` runs).
    pub(super) staged_squares: f64,
    /// f16's loss scale (the same on every actor, moved by the same vote).
    pub(super) scaler: Option<LossScaler>,
    /// This step's scale, for the report (when scaling).
    pub(super) scale_used: Option<f32>,
    /// This step overflowed somewhere: no update anywhere.
    pub(super) skipped: bool,
    /// This actor's own share of the sum of squares, before the all-reduce (read only by the
    /// `LocalOverflowDecision` control).
    pub(super) own_squares: f32,
}

impl UpdateState {
    /// Whether the update waits for the reduced sum of squares (clipping, loss scaling).
    pub(super) fn needs_squares(&self) -> bool {
        self.clip.is_some() || self.scaler.is_some()
    }
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Starts this step's update once: the step counter, the schedule's rate and the factor
    /// the gradients are multiplied by (clipping's, and `1/S` under loss scaling) — or, when the
    /// vote says some actor's gradients overflowed, nothing: the step is skipped.
    pub(super) fn begin_update(&mut self, table: &mut TensorTable) -> Result<(), String> {
        if self.state.update.begun {
            return Ok(());
        }
        self.state.update.begun = true;
        if let Some(factor) = self.gradient_factor(table)? {
            self.state.optimizer.begin_step();
            self.state.optimizer.set_grad_scale(factor);
        }
        Ok(())
    }

    /// The factor this step's gradients are multiplied by in the update — clipping's from the
    /// reduced sum of squares, times `1/S` under loss scaling — or `None` when the step is
    /// skipped (loss scaling: the sum is not finite, so some actor's gradients overflowed; the
    /// scale moves either way).
    pub(super) fn gradient_factor(&mut self, table: &mut TensorTable) -> Result<Option<f32>, String> {
        let update = &self.state.update;
        if !update.needs_squares() {
            return Ok(Some(1.0));
        }
        let total = self.take_grad_squares(table)? as f64;
        let mut unscale = 1.0f64;
        if let Some(mut scaler) = self.state.update.scaler {
            let local = self.fault.as_ref().is_some_and(|f| f.decides_overflow_locally());
            let overflow = match local {
                true => !self.state.update.own_squares.is_finite(),
                false => !total.is_finite(),
            };
            self.state.update.scale_used = Some(scaler.scale);
            unscale = 1.0 / scaler.scale as f64;
            let skipped = scaler.after_step(overflow);
            self.state.update.scaler = Some(scaler);
            self.state.update.skipped = skipped;
            if skipped {
                self.state.update.grad_norm = None;
                return Ok(None);
            }
        }
        let Some(max) = self.state.update.clip else {
            self.state.update.grad_norm = None;
            return Ok(Some(unscale as f32));
        };
        let squares = total * unscale * unscale;
        self.state.update.grad_norm = Some(squares.max(0.0).sqrt() as f32);
        Ok(Some((clip_factor(squares, max) as f64 * unscale) as f32))
    }

    /// Takes the reduced sum of squares of every gradient (clipping's squared global norm, loss
    /// scaling's vote).
    fn take_grad_squares(&mut self, table: &mut TensorTable) -> Result<f32, String> {
        let squares = table
            .remove(&GRAD_SQUARES)
            .ok_or("the update needs the reduced gradient norm, and it is missing")?;
        let [total] = squares.f32s()[..] else {
            return Err(format!(
                "`{GRAD_SQUARES}` holds {} values, not 1",
                squares.elements()
            ));
        };
        Ok(total)
    }

    /// `GradNorm`: the sum of squares of this actor's share of its reduced gradient buckets (its
    /// shard of each, so that replicas holding the same values count them once), including the
    /// buckets already staged with the offload actor.
    pub(super) fn grad_norm(
        &mut self,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let mut sum = std::mem::take(&mut self.state.update.staged_squares);
        for name in inputs {
            let blocks = self
                .step
                .grad_ranges
                .get(name)
                .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
            let segment = self.state.sharding.segment(blocks.start)?;
            if !self.stage.tp.leads() {
                // Replicated parameters' gradients, the same on every tp rank, count once.
                sum -= self.replicated_squares(name, segment, segment.own.clone(), table)?;
            }
            // A bucket the store keeps (on the device) is summed there.
            if let Some(squares) = self.state.store.grad_squares(name, segment.own.clone()) {
                sum += squares?;
                continue;
            }
            let grad = table
                .get(name)
                .ok_or_else(|| format!("gradient `{name}` missing"))?;
            sum += sum_of_squares(grad_part(name, grad.f32s(), segment, &segment.own)?);
        }
        self.state.update.own_squares = sum as f32;
        let out = outputs.first().ok_or("GradNorm names no output")?;
        table.insert(out.clone(), TypedTensor::flat(vec![sum as f32]));
        Ok(())
    }

    /// `TrustNorms` (LAMB's first phase): begins the update, updates the moments of what this
    /// actor updates and writes the partial per-parameter sums of squares of the elements it
    /// owns (the replicas of an unsharded stage update everything but count only their shard).
    pub(super) fn trust_norms(
        &mut self,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        self.begin_update(table)?;
        let mut sums = vec![0.0f64; self.state.optimizer.norms_len()];
        let buckets: Vec<&TensorId> = inputs.iter().filter(|n| **n != GRAD_SQUARES).collect();
        if self.state.update.skipped {
            // An overflow somewhere: the moments stay; the dp all-reduce still gets its sums. On
            // the device this phase consumes the buckets (the update does in host memory).
            if let Some(state) = self.state.store.device_mut() {
                for name in buckets {
                    state.drop_bucket(name);
                    table.remove(name);
                }
            }
        } else if self.state.store.device().is_some() {
            self.trust_norms_on_device(&buckets, &mut sums, table)?;
        } else {
            for name in buckets {
                self.trust_norms_of(name, &mut sums, table)?;
            }
        }
        let out = outputs.first().ok_or("TrustNorms names no output")?;
        table.insert(
            out.clone(),
            TypedTensor::flat(sums.iter().map(|&s| s as f32).collect()),
        );
        Ok(())
    }

    /// LAMB's first phase for bucket `name` in host memory: the moments of the part this actor
    /// updates, and into `sums` the squares of what it owns of that part.
    fn trust_norms_of(
        &mut self,
        name: &TensorId,
        sums: &mut [f64],
        table: &TensorTable,
    ) -> Result<(), String> {
        let grad = table
            .get(name)
            .ok_or_else(|| format!("gradient `{name}` missing"))?;
        let blocks = self
            .step
            .grad_ranges
            .get(name)
            .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
        let segment = self.state.sharding.segment(blocks.start)?.clone();
        let (updated, own) = (segment.updated.clone(), segment.own.clone());
        let grads = grad_part(name, grad.f32s(), &segment, &updated)?;
        // The updated part, cut where this replica's own shard begins and ends.
        let (from, to) = (
            own.start.clamp(updated.start, updated.end),
            own.end.clamp(updated.start, updated.end),
        );
        for (piece, counted) in [
            (updated.start..from, false),
            (from..to, true),
            (to..updated.end, false),
        ] {
            if piece.is_empty() {
                continue;
            }
            let in_updated = piece.start - updated.start..piece.end - updated.start;
            let held = segment.in_held(&piece);
            let sink = if counted { Some(&mut sums[..]) } else { None };
            self.state.optimizer.accumulate_norms(
                segment.state_at + in_updated.start,
                &self.state.held[held],
                &grads[in_updated],
                sink,
            );
        }
        Ok(())
    }

    /// LAMB: takes the reduced per-parameter norms for this step's trust ratios.
    pub(super) fn take_trust_norms(&mut self, table: &mut TensorTable) -> Result<(), String> {
        if !self.state.optimizer.spec().needs_param_norms() {
            return Ok(());
        }
        let sums = table
            .remove(&TRUST_SQUARES)
            .ok_or("LAMB's update needs the reduced parameter norms, and they are missing")?;
        if sums.elements() != self.state.optimizer.norms_len() {
            return Err(format!(
                "`{TRUST_SQUARES}` holds {} values; this stage's {} parameters need {}",
                sums.elements(),
                self.state.optimizer.norms_len() / 2,
                self.state.optimizer.norms_len()
            ));
        }
        self.state.optimizer.set_norms(sums.f32s());
        Ok(())
    }
}
