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
