//! `archipelago eval`: the loss and perplexity of a model over a text file, on one CPU device —
//! a model's weights from a safetensors file (`--init`, as `transformers` or `export` wrote them)
//! or from a checkpoint (`--checkpoint`), the text as bytes or through `--tokenizer`. The model
//! is `--model`, or read from the `config.json` beside the `--init` file (`transformers`'
//! `GPT2Config`, or the one `export` writes); `--lora-init DIR` adds a PEFT adapter on it;
//! `--quantize int8` runs its projections in int8 (LLM.int8). Windows of `ctx` inputs start
//! every `ctx` tokens, so every token but the first is predicted once
//! ([`archipelago_actors::inference`]).

use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use archipelago_actors::inference::{Evaluation, WholeModel};
use archipelago_actors::text_tokens::text_stream;
use archipelago_actors::zoo::int8_layers::Int8Bytes;
use archipelago_dataflow::ModelSpec;

pub use crate::weight_args::{QuantizeArgs, WeightArgs, model_from_config};

/// Flags of `eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The model and its weights.
    #[command(flatten)]
    pub weights: WeightArgs,
    /// int8 weights.
    #[command(flatten)]
    pub quantize: QuantizeArgs,
    /// The text to score (UTF-8 with `--tokenizer`; bytes as tokens without).
    #[arg(long)]
    pub data: PathBuf,
    /// A Hugging Face `tokenizer.json` turning the text into token ids.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
}

/// Scores the text (see the module docs).
pub fn evaluate(args: &EvalArgs) -> Result<(ModelSpec, Evaluation, String, Option<Int8Bytes>), String> {
    args.quantize.check()?;
    let (spec, values, source) = args.weights.load()?;
    let (Some(ctx), Some(vocab)) = (spec.get("ctx"), spec.get("vocab")) else {
        return Err(format!("{spec} does not read tokens: eval scores token models"));
    };
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(|p| p.to_string_lossy().into_owned());
    let stream = text_stream(&args.data.to_string_lossy(), tokenizer.as_deref(), ctx, vocab)?;
    let mut model = WholeModel::load(&spec, &values)?;
    drop(values);
    let int8 = args.quantize.apply(&mut model)?;
    let source = match int8 {
        Some(bytes) => format!("{source}; {}", QuantizeArgs::describe(&bytes)),
        None => source,
    };
    Ok((spec, model.evaluate(stream.ids())?, source, int8))
}

/// Runs `archipelago eval`.
pub fn run(args: &EvalArgs) -> anyhow::Result<()> {
    let (spec, e, source, int8) = evaluate(args).map_err(anyhow::Error::msg)?;
    let tokens = match &args.tokenizer {
        Some(t) => format!("tokenized by {}", t.display()),
        None => "bytes as tokens".into(),
    };
    println!(
        "eval {spec} ({source}) on {} ({} tokens predicted, {tokens}): loss {:.6}, perplexity {:.4}",
        args.data.display(),
        e.predicted,
        e.loss,
        e.perplexity
    );
    if let Some(path) = &args.report {
        let report = json!({
            "model": spec.explicit(),
            "weights": source,
            "data": args.data.display().to_string(),
            "tokenizer": args.tokenizer.as_ref().map(|t| t.display().to_string()),
            "predicted_tokens": e.predicted,
            "loss": e.loss,
            "perplexity": e.perplexity,
            "precision": args.quantize.precision,
            "quantize": args.quantize.quantize,
            "outlier_threshold": args.quantize.quantize.as_ref().map(|_| args.quantize.outlier_threshold),
            "int8": int8.map(|b| json!({
                "layers": b.layers,
                "f32_bytes": b.f32_bytes,
                "int8_bytes": b.int8_bytes,
                "scale_bytes": b.scale_bytes,
            })),
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .map_err(|err| anyhow::anyhow!("cannot write --report {}: {err}", path.display()))?;
    }
    Ok(())
}
