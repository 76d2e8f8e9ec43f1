//! Optimizers on flat f32 shards: plain loops over `&mut [f32]`, no tensor ops, on any shard
//! layout (ZeRO shards, offload tiers). On CPU this is several times faster than a tensor-op
//! optimizer.
//!
//! One file per family, each naming its paper: `adam.rs` (Adam, Kingma & Ba 2015; AdamW,
//! Loshchilov & Hutter 2019), `sgd.rs` (SGD with momentum and Nesterov, Sutskever et al. 2013),
//! `lamb.rs` (You et al. 2020); [`clip`] (clipping by the global norm, Pascanu et al. 2013),
//! [`groups`] (which elements belong to which parameter, and which take weight decay). The
//! learning-rate schedule is the program's [`LrSchedule`], a pure function of the step.
//!
//! A step on a [`FlatOptimizer`]: [`FlatOptimizer::begin_step`] (advances the step counter and
//! sets this step's learning rate from the schedule), optionally
//! [`FlatOptimizer::clip`] with the squared global gradient norm the caller reduced over every
//! shard, then [`FlatOptimizer::update`] range by range. LAMB is two-phase:
//! [`FlatOptimizer::accumulate_norms`] range by range (moments and partial norms), the caller's
//! reduction of the partial norms over the shards of each parameter, [`FlatOptimizer::set_norms`],
//! then [`FlatOptimizer::update`].

mod adam;
pub mod clip;
pub mod groups;
mod lamb;
mod sgd;
#[cfg(test)]
mod tests;

use std::ops::Range;

use archipelago_dataflow::{LrSchedule, OptimizerSpec};

pub use clip::{clip_factor, sum_of_squares};
pub use groups::{ParamLayout, ParamPart};
pub use lamb::{LambStep, apply_range as lamb_apply_range, moments_range as lamb_moments_range};

/// What one step of an update rule needs besides the slices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepContext {
    /// The step, from 1.
    pub t: i32,
    /// This step's learning rate (the schedule's).
    pub lr: f32,
    /// The clipping factor of this step's gradients (1: not clipped).
    pub grad_scale: f32,
    /// 1-bit Adam's freeze step, when the rule is 1-bit Adam's: after it the "gradients" are
    /// the exchanged momentum and the second moment is frozen (`adam::update_with_momentum`).
    pub exchanged_momentum_after: Option<i32>,
}

/// An optimizer over one flat parameter vector, updated range by range.
#[derive(Debug, Clone)]
pub struct FlatOptimizer {
    spec: OptimizerSpec,
    schedule: LrSchedule,
    layout: ParamLayout,
    /// First moments (Adam, AdamW, LAMB) or the momentum buffer (SGD); empty without state.
    m: Vec<f32>,
    /// Second moments (Adam, AdamW, LAMB); empty otherwise.
    v: Vec<f32>,
    t: i32,
    /// Steps the learning-rate schedule has advanced (checkpointed beside `t`; they move
    /// together, but a resumed run restores each from what was saved).
    schedule_step: u64,
    lr: f32,
    grad_scale: f32,
    /// LAMB: this step's trust ratio per parameter, once the reduced norms are set.
    trust: Vec<f32>,
    /// 1-bit Adam's freeze step: after it the "gradients" are the exchanged momentum and the
    /// variance is frozen ([`FlatOptimizer::with_exchanged_momentum`]).
    exchanged_momentum_after: Option<i32>,
}

impl FlatOptimizer {
    /// State for `len` parameters (one parameter group, with weight decay; a constant rate).
    pub fn new(spec: OptimizerSpec, len: usize) -> FlatOptimizer {
        let floats = spec.state_floats_per_param();
        FlatOptimizer {
            spec,
            schedule: LrSchedule::constant(),
            layout: ParamLayout::whole(len),
            m: vec![0.0; if floats >= 1 { len } else { 0 }],
            v: vec![0.0; if floats >= 2 { len } else { 0 }],
            t: 0,
            schedule_step: 0,
            lr: spec.lr(),
            grad_scale: 1.0,
            trust: Vec::new(),
            exchanged_momentum_after: None,
        }
    }

