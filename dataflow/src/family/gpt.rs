//! The `gpt` family: a decoder-only, pre-LayerNorm GPT (`shared/WORKLOADS.md`'s `gpt-tiny`),
//! exact (erf) GELU, an untied head without bias. Its PyTorch names are those of
//! `scripts/torch_reference.py`: `tok.weight`, `pos.weight`,
//! `layers.{i}.{ln1,qkv,proj,ln2,fc1,fc2}.{weight,bias}`, `ln_f`, `head.weight`; the fused `qkv`
//! is one `[3d, d]` matrix (query, key, value rows). Under tp, Megatron's splits: `qkv` by heads,
//! `fc1` and the head by columns, `proj` and `fc2` by rows, the token table by rows.

use serde_json::{Value, json};

use super::{ModelFamily, dims};
use crate::model_spec::{BlockInfo, InputKind, ModelDesc};
use crate::param_desc::{ParamDesc, describe_zoo};
use crate::param_names::{NamedParam, layer_norm, linear, table};
use crate::tensor_parallel::TpHeld;

/// The `gpt` family.
pub(super) struct Gpt;

impl ModelFamily for Gpt {
    fn name(&self) -> &'static str {
        "gpt"
    }

    fn keys(&self) -> &'static [(&'static str, usize)] {
        &[
            ("vocab", 256),
            ("ctx", 128),
            ("d", 256),
            ("layers", 4),
            ("heads", 4),
        ]
    }

    fn presets(&self) -> &'static [(&'static str, &'static [usize])] {
        &[("gpt-tiny", &[256, 128, 256, 4, 4])]
    }

    fn check(&self, d: &[usize]) -> Result<(), String> {
        check_heads(d)
    }

    fn input(&self, d: &[usize]) -> InputKind {
        InputKind::Tokens {
            vocab: d[0],
            ctx: d[1],
        }
    }

    fn block_params(&self, dims_: &[usize]) -> Vec<Vec<NamedParam>> {
        let [vocab, ctx, d, layers, _] = dims(dims_);
        let mut blocks = vec![vec![table("tok.weight", vocab, d), table("pos.weight", ctx, d)]];
        for i in 0..layers {
            let p = format!("layers.{i}");
            let mut attention = layer_norm(&format!("{p}.ln1"), d);
            attention.extend(linear(&format!("{p}.qkv"), d, 3 * d, true));
            attention.extend(linear(&format!("{p}.proj"), d, d, true));
            blocks.push(attention);
            let mut mlp = layer_norm(&format!("{p}.ln2"), d);
            mlp.extend(linear(&format!("{p}.fc1"), d, 4 * d, true));
            mlp.extend(linear(&format!("{p}.fc2"), 4 * d, d, true));
            blocks.push(mlp);
        }
        let mut head = layer_norm("ln_f", d);
        head.extend(linear("head", d, vocab, false));
        blocks.push(head);
        blocks
    }

    fn describe(&self, d: &[usize]) -> Vec<Vec<ParamDesc>> {
        let columns = |component: &str| matches!(component, "qkv" | "fc1" | "head");
        describe_zoo(self.block_params(d), columns)
    }

    fn desc(&self, name: String, d: &[usize]) -> ModelDesc {
        transformer_desc(name, d, self.describe(d))
    }

    fn sequence_parallel(&self, name: String, d: &[usize]) -> Option<ModelDesc> {
        Some(crate::sequence_parallel::transformer_desc(
            name,
            d,
            self.describe(d),
        ))
    }

    fn tp_unit(&self, d: &[usize]) -> (&'static str, usize) {
        ("attention heads", d[4])
    }

    fn projections(&self) -> &'static [&'static str] {
        &["qkv", "proj", "fc1", "fc2"]
    }

    fn lora_default_targets(&self) -> &'static [&'static str] {
        &["qkv"]
    }

    fn training_flops_per_token(&self, d: &[usize]) -> f64 {
        transformer_flops(d)
    }

    fn config(&self, dims_: &[usize]) -> Value {
        let [vocab, ctx, d, layers, heads] = dims(dims_);
        json!({
            "family": "gpt",
            "vocab_size": vocab,
            "n_positions": ctx,
            "n_embd": d,
            "n_layer": layers,
            "n_head": heads,
            "n_inner": 4 * d,
            "activation_function": "gelu (exact, erf)",
            "layer_norm_epsilon": 1e-5,
            "normalization": "pre-LayerNorm, final LayerNorm before the head",
            "position_embeddings": "learned",
            "tie_word_embeddings": false,
            "head_bias": false,
            "dropout": 0.0,
        })
    }
}

/// `heads` (the fifth key) divides `d` (the third).
pub(super) fn check_heads(dims_: &[usize]) -> Result<(), String> {
    let [_, _, d, _, heads] = dims(dims_);
    if d.is_multiple_of(heads) {
        Ok(())
    } else {
        Err(format!("heads={heads} must divide d={d}"))
    }
}

/// Model FLOPs per token of a `vocab, ctx, d, layers, heads` transformer: 6 per matmul weight
/// (12·d² a layer and the head's d·vocab) plus the attention's 12 · layers · d · ctx.
pub(super) fn transformer_flops(dims_: &[usize]) -> f64 {
    let [vocab, ctx, d, layers, _] = dims(dims_);
    let weights = layers * 12 * d * d + d * vocab;
    6.0 * weights as f64 + 12.0 * (layers * d * ctx) as f64
}

/// The compiler's view of a `vocab, ctx, d, layers, heads` pre-LayerNorm transformer whose
/// blocks are the embedding, per layer an attention and an MLP half, then the head, with
/// `params` their descriptions.
pub(super) fn transformer_desc(name: String, dims_: &[usize], params: Vec<Vec<ParamDesc>>) -> ModelDesc {
    let [vocab, ctx, d, layers, heads] = dims(dims_);
    // Per layer ctx·(17d + 3·heads·ctx) kept floats: the attention half keeps its input, ln1's
    // output, q/k/v, the attention output, proj's output and the sum (7d) and the scores
    // (3·heads·ctx); the MLP half ln2's and fc2's outputs (d each) and fc1's and GELU's (4d
    // each): 10d.
    let attention_acts = ctx * (7 * d + 3 * heads * ctx);
    let mlp_acts = ctx * 10 * d;
    // What tp cuts of them (Korthikanti et al. 2022): q/k/v, the attention output and the
    // scores (4d + 3·heads·ctx); fc1's and GELU's outputs (8d). The rest, 5d a layer, every rank
    // keeps whole.
    let attention_sharded = ctx * (4 * d + 3 * heads * ctx);
    let mlp_sharded = ctx * 8 * d;
    let mut params = params.into_iter();
    // Under tp: the vocabulary-parallel embedding and every half-layer end in a partial sum
    // (row-parallel proj and fc2, the residual on rank 0), the head in the vocabulary's slice of
    // the logits.
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
        name,
        input: InputKind::Tokens { vocab, ctx },
        blocks,
    }
}
