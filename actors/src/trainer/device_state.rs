//! Training state on the device (`--state device`): each segment's master parameters, optimizer
//! state and gradient bucket are flat tensors on the actor's own device; the update runs there
//! as tensor ops, and the modules take their parameters as slices of the master tensor. Nothing
//! crosses between host and device on the optimizer path unless a collective needs a gradient
//! in host memory (dp > 1, until collectives run on the device: then exactly the bucket's bytes
//! each way).
//!
//! On the CPU backend, whose device memory is host memory, the update is the optimizer's own flat
//! loop over the tensors' buffers, in place (`cpu_buffers`). Elsewhere the update rules are
//! `optim::{adam, sgd}`'s formulas (PyTorch's `Adam`, `AdamW`, `SGD` with momentum and Nesterov)
//! written as tensor ops with the same operations in the same order (on the CPU backend they
//! matched the flat loops bit for bit); the parameter groups (no weight decay for biases and
//! LayerNorm) are then a 0/1 mask per segment, made once. Covered: the replicated update (ZeRO-0)
//! and ZeRO-1/2, where each replica keeps every parameter but the optimizer state of its shard
//! only, updates that shard on the device and hands it to the all-gather (in host memory until
//! collectives run on the device: the shard's bytes down, the segment's bytes back up), with
//! clipping by the global norm (each bucket's sum of squares taken on the device: one value read
//! back per bucket). Under ZeRO-3 the device holds only the shard (parameters and state): it is
//! read down for each all-gather and the gathered segment goes up into the modules. The plan
//! refuses offload and LAMB with it.

use archipelago_dataflow::TensorId;
use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Float, Tensor, TensorData};

use archipelago_dataflow::OptimizerSpec;

use super::cpu_buffers::{from_cpu, into_cpu, is_cpu, values_mut};
use crate::optim::{ParamLayout, StepContext, sum_of_squares, update_range};
use crate::transfer::{TransferKind, download, upload};

/// Where one segment's state lies: in the flat master, and what of it this replica updates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SegmentPlace {
    /// The segment's first block (its key).
    pub(super) start: usize,
    /// The segment's elements in the actor's flat master coordinates.
    pub(super) range: Range<usize>,
    /// The elements this replica updates, relative to the segment: all of it, or its ZeRO shard.
    pub(super) update: Range<usize>,
    /// The parameters the device keeps between steps, relative to the segment: all of it, or
    /// (ZeRO-3) the shard it updates.
    pub(super) held: Range<usize>,
    /// The part of the reduced gradient bucket that reaches it (the plan's): the whole segment,
    /// or the shard it updates (ZeRO-2/3).
    pub(super) grads: Range<usize>,
    /// Where the optimizer state of `update` starts in the optimizer's coordinates (those of its
    /// layout: the flat master without ZeRO, the concatenated shards with).
    pub(super) state_at: usize,
}

/// One segment's state on the device.
pub(super) struct SegmentState<B: Backend> {
    pub(super) place: SegmentPlace,
    /// Master parameters of `place.held`, flat in block order.
    pub(super) master: Tensor<B, 1>,
    /// First moments (Adam, AdamW) or SGD's momentum buffer, of `place.update`.
    pub(super) m: Option<Tensor<B, 1>>,
    /// Second moments (Adam, AdamW), of `place.update`.
    pub(super) v: Option<Tensor<B, 1>>,
    /// 1 where an element of `place.update` takes weight decay, 0 where its parameter group has
    /// none (the tensor-op update only; the flat loops read the groups from the layout).
    pub(super) decay: Option<Tensor<B, 1>>,
}

impl<B: Backend> SegmentState<B> {
    /// The optimizer-state range of what this replica updates.
    pub(super) fn state_range(&self) -> Range<usize> {
        self.place.state_at..self.place.state_at + self.place.update.len()
    }

    /// Whether this replica updates all it holds.
    pub(super) fn updates_all(&self) -> bool {
        self.place.update == self.place.held
    }

    /// Where `place.update` lies in the master.
    pub(super) fn update_in_master(&self) -> Range<usize> {
        let at = self.place.held.start;
        self.place.update.start - at..self.place.update.end - at
    }

    /// Puts the updated parameters of `place.update` into the master.
    pub(super) fn put_updated(&mut self, updated: Tensor<B, 1>) {
        self.master = if self.updates_all() {
            updated
        } else {
            self.master
                .clone()
                .slice_assign([self.update_in_master()], updated)
        };
    }
}