    /// The same optimizer as 1-bit Adam's (Tang et al. 2021) with its freeze at step `freeze`:
    /// plain Adam up to it; after it [`FlatOptimizer::update`]'s `grads` are the momentum the
    /// collective exchanged (`collectives::onebit`), taken as the first moment, and the second
    /// moment stays frozen. Only for Adam (the plan refuses the other rules).
    pub fn with_exchanged_momentum(mut self, freeze: u32) -> FlatOptimizer {
        self.exchanged_momentum_after = Some(i32::try_from(freeze).unwrap_or(i32::MAX));
        self
    }

    /// The same optimizer with learning-rate schedule `schedule`.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> FlatOptimizer {
        self.schedule = schedule;
        self
    }

    /// The same optimizer with the parameters of its state described by `layout` (weight-decay
    /// groups, LAMB's parameters).
    ///
    /// # Panics
    /// When `layout` covers another number of elements than the state was made for.
    pub fn with_layout(mut self, layout: ParamLayout) -> FlatOptimizer {
        assert_eq!(
            layout.len(),
            self.layout.len(),
            "the parameter layout covers another state length"
        );
        self.layout = layout;
        self
    }

    /// Starts a new step: advances the step counter (Adam's bias correction, the schedule's
    /// position) and sets the step's learning rate; no clipping until [`FlatOptimizer::clip`].
    pub fn begin_step(&mut self) {
        self.t += 1;
        self.schedule_step += 1;
        self.lr = self.lr_at(self.schedule_step);
        self.grad_scale = 1.0;
        self.trust.clear();
    }

    /// The learning rate at schedule position `t` (from 1).
    pub fn lr_at(&self, t: u64) -> f32 {
        self.spec.lr() * self.schedule.factor(t.max(1))
    }

    /// This step's learning rate.
    pub fn lr(&self) -> f32 {
        self.lr
    }

    /// Clips this step's gradients to global norm `max_norm`, given their squared global norm
    /// (summed by the caller over every shard); returns the factor applied.
    pub fn clip(&mut self, total_squares: f64, max_norm: f32) -> f32 {
        self.grad_scale = clip_factor(total_squares, max_norm);
        self.grad_scale
    }

    /// Sets the factor this step's gradients are multiplied by (clipping's, and loss scaling's
    /// `1/S`: see `trainer::norms`).
    pub fn set_grad_scale(&mut self, factor: f32) {
        self.grad_scale = factor;
    }

    /// The factor this step's gradients are multiplied by (1 unless clipped).
    pub fn grad_scale(&self) -> f32 {
        self.grad_scale
    }

    /// This step's context.
    pub fn context(&self) -> StepContext {
        StepContext {
            t: self.t,
            lr: self.lr,
            grad_scale: self.grad_scale,
            exchanged_momentum_after: self.exchanged_momentum_after,
        }
    }

    /// Updates `params` (the flat parameters whose state lies at `offset..offset+len`) with
    /// `grads`. For LAMB this is phase 2: `grads` were consumed by
    /// [`FlatOptimizer::accumulate_norms`] and are not read.
    ///
    /// # Panics
    /// When `params` and `grads` differ in length, the range is outside the state, or LAMB's
    /// norms were not set this step.
    pub fn update(&mut self, offset: usize, params: &mut [f32], grads: &[f32]) {
        let range = offset..offset + params.len();
        let ctx = self.context();
        let FlatOptimizer {
            spec,
            layout,
            m,
            v,
            trust,
            ..
        } = self;
        let (m, v) = (state_slice(m, range.clone()), state_slice(v, range.clone()));
        if let OptimizerSpec::Lamb { .. } = spec {
            assert_eq!(
                trust.len(),
                layout.params(),
                "LAMB's update needs this step's reduced norms (accumulate_norms, set_norms) first"
            );
            lamb::apply_range(*spec, &ctx, layout, range, trust, params, m, v);
            return;
        }
        update_range(*spec, &ctx, layout, range, params, m, v, grads);
    }

    /// LAMB's phase 1 over `params` (state at `offset..`): updates the moments with `grads` and,
    /// when `sums` is given, adds each parameter's `Σp²` and `Σu²` at `sums[2k]`, `sums[2k + 1]`
    /// (pass `None` for ranges another shard answers for). No-op for the other rules.
    ///
    /// # Panics
    /// When the slices differ in length, the range is outside the state or `sums` is shorter
    /// than [`FlatOptimizer::norms_len`].
    pub fn accumulate_norms(
        &mut self,
        offset: usize,
        params: &[f32],
        grads: &[f32],
        sums: Option<&mut [f64]>,
    ) {
        if !self.spec.needs_param_norms() {
            return;
        }
        let range = offset..offset + params.len();
        let ctx = self.context();
        let FlatOptimizer {
            spec, layout, m, v, ..
        } = self;
        let (m, v) = (state_slice(m, range.clone()), state_slice(v, range.clone()));
        lamb::moments_range(*spec, &ctx, layout, range, params, m, v, grads, sums);
    }

    /// Length of LAMB's per-parameter norm vector (`Σp²`, `Σu²` per parameter); 0 for rules
    /// that need none.
    pub fn norms_len(&self) -> usize {
        if self.spec.needs_param_norms() {
            2 * self.layout.params()
        } else {
            0
        }
    }

    /// LAMB: takes the per-parameter sums of squares reduced over every shard, for this step's
    /// trust ratios.
    ///
    /// # Panics
    /// When `sums` is not [`FlatOptimizer::norms_len`] long.
    pub fn set_norms(&mut self, sums: &[f32]) {
        assert_eq!(
            sums.len(),
            self.norms_len(),
            "LAMB norms of another parameter count"
        );
        self.trust = sums
            .chunks_exact(2)
            .map(|s| lamb::trust_ratio(s[0] as f64, s[1] as f64))
            .collect();
    }

    /// LAMB: this step's trust ratio per parameter (after [`FlatOptimizer::set_norms`]).
    pub fn trust(&self) -> &[f32] {
        &self.trust
    }

    /// The update rule.
    pub fn spec(&self) -> OptimizerSpec {
        self.spec
    }

    /// The learning-rate schedule.
    pub fn schedule(&self) -> LrSchedule {
        self.schedule
    }

    /// The parameters of the state.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Steps taken (bias correction, the schedule's position, SGD's first momentum step).
    pub fn steps(&self) -> i32 {
        self.t
    }

    /// Sets the steps taken (a restored checkpoint's).
    pub fn set_steps(&mut self, t: i32) {
        self.t = t;
    }

    /// Steps the learning-rate schedule has advanced: the next step's rate is the schedule's at
    /// this + 1.
    pub fn schedule_step(&self) -> u64 {
        self.schedule_step
    }

    /// Sets the schedule's position (a restored checkpoint's, or one more after an update run
    /// elsewhere: the offload actor's).
    pub fn set_schedule_step(&mut self, position: u64) {
        self.schedule_step = position;
    }

    /// The rate of the next step under the schedule.
    pub fn next_lr(&self) -> f32 {
        self.lr_at(self.schedule_step + 1)
    }

    /// The state of the parameters at `range`: (`m` or SGD's momentum buffer, `v`); empty
    /// slices for what the rule does not keep.
    pub fn state(&self, range: Range<usize>) -> (&[f32], &[f32]) {
        let m = if self.m.is_empty() {
            &[][..]
        } else {
            &self.m[range.clone()]
        };
        let v = if self.v.is_empty() {
            &[][..]
        } else {
            &self.v[range]
        };
        (m, v)
    }

    /// Overwrites the state of the parameters at `offset..` (empty slices leave it be).
    pub fn set_state(&mut self, offset: usize, m: &[f32], v: &[f32]) {
        if !self.m.is_empty() && !m.is_empty() {
            self.m[offset..offset + m.len()].copy_from_slice(m);
        }
        if !self.v.is_empty() && !v.is_empty() {
            self.v[offset..offset + v.len()].copy_from_slice(v);
        }
    }

    /// Frees the per-parameter state buffers: the state lives elsewhere (on the device) and
    /// this optimizer keeps only the step counters, schedule and layout. [`FlatOptimizer::state`]
    /// then reads empty slices; [`FlatOptimizer::ensure_state`] makes the buffers again.
    pub fn release_state(&mut self) {
        self.m = Vec::new();
        self.v = Vec::new();
    }

    /// Makes the per-parameter state buffers again (zeros) after
    /// [`FlatOptimizer::release_state`], so that [`FlatOptimizer::set_state`] can fill them.
    pub fn ensure_state(&mut self) {
        let (floats, len) = (self.spec.state_floats_per_param(), self.layout.len());
        if floats >= 1 && self.m.is_empty() {
            self.m = vec![0.0; len];
        }
        if floats >= 2 && self.v.is_empty() {
            self.v = vec![0.0; len];
        }
    }

    /// Whether the optimizer keeps per-parameter state.
    pub fn has_state(&self) -> bool {
        !self.m.is_empty()
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> u64 {
        4 * (self.m.len() + self.v.len()) as u64
    }
}

