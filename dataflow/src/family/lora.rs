//! LoRA adapters on a model (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language
//! Models"): a frozen projection `W` (`d_in × d_out`) learns its update as `A·B` scaled by
//! `α/r`, `A` `d_in × r` from PEFT's default init (Kaiming uniform, `U(±1/√d_in)`), `B`
//! `r × d_out` from zeros, so training starts from the base model exactly.
//!
//! Targets match module paths by suffix as PEFT's `target_modules` do: a module matches `t` when
//! its path is `t` or ends with `.t` (`c_proj` alone matches GPT-2's attention and MLP output
//! projections). The adapters sit in the description right after their module's parameters
//! (`{module}.lora_A.weight` `[d_in, r]`, `{module}.lora_B.weight` `[r, d_out]` in burn's layout;
//! PEFT's files hold `[r, d_in]` and `[d_out, r]`, so both are transposed at the boundary), and
//! every other parameter of the model is frozen: no gradient, no optimizer state, no bucket.
//! Under tensor parallelism the product follows the base weight's split: `B` takes a
//! column-parallel weight's split, `A` a row-parallel one's.

use std::fmt;

use crate::param_desc::{ParamDesc, ParamInit, Split};
use crate::param_names::NamedParam;

/// Adapters: rank, α and target modules.
#[derive(Debug, Clone)]
pub struct LoraSpec {
    /// The rank `r`.
    pub rank: usize,
    /// `α`: the update is scaled by `α/r`.
    pub alpha: f64,
    /// Module names matched by suffix.
    pub targets: Vec<String>,
}

impl PartialEq for LoraSpec {
    fn eq(&self, other: &LoraSpec) -> bool {
        (self.rank, self.alpha.to_bits(), &self.targets)
            == (other.rank, other.alpha.to_bits(), &other.targets)
    }
}

impl Eq for LoraSpec {}

/// Whether parameter name `name` is an adapter's (`….lora_A.weight`, `….lora_B.weight`).
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

impl LoraSpec {
    /// The update's scale `α/r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether module path `module` is a target.
    pub fn targets_module(&self, module: &str) -> bool {
        (self.targets.iter()).any(|t| module == t || module.ends_with(&format!(".{t}")))
    }

