//! Model descriptions: the zoo's specs (`mlp-8x1024`, `gpt-tiny`, parametric `mlp:`/`gpt:`) and
//! the pure per-block facts the compiler plans with (parameter counts, activation sizes).
//!
//! The definitions follow `shared/WORKLOADS.md` exactly. A model is an ordered list of blocks;
//! the compiler never sees weights, only these counts.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// A model of the built-in zoo.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ModelSpec {
    /// `in → layers × (Linear(·, hidden) + ReLU) → Linear(hidden, out)`, cross-entropy loss.
    Mlp {
        /// Input features.
        input: usize,
        /// Hidden width.
        hidden: usize,
        /// Number of Linear+ReLU blocks.
        layers: usize,
        /// Classes.
        out: usize,
    },
    /// A decoder-only, pre-LayerNorm GPT (character level by default).
    Gpt {
        /// Vocabulary size.
        vocab: usize,
        /// Context length.
        ctx: usize,
        /// Model width.
        d: usize,
        /// Transformer layers.
        layers: usize,
        /// Attention heads (must divide `d`).
        heads: usize,
    },
}

/// What a model eats: dense feature rows with class labels, or token sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InputKind {
    /// Rows of `features` floats, labels in `0..classes`.
    Dense {
        /// Features per row.
        features: usize,
        /// Number of classes.
        classes: usize,
    },
    /// Sequences of `ctx` tokens in `0..vocab`, next-token targets.
    Tokens {
        /// Vocabulary size.
        vocab: usize,
        /// Tokens per sequence.
        ctx: usize,
    },
}

impl InputKind {
    /// Tokens in one sample (1 for dense rows).
    pub fn tokens_per_sample(&self) -> usize {
        match self {
            InputKind::Dense { .. } => 1,
            InputKind::Tokens { ctx, .. } => *ctx,
        }
    }
}

/// The facts the compiler knows about one block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// A readable name, e.g. `linear_relu.3`.
    pub name: String,
    /// Number of f32 parameters.
    pub params: u64,
    /// f32 activations kept for backward, per sample.
    pub activation_floats_per_sample: u64,
    /// f32 values of the block's output per sample (what crosses to the next pipeline stage, and
    /// what activation checkpointing keeps of a stage's input).
    #[serde(default)]
    pub output_floats_per_sample: u64,
}

/// A model as the compiler sees it: a name, what it eats, and its blocks in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDesc {
    /// The spec string or a user-chosen name.
    pub name: String,
    /// What a sample is.
    pub input: InputKind,
    /// Blocks in forward order.
    pub blocks: Vec<BlockInfo>,
}

impl ModelDesc {
    /// Total parameter count.
    pub fn params(&self) -> u64 {
        self.blocks.iter().map(|b| b.params).sum()
    }
}

impl ModelSpec {
    /// The `mlp-8x1024` workload.
    pub fn mlp_8x1024() -> ModelSpec {
        ModelSpec::Mlp {
            input: 1024,
            hidden: 1024,
            layers: 8,
            out: 10,
        }
    }

    /// The `gpt-tiny` workload.
    pub fn gpt_tiny() -> ModelSpec {
        ModelSpec::Gpt {
            vocab: 256,
            ctx: 128,
            d: 256,
            layers: 4,
            heads: 4,
        }
    }

    /// Model FLOPs of one training step (forward + backward) per token for a gpt, per sample for
    /// an mlp — the numerator of model FLOP utilisation (Chowdhery et al., 2022, appendix B):
    /// 6 per weight of every matmul (embedding lookups are not matmuls) plus, for a gpt, the
    /// attention scores and mix, 12 · layers · d · ctx (full attention, as computed here).
    pub fn training_flops_per_token(&self) -> f64 {
        match *self {
            ModelSpec::Mlp {
                input,
                hidden,
                layers,
                out,
            } => {
                let weights = input * hidden + layers.saturating_sub(1) * hidden * hidden + hidden * out;
                6.0 * weights as f64
            }
            ModelSpec::Gpt {
                vocab,
                ctx,
                d,
                layers,
                ..
            } => {
                let weights = layers * 12 * d * d + d * vocab;
                6.0 * weights as f64 + 12.0 * (layers * d * ctx) as f64
            }
        }
    }

