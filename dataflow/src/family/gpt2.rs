//! The `gpt2` family: exactly `transformers.GPT2LMHeadModel`'s forward (Radford et al., 2019):
//! learned positions, pre-LayerNorm layers (ε 1e-5), the tanh GELU (`gelu_new`), attention scaled
//! by 1/√(d/heads), a final LayerNorm and an output head tied to the token embedding; no dropout
//! (training runs it deterministic, as `transformers` with every `*_pdrop` 0).
//!
//! Parameters are named by `GPT2LMHeadModel`'s `state_dict` keys (`transformer.wte.weight`,
//! `transformer.h.{i}.attn.c_attn.weight`, …), and GPT-2's `Conv1D` stores `[in, out]` as burn's
//! `Linear` does, so nothing is transposed at the file boundary. A file saved from `GPT2Model`
//! lacks the `transformer.` prefix ([`ModelFamily::optional_prefix`]); old files hold the causal
//! mask buffers `attn.bias`/`attn.masked_bias`, which are ignored. The head's weight
//! `lm_head.weight` mirrors `transformer.wte.weight` ([`ParamDesc::tied_to`]): read from it,
//! never written. Initialisation is `transformers`' `_init_weights`: `N(0, 0.02²)` for the
//! tables and `Conv1D` weights (`c_proj`'s `N(0, (0.02/√(2·layers))²)`), biases 0, LayerNorm 1/0.

use serde_json::{Value, json};

use super::gpt::{check_heads, transformer_desc, transformer_flops};
use super::{ModelFamily, dims};
use crate::model_spec::{InputKind, ModelDesc};
use crate::param_desc::{ParamDesc, ParamInit, Split};
use crate::param_names::NamedParam;

/// The `gpt2` family.
pub(super) struct Gpt2;

/// Suffixes of the causal-mask buffers older `transformers` saved with GPT-2's weights.
pub const GPT2_IGNORED_SUFFIXES: &[&str] = &[".attn.bias", ".attn.masked_bias"];

/// The token embedding, which the head mirrors.
const WTE: &str = "transformer.wte.weight";

/// A parameter in GPT-2's layout (never transposed: `Conv1D` is `[in, out]` like burn's).
fn named(name: String, shape: Vec<usize>) -> NamedParam {
    NamedParam {
        name,
        shape,
        transposed: false,
        tied_to: None,
    }
}

/// `{prefix}.weight [d_in, d_out]` and `{prefix}.bias [d_out]`.
fn conv1d(prefix: &str, d_in: usize, d_out: usize) -> Vec<NamedParam> {
    vec![
        named(format!("{prefix}.weight"), vec![d_in, d_out]),
        named(format!("{prefix}.bias"), vec![d_out]),
    ]
}

/// `{prefix}.weight [d]` and `{prefix}.bias [d]`.
fn layer_norm(prefix: &str, d: usize) -> Vec<NamedParam> {
    vec![
        named(format!("{prefix}.weight"), vec![d]),
        named(format!("{prefix}.bias"), vec![d]),
    ]
}

impl ModelFamily for Gpt2 {
    fn name(&self) -> &'static str {
        "gpt2"
    }

    fn keys(&self) -> &'static [(&'static str, usize)] {
        &[
            ("vocab", 50257),
            ("ctx", 1024),
            ("d", 768),
            ("layers", 12),
            ("heads", 12),
        ]
    }

    fn presets(&self) -> &'static [(&'static str, &'static [usize])] {
        &[("gpt2", &[50257, 1024, 768, 12, 12])]
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
        let mut blocks = vec![vec![
            named(WTE.into(), vec![vocab, d]),
            named("transformer.wpe.weight".into(), vec![ctx, d]),
        ]];
        for i in 0..layers {
            let p = format!("transformer.h.{i}");
            let mut attention = layer_norm(&format!("{p}.ln_1"), d);
            attention.extend(conv1d(&format!("{p}.attn.c_attn"), d, 3 * d));
            attention.extend(conv1d(&format!("{p}.attn.c_proj"), d, d));
            blocks.push(attention);
            let mut mlp = layer_norm(&format!("{p}.ln_2"), d);
            mlp.extend(conv1d(&format!("{p}.mlp.c_fc"), d, 4 * d));
            mlp.extend(conv1d(&format!("{p}.mlp.c_proj"), 4 * d, d));
            blocks.push(mlp);
        }
        let mut head = layer_norm("transformer.ln_f", d);
        head.push(NamedParam {
            tied_to: Some(WTE.into()),
            ..named("lm_head.weight".into(), vec![vocab, d])
        });
        blocks.push(head);
        blocks
    }

    fn describe(&self, d: &[usize]) -> Vec<Vec<ParamDesc>> {
        let layers = d[3];
        let residual_std = 0.02 / (2.0 * layers as f32).sqrt();
        (self.block_params(d).into_iter())
            .map(|block| {
                (block.into_iter())
                    .map(|p| describe_one(p, residual_std))
                    .collect()
            })
            .collect()
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
        &["c_attn", "c_proj", "c_fc"]
    }

    fn lora_default_targets(&self) -> &'static [&'static str] {
        &["c_attn"]
    }

    fn fan_in_fan_out(&self) -> bool {
        true
    }

    fn training_flops_per_token(&self, d: &[usize]) -> f64 {
        transformer_flops(d)
    }

    /// `transformers`' `GPT2Config`, so that an export directory loads with `from_pretrained`.
    fn config(&self, dims_: &[usize]) -> Value {
        let [vocab, ctx, d, layers, heads] = dims(dims_);
        json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "family": "gpt2",
            "vocab_size": vocab,
            "n_positions": ctx,
            "n_ctx": ctx,
            "n_embd": d,
            "n_layer": layers,
            "n_head": heads,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "initializer_range": 0.02,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "reorder_and_upcast_attn": false,
            "tie_word_embeddings": true,
            "torch_dtype": "float32",
        })
    }

    fn optional_prefix(&self) -> &'static str {
        "transformer."
    }

    fn ignored_suffixes(&self) -> &'static [&'static str] {
        GPT2_IGNORED_SUFFIXES
    }
}