    /// Parses the spec's suffix `r=8,alpha=16,targets=c_attn+c_proj`.
    pub fn parse(text: &str) -> Result<LoraSpec, String> {
        let (mut rank, mut alpha, mut targets) = (None, None, None);
        for pair in text.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or("each LoRA option is key=value")?;
            match k.trim() {
                "r" => {
                    rank = Some(
                        v.parse::<usize>()
                            .map_err(|_| format!("LoRA `r={v}` needs a whole number"))?,
                    )
                }
                "alpha" => {
                    alpha = Some(
                        v.parse::<f64>()
                            .map_err(|_| format!("LoRA `alpha={v}` needs a number"))?,
                    )
                }
                "targets" => targets = Some(v.split('+').map(str::to_string).collect::<Vec<_>>()),
                other => {
                    return Err(format!(
                        "unknown LoRA option `{other}`; LoRA takes r, alpha, targets"
                    ));
                }
            }
        }
        let rank = rank
            .filter(|&r| r > 0)
            .ok_or("LoRA needs a rank r of 1 or more")?;
        let alpha = alpha.unwrap_or(rank as f64);
        if !alpha.is_finite() || alpha <= 0.0 {
            return Err(format!("LoRA alpha={alpha} must be a positive number"));
        }
        let targets = targets
            .filter(|t| t.iter().all(|t| !t.is_empty()))
            .ok_or("LoRA needs targets")?;
        Ok(LoraSpec { rank, alpha, targets })
    }

    /// Checks the targets and the rank against a model's projections (`module → [d_in, d_out]`):
    /// every target matches a module (else the modules are listed), and the rank is at most
    /// `min(d_in, d_out)` of each matched one.
    pub fn check(&self, projections: &[(String, [usize; 2])]) -> Result<(), String> {
        for target in &self.targets {
            let probe = LoraSpec {
                targets: vec![target.clone()],
                ..self.clone()
            };
            if !projections.iter().any(|(m, _)| probe.targets_module(m)) {
                let mut leaves: Vec<&str> = (projections.iter())
                    .map(|(m, _)| m.rsplit('.').next().unwrap_or(m))
                    .collect();
                leaves.sort_unstable();
                leaves.dedup();
                return Err(format!(
                    "--lora-targets `{target}` matches no module of the model; its projections are {} \
                     (matched by suffix: `{}` matches every `….{}`)",
                    leaves.join(", "),
                    leaves[0],
                    leaves[0]
                ));
            }
        }
        for (module, [d_in, d_out]) in projections.iter().filter(|(m, _)| self.targets_module(m)) {
            if self.rank > (*d_in).min(*d_out) {
                return Err(format!(
                    "--lora-rank {} is above min(d_in, d_out) = {} of `{module}` ({d_in} × {d_out}): use a rank of \
                     at most {}",
                    self.rank,
                    d_in.min(d_out),
                    d_in.min(d_out)
                ));
            }
        }
        Ok(())
    }

    /// Each block's parameters at the file boundary with the adapters after their modules'.
    pub fn adapt_names(
        &self,
        blocks: Vec<Vec<NamedParam>>,
        projection: &dyn Fn(&str) -> bool,
    ) -> Vec<Vec<NamedParam>> {
        (blocks.into_iter())
            .map(|block| {
                let mut out = Vec::with_capacity(block.len() + 2);
                for (i, p) in block.iter().enumerate() {
                    out.push(p.clone());
                    let Some((module, w)) = self.module_done(&block, i, projection) else {
                        continue;
                    };
                    let [d_in, d_out] = [w.shape[0], w.shape[1]];
                    for (leaf, shape) in [
                        ("lora_A", vec![d_in, self.rank]),
                        ("lora_B", vec![self.rank, d_out]),
                    ] {
                        out.push(NamedParam {
                            name: format!("{module}.{leaf}.weight"),
                            shape,
                            transposed: true,
                            tied_to: None,
                        });
                    }
                }
                out
            })
            .collect()
    }

    /// Each block's descriptions with the adapters after their modules' and the rest frozen.
    pub fn adapt(
        &self,
        blocks: Vec<Vec<ParamDesc>>,
        projection: &dyn Fn(&str) -> bool,
    ) -> Vec<Vec<ParamDesc>> {
        (blocks.into_iter())
            .map(|block| {
                let mut out = Vec::with_capacity(block.len() + 2);
                for (i, p) in block.iter().enumerate() {
                    out.push(p.clone().frozen());
                    let Some((module, w)) = self.module_done(&block, i, projection) else {
                        continue;
                    };
                    let [d_in, d_out] = [w.shape[0], w.shape[1]];
                    let (a_split, b_split) = match w.split {
                        Split::Rows => (Split::Rows, Split::Replicated),
                        Split::Replicated => (Split::Replicated, Split::Replicated),
                        columns => (Split::Replicated, columns),
                    };
                    let a = ParamDesc::new(
                        format!("{module}.lora_A.weight"),
                        vec![d_in, self.rank],
                        ParamInit::UniformFanIn { fan_in: d_in },
                    );
                    let b = ParamDesc::new(
                        format!("{module}.lora_B.weight"),
                        vec![self.rank, d_out],
                        ParamInit::Zeros,
                    );
                    out.push(a.with_split(a_split));
                    out.push(b.with_split(b_split));
                }
                out
            })
            .collect()
    }

    /// Whether parameter `i` of `block` is the last of a targeted projection: its module path and
    /// the projection's weight (a 2-D `{module}.weight`).
    fn module_done<'a, P: Named>(
        &self,
        block: &'a [P],
        i: usize,
        projection: &dyn Fn(&str) -> bool,
    ) -> Option<(String, &'a P)> {
        let module = block[i].name().rsplit_once('.')?.0;
        let next_same = block
            .get(i + 1)
            .and_then(|q| q.name().rsplit_once('.'))
            .map(|(m, _)| m)
            == Some(module);
        if next_same || !self.targets_module(module) {
            return None;
        }
        let leaf = module.rsplit('.').next().unwrap_or(module);
        let weight =
            (block.iter()).find(|q| q.name() == format!("{module}.weight") && q.shape().len() == 2)?;
        projection(leaf).then(|| (module.to_string(), weight))
    }
}

/// A parameter with a name and a shape (a description or a file-boundary name).
trait Named {
    fn name(&self) -> &str;
    fn shape(&self) -> &[usize];
}

impl Named for ParamDesc {
    fn name(&self) -> &str {
        &self.name
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl Named for NamedParam {
    fn name(&self) -> &str {
        &self.name
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl fmt::Display for LoraSpec {
    /// `r=8,alpha=16,targets=c_attn+c_proj` (α without a fraction prints as a whole number).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "r={},alpha={},targets={}",
            self.rank,
            self.alpha,
            self.targets.join("+")
        )
    }
}
