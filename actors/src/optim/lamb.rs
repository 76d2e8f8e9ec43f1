//! LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
//! ICLR 2020, Algorithm 2) on flat slices, in two phases so that a parameter split over shards
//! (ZeRO) or actors still gets the trust ratio of the *whole* parameter:
//!
//! ```text
//! phase 1 (each shard):  g ← c·g;  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
//!                        u = (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + ε) + wd·p
//!                        partial sums Σp², Σu² per parameter
//! the caller sums the partial sums over the shards (an all-reduce; the identity on one device)
//! phase 2 (each shard):  p ← p − lr · r · u,   r = ‖p‖ / ‖u‖ (1 when either norm is 0)
//! ```
//!
//! Phase 2 recomputes `u` from the moments and the unchanged `p` with the same operations, so
//! no buffer of `u` is kept; the optimizer state is `m` and `v`, as Adam's.

use std::ops::Range;

use archipelago_dataflow::OptimizerSpec;

use super::{ParamLayout, StepContext, lamb_step};

/// LAMB's phase 1 over the state elements `range` of `layout`, given that range's slices:
/// updates the moments and adds, per parameter, `Σp²` and `Σu²` at `sums[2k]`, `sums[2k + 1]`
/// (when `sums` is given: pass `None` for ranges another shard answers for).
///
/// # Panics
/// When the slices are not the range's, or `spec` is not LAMB.
#[allow(clippy::too_many_arguments)]
pub fn moments_range(
    spec: OptimizerSpec,
    ctx: &StepContext,
    layout: &ParamLayout,
    range: Range<usize>,
    params: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: &[f32],
    mut sums: Option<&mut [f64]>,
) {
    let offset = range.start;
    for (piece, part) in layout.pieces(range) {
        let at = piece.start - offset..piece.end - offset;
        let step = lamb_step(spec, ctx, part.decay);
        let (pp, uu) = moments(
            &step,
            &params[at.clone()],
            &mut m[at.clone()],
            &mut v[at.clone()],
            &grads[at],
        );
        if let Some(sums) = sums.as_deref_mut() {
            sums[2 * part.param] += pp;
            sums[2 * part.param + 1] += uu;
        }
    }
}

/// LAMB's phase 2 over the state elements `range` of `layout`: `p -= lr · trust[k] · u` with
/// parameter `k`'s trust ratio.
///
/// # Panics
/// When the slices are not the range's, `trust` misses a parameter, or `spec` is not LAMB.
#[allow(clippy::too_many_arguments)]
pub fn apply_range(
    spec: OptimizerSpec,
    ctx: &StepContext,
    layout: &ParamLayout,
    range: Range<usize>,
    trust: &[f32],
    params: &mut [f32],
    m: &[f32],
    v: &[f32],
) {
    let offset = range.start;
    for (piece, part) in layout.pieces(range) {
        let at = piece.start - offset..piece.end - offset;
        let step = lamb_step(spec, ctx, part.decay);
        apply(
            &step,
            trust[part.param],
            &mut params[at.clone()],
            &m[at.clone()],
            &v[at],
        );
    }
}

/// One LAMB step over one range of one parameter group.
#[derive(Debug, Clone, Copy)]
pub struct LambStep {
    /// This step's learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// The weight decay of this range's group.
    pub weight_decay: f32,
    /// The step, from 1 (bias correction).
    pub t: i32,
    /// The clipping factor of the step's gradients.
    pub grad_scale: f32,
}

impl LambStep {
    /// The bias corrections `(1 − β1ᵗ, 1 − β2ᵗ)`.
    pub fn corrections(&self) -> (f32, f32) {
        (1.0 - self.beta1.powi(self.t), 1.0 - self.beta2.powi(self.t))
    }
}

#[inline]
fn direction(s: &LambStep, c1: f32, c2: f32, p: f32, m: f32, v: f32) -> f32 {
    (m / c1) / ((v / c2).sqrt() + s.eps) + s.weight_decay * p
}

/// Phase 1: updates the moments of the range with `grads` and returns the range's sums of
/// squares of the parameters and of their update directions.
///
/// # Panics
/// When the slices differ in length.
pub(super) fn moments(
    s: &LambStep,
    params: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: &[f32],
) -> (f64, f64) {
    assert!(
        m.len() == params.len() && v.len() == params.len() && grads.len() == params.len(),
        "LAMB state, parameter and gradient ranges differ"
    );
    let (c1, c2) = s.corrections();
    let (beta1, beta2, scale) = (s.beta1, s.beta2, s.grad_scale);
    let (mut pp, mut uu) = (0.0f64, 0.0f64);
    for (((p, g), m), v) in params.iter().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = scale * g;
        *m = beta1 * *m + (1.0 - beta1) * g;
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        let u = direction(s, c1, c2, *p, *m, *v);
        pp += (*p as f64) * (*p as f64);
        uu += (u as f64) * (u as f64);
    }
    (pp, uu)
}

/// The trust ratio from a parameter's reduced sums of squares.
pub(super) fn trust_ratio(param_squares: f64, update_squares: f64) -> f32 {
    let (p, u) = (param_squares.sqrt(), update_squares.sqrt());
    if p > 0.0 && u > 0.0 { (p / u) as f32 } else { 1.0 }
}

/// Phase 2: `p -= lr · trust · u` over the range, with the moments phase 1 left.
///
/// # Panics
/// When the slices differ in length.
pub(super) fn apply(s: &LambStep, trust: f32, params: &mut [f32], m: &[f32], v: &[f32]) {
    assert!(
        m.len() == params.len() && v.len() == params.len(),
        "LAMB state and parameter ranges differ"
    );
    let (c1, c2) = s.corrections();
    let rate = s.lr * trust;
    for ((p, m), v) in params.iter_mut().zip(m).zip(v) {
        let u = direction(s, c1, c2, *p, *m, *v);
        *p -= rate * u;
    }
}