/// An actor's training state on its device, by segment (first block), and the gradient buckets
/// of the step in flight.
pub(super) struct DeviceState<B: Backend> {
    pub(super) spec: OptimizerSpec,
    /// Update with the optimizer's flat loops on the buffers in place (CPU backend), not with
    /// tensor ops.
    pub(super) in_place: bool,
    /// The parameters of the state (weight-decay groups), in the optimizer's coordinates.
    pub(super) layout: ParamLayout,
    pub(super) segments: HashMap<usize, SegmentState<B>>,
    pub(super) buckets: HashMap<TensorId, Tensor<B, 1>>,
}

impl<B: Backend> DeviceState<B> {
    /// Moves the state of `segments` onto `device`: the parameters each holds from `params`, the
    /// optimizer's moments from `state` (`(m, v)` of a range of the optimizer's coordinates;
    /// empty for what the rule keeps none of), the decay mask from `layout`.
    pub(super) fn upload(
        spec: OptimizerSpec,
        segments: &[SegmentPlace],
        params: impl Fn(&SegmentPlace) -> Vec<f32>,
        state: impl Fn(Range<usize>) -> (Vec<f32>, Vec<f32>),
        layout: &ParamLayout,
        device: &B::Device,
        tensor_ops: bool,
    ) -> DeviceState<B> {
        let in_place = is_cpu::<B>() && !tensor_ops;
        let put = |values: Vec<f32>| {
            let n = values.len();
            upload::<B, 1, Float>(TensorData::new(values, [n]), device, TransferKind::Parameter)
        };
        let mut by_start = HashMap::new();
        for place in segments {
            let states = place.state_at..place.state_at + place.update.len();
            let mask = (!in_place).then(|| {
                let mut mask = vec![0.0f32; states.len()];
                for (piece, part) in layout.pieces(states.clone()) {
                    let at = piece.start - states.start..piece.end - states.start;
                    mask[at].fill(if part.decay { 1.0 } else { 0.0 });
                }
                put(mask)
            });
            let (m, v) = state(states);
            let segment = SegmentState {
                place: place.clone(),
                master: put(params(place)),
                m: (!m.is_empty()).then(|| put(m)),
                v: (!v.is_empty()).then(|| put(v)),
                decay: mask,
            };
            by_start.insert(place.start, segment);
        }
        DeviceState {
            spec,
            in_place,
            layout: layout.clone(),
            segments: by_start,
            buckets: HashMap::new(),
        }
    }

    /// Adds a micro-batch's gradients of one segment (flat tensors in order) to bucket `name`,
    /// or starts it with them.
    pub(super) fn add_grads(&mut self, name: &TensorId, parts: Vec<Tensor<B, 1>>, first: bool) {
        // Buckets accumulate in f32 whatever the compute dtype (16-bit gradients widened here).
        let grads = Tensor::cat(parts, 0).cast(burn::tensor::FloatDType::F32);
        let sum = match self.buckets.remove(name) {
            Some(acc) if !first => acc + grads,
            _ => grads,
        };
        self.buckets.insert(name.clone(), sum);
    }

    /// Takes bucket `name` off the device into host memory (for a collective).
    pub(super) fn export_bucket(&mut self, name: &TensorId) -> Option<Vec<f32>> {
        let bucket = self.buckets.remove(name)?;
        Some(
            download(bucket, TransferKind::Gradient)
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 gradients"),
        )
    }

    /// Bucket `name` of this step: the one on the device, or `reduced` (from a collective, in
    /// host memory) moved onto it.
    pub(super) fn bucket(
        &mut self,
        name: &TensorId,
        reduced: Option<Vec<f32>>,
        device: &B::Device,
    ) -> Result<Tensor<B, 1>, String> {
        match (self.buckets.remove(name), reduced) {
            (Some(bucket), _) => Ok(bucket),
            (None, Some(values)) => {
                let n = values.len();
                Ok(upload(
                    TensorData::new(values, [n]),
                    device,
                    TransferKind::Gradient,
                ))
            }
            (None, None) => Err(format!("gradient `{name}` missing")),
        }
    }

