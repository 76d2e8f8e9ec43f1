//! Adam (Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015) and AdamW
//! (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019) on flat slices, in
//! PyTorch's form (`torch.optim.Adam`, `torch.optim.AdamW`):
//!
//! ```text
//! g ← c·g (+ wd·p for Adam's L2)      p ← p·(1 − lr·wd) (AdamW)
//! m ← β1·m + (1 − β1)·g               v ← β2·v + (1 − β2)·g²
//! p ← p − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)
//! ```
//!
//! where `c` is the step's clipping factor (1 when not clipping).
//!
//! 1-bit Adam (Tang et al. 2021) after its freeze at step `W` ([`update_with_momentum`]): the
//! momentum is the exchange's result (the collective computed it, `collectives::onebit`) and
//! the variance stays as it was at `W`, with `W`'s bias correction:
//! `m ← exchanged`, `p ← p − lr/(1 − β1ᵗ) · m / (max(√v / √(1 − β2ᵂ), |m̂|·√(1 − β2)/(1 − β1)) + ε)`:
//! the frozen root is floored so that no step exceeds `lr·(1 − β1)/√(1 − β2)`, the bound of
//! Adam's own step (Kingma & Ba §2.1) — a variance frozen small under a gradient that grows
//! later would otherwise step without bound (a 4-layer mlp went to NaN three steps after its
//! freeze, even with the momentum exchanged exactly).

/// One step of Adam or AdamW over one range of one parameter group.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdamStep {
    /// This step's learning rate.
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// The weight decay of this range's group (0 for parameters without decay).
    pub weight_decay: f32,
    /// AdamW's decoupled decay; Adam's L2 otherwise.
    pub decoupled: bool,
    /// The step, from 1 (bias correction).
    pub t: i32,
    /// The clipping factor of the step's gradients.
    pub grad_scale: f32,
}

/// Updates `params` and the moments `m`, `v` of the same range with `grads`.
///
/// # Panics
/// When the slices differ in length.
pub(super) fn update(s: &AdamStep, params: &mut [f32], m: &mut [f32], v: &mut [f32], grads: &[f32]) {
    assert!(
        m.len() == params.len() && v.len() == params.len() && grads.len() == params.len(),
        "Adam state, parameter and gradient ranges differ"
    );
    let c1 = 1.0 - s.beta1.powi(s.t);
    let c2 = 1.0 - s.beta2.powi(s.t);
    let step = s.lr / c1;
    let c2_sqrt = c2.sqrt();
    let (beta1, beta2, eps, scale) = (s.beta1, s.beta2, s.eps, s.grad_scale);
    // With no decay and no clipping these are exact no-ops (×1, +0), so plain Adam is unchanged.
    let (l2, shrink) = if s.decoupled {
        (0.0, 1.0 - s.lr * s.weight_decay)
    } else {
        (s.weight_decay, 1.0)
    };
    for (((p, g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = scale * g + l2 * *p;
        *p *= shrink;
        *m = beta1 * *m + (1.0 - beta1) * g;
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        *p -= step * *m / (v.sqrt() / c2_sqrt + eps);
    }
}

/// 1-bit Adam's update after its freeze at step `frozen_at`: `m` takes the `exchanged`
/// momentum, `v` is left as it was (weight decay and clipping are refused by the plan).
///
/// # Panics
/// When the slices differ in length.
pub(super) fn update_with_momentum(
    s: &AdamStep,
    frozen_at: i32,
    params: &mut [f32],
    m: &mut [f32],
    v: &[f32],
    exchanged: &[f32],
) {
    assert!(
        m.len() == params.len() && v.len() == params.len() && exchanged.len() == params.len(),
        "Adam state, parameter and momentum ranges differ"
    );
    let c1 = 1.0 - s.beta1.powi(s.t);
    let c2 = 1.0 - s.beta2.powi(frozen_at.min(s.t).max(1));
    let step = s.lr / c1;
    let (c2_sqrt, eps) = (c2.sqrt(), s.eps);
    // The floor of the frozen root: |m̂|·√(1 − β2)/(1 − β1), so no step exceeds
    // lr·(1 − β1)/√(1 − β2), the bound of Adam's own step (whose variance takes in each gradient).
    let floor = (1.0 - s.beta2).sqrt() / ((1.0 - s.beta1) * c1);
    for (((p, x), m), v) in params.iter_mut().zip(exchanged).zip(m.iter_mut()).zip(v) {
        // A variance frozen at 0 (no gradient through the warm-up): no step while frozen.
        if *v == 0.0 {
            *m = 0.0;
            continue;
        }
        *m = *x;
        let root = (v.sqrt() / c2_sqrt).max(m.abs() * floor);
        *p -= step * *m / (root + eps);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1-bit Adam after its freeze: the exchanged momentum replaces `m`, `v` stays, a healthy
    /// variance gives Adam's formula exactly, and a variance frozen far too small cannot make a step
    /// larger than Adam's own bound `lr·(1 − β1)/√(1 − β2)`; a variance frozen at 0 makes none.
    #[test]
    fn onebit_adams_frozen_update_takes_the_momentum_and_bounds_the_step() {
        let s = AdamStep {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            t: 20,
            grad_scale: 1.0,
        };
        let (mut p, mut m) = (vec![1.0f32; 3], vec![9.0f32; 3]);
        let v = [4e-4f32, 1e-30, 0.0];
        update_with_momentum(&s, 10, &mut p, &mut m, &v, &[0.02, 0.02, 0.02]);
        assert_eq!(m, [0.02, 0.02, 0.0]);
        let c1 = 1.0 - 0.9f32.powi(20);
        let c2_sqrt = (1.0 - 0.999f32.powi(10)).sqrt();
        let healthy = 1.0 - 0.01 / c1 * 0.02 / ((4e-4f32).sqrt() / c2_sqrt + 1e-8);
        assert_eq!(p[0], healthy);
        let bound = 0.01 * 0.1 / (0.001f32).sqrt();
        assert!(
            (1.0 - p[1]) <= bound * 1.0001 && (1.0 - p[1]) > 0.9 * bound,
            "{}",
            1.0 - p[1]
        );
        assert_eq!(p[2], 1.0);
    }
}
