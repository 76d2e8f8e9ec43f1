//! What a program says about its optimizer: the update rule ([`OptimizerSpec`]), the
//! learning-rate schedule ([`LrSchedule`]), gradient clipping and parameter groups
//! ([`ParamGroups`]). Pure data; the loops that apply them run on flat shards in
//! `archipelago_actors::optim`.
//!
//! The rules follow PyTorch's optimizers, with PyTorch's defaults: Adam (Kingma & Ba, ICLR 2015,
//! `torch.optim.Adam`, its `weight_decay` an L2 term added to the gradient), AdamW (Loshchilov &
//! Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, `torch.optim.AdamW`), SGD with
//! momentum, dampening, Nesterov momentum (Sutskever et al., ICML 2013) and weight decay
//! (`torch.optim.SGD`), and LAMB (You et al., "Large Batch Optimization for Deep Learning:
//! Training BERT in 76 minutes", ICLR 2020), whose per-parameter trust ratio needs norms over
//! the whole parameter wherever its shards live (a two-phase update, see the plan's
//! `TrustNorms`). Clipping follows `torch.nn.utils.clip_grad_norm_`: one norm over every
//! gradient of the model, across every actor.

mod lr_schedule;

use serde::{Deserialize, Serialize};

pub use lr_schedule::{LrDecay, LrSchedule};

/// The update rule, run on flat parameter shards.
///
/// Every variant's fields have PyTorch's defaults in the constructors ([`OptimizerSpec::adam`],
/// [`OptimizerSpec::adamw`], [`OptimizerSpec::sgd`], [`OptimizerSpec::lamb`]). Which parameters
/// take weight decay is the program's [`ParamGroups`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum OptimizerSpec {
    /// Adam (Kingma & Ba, 2015) with bias correction, as `torch.optim.Adam`:
    /// `g += wd·p` (L2, coupled with the moments); `p -= lr · m̂ / (√v̂ + ε)`.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root of the second moment.
        eps: f32,
        /// L2 penalty added to the gradient (PyTorch's default 0).
        #[serde(default)]
        weight_decay: f32,
    },
    /// AdamW (Loshchilov & Hutter, 2019), as `torch.optim.AdamW`: decoupled weight decay
    /// `p *= 1 − lr·wd`, then Adam's step `p -= lr · m̂ / (√v̂ + ε)`.
    AdamW {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root of the second moment.
        eps: f32,
        /// Decoupled weight decay (PyTorch's default 0.01).
        weight_decay: f32,
    },
    /// SGD as `torch.optim.SGD`: `d = g + wd·p`; with momentum `b = μ·b + (1 − dampening)·d`
    /// (`b = d` on the first step), then `d = d + μ·b` (Nesterov) or `d = b`; `p -= lr·d`.
    /// With momentum 0 and weight decay 0 it is exactly `p -= lr·g` and keeps no state.
    Sgd {
        /// Learning rate.
        lr: f32,
        /// Momentum factor μ (0: none).
        #[serde(default)]
        momentum: f32,
        /// Dampening of the momentum (PyTorch's default 0).
        #[serde(default)]
        dampening: f32,
        /// Nesterov momentum (needs momentum > 0 and dampening 0).
        #[serde(default)]
        nesterov: bool,
        /// L2 penalty added to the gradient.
        #[serde(default)]
        weight_decay: f32,
    },
    /// LAMB (You et al., 2020): Adam's bias-corrected direction plus decoupled weight decay,
    /// `u = m̂ / (√v̂ + ε) + wd·p`, scaled per parameter by the trust ratio `‖p‖ / ‖u‖` (1 when
    /// either norm is 0), both norms over the whole parameter: `p -= lr · ‖p‖/‖u‖ · u`.
    Lamb {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root of the second moment (1e-6, as the paper's BERT runs and timm).
        eps: f32,
        /// Decoupled weight decay inside the trust-ratio direction (0.01).
        weight_decay: f32,
    },
}

impl OptimizerSpec {
    /// Adam at `lr` with PyTorch's defaults otherwise (β = (0.9, 0.999), ε = 1e-8, no decay).
    pub fn adam(lr: f32) -> OptimizerSpec {
        OptimizerSpec::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }

    /// AdamW at `lr` with PyTorch's defaults otherwise (β = (0.9, 0.999), ε = 1e-8, wd = 0.01).
    pub fn adamw(lr: f32) -> OptimizerSpec {
        OptimizerSpec::AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// Plain SGD at `lr`: `p -= lr·g`, no state.
    pub fn sgd(lr: f32) -> OptimizerSpec {
        OptimizerSpec::Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    /// LAMB at `lr` with β = (0.9, 0.999), ε = 1e-6 and weight decay 0.01.
    pub fn lamb(lr: f32) -> OptimizerSpec {
        OptimizerSpec::Lamb {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
        }
    }

    /// The rule's name as the command line spells it (`adam`, `adamw`, `sgd`, `lamb`).
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerSpec::Adam { .. } => "adam",
            OptimizerSpec::AdamW { .. } => "adamw",
            OptimizerSpec::Sgd { .. } => "sgd",
            OptimizerSpec::Lamb { .. } => "lamb",
        }
    }