    /// The values of bucket `name` at `ranges`, in order, read into host memory (tensor
    /// parallelism's replicated gradients); `None` when the bucket is not on the device.
    pub(super) fn read_ranges(&self, name: &TensorId, ranges: &[Range<usize>]) -> Option<Vec<f32>> {
        let bucket = self.buckets.get(name)?;
        if ranges.is_empty() {
            return Some(Vec::new());
        }
        let parts = ranges.iter().map(|r| bucket.clone().slice([r.clone()])).collect();
        let values = download(Tensor::cat(parts, 0), TransferKind::Gradient).convert::<f32>();
        Some(values.into_vec::<f32>().expect("f32 gradients"))
    }

    /// Writes `values` (in order) over bucket `name` at `ranges`; false when the bucket is not
    /// on the device.
    pub(super) fn write_ranges(
        &mut self,
        name: &TensorId,
        ranges: &[Range<usize>],
        values: Vec<f32>,
        device: &B::Device,
    ) -> bool {
        let Some(mut bucket) = self.buckets.remove(name) else {
            return false;
        };
        let n = values.len();
        let sum: Tensor<B, 1> = upload(TensorData::new(values, [n]), device, TransferKind::Gradient);
        let mut at = 0;
        for r in ranges {
            let part = at..at + r.len();
            bucket = bucket.slice_assign([r.clone()], sum.clone().slice([part]));
            at += r.len();
        }
        self.buckets.insert(name.clone(), bucket);
        true
    }

    /// Drops bucket `name` of this step unread (a skipped update).
    pub(super) fn drop_bucket(&mut self, name: &TensorId) {
        self.buckets.remove(name);
    }

    /// Σx² over `own` (a range of the bucket) of bucket `name` of this step, in f64; `None`
    /// when the bucket is not on the device (a collective took it). The tensor-op path sums on
    /// the device and reads back one value.
    pub(super) fn squares(&self, name: &TensorId, own: Range<usize>) -> Option<Result<f64, String>> {
        let bucket = self.buckets.get(name)?;
        if self.in_place {
            let cpu = into_cpu(bucket.clone())?;
            return Some(match cpu.as_slice::<f32>() {
                Some(values) => Ok(sum_of_squares(&values[own])),
                None => Err(format!("gradient bucket `{name}` is not one contiguous buffer")),
            });
        }
        let part = bucket.clone().slice([own]);
        let sum = download((part.clone() * part).sum(), TransferKind::Scalar);
        Some(
            sum.convert::<f32>()
                .as_slice::<f32>()
                .map(|s| f64::from(s[0]))
                .map_err(|e| format!("the sum of squares of `{name}`: {e:?}")),
        )
    }

    /// Bytes held on the device: parameters, optimizer state, masks and buckets in flight.
    /// Bytes of the optimizer's state (moments, decay masks) on the device.
    pub(super) fn optimizer_bytes(&self) -> u64 {
        let n = |t: &Tensor<B, 1>| 4 * t.shape().num_elements() as u64;
        (self.segments.values())
            .map(|s| s.m.as_ref().map_or(0, n) + s.v.as_ref().map_or(0, n) + s.decay.as_ref().map_or(0, n))
            .sum()
    }

    pub(super) fn bytes(&self) -> u64 {
        let n = |t: &Tensor<B, 1>| 4 * t.shape().num_elements() as u64;
        let state: u64 = self
            .segments
            .values()
            .map(|s| {
                n(&s.master)
                    + s.m.as_ref().map_or(0, n)
                    + s.v.as_ref().map_or(0, n)
                    + s.decay.as_ref().map_or(0, n)
            })
            .sum();
        state + self.buckets.values().map(n).sum::<u64>()
    }

