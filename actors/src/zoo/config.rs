//! What a zoo model is, in the words a reader of its weights needs and cannot find in them: the
//! family and shape, the activation, the normalisation and its ε, positions, tying and biases —
//! written beside every export (`config.json`) and in the safetensors metadata, in the spirit of
//! Hugging Face's `config.json` (GPT-2's names where they apply).

use archipelago_dataflow::ModelSpec;
use serde_json::{Value, json};

/// The facts of `spec`'s architecture, with the spec itself under `archipelago_model`.
pub fn model_config(spec: &ModelSpec) -> Value {
    match *spec {
        ModelSpec::Mlp {
            input,
            hidden,
            layers,
            out,
        } => json!({
            "archipelago_model": spec.explicit(),
            "family": "mlp",
            "in_features": input,
            "hidden": hidden,
            "hidden_layers": layers,
            "classes": out,
            "activation": "relu",
            "bias": true,
        }),
        ModelSpec::Gpt {
            vocab,
            ctx,
            d,
            layers,
            heads,
        } => json!({
            "archipelago_model": spec.explicit(),
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
        }),
    }
}
