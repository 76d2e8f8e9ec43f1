//! LAMB (You et al., ICLR 2020) with the training state on the device: the two phases of
//! `optim::lamb` — moments and per-parameter sums of squares, then the update scaled by each
//! parameter's trust ratio — over a segment's device state. On the CPU backend they are the
//! optimizer's own loops over the buffers in place (bit for bit the host path); elsewhere tensor
//! ops with the same formulas, each parameter's two sums reduced on the device and read back as
//! one small tensor per segment (the sums are f32 there, f64 in the loops: equal to rounding).

use std::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use archipelago_dataflow::OptimizerSpec;

use super::cpu_buffers::{from_cpu, into_cpu, values_mut};
use super::device_state::{DeviceState, SegmentState};
use crate::optim::{StepContext, lamb_apply_range, lamb_moments_range, lamb_step};
use crate::transfer::{TransferKind, download};

/// LAMB's constants and this step's bias corrections.
struct Lamb {
    beta1: f32,
    beta2: f32,
    eps: f32,
    wd: f32,
    c1: f32,
    c2: f32,
}

impl Lamb {
    fn of(spec: OptimizerSpec, ctx: &StepContext) -> Result<Lamb, String> {
        if !matches!(spec, OptimizerSpec::Lamb { .. }) {
            return Err(format!("a LAMB phase of the {} rule", spec.name()));
        }
        // The decaying group's step: `wd` is masked per element by the decay mask.
        let step = lamb_step(spec, ctx, true);
        let (c1, c2) = step.corrections();
        Ok(Lamb {
            beta1: step.beta1,
            beta2: step.beta2,
            eps: step.eps,
            wd: step.weight_decay,
            c1,
            c2,
        })
    }

    /// `u = (m / c1) / (√(v / c2) + ε) + wd·p` where the group decays.
    fn direction<B: Backend>(&self, s: &SegmentState<B>, p: &Tensor<B, 1>) -> Result<Tensor<B, 1>, String> {
        let (m, v) = moments(s)?;
        let decay = s
            .decay
            .clone()
            .ok_or("the device state has no weight-decay mask")?;
        let u = m.div_scalar(self.c1) / v.div_scalar(self.c2).sqrt().add_scalar(self.eps);
        Ok(u + p.clone() * decay.mul_scalar(self.wd))
    }
}

fn moments<B: Backend>(s: &SegmentState<B>) -> Result<(Tensor<B, 1>, Tensor<B, 1>), String> {
    match (&s.m, &s.v) {
        (Some(m), Some(v)) => Ok((m.clone(), v.clone())),
        _ => Err("LAMB's moments are missing from the device state".into()),
    }
}

/// The parameters this replica updates, from the master.
fn updated_params<B: Backend>(s: &SegmentState<B>) -> Tensor<B, 1> {
    if s.updates_all() {
        s.master.clone()
    } else {
        s.master.clone().slice([s.update_in_master()])
    }
}

