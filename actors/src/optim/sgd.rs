//! SGD with momentum, dampening, Nesterov momentum (Sutskever et al., "On the importance of
//! initialization and momentum in deep learning", ICML 2013) and weight decay, in the form of
//! `torch.optim.SGD`:
//!
//! ```text
//! d ← c·g + wd·p
//! b ← d on the first step, else μ·b + (1 − dampening)·d
//! d ← d + μ·b (Nesterov) or b
//! p ← p − lr·d
//! ```
//!
//! With μ = 0 and wd = 0 it is exactly `p -= lr·(c·g)` and keeps no buffer.

/// One SGD step over one range of one parameter group.
#[derive(Debug, Clone, Copy)]
pub(super) struct SgdStep {
    /// This step's learning rate.
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub nesterov: bool,
    /// The weight decay of this range's group.
    pub weight_decay: f32,
    /// The step, from 1 (the momentum buffer starts as the first step's gradient).
    pub t: i32,
    /// The clipping factor of the step's gradients.
    pub grad_scale: f32,
}

/// Updates `params` and the momentum buffer `buf` (empty without momentum) with `grads`.
///
/// # Panics
/// When the slices differ in length.
pub(super) fn update(s: &SgdStep, params: &mut [f32], buf: &mut [f32], grads: &[f32]) {
    assert_eq!(params.len(), grads.len(), "parameter and gradient ranges differ");
    let (lr, wd, scale) = (s.lr, s.weight_decay, s.grad_scale);
    if s.momentum == 0.0 {
        if wd == 0.0 {
            for (p, g) in params.iter_mut().zip(grads) {
                *p -= lr * (scale * g);
            }
        } else {
            for (p, g) in params.iter_mut().zip(grads) {
                let d = scale * g + wd * *p;
                *p -= lr * d;
            }
        }
        return;
    }
    assert_eq!(
        buf.len(),
        params.len(),
        "momentum buffer and parameter ranges differ"
    );
    let (mu, keep) = (s.momentum, 1.0 - s.dampening);
    let first = s.t <= 1;
    for ((p, g), b) in params.iter_mut().zip(grads).zip(buf.iter_mut()) {
        let d = scale * g + wd * *p;
        *b = if first { d } else { mu * *b + keep * d };
        let d = if s.nesterov { d + mu * *b } else { *b };
        *p -= lr * d;
    }
}
