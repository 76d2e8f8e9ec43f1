//! The trainer's side of the reductions an update may need first (see the plan's
//! `passes::optimizer`): clipping's global gradient norm (`GradNorm`, Pascanu et al., ICML 2013,
//! as `torch.nn.utils.clip_grad_norm_`) and LAMB's per-parameter norms (`TrustNorms`, You et al.,
//! ICLR 2020), each a partial sum over what this actor owns, summed by the plan's all-reduce
//! before the update reads it. Also the parameter groups of the optimizer's state: which
//! elements belong to which parameter of the stage and whether they take weight decay (from the
//! blocks' parameter shapes; no decay for biases and LayerNorm under the default groups).

use archipelago_dataflow::TensorId;
use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::ParamGroups;
use archipelago_dataflow::passes::optimizer::{GRAD_SQUARES, TRUST_SQUARES};

use super::Trainer;
use super::zero::grad_part;
use crate::executor::TensorTable;
use crate::optim::{ParamLayout, ParamPart, sum_of_squares};
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
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Starts this step's update once: the step counter, the schedule's rate and, when
    /// clipping, the factor from the reduced squared global norm.
    pub(super) fn begin_update(&mut self, table: &mut TensorTable) -> Result<(), String> {
        if self.state.update.begun {
            return Ok(());
        }
        self.state.update.begun = true;
        self.state.optimizer.begin_step();
        if let Some(max) = self.state.update.clip {
            let total = self.take_grad_squares(table)?;
            self.state.optimizer.clip(total as f64, max);
        }
        Ok(())
    }

    /// Clipping: takes the reduced squared global gradient norm (and keeps the norm for the
    /// report).
    pub(super) fn take_grad_squares(&mut self, table: &mut TensorTable) -> Result<f32, String> {
        let squares = table
            .remove(&GRAD_SQUARES)
            .ok_or("clipping needs the reduced gradient norm, and it is missing")?;
        let [total] = squares.f32s()[..] else {
            return Err(format!(
                "`{GRAD_SQUARES}` holds {} values, not 1",
                squares.elements()
            ));
        };
        self.state.update.grad_norm = Some(total.max(0.0).sqrt());
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
        if self.state.store.device().is_some() {
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