    /// The rule named `name` at `lr`, with its defaults.
    pub fn named(name: &str, lr: f32) -> Result<OptimizerSpec, String> {
        match name {
            "adam" => Ok(OptimizerSpec::adam(lr)),
            "adamw" => Ok(OptimizerSpec::adamw(lr)),
            "sgd" => Ok(OptimizerSpec::sgd(lr)),
            "lamb" => Ok(OptimizerSpec::lamb(lr)),
            other => Err(format!(
                "--optimizer `{other}`: use adam, adamw, sgd, lamb or (on the command line) onebit-adam"
            )),
        }
    }

    /// The base learning rate (the peak, under a schedule).
    pub fn lr(&self) -> f32 {
        match *self {
            OptimizerSpec::Adam { lr, .. }
            | OptimizerSpec::AdamW { lr, .. }
            | OptimizerSpec::Sgd { lr, .. }
            | OptimizerSpec::Lamb { lr, .. } => lr,
        }
    }

    /// The weight decay (L2 for Adam and SGD, decoupled for AdamW and LAMB).
    pub fn weight_decay(&self) -> f32 {
        match *self {
            OptimizerSpec::Adam { weight_decay, .. }
            | OptimizerSpec::AdamW { weight_decay, .. }
            | OptimizerSpec::Sgd { weight_decay, .. }
            | OptimizerSpec::Lamb { weight_decay, .. } => weight_decay,
        }
    }

    /// The same rule at learning rate `lr`.
    pub fn with_lr(mut self, new: f32) -> OptimizerSpec {
        match &mut self {
            OptimizerSpec::Adam { lr, .. }
            | OptimizerSpec::AdamW { lr, .. }
            | OptimizerSpec::Sgd { lr, .. }
            | OptimizerSpec::Lamb { lr, .. } => *lr = new,
        }
        self
    }

    /// The same rule with weight decay `wd`.
    pub fn with_weight_decay(mut self, wd: f32) -> OptimizerSpec {
        match &mut self {
            OptimizerSpec::Adam { weight_decay, .. }
            | OptimizerSpec::AdamW { weight_decay, .. }
            | OptimizerSpec::Sgd { weight_decay, .. }
            | OptimizerSpec::Lamb { weight_decay, .. } => *weight_decay = wd,
        }
        self
    }

    /// SGD with momentum `mu` (and Nesterov momentum when `nesterov`); other rules have no
    /// momentum factor to set.
    pub fn with_momentum(self, mu: f32, use_nesterov: bool) -> Result<OptimizerSpec, String> {
        match self {
            OptimizerSpec::Sgd {
                lr,
                dampening,
                weight_decay,
                ..
            } => Ok(OptimizerSpec::Sgd {
                lr,
                momentum: mu,
                dampening,
                nesterov: use_nesterov,
                weight_decay,
            }),
            other => Err(format!(
                "--momentum and --nesterov apply to --optimizer sgd; {} has its own moments (beta1)",
                other.name()
            )),
        }
    }

    /// Whether the update needs per-parameter norms over the whole parameter (LAMB's trust
    /// ratio): a first phase, a reduction over the parameter's shards, then the update.
    pub fn needs_param_norms(&self) -> bool {
        matches!(self, OptimizerSpec::Lamb { .. })
    }

    /// Refuses values PyTorch refuses (a negative rate, β outside [0, 1), Nesterov without
    /// momentum or with dampening), naming the flag to change.
    pub fn check(&self) -> Result<(), String> {
        let lr = self.lr();
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(format!(
                "--lr {lr}: the learning rate must be a finite number ≥ 0"
            ));
        }
        let wd = self.weight_decay();
        if !(wd.is_finite() && wd >= 0.0) {
            return Err(format!("--weight-decay {wd}: must be a finite number ≥ 0"));
        }
        match *self {
            OptimizerSpec::Adam {
                beta1, beta2, eps, ..
            }
            | OptimizerSpec::AdamW {
                beta1, beta2, eps, ..
            }
            | OptimizerSpec::Lamb {
                beta1, beta2, eps, ..
            } => {
                for (b, what) in [(beta1, "beta1"), (beta2, "beta2")] {
                    if !(0.0..1.0).contains(&b) {
                        return Err(format!("{} {what} {b}: must lie in [0, 1)", self.name()));
                    }
                }
                if !(eps > 0.0 && eps.is_finite()) {
                    return Err(format!("{} eps {eps}: must be > 0", self.name()));
                }
            }
            OptimizerSpec::Sgd {
                momentum,
                dampening,
                nesterov,
                ..
            } => {
                if !(momentum.is_finite() && momentum >= 0.0) {
                    return Err(format!("--momentum {momentum}: must be a finite number ≥ 0"));
                }
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return Err(format!(
                        "--nesterov needs --momentum > 0 and dampening 0 (got momentum {momentum}, \
                         dampening {dampening}), as torch.optim.SGD"
                    ));
                }
            }
        }
        Ok(())
    }

    /// f32 state values kept per parameter: Adam, AdamW and LAMB keep `m` and `v`; SGD keeps its
    /// momentum buffer when momentum is on, nothing otherwise.
    pub fn state_floats_per_param(&self) -> u64 {
        match self {
            OptimizerSpec::Adam { .. } | OptimizerSpec::AdamW { .. } | OptimizerSpec::Lamb { .. } => 2,
            OptimizerSpec::Sgd { momentum, .. } => u64::from(*momentum != 0.0),
        }
    }
}