/// `range` of a state vector, or nothing when the rule keeps no such state.
fn state_slice(state: &mut [f32], range: Range<usize>) -> &mut [f32] {
    if state.is_empty() {
        state
    } else {
        &mut state[range]
    }
}

/// LAMB's step for a range whose parameter group decays (`decay`) or not.
///
/// # Panics
/// When `spec` is not LAMB.
pub fn lamb_step(spec: OptimizerSpec, ctx: &StepContext, decay: bool) -> lamb::LambStep {
    let OptimizerSpec::Lamb {
        beta1,
        beta2,
        eps,
        weight_decay,
        ..
    } = spec
    else {
        unreachable!("a LAMB step of another rule")
    };
    lamb::LambStep {
        lr: ctx.lr,
        beta1,
        beta2,
        eps,
        weight_decay: if decay { weight_decay } else { 0.0 },
        t: ctx.t,
        grad_scale: ctx.grad_scale,
    }
}

/// One update of the one-phase rules (Adam, AdamW, SGD) over the state elements `range` of
/// `layout` (its weight-decay groups), given the slices of that range: parameters, `m` (or SGD's
/// momentum buffer; empty without), `v` (empty unless Adam/AdamW) and gradients. Offload tiers
/// call this on state they keep outside a [`FlatOptimizer`].
///
/// # Panics
/// When the slices differ in length, or for LAMB (two-phase: use a [`FlatOptimizer`]).
#[allow(clippy::too_many_arguments)]
pub fn update_range(
    spec: OptimizerSpec,
    ctx: &StepContext,
    layout: &ParamLayout,
    range: Range<usize>,
    params: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: &[f32],
) {
    assert_eq!(params.len(), grads.len(), "parameter and gradient ranges differ");
    assert_eq!(params.len(), range.len(), "the slices are not the range's");
    let offset = range.start;
    for (piece, part) in layout.pieces(range) {
        let at = piece.start - offset..piece.end - offset;
        let mr = if m.is_empty() { 0..0 } else { at.clone() };
        let vr = if v.is_empty() { 0..0 } else { at.clone() };
        let wd = if part.decay { spec.weight_decay() } else { 0.0 };
        match spec {
            OptimizerSpec::Adam {
                beta1, beta2, eps, ..
            }
            | OptimizerSpec::AdamW {
                beta1, beta2, eps, ..
            } => {
                let step = adam::AdamStep {
                    lr: ctx.lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay: wd,
                    decoupled: matches!(spec, OptimizerSpec::AdamW { .. }),
                    t: ctx.t,
                    grad_scale: ctx.grad_scale,
                };
                let (p, g) = (&mut params[at.clone()], &grads[at]);
                match ctx.exchanged_momentum_after {
                    Some(frozen_at) if ctx.t > frozen_at => {
                        adam::update_with_momentum(&step, frozen_at, p, &mut m[mr], &v[vr], g);
                    }
                    _ => adam::update(&step, p, &mut m[mr], &mut v[vr], g),
                }
            }
            OptimizerSpec::Sgd {
                momentum,
                dampening,
                nesterov,
                ..
            } => {
                let step = sgd::SgdStep {
                    lr: ctx.lr,
                    momentum,
                    dampening,
                    nesterov,
                    weight_decay: wd,
                    t: ctx.t,
                    grad_scale: ctx.grad_scale,
                };
                sgd::update(&step, &mut params[at.clone()], &mut m[mr], &grads[at]);
            }
            OptimizerSpec::Lamb { .. } => {
                panic!("LAMB is two-phase (per-parameter norms over every shard): use a FlatOptimizer")
            }
        }
    }
}
