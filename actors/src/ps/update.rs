//! The server's update rule — ps-lite's *server handle* (Li et al., OSDI 2014, §3.4 "user-defined
//! functions on the server"): what a server does with the aggregated gradient of one key, and
//! what a key holds when first touched. A job picks one [`ServerUpdate`] type; the server actor
//! is generic over it, so a program registers `PsServer<ItsRule>` and the rule's parameters
//! travel to other hosts with the server's.
//!
//! Provided: [`Sgd`] (`w ← w − η·g`), [`ProximalL1`] (the proximal gradient step of L1-regularised
//! models, Li et al.'s sparse logistic regression: `w ← soft(w − η·g, η·λ)`), [`Adam`] (Kingma &
//! Ba 2015, per key, lazily: a key's step counter advances only when it gets a gradient), and
//! [`BuiltinUpdate`], which picks one of them at run time (the CLI's choice).

use serde::{Deserialize, Serialize};

use archipelago_dataflow::OptimizerSpec;

use super::ring::ring_position;

/// What a server does with one key's aggregated gradient.
pub trait ServerUpdate: Clone + Send + Sync + 'static {
    /// Floats of state a key of `width` values keeps (moments, counters).
    fn state_len(&self, width: usize) -> usize;

    /// The values of `key` when first touched (zeros unless overridden).
    fn initial(&self, key: u64, values: &mut [f32]) {
        let _ = key;
        values.fill(0.0);
    }

    /// Applies `grad` (the sum of a clock's pushes for this key) to `values` and `state`.
    fn update(&self, values: &mut [f32], state: &mut [f32], grad: &[f32]);

    /// The rule in words (reports, errors).
    fn describe(&self) -> String;
}

/// Plain SGD: `w ← w − η·g`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sgd {
    /// Learning rate η.
    pub lr: f32,
}

impl ServerUpdate for Sgd {
    fn state_len(&self, _width: usize) -> usize {
        0
    }

    fn update(&self, values: &mut [f32], _state: &mut [f32], grad: &[f32]) {
        for (w, g) in values.iter_mut().zip(grad) {
            *w -= self.lr * g;
        }
    }

    fn describe(&self) -> String {
        format!("sgd (lr {})", self.lr)
    }
}

/// The proximal gradient step for an L1 penalty `λ‖w‖₁`: a gradient step on the smooth loss,
/// then soft-thresholding by `η·λ`, which sets small weights to exactly 0 (a sparse model).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProximalL1 {
    /// Learning rate η.
    pub lr: f32,
    /// The L1 weight λ.
    pub l1: f32,
}

/// `sign(u)·max(|u| − t, 0)`.
pub fn soft_threshold(u: f32, t: f32) -> f32 {
    u.signum() * (u.abs() - t).max(0.0)
}

impl ServerUpdate for ProximalL1 {
    fn state_len(&self, _width: usize) -> usize {
        0
    }

    fn update(&self, values: &mut [f32], _state: &mut [f32], grad: &[f32]) {
        let t = self.lr * self.l1;
        for (w, g) in values.iter_mut().zip(grad) {
            *w = soft_threshold(*w - self.lr * g, t);
        }
    }

    fn describe(&self) -> String {
        format!("proximal L1 (lr {}, λ {})", self.lr, self.l1)
    }
}

/// Adam per key with bias correction, in the library's flat form (`p −= η/c₁ · m / (√v/√c₂ + ε)`);
/// the key's step counter is its last state float.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Adam {
    /// Learning rate η.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the root of the second moment.
    pub eps: f32,
}

impl ServerUpdate for Adam {
    fn state_len(&self, width: usize) -> usize {
        2 * width + 1
    }

    fn update(&self, values: &mut [f32], state: &mut [f32], grad: &[f32]) {
        let width = values.len();
        let (moments, t) = state.split_at_mut(2 * width);
        let (m, v) = moments.split_at_mut(width);
        t[0] += 1.0;
        let t = t[0] as i32;
        let c1 = 1.0 - self.beta1.powi(t);
        let c2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
        let step = self.lr / c1;
        for (((p, g), m), v) in values.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
            *m = self.beta1 * *m + (1.0 - self.beta1) * g;
            *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
            *p -= step * *m / (v.sqrt() / c2_sqrt + self.eps);
        }
    }

    fn describe(&self) -> String {
        format!(
            "adam (lr {}, β {} {}, ε {})",
            self.lr, self.beta1, self.beta2, self.eps
        )
    }
}

/// How a key's values start.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Initializer {
    /// All zeros (logistic-regression weights).
    Zeros,
    /// Uniform in `[−scale, scale]`, a pure function of `(seed, key, index)` (embedding rows).
    Uniform {
        /// Half the interval.
        scale: f32,
        /// The seed.
        seed: u64,
    },
}

impl Initializer {
    /// Fills `values` for `key`.
    pub fn fill(&self, key: u64, values: &mut [f32]) {
        match *self {
            Initializer::Zeros => values.fill(0.0),
            Initializer::Uniform { scale, seed } => {
                let base = ring_position(seed ^ ring_position(key));
                for (i, v) in values.iter_mut().enumerate() {
                    let bits = ring_position(base.wrapping_add(i as u64)) >> 40;
                    *v = scale * (2.0 * bits as f32 / (1u64 << 24) as f32 - 1.0);
                }
            }
        }
    }
}