impl OptimizerSpec {
    /// The names of the state tensors kept per parameter, in order, as PyTorch's optimizers
    /// name them in their `state_dict`: `exp_avg`, `exp_avg_sq` (Adam, AdamW, LAMB);
    /// `momentum_buffer` (SGD with momentum); none (plain SGD). Checkpoints store state by these.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self.state_floats_per_param() {
            0 => &[],
            1 => &["momentum_buffer"],
            _ => &["exp_avg", "exp_avg_sq"],
        }
    }
}

impl std::fmt::Display for OptimizerSpec {
    /// The rule and every hyper-parameter, e.g. `adamw lr 0.001 betas (0.9, 0.999) eps 1e-8
    /// weight decay 0.01` (the banner's and a refused resume's words).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            OptimizerSpec::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | OptimizerSpec::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | OptimizerSpec::Lamb {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => write!(
                f,
                "{} lr {lr} betas ({beta1}, {beta2}) eps {eps:e} weight decay {weight_decay}",
                self.name()
            ),
            OptimizerSpec::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => {
                write!(f, "sgd lr {lr}")?;
                if momentum != 0.0 {
                    write!(f, " momentum {momentum}")?;
                    if dampening != 0.0 {
                        write!(f, " dampening {dampening}")?;
                    }
                    if nesterov {
                        f.write_str(" nesterov")?;
                    }
                }
                write!(f, " weight decay {weight_decay}")
            }
        }
    }
}

/// Which parameters take weight decay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ParamGroups {
    /// Matrices and embeddings (parameters of two or more dimensions) take weight decay; biases
    /// and LayerNorm gains and shifts (vectors) do not, as every AdamW recipe (BERT, GPT-2,
    /// nanoGPT) groups them.
    #[default]
    NoDecayForVectors,
    /// Every parameter takes weight decay (a plain `torch.optim.AdamW(model.parameters())`).
    DecayAll,
}

impl ParamGroups {
    /// Whether a parameter of `shape` takes weight decay.
    pub fn decays(&self, shape: &[usize]) -> bool {
        match self {
            ParamGroups::NoDecayForVectors => shape.len() >= 2,
            ParamGroups::DecayAll => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_floats_match_each_rule() {
        assert_eq!(OptimizerSpec::adam(1e-3).state_floats_per_param(), 2);
        assert_eq!(OptimizerSpec::adamw(1e-3).state_floats_per_param(), 2);
        assert_eq!(OptimizerSpec::lamb(1e-3).state_floats_per_param(), 2);
        assert_eq!(OptimizerSpec::sgd(0.1).state_floats_per_param(), 0);
        let momentum = OptimizerSpec::sgd(0.1).with_momentum(0.9, true).unwrap();
        assert_eq!(momentum.state_floats_per_param(), 1);
        assert_eq!(momentum.state_names(), ["momentum_buffer"]);
        assert_eq!(OptimizerSpec::lamb(1e-3).state_names(), ["exp_avg", "exp_avg_sq"]);
        assert!(OptimizerSpec::sgd(0.1).state_names().is_empty());
        assert!(momentum.check().is_ok());
    }

    #[test]
    fn refuses_what_pytorch_refuses() {
        let nesterov = OptimizerSpec::sgd(0.1).with_momentum(0.0, true).unwrap();
        assert!(
            nesterov
                .check()
                .unwrap_err()
                .contains("--nesterov needs --momentum")
        );
        assert!(OptimizerSpec::adam(0.1).with_momentum(0.9, false).is_err());
        assert!(OptimizerSpec::adamw(-1.0).check().is_err());
        assert!(OptimizerSpec::named("adagrad", 0.1).is_err());
        assert_eq!(
            OptimizerSpec::named("lamb", 0.1).unwrap(),
            OptimizerSpec::lamb(0.1)
        );
    }

    #[test]
    fn old_json_of_sgd_and_adam_still_reads() {
        let sgd: OptimizerSpec = serde_json::from_str(r#"{"Sgd":{"lr":0.5}}"#).unwrap();
        assert_eq!(sgd, OptimizerSpec::sgd(0.5));
        let adam: OptimizerSpec =
            serde_json::from_str(r#"{"Adam":{"lr":0.1,"beta1":0.9,"beta2":0.999,"eps":1e-8}}"#).unwrap();
        assert_eq!(adam, OptimizerSpec::adam(0.1));
    }

    #[test]
    fn vectors_take_no_weight_decay_by_default() {
        let groups = ParamGroups::default();
        assert!(groups.decays(&[4, 8]));
        assert!(!groups.decays(&[8]));
        assert!(ParamGroups::DecayAll.decays(&[8]));
    }
}