impl<B: Backend> DeviceState<B> {
    /// Phase 1 for the segment at block `start`: updates its moments with `grad` (the whole
    /// segment's or this replica's shard) and adds, per parameter, `Σp²` and `Σu²` over the
    /// elements of `counted` (relative to the segment; the replica's share of what it updates)
    /// to `sums`.
    pub(super) fn lamb_moments(
        &mut self,
        start: usize,
        grad: Tensor<B, 1>,
        counted: Range<usize>,
        ctx: &StepContext,
        sums: &mut [f64],
    ) -> Result<(), String> {
        let (spec, layout, in_place) = (self.spec, self.layout.clone(), self.in_place);
        // A whole segment's gradient (ZeRO-0, ZeRO-1's all-reduce) or this replica's shard
        // (ZeRO-2/3's reduce-scatter), as the plan says.
        let s = self.segment_mut(start)?;
        let whole_grad = s.place.grads.len() == s.place.range.len();
        let updated = s.place.update.clone();
        // `counted` ∩ `updated`, in the optimizer's coordinates.
        let to_state = |r: Range<usize>| {
            s.place.state_at + r.start - updated.start..s.place.state_at + r.end - updated.start
        };
        let counted = counted.start.max(updated.start)
            ..counted.end.min(updated.end).max(counted.start.max(updated.start));
        let counted_state = to_state(counted);
        if in_place {
            let cpu = |t: Tensor<B, 1>| {
                into_cpu(t).ok_or_else(|| "a device-state tensor is not a CPU tensor".to_string())
            };
            let (m, v) = moments(s)?;
            let (mut m, mut v, mut g) = (cpu(m)?, cpu(v)?, cpu(grad)?);
            s.m = None;
            s.v = None;
            let master = cpu(s.master.clone())?;
            let values = master
                .as_slice::<f32>()
                .ok_or("device parameters are not one buffer")?;
            let values = &values[s.update_in_master()];
            let (mv, vv, gv) = (values_mut(&mut m)?, values_mut(&mut v)?, values_mut(&mut g)?);
            let gv = if whole_grad { &gv[updated.clone()] } else { &gv[..] };
            let states = s.state_range();
            // Count only `counted`: three pieces, the outer two uncounted.
            for (piece, count) in [
                (states.start..counted_state.start, false),
                (counted_state.clone(), true),
                (counted_state.end..states.end, false),
            ] {
                if piece.is_empty() {
                    continue;
                }
                let at = piece.start - states.start..piece.end - states.start;
                let sink = if count { Some(&mut sums[..]) } else { None };
                let (mm, vm) = (&mut mv[at.clone()], &mut vv[at.clone()]);
                lamb_moments_range(
                    spec,
                    ctx,
                    &layout,
                    piece,
                    &values[at.clone()],
                    mm,
                    vm,
                    &gv[at],
                    sink,
                );
            }
            s.m = Some(from_cpu(m));
            s.v = Some(from_cpu(v));
            return Ok(());
        }
        let lamb = Lamb::of(spec, ctx)?;
        let p = updated_params(s);
        let grad = if whole_grad { grad.slice([updated]) } else { grad };
        let g = grad.mul_scalar(ctx.grad_scale);
        let (m, v) = moments(s)?;
        s.m = Some(m.mul_scalar(lamb.beta1) + g.clone().mul_scalar(1.0 - lamb.beta1));
        s.v = Some(v.mul_scalar(lamb.beta2) + g.clone().mul_scalar(1.0 - lamb.beta2) * g);
        let u = lamb.direction(s, &p)?;
        let states = s.state_range();
        let mut parts = Vec::new();
        let mut params = Vec::new();
        for (piece, part) in layout.pieces(counted_state) {
            let at = piece.start - states.start..piece.end - states.start;
            let (ps, us) = (p.clone().slice([at.clone()]), u.clone().slice([at]));
            parts.push((ps.clone() * ps).sum());
            parts.push((us.clone() * us).sum());
            params.push(part.param);
        }
        if parts.is_empty() {
            return Ok(());
        }
        let read = download(Tensor::cat(parts, 0), TransferKind::Scalar)
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| format!("LAMB's sums of squares: {e:?}"))?;
        for (k, param) in params.into_iter().enumerate() {
            sums[2 * param] += f64::from(read[2 * k]);
            sums[2 * param + 1] += f64::from(read[2 * k + 1]);
        }
        Ok(())
    }

    /// Phase 2 for the segment at block `start`: `p -= lr · trust[k] · u` with each parameter's
    /// trust ratio; returns the segment's master (for the modules).
    pub(super) fn lamb_apply(
        &mut self,
        start: usize,
        trust: &[f32],
        ctx: &StepContext,
    ) -> Result<Tensor<B, 1>, String> {
        let (spec, layout, in_place) = (self.spec, self.layout.clone(), self.in_place);
        let s = self.segment_mut(start)?;
        let states = s.state_range();
        if in_place {
            let cpu = |t: Tensor<B, 1>| {
                into_cpu(t).ok_or_else(|| "a device-state tensor is not a CPU tensor".to_string())
            };
            let (m, v) = moments(s)?;
            let (m, v) = (cpu(m)?, cpu(v)?);
            let empty = Tensor::empty([0], &s.master.device());
            let mut master = cpu(std::mem::replace(&mut s.master, empty))?;
            {
                let at = s.update_in_master();
                let params = &mut values_mut(&mut master)?[at];
                let mv = m.as_slice::<f32>().ok_or("LAMB's moments are not one buffer")?;
                let vv = v.as_slice::<f32>().ok_or("LAMB's moments are not one buffer")?;
                lamb_apply_range(spec, ctx, &layout, states, trust, params, mv, vv);
            }
            s.master = from_cpu(master);
            s.m = Some(from_cpu(m));
            s.v = Some(from_cpu(v));
            return Ok(s.master.clone());
        }
        let lamb = Lamb::of(spec, ctx)?;
        let p = updated_params(s);
        let u = lamb.direction(s, &p)?;
        // Each parameter's piece steps by lr · its trust ratio.
        let mut next = p.clone();
        for (piece, part) in layout.pieces(states.clone()) {
            let at = piece.start - states.start..piece.end - states.start;
            let step = u
                .clone()
                .slice([at.clone()])
                .mul_scalar(ctx.lr * trust[part.param]);
            next = next.slice_assign([at.clone()], p.clone().slice([at]) - step);
        }
        s.put_updated(next);
        Ok(s.master.clone())
    }

    fn segment_mut(&mut self, start: usize) -> Result<&mut SegmentState<B>, String> {
        self.segments
            .get_mut(&start)
            .ok_or_else(|| format!("no segment of this actor's device state starts at block {start}"))
    }
}