/// One of the provided rules, chosen at run time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Rule {
    /// [`Sgd`].
    Sgd(Sgd),
    /// [`ProximalL1`].
    ProximalL1(ProximalL1),
    /// [`Adam`].
    Adam(Adam),
}

/// A provided rule and the keys' initialiser: the server update the CLI runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BuiltinUpdate {
    /// The rule.
    pub rule: Rule,
    /// The values of a key first touched.
    pub init: Initializer,
}

impl BuiltinUpdate {
    /// The rule of a training optimizer spec: plain SGD (no momentum, no weight decay) or Adam
    /// (no weight decay); `l1 > 0` with SGD gives the proximal L1 step. Others are refused, the
    /// fix named.
    pub fn from_spec(spec: OptimizerSpec, l1: f32, init: Initializer) -> Result<BuiltinUpdate, String> {
        let rule = match spec {
            OptimizerSpec::Sgd {
                lr,
                momentum,
                weight_decay,
                ..
            } if momentum == 0.0 && weight_decay == 0.0 => {
                if l1 > 0.0 {
                    Rule::ProximalL1(ProximalL1 { lr, l1 })
                } else {
                    Rule::Sgd(Sgd { lr })
                }
            }
            OptimizerSpec::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } if weight_decay == 0.0 && l1 == 0.0 => Rule::Adam(Adam {
                lr,
                beta1,
                beta2,
                eps,
            }),
            other => {
                return Err(format!(
                    "the parameter server's updates are plain sgd (with --l1 for proximal L1) and adam \
                     without weight decay or momentum; {other:?} is not one: use --optimizer sgd or adam"
                ));
            }
        };
        Ok(BuiltinUpdate { rule, init })
    }
}

impl ServerUpdate for BuiltinUpdate {
    fn state_len(&self, width: usize) -> usize {
        match &self.rule {
            Rule::Sgd(r) => r.state_len(width),
            Rule::ProximalL1(r) => r.state_len(width),
            Rule::Adam(r) => r.state_len(width),
        }
    }

    fn initial(&self, key: u64, values: &mut [f32]) {
        self.init.fill(key, values);
    }

    fn update(&self, values: &mut [f32], state: &mut [f32], grad: &[f32]) {
        match &self.rule {
            Rule::Sgd(r) => r.update(values, state, grad),
            Rule::ProximalL1(r) => r.update(values, state, grad),
            Rule::Adam(r) => r.update(values, state, grad),
        }
    }

    fn describe(&self) -> String {
        match &self.rule {
            Rule::Sgd(r) => r.describe(),
            Rule::ProximalL1(r) => r.describe(),
            Rule::Adam(r) => r.describe(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proximal_l1_zeroes_small_weights_and_shrinks_the_rest() {
        let rule = ProximalL1 { lr: 0.5, l1: 0.25 };
        let mut w = [0.05, 1.0, -1.0];
        rule.update(&mut w, &mut [], &[0.0, 0.0, 0.5]);
        // t = 0.125: 0.05 → 0; 1 → 0.875; −1 − 0.25 = −1.25 → −1.125.
        assert_eq!(w, [0.0, 0.875, -1.125]);
        assert_eq!(soft_threshold(-0.75, 0.25), -0.5);
    }

    #[test]
    fn adam_per_key_matches_the_closed_form_first_step() {
        let rule = Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let mut w = [1.0f32, 1.0];
        let mut state = vec![0.0; rule.state_len(2)];
        rule.update(&mut w, &mut state, &[0.5, -2.0]);
        // The first bias-corrected step moves each weight by lr·sign(g).
        assert!((w[0] - 0.9).abs() < 1e-6 && (w[1] - 1.1).abs() < 1e-6, "{w:?}");
        assert_eq!(state[4], 1.0);
    }

    #[test]
    fn specs_map_to_rules_or_are_refused_with_the_fix() {
        let sgd = BuiltinUpdate::from_spec(OptimizerSpec::sgd(0.1), 0.0, Initializer::Zeros).unwrap();
        assert_eq!(sgd.rule, Rule::Sgd(Sgd { lr: 0.1 }));
        let prox = BuiltinUpdate::from_spec(OptimizerSpec::sgd(0.1), 0.01, Initializer::Zeros).unwrap();
        assert!(matches!(prox.rule, Rule::ProximalL1(_)));
        let momentum = OptimizerSpec::sgd(0.1).with_momentum(0.9, false).unwrap();
        let e = BuiltinUpdate::from_spec(momentum, 0.0, Initializer::Zeros).unwrap_err();
        assert!(e.contains("--optimizer sgd or adam"), "{e}");
    }

    #[test]
    fn the_uniform_initialiser_is_a_pure_function_of_the_key() {
        let init = Initializer::Uniform { scale: 0.1, seed: 3 };
        let (mut a, mut b, mut c) = ([0.0f32; 4], [0.0f32; 4], [0.0f32; 4]);
        init.fill(9, &mut a);
        init.fill(9, &mut b);
        init.fill(10, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|v| v.abs() <= 0.1));
    }
}