    /// Updates the segment starting at block `start` with its reduced gradient `grad`; returns
    /// its new master parameters (for the modules).
    pub(super) fn update(
        &mut self,
        start: usize,
        grad: Tensor<B, 1>,
        ctx: &StepContext,
    ) -> Result<Tensor<B, 1>, String> {
        let spec = self.spec;
        let s = self
            .segments
            .get_mut(&start)
            .ok_or_else(|| format!("no segment of this actor's device state starts at block {start}"))?;
        let (len, updated) = (s.place.range.len(), s.place.update.clone());
        let whole_grad = s.place.grads.len() == len;
        let (n, expected) = (
            grad.shape().num_elements(),
            if whole_grad { len } else { updated.len() },
        );
        if n != expected {
            return Err(format!(
                "gradient of the segment at block {start} has {n} values; the plan says it arrives {} \
                 ({expected} values)",
                if whole_grad {
                    "whole"
                } else {
                    "as this replica's shard"
                }
            ));
        }
        if self.in_place {
            return update_in_place(spec, &self.layout, s, grad, whole_grad, ctx);
        }
        let grad = if whole_grad && !s.updates_all() {
            grad.slice([updated.clone()])
        } else {
            grad
        };
        let g = if ctx.grad_scale == 1.0 {
            grad
        } else {
            grad.mul_scalar(ctx.grad_scale)
        };
        let wd = spec.weight_decay();
        let decay = s
            .decay
            .clone()
            .ok_or("the device state has no weight-decay mask")?;
        // `wd·p` where the group decays, 0 elsewhere (the flat loops' per-group `wd`).
        let decayed = |p: &Tensor<B, 1>, decay: &Tensor<B, 1>| p.clone() * decay.clone().mul_scalar(wd);
        let p = if s.updates_all() {
            s.master.clone()
        } else {
            s.master.clone().slice([s.update_in_master()])
        };
        match spec {
            OptimizerSpec::Adam {
                beta1, beta2, eps, ..
            }
            | OptimizerSpec::AdamW {
                beta1, beta2, eps, ..
            } => {
                let decoupled = matches!(spec, OptimizerSpec::AdamW { .. });
                let (m, v) = match (s.m.take(), s.v.take()) {
                    (Some(m), Some(v)) => (m, v),
                    _ => return Err("Adam's moments are missing from the device state".into()),
                };
                let g = if !decoupled && wd != 0.0 {
                    g + decayed(&p, &decay)
                } else {
                    g
                };
                let p = if decoupled && wd != 0.0 {
                    p * decay.clone().mul_scalar(ctx.lr * wd).neg().add_scalar(1.0)
                } else {
                    p
                };
                let c1 = 1.0 - beta1.powi(ctx.t);
                // 1-bit Adam after its freeze: `g` is the exchanged momentum, `v` stays frozen.
                let frozen = ctx.exchanged_momentum_after.filter(|&w| ctx.t > w);
                let c2_sqrt = (1.0 - beta2.powi(frozen.unwrap_or(ctx.t))).sqrt();
                let (m, v) = match frozen {
                    // A variance frozen at 0 takes no step (`adam::update_with_momentum`).
                    Some(_) => (g.mask_fill(v.clone().equal_elem(0.0), 0.0), v),
                    None => (
                        m.mul_scalar(beta1) + g.clone().mul_scalar(1.0 - beta1),
                        v.mul_scalar(beta2) + g.clone().mul_scalar(1.0 - beta2) * g,
                    ),
                };
                let root = v.clone().sqrt().div_scalar(c2_sqrt);
                // Frozen: the root floored as the flat loop does, so no step exceeds Adam's bound.
                let root = match frozen {
                    Some(_) => {
                        let floor = (1.0 - beta2).sqrt() / ((1.0 - beta1) * c1);
                        root.max_pair(m.clone().abs().mul_scalar(floor))
                    }
                    None => root,
                };
                let denominator = root.add_scalar(eps);
                s.put_updated(p - m.clone().mul_scalar(ctx.lr / c1) / denominator);
                s.m = Some(m);
                s.v = Some(v);
            }
            OptimizerSpec::Sgd {
                momentum,
                dampening,
                nesterov,
                ..
            } => {
                let d = if wd != 0.0 { g + decayed(&p, &decay) } else { g };
                let d = if momentum == 0.0 {
                    d
                } else {
                    let b = match s.m.take() {
                        Some(b) if ctx.t > 1 => {
                            b.mul_scalar(momentum) + d.clone().mul_scalar(1.0 - dampening)
                        }
                        Some(_) => d.clone(),
                        None => return Err("SGD's momentum buffer is missing from the device state".into()),
                    };
                    s.m = Some(b.clone());
                    if nesterov { d + b.mul_scalar(momentum) } else { b }
                };
                s.put_updated(p - d.mul_scalar(ctx.lr));
            }
            OptimizerSpec::Lamb { .. } => {
                return Err("LAMB runs with --state host (its norms are reduced from host copies)".into());
            }
        }
        Ok(s.master.clone())
    }

