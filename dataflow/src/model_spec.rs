//! Model descriptions: the zoo's specs (`mlp-8x1024`, `gpt-tiny`, parametric `mlp:`/`gpt:`) and
//! the pure per-block facts the compiler plans with (each parameter's description, activation
//! sizes).
//!
//! The definitions follow `shared/WORKLOADS.md` exactly. A model is an ordered list of blocks;
//! the compiler never sees weights, only their descriptions ([`ParamDesc`]: name, shape, dtype,
//! trainable or frozen, split, initialisation).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::PlanError;
use crate::param_desc::{ParamDesc, describe};
use crate::tensor_parallel::{BlockTp, TpHeld};

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
    /// Number of parameter elements (the sum of [`BlockInfo::param_descs`]' lengths when they
    /// are given; [`ModelDesc::check`] holds them to it).
    pub params: u64,
    /// Each parameter, in the runtime's flattening order. Empty for a user model that gives only
    /// a count: the runtime then describes its parameters from the burn module (f32, trainable,
    /// replicated) and the compiler counts them as f32 and trainable.
    #[serde(default)]
    pub param_descs: Vec<ParamDesc>,
    /// f32 activations kept for backward, per sample.
    pub activation_floats_per_sample: u64,
    /// f32 values of the block's output per sample (what crosses to the next pipeline stage, and
    /// what activation checkpointing keeps of a stage's input).
    #[serde(default)]
    pub output_floats_per_sample: u64,
    /// How its input and output are held across a tensor-parallel group (`None`: the block has
    /// no tensor-parallel form, and `--tp` above 1 is refused).
    #[serde(default)]
    pub tp: Option<BlockTp>,
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

impl BlockInfo {
    /// A block described parameter by parameter (its count is their sum).
    pub fn described(
        name: impl Into<String>,
        param_descs: Vec<ParamDesc>,
        activation_floats_per_sample: u64,
        output_floats_per_sample: u64,
    ) -> BlockInfo {
        BlockInfo {
            name: name.into(),
            params: param_descs.iter().map(|p| p.len() as u64).sum(),
            param_descs,
            activation_floats_per_sample,
            output_floats_per_sample,
            tp: None,
        }
    }

    /// This block with its tensor-parallel form.
    pub fn with_tp(mut self, input: TpHeld, output: TpHeld) -> BlockInfo {
        self.tp = Some(BlockTp::new(input, output));
        self
    }

    /// Of its activations, the floats per sample tp cuts (see [`BlockTp::sharded_activations`]);
    /// nothing without a tensor-parallel form.
    pub fn with_sharded_activations(mut self, floats: u64) -> BlockInfo {
        if let Some(tp) = self.tp.as_mut() {
            tp.sharded_activations = floats;
        }
        self
    }

    /// Number of parameter elements (cheap: no walk over the descriptions).
    pub fn param_count(&self) -> u64 {
        self.params
    }

    /// Bytes of the parameters' values, from each one's dtype (f32 when not described).
    pub fn param_bytes(&self) -> u64 {
        if self.param_descs.is_empty() {
            return 4 * self.params;
        }
        self.param_descs.iter().map(ParamDesc::bytes).sum()
    }

    /// Bytes of the gradients: those of the trainable parameters (frozen ones have none).
    pub fn grad_bytes(&self) -> u64 {
        if self.param_descs.is_empty() {
            return 4 * self.params;
        }
        self.param_descs.iter().map(ParamDesc::grad_bytes).sum()
    }

    /// Elements of the trainable parameters: the length of the block's trained vector
    /// ([`crate::TrainedLayout`]), which the trainer reduces, shards and updates and the optimizer
    /// keeps state for.
    pub fn trained_params(&self) -> u64 {
        if self.param_descs.is_empty() {
            return self.params;
        }
        self.param_descs.iter().map(ParamDesc::optimized_len).sum()
    }

    /// Bytes of the frozen parameters' values (kept whole by each actor holding the block).
    pub fn frozen_bytes(&self) -> u64 {
        self.param_bytes() - self.grad_bytes()
    }