/// One parameter's initialisation and Megatron split: `c_attn` by heads within q, k and v,
/// `c_fc` by columns, both `c_proj`s by rows (their biases replicated), the token table and its
/// mirror by rows (vocabulary-parallel).
fn describe_one(p: NamedParam, residual_std: f32) -> ParamDesc {
    let (layer, leaf) = p.name.rsplit_once('.').unwrap_or(("", p.name.as_str()));
    let component = layer.rsplit('.').next().unwrap_or(layer);
    let init = match (component, leaf) {
        (c, "weight") if c.starts_with("ln") => ParamInit::Ones,
        (_, "bias") => ParamInit::Zeros,
        ("c_proj", _) => ParamInit::Normal { std: residual_std },
        _ => ParamInit::Normal { std: 0.02 },
    };
    let split = match (component, leaf) {
        ("wte" | "lm_head", _) => Split::Rows,
        ("c_attn", _) => Split::HeadColumns { parts: 3 },
        ("c_fc", _) => Split::Columns,
        ("c_proj", "weight") => Split::Rows,
        _ => Split::Replicated,
    };
    let desc = ParamDesc::new(p.name, p.shape, init).with_split(split);
    match p.tied_to {
        Some(target) => desc.tied_to(target),
        None => desc,
    }
}

/// The gpt2 spec of `transformers`' `config.json` (`GPT2Config`): its shapes, refused (naming the
/// field) where the forward it describes is not the one built here. Dropout is accepted and not
/// applied: archipelago's GPT-2 runs without dropout.
pub fn spec_from_config(config: &Value) -> Result<super::ModelSpec, String> {
    let field = |name: &str| config.get(name).filter(|v| !v.is_null());
    let refuse = |name: &str, why: &str| {
        Err(format!(
            "config.json: `{name}` is {}: {why}",
            field(name).map_or("absent".into(), |v| v.to_string())
        ))
    };
    if field("model_type").and_then(Value::as_str) != Some("gpt2") {
        return refuse(
            "model_type",
            "expected \"gpt2\" (give --model for other families)",
        );
    }
    let size = |name: &str| field(name).and_then(Value::as_u64).map(|v| v as usize);
    let mut dims = Vec::new();
    for name in ["vocab_size", "n_positions", "n_embd", "n_layer", "n_head"] {
        match size(name) {
            Some(v) if v > 0 => dims.push(v),
            _ => return refuse(name, "expected a whole number above 0"),
        }
    }
    let is = |name: &str, want: Value, default: bool| field(name).map_or(default, |v| *v == want);
    if field("activation_function").is_some_and(|v| v != "gelu_new") {
        return refuse(
            "activation_function",
            "only GPT-2's \"gelu_new\" (the tanh GELU) is built",
        );
    }
    if let Some(inner) = size("n_inner").filter(|&n| n != 4 * dims[2]) {
        return refuse(
            "n_inner",
            &format!("only 4·n_embd ({}) or null is built, not {inner}", 4 * dims[2]),
        );
    }
    let epsilon = field("layer_norm_epsilon")
        .and_then(Value::as_f64)
        .unwrap_or(1e-5);
    if (epsilon - 1e-5).abs() > 1e-12 {
        return refuse("layer_norm_epsilon", "only 1e-5 is built");
    }
    for (name, want, default) in [
        ("scale_attn_weights", true, true),
        ("tie_word_embeddings", true, true),
        ("scale_attn_by_inverse_layer_idx", false, true),
        ("add_cross_attention", false, true),
    ] {
        if !is(name, Value::Bool(want), default) {
            return refuse(name, &format!("only {want} is built"));
        }
    }
    let spec = format!(
        "gpt2:vocab={},ctx={},d={},layers={},heads={}",
        dims[0], dims[1], dims[2], dims[3], dims[4]
    );
    super::ModelSpec::parse(&spec).map_err(|e| format!("config.json: {e}"))
}