    /// This replica's (updated) shard of the segment at block `start`, in host memory: for the
    /// all-gather after a ZeRO-1/2 update, or before a ZeRO-3 forward or backward.
    pub(super) fn updated_shard(&self, start: usize) -> Result<(Range<usize>, Vec<f32>), String> {
        let s = self
            .segments
            .get(&start)
            .ok_or_else(|| format!("no segment of this actor's device state starts at block {start}"))?;
        let shard = if s.updates_all() {
            s.master.clone()
        } else {
            s.master.clone().slice([s.update_in_master()])
        };
        let values = download(shard, TransferKind::Parameter)
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| format!("the updated shard at block {start}: {e:?}"))?;
        Ok((s.place.update.clone(), values))
    }

    /// ZeRO-1/2: the gathered parameters of the segment at block `start` (every replica's
    /// updated shard) become its master; returns it (for the modules).
    pub(super) fn load_gathered(
        &mut self,
        start: usize,
        values: Vec<f32>,
        keep_own: bool,
        device: &B::Device,
    ) -> Result<Tensor<B, 1>, String> {
        let s = self
            .segments
            .get_mut(&start)
            .ok_or_else(|| format!("no segment of this actor's device state starts at block {start}"))?;
        if values.len() != s.place.range.len() {
            return Err(format!(
                "gathered parameters of {} values for the segment at block {start} of {}",
                values.len(),
                s.place.range.len()
            ));
        }
        let n = values.len();
        let gathered = upload(TensorData::new(values, [n]), device, TransferKind::Parameter);
        let own = s.place.update.clone();
        s.master = if keep_own && !own.is_empty() {
            // The segment is held whole: its own shard is at the same place in the master.
            gathered.slice_assign([own.clone()], s.master.clone().slice([own]))
        } else {
            gathered
        };
        Ok(s.master.clone())
    }

    /// Copies the state back into host memory: calls `put(place, params, m, v)` per segment
    /// (the parameters it holds; `m`, `v` of what this replica updates, empty where the rule
    /// keeps none).
    pub(super) fn download_into(&self, mut put: impl FnMut(&SegmentPlace, Vec<f32>, Vec<f32>, Vec<f32>)) {
        let read = |t: &Tensor<B, 1>| {
            download(t.clone(), TransferKind::Parameter)
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 state")
        };
        for s in self.segments.values() {
            let m = s.m.as_ref().map(read).unwrap_or_default();
            let v = s.v.as_ref().map(read).unwrap_or_default();
            put(&s.place, read(&s.master), m, v);
        }
    }
}

/// The CPU backend's update: the optimizer's flat loop over the segment's own buffers, in place
/// (`grad` covers the whole segment when `whole_grad`, else what this replica updates).
fn update_in_place<B: Backend>(
    spec: OptimizerSpec,
    layout: &ParamLayout,
    s: &mut SegmentState<B>,
    grad: Tensor<B, 1>,
    whole_grad: bool,
    ctx: &StepContext,
) -> Result<Tensor<B, 1>, String> {
    let cpu =
        |t: Tensor<B, 1>| into_cpu(t).ok_or_else(|| "a device-state tensor is not a CPU tensor".to_string());
    // Moved out (an empty tensor in its place), so that the buffer is not shared by this state.
    let empty = Tensor::empty([0], &s.master.device());
    let mut master = cpu(std::mem::replace(&mut s.master, empty))?;
    let mut m = s.m.take().map(cpu).transpose()?;
    let mut v = s.v.take().map(cpu).transpose()?;
    let mut grad = cpu(grad)?;
    {
        let params = values_mut(&mut master)?;
        let mut none = [0.0f32; 0];
        let m = match &mut m {
            Some(m) => values_mut(m)?,
            None => &mut none[..],
        };
        let mut none_v = [0.0f32; 0];
        let v = match &mut v {
            Some(v) => values_mut(v)?,
            None => &mut none_v[..],
        };
        let grads = values_mut(&mut grad)?;
        let grads = if whole_grad {
            &grads[s.place.update.clone()]
        } else {
            &grads[..]
        };
        let states = s.state_range();
        let params = &mut params[s.update_in_master()];
        update_range(spec, ctx, layout, states, params, m, v, grads);
    }
    s.master = from_cpu(master);
    s.m = m.map(from_cpu);
    s.v = v.map(from_cpu);
    Ok(s.master.clone())
}