    /// Parses `mlp-8x1024`, `gpt-tiny`, `mlp:in=I,hidden=H,layers=L,out=O` or
    /// `gpt:vocab=V,ctx=C,d=D,layers=L,heads=H` (omitted keys take gpt-tiny's / mlp-8x1024's values).
    pub fn parse(spec: &str) -> Result<ModelSpec, PlanError> {
        let bad = |why: &str| PlanError::BadModelSpec {
            spec: spec.to_string(),
            why: why.to_string(),
        };
        match spec {
            "mlp-8x1024" => return Ok(Self::mlp_8x1024()),
            "gpt-tiny" => return Ok(Self::gpt_tiny()),
            _ => {}
        }
        let (kind, args) = spec.split_once(':').ok_or_else(|| {
            bad("expected `mlp-8x1024`, `gpt-tiny`, `mlp:in=I,hidden=H,layers=L,out=O` or `gpt:vocab=V,ctx=C,d=D,layers=L,heads=H`")
        })?;
        let mut kv = BTreeMap::new();
        for pair in args.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| bad("each option is key=value"))?;
            let v: usize = v
                .trim()
                .parse()
                .map_err(|_| bad(&format!("`{k}` needs a whole number")))?;
            if v == 0 {
                return Err(bad(&format!("`{k}` must be at least 1")));
            }
            kv.insert(k.trim().to_string(), v);
        }
        let mut take = |key: &str, default: usize| kv.remove(key).unwrap_or(default);
        let model = match kind {
            "mlp" => ModelSpec::Mlp {
                input: take("in", 1024),
                hidden: take("hidden", 1024),
                layers: take("layers", 8),
                out: take("out", 10),
            },
            "gpt" => ModelSpec::Gpt {
                vocab: take("vocab", 256),
                ctx: take("ctx", 128),
                d: take("d", 256),
                layers: take("layers", 4),
                heads: take("heads", 4),
            },
            _ => return Err(bad("the kind must be `mlp` or `gpt`")),
        };
        if let Some(k) = kv.keys().next() {
            return Err(bad(&format!("unknown option `{k}`")));
        }
        if let ModelSpec::Gpt { d, heads, .. } = model
            && !d.is_multiple_of(heads)
        {
            return Err(bad(&format!("heads={heads} must divide d={d}")));
        }
        Ok(model)
    }

    /// The compiler's view of this model.
    pub fn desc(&self) -> ModelDesc {
        match *self {
            ModelSpec::Mlp {
                input,
                hidden,
                layers,
                out,
            } => {
                let mut blocks = Vec::with_capacity(layers + 1);
                let mut width = input;
                for i in 0..layers {
                    blocks.push(BlockInfo {
                        name: format!("linear_relu.{i}"),
                        params: (width * hidden + hidden) as u64,
                        activation_floats_per_sample: (width + 2 * hidden) as u64,
                        output_floats_per_sample: hidden as u64,
                    });
                    width = hidden;
                }
                blocks.push(BlockInfo {
                    name: "output".into(),
                    params: (width * out + out) as u64,
                    activation_floats_per_sample: (width + 3 * out) as u64,
                    output_floats_per_sample: out as u64,
                });
                ModelDesc {
                    name: self.to_string(),
                    input: InputKind::Dense {
                        features: input,
                        classes: out,
                    },
                    blocks,
                }
            }
            ModelSpec::Gpt {
                vocab,
                ctx,
                d,
                layers,
                heads,
            } => {
                let per_layer =
                    2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d);
                let layer_acts = ctx * (17 * d + 3 * heads * ctx);
                let mut blocks = vec![BlockInfo {
                    name: "embedding".into(),
                    params: (vocab * d + ctx * d) as u64,
                    activation_floats_per_sample: (ctx * d) as u64,
                    output_floats_per_sample: (ctx * d) as u64,
                }];
                for i in 0..layers {
                    blocks.push(BlockInfo {
                        name: format!("transformer.{i}"),
                        params: per_layer as u64,
                        activation_floats_per_sample: layer_acts as u64,
                        output_floats_per_sample: (ctx * d) as u64,
                    });
                }
                blocks.push(BlockInfo {
                    name: "head".into(),
                    params: (2 * d + d * vocab) as u64,
                    activation_floats_per_sample: (ctx * (2 * d + 3 * vocab)) as u64,
                    output_floats_per_sample: (ctx * vocab) as u64,
                });
                ModelDesc {
                    name: self.to_string(),
                    input: InputKind::Tokens { vocab, ctx },
                    blocks,
                }
            }
        }
    }
}

impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::mlp_8x1024() {
            return write!(f, "mlp-8x1024");
        }
        if *self == Self::gpt_tiny() {
            return write!(f, "gpt-tiny");
        }
        match self {
            ModelSpec::Mlp {
                input,
                hidden,
                layers,
                out,
            } => {
                write!(f, "mlp:in={input},hidden={hidden},layers={layers},out={out}")
            }
            ModelSpec::Gpt {
                vocab,
                ctx,
                d,
                layers,
                heads,
            } => {
                write!(
                    f,
                    "gpt:vocab={vocab},ctx={ctx},d={d},layers={layers},heads={heads}"
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn training_flops_count_six_per_matmul_weight_plus_attention() {
        // gpt-tiny: 6 · (4 · 12 · 256² + 256 · 256) + 12 · 4 · 256 · 128.
        assert_eq!(ModelSpec::gpt_tiny().training_flops_per_token(), 20_840_448.0);
        // mlp-8x1024: 6 · (8 · 1024² + 1024 · 10) per sample.
        assert_eq!(
            ModelSpec::mlp_8x1024().training_flops_per_token(),
            6.0 * 8_398_848.0
        );
    }

    use super::*;

    #[test]
    fn workload_parameter_counts_match_workloads_md() {
        assert_eq!(ModelSpec::parse("mlp-8x1024").unwrap().desc().params(), 8_407_050);
        assert_eq!(ModelSpec::parse("gpt-tiny").unwrap().desc().params(), 3_323_392);
    }

    #[test]
    fn parses_parametric_specs_and_round_trips() {
        let m = ModelSpec::parse("mlp:in=16,hidden=32,layers=3,out=4").unwrap();
        assert_eq!(m.desc().blocks.len(), 4);
        assert_eq!(ModelSpec::parse(&m.to_string()).unwrap(), m);
        let g = ModelSpec::parse("gpt:vocab=64,ctx=16,d=32,layers=2,heads=2").unwrap();
        assert_eq!(g.desc().blocks.len(), 4);
        assert_eq!(ModelSpec::parse(&g.to_string()).unwrap(), g);
    }

    #[test]
    fn refuses_bad_specs_with_reasons() {
        for bad in [
            "mlp",
            "cnn:x=1",
            "mlp:in=0",
            "mlp:width=3",
            "gpt:d=30,heads=4",
            "mlp:in=a",
        ] {
            let err = ModelSpec::parse(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{err}");
        }
    }
}
