//! Optimizers on flat f32 shards: plain loops over `&mut [f32]`, no tensor ops.
//!
//! Adam follows Kingma & Ba ("Adam: A Method for Stochastic Optimization", ICLR 2015) in
//! PyTorch's form: `p -= lr · m̂ / (√v̂ + ε)`. On CPU this is several times faster than a
//! tensor-op optimizer and works on any shard layout (ZeRO shards, offload tiers).

use archipelago_dataflow::OptimizerSpec;

/// An optimizer over one flat parameter vector, updated range by range.
#[derive(Debug, Clone)]
pub struct FlatOptimizer {
    spec: OptimizerSpec,
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
}

impl FlatOptimizer {
    /// State for `len` parameters.
    pub fn new(spec: OptimizerSpec, len: usize) -> FlatOptimizer {
        let state = spec.state_floats_per_param() as usize / 2 * len;
        FlatOptimizer {
            spec,
            m: vec![0.0; state],
            v: vec![0.0; state],
            t: 0,
        }
    }

    /// Starts a new step (advances the bias-correction counter).
    pub fn begin_step(&mut self) {
        self.t += 1;
    }

    /// Updates `params` (the flat parameters at `offset..offset+len`) with `grads`.
    ///
    /// # Panics
    /// When `params` and `grads` differ in length or the range is outside the state.
    pub fn update(&mut self, offset: usize, params: &mut [f32], grads: &[f32]) {
        let len = params.len();
        let (m, v) = if self.m.is_empty() {
            (&mut [][..], &mut [][..])
        } else {
            (
                &mut self.m[offset..offset + len],
                &mut self.v[offset..offset + len],
            )
        };
        update_slices(self.spec, self.t, params, m, v, grads);
    }

    /// The optimizer.
    pub fn spec(&self) -> OptimizerSpec {
        self.spec
    }

    /// Steps taken (Adam's bias-correction counter).
    pub fn steps(&self) -> i32 {
        self.t
    }

    /// Sets the steps taken (a restored checkpoint's).
    pub fn set_steps(&mut self, t: i32) {
        self.t = t;
    }

    /// The state (`m`, `v`) of the parameters at `range`; empty slices for SGD.
    pub fn state(&self, range: std::ops::Range<usize>) -> (&[f32], &[f32]) {
        if self.m.is_empty() {
            (&[], &[])
        } else {
            (&self.m[range.clone()], &self.v[range])
        }
    }

    /// Overwrites the state of the parameters at `offset..`; ignored for SGD (no state).
    pub fn set_state(&mut self, offset: usize, m: &[f32], v: &[f32]) {
        if !self.m.is_empty() {
            self.m[offset..offset + m.len()].copy_from_slice(m);
            self.v[offset..offset + v.len()].copy_from_slice(v);
        }
    }

    /// Whether the optimizer keeps per-parameter state (Adam) or none (SGD).
    pub fn has_state(&self) -> bool {
        !self.m.is_empty()
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> u64 {
        4 * (self.m.len() + self.v.len()) as u64
    }
}

/// One optimizer update of `params` with `grads` at step `t` (counted from 1), given the state
/// slices of the same range (`m` and `v`; empty for SGD). Offload tiers call this on state they
/// keep outside a [`FlatOptimizer`].
///
/// # Panics
/// When the slices differ in length.
pub fn update_slices(
    spec: OptimizerSpec,
    t: i32,
    params: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: &[f32],
) {
    assert_eq!(params.len(), grads.len(), "parameter and gradient ranges differ");
    match spec {
        OptimizerSpec::Sgd { lr } => {
            for (p, g) in params.iter_mut().zip(grads) {
                *p -= lr * g;
            }
        }
        OptimizerSpec::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => {
            assert!(
                m.len() == params.len() && v.len() == params.len(),
                "Adam state and parameter ranges differ"
            );
            let c1 = 1.0 - beta1.powi(t);
            let c2 = 1.0 - beta2.powi(t);
            let step = lr / c1;
            let c2_sqrt = c2.sqrt();
            for (((p, g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *p -= step * *m / (v.sqrt() / c2_sqrt + eps);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adam_first_step_moves_each_parameter_by_lr() {
        let mut opt = FlatOptimizer::new(OptimizerSpec::adam(0.1), 3);
        let mut p = vec![1.0, 1.0, 1.0];
        opt.begin_step();
        opt.update(0, &mut p, &[0.5, -2.0, 0.0]);
        assert!(
            (p[0] - 0.9).abs() < 1e-5 && (p[1] - 1.1).abs() < 1e-5 && p[2] == 1.0,
            "{p:?}"
        );
        assert_eq!(opt.state_bytes(), 24);
    }

    #[test]
    fn updating_in_ranges_equals_updating_whole() {
        let grads: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
        let mut whole = FlatOptimizer::new(OptimizerSpec::adam(0.01), 10);
        let mut parts = whole.clone();
        let (mut a, mut b) = (vec![0.5f32; 10], vec![0.5f32; 10]);
        for _ in 0..3 {
            whole.begin_step();
            whole.update(0, &mut a, &grads);
            parts.begin_step();
            parts.update(6, &mut b[6..], &grads[6..]);
            parts.update(0, &mut b[..6], &grads[..6]);
        }
        assert_eq!(a, b);
    }
}