    /// Whether any parameter is frozen.
    pub fn has_frozen(&self) -> bool {
        self.param_descs.iter().any(|p| !p.trainable)
    }
}

impl ModelDesc {
    /// Total parameter count.
    pub fn params(&self) -> u64 {
        self.blocks.iter().map(|b| b.params).sum()
    }

    /// Checks that the trainer can hold every described parameter (f32 today; see
    /// `ParamDesc::not_trainable_yet`): what `compile` refuses, so that no actor refuses it.
    pub fn check_trainable(&self) -> Result<(), PlanError> {
        for (block, info) in self.blocks.iter().enumerate() {
            if let Some(why) = info.param_descs.iter().find_map(|p| p.not_trainable_yet()) {
                return Err(PlanError::NotTrainable {
                    block,
                    name: info.name.clone(),
                    why,
                });
            }
        }
        Ok(())
    }

    /// Checks the parameter descriptions: each described block's lengths add up to its count,
    /// no parameter is empty, and names are unique over the model (initialisation and
    /// checkpoints are keyed by them).
    pub fn check(&self) -> Result<(), PlanError> {
        let mut names = std::collections::HashSet::new();
        for (index, block) in self.blocks.iter().enumerate() {
            let bad = |why: String| PlanError::BadParams {
                block: index,
                name: block.name.clone(),
                why,
            };
            if block.param_descs.is_empty() {
                continue;
            }
            let sum: u64 = block.param_descs.iter().map(|p| p.len() as u64).sum();
            if sum != block.params {
                return Err(bad(format!(
                    "its parameters add up to {sum} elements but it counts {}",
                    block.params
                )));
            }
            for p in &block.param_descs {
                if p.is_empty() {
                    return Err(bad(format!(
                        "parameter `{}` has shape {:?}, with no element",
                        p.name, p.shape
                    )));
                }
                if !names.insert(p.name.as_str()) {
                    return Err(bad(format!(
                        "parameter name `{}` is used twice in the model",
                        p.name
                    )));
                }
            }
        }
        Ok(())
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
            let known: &[&str] = match model {
                ModelSpec::Mlp { .. } => &["in", "hidden", "layers", "out"],
                ModelSpec::Gpt { .. } => &["vocab", "ctx", "d", "layers", "heads"],
            };
            let guess = (known.iter())
                .map(|&key| (edit_distance(k, key), key))
                .filter(|&(distance, _)| distance <= 2)
                .min()
                .map_or(String::new(), |(_, key)| format!(" (did you mean `{key}`?)"));
            return Err(bad(&format!(
                "unknown option `{k}`{guess}; `{kind}` takes {}",
                known.join(", ")
            )));
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
                let mut params = describe(self).into_iter();
                let mut blocks = Vec::with_capacity(layers + 1);
                let mut width = input;
                // Megatron's MLP: even layers column-parallel (a replicated input, a sharded
                // output), odd ones row-parallel (a sharded input, a partial output).
                let tp = |k: usize| {
                    if k.is_multiple_of(2) {
                        (TpHeld::Replicated, TpHeld::Sharded)
                    } else {
                        (TpHeld::Sharded, TpHeld::Partial)
                    }
                };
                // What tp cuts of a layer's kept activations: a column-parallel layer's outputs,
                // a row-parallel layer's input.
                let sharded = |held_in: TpHeld, input: usize, outputs: usize| match held_in {
                    TpHeld::Replicated => outputs as u64,
                    _ => input as u64,
                };
                for i in 0..layers {
                    let (held_in, held_out) = tp(i);
                    blocks.push(
                        BlockInfo::described(
                            format!("linear_relu.{i}"),
                            params.next().unwrap_or_default(),
                            (width + 2 * hidden) as u64,
                            hidden as u64,
                        )
                        .with_tp(held_in, held_out)
                        .with_sharded_activations(sharded(
                            held_in,
                            width,
                            2 * hidden,
                        )),
                    );
                    width = hidden;
                }
                let (held_in, held_out) = tp(layers);
                blocks.push(
                    BlockInfo::described(
                        "output",
                        params.next().unwrap_or_default(),
                        (width + 3 * out) as u64,
                        out as u64,
                    )
                    .with_tp(held_in, held_out)
                    .with_sharded_activations(sharded(held_in, width, 3 * out)),
                );
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
                // Per layer ctx·(17d + 3·heads·ctx) kept floats: the attention half keeps its
                // input, ln1's output, q/k/v, the attention output, proj's output and the sum
                // (7d) and the scores (3·heads·ctx); the MLP half ln2's and fc2's outputs (d each)
                // and fc1's and GELU's (4d each): 10d.
                let attention_acts = ctx * (7 * d + 3 * heads * ctx);
                let mlp_acts = ctx * 10 * d;
                // What tp cuts of them (Korthikanti et al. 2022): q/k/v, the attention output
                // and the scores (4d + 3·heads·ctx); fc1's and GELU's outputs (8d). The rest,
                // 5d a layer, every rank keeps whole.
                let attention_sharded = ctx * (4 * d + 3 * heads * ctx);
                let mlp_sharded = ctx * 8 * d;
                let mut params = describe(self).into_iter();
                // Under tp: the vocabulary-parallel embedding and every half-layer end in a
                // partial sum (row-parallel proj and fc2, the residual on rank 0), the head in
                // the vocabulary's slice of the logits.
                let (replicated, partial) = (TpHeld::Replicated, TpHeld::Partial);
                let mut blocks = vec![
                    BlockInfo::described(
                        "embedding",
                        params.next().unwrap_or_default(),
                        (ctx * d) as u64,
                        (ctx * d) as u64,
                    )
                    .with_tp(replicated, partial),
                ];
                for i in 0..layers {
                    let halves = [
                        ("attn", attention_acts, attention_sharded),
                        ("mlp", mlp_acts, mlp_sharded),
                    ];
                    for (half, acts, sharded) in halves {
                        blocks.push(
                            BlockInfo::described(
                                format!("{half}.{i}"),
                                params.next().unwrap_or_default(),
                                acts as u64,
                                (ctx * d) as u64,
                            )
                            .with_tp(replicated, partial)
                            .with_sharded_activations(sharded as u64),
                        );
                    }
                }
                blocks.push(
                    BlockInfo::described(
                        "head",
                        params.next().unwrap_or_default(),
                        (ctx * (2 * d + 3 * vocab)) as u64,
                        (ctx * vocab) as u64,
                    )
                    .with_tp(replicated, TpHeld::Sharded)
                    .with_sharded_activations((ctx * 3 * vocab) as u64),
                );
                ModelDesc {
                    name: self.to_string(),
                    input: InputKind::Tokens { vocab, ctx },
                    blocks,
                }
            }
        }
    }
}

impl ModelSpec {
    /// The spec spelled out (`gpt:vocab=…,ctx=…,d=…,layers=…,heads=…`), never a preset's name:
    /// what a reader outside this workspace can parse (an export's metadata).
    pub fn explicit(&self) -> String {
        match *self {
            ModelSpec::Mlp {
                input,
                hidden,
                layers,
                out,
            } => format!("mlp:in={input},hidden={hidden},layers={layers},out={out}"),
            ModelSpec::Gpt {
                vocab,
                ctx,
                d,
                layers,
                heads,
            } => format!("gpt:vocab={vocab},ctx={ctx},d={d},layers={layers},heads={heads}"),
        }
    }
}

impl fmt::Display for ModelSpec {
    /// A preset's name where the spec is one, else [`ModelSpec::explicit`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::mlp_8x1024() {
            return write!(f, "mlp-8x1024");
        }
        if *self == Self::gpt_tiny() {
            return write!(f, "gpt-tiny");
        }
        f.write_str(&self.explicit())
    }
}

/// Levenshtein distance between `a` and `b` (for "did you mean").
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1).min(row[j] + 1).min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
#[path = "model_spec_tests.rs"]
mod tests;
