//! `archipelago eval`: the loss and perplexity of a model over a text file, on one CPU device —
//! a model's weights from a safetensors file (`--init`, as `transformers` or `export` wrote them)
//! or from a checkpoint (`--checkpoint`), the text as bytes or through `--tokenizer`. The model
//! is `--model`, or read from the `config.json` beside the `--init` file (`transformers`'
//! `GPT2Config`, or the one `export` writes); `--lora-init DIR` adds a PEFT adapter on it. Windows of `ctx` inputs start every `ctx` tokens,
//! so every token but the first is predicted once ([`archipelago_actors::inference`]).

use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::json;

use archipelago_actors::inference::{Evaluation, WholeModel, read_weights};
use archipelago_actors::peft::read_config;
use archipelago_actors::text_tokens::text_stream;
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::family::gpt2_from_config;

use crate::export::{checkpoint_weights, open_checkpoint};

/// Flags of `eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The model (`gpt-tiny`, `gpt2:vocab=…`); without it, read from the `config.json` beside
    /// the `--init` file.
    #[arg(long)]
    pub model: Option<String>,
    /// Weights as a safetensors file (`transformers`' `model.safetensors`, or `export`'s).
    #[arg(long, conflicts_with = "checkpoint", required_unless_present = "checkpoint")]
    pub init: Option<PathBuf>,
    /// Weights from a checkpoint: a `step-N` directory or a run's --checkpoint-dir (its newest
    /// complete checkpoint); its model is the one it trained.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// LoRA adapters on the `--init` base: a PEFT directory (`adapter_config.json`,
    /// `adapter_model.safetensors`), as PEFT or `train --lora-out` wrote it.
    #[arg(long, requires = "init")]
    pub lora_init: Option<PathBuf>,
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

/// The model a `config.json` describes: a `transformers` GPT-2 config, or one `export` wrote
/// (its `archipelago_model`).
pub(crate) fn model_from_config(path: &Path) -> Result<ModelSpec, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the model's {}: {e}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    if let Some(spec) = config.get("archipelago_model").and_then(|v| v.as_str()) {
        return ModelSpec::parse(spec).map_err(|e| format!("{}: {e}", path.display()));
    }
    gpt2_from_config(&config).map_err(|e| format!("{}: {e} (or give --model)", path.display()))
}

/// The model and its weights, as the flags say.
fn weights(args: &EvalArgs) -> Result<(ModelSpec, Vec<Vec<f32>>, String), String> {
    let given = |spec: &str| ModelSpec::parse(spec).map_err(|e| e.to_string());
    if let Some(dir) = &args.checkpoint {
        let (reader, held, checkpoint, _) = open_checkpoint(dir)?;
        if let Some(spec) = args
            .model
            .as_deref()
            .map(given)
            .transpose()?
            .filter(|s| *s != held)
        {
            return Err(format!(
                "--checkpoint {} holds `{held}`, --model says `{spec}`: drop --model",
                checkpoint.display()
            ));
        }
        if held.lora().is_some() {
            return Err(format!(
                "--checkpoint {} holds LoRA adapters, not its frozen base: give --init BASE.safetensors \
                 --lora-init ADAPTER_DIR (train --lora-out writes the adapters)",
                checkpoint.display()
            ));
        }
        let values = checkpoint_weights(&reader, &held)?;
        return Ok((held, values, checkpoint.display().to_string()));
    }
    let init = args
        .init
        .as_ref()
        .ok_or("give --init FILE.safetensors or --checkpoint DIR")?;
    let spec = match &args.model {
        Some(spec) => given(spec)?,
        None => model_from_config(&init.with_file_name("config.json"))?,
    };
    let spec = match &args.lora_init {
        Some(dir) => spec.with_lora(read_config(dir)?)?,
        None => spec,
    };
    let values = read_weights(&spec, init, args.lora_init.as_deref())?;
    Ok((spec, values, init.display().to_string()))
}

/// Scores the text (see the module docs).
pub fn evaluate(args: &EvalArgs) -> Result<(ModelSpec, Evaluation, String), String> {
    let (spec, values, source) = weights(args)?;
    let (Some(ctx), Some(vocab)) = (spec.get("ctx"), spec.get("vocab")) else {
        return Err(format!("{spec} does not read tokens: eval scores token models"));
    };
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(|p| p.to_string_lossy().into_owned());
    let stream = text_stream(&args.data.to_string_lossy(), tokenizer.as_deref(), ctx, vocab)?;
    let model = WholeModel::load(&spec, &values)?;
    Ok((spec, model.evaluate(stream.ids())?, source))
}

/// Runs `archipelago eval`.
pub fn run(args: &EvalArgs) -> anyhow::Result<()> {
    let (spec, e, source) = evaluate(args).map_err(anyhow::Error::msg)?;
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
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .map_err(|err| anyhow::anyhow!("cannot write --report {}: {err}", path.display()))?;
    }
    Ok(())
}
