//! Which model, with which weights, for the commands that run one whole (`eval`, `serve`): a
//! safetensors file (`--init`, as `transformers` or `export` wrote it, the model read from the
//! `config.json` beside it unless `--model` says) with a PEFT adapter on it (`--lora-init`), or a
//! training checkpoint (`--checkpoint`) — a LoRA run's included: its adapters from the checkpoint
//! on the frozen base it was trained on (the base file the checkpoint records, checked by its
//! SHA-256, or `--init`), with no export step.

use std::path::{Path, PathBuf};

use clap::Args;

use archipelago_actors::checkpoint::CheckpointReader;
use archipelago_actors::inference::{WholeModel, read_weights};
use archipelago_actors::kernels::int8::DEFAULT_OUTLIER_THRESHOLD;
use archipelago_actors::peft::read_config;
use archipelago_actors::zoo::int8_layers::Int8Bytes;
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::family::gpt2_from_config;

use crate::export::{checkpoint_weights, open_checkpoint};

/// Which model, with which weights (`eval`, `serve`).
#[derive(Debug, Clone, Args, serde::Serialize, serde::Deserialize)]
pub struct WeightArgs {
    /// The model (`gpt-tiny`, `gpt2:vocab=…`); without it, read from the `config.json` beside
    /// the `--init` file.
    #[arg(long)]
    pub model: Option<String>,
    /// Weights as a safetensors file (`transformers`' `model.safetensors`, or `export`'s); with
    /// the --checkpoint of a LoRA run, its frozen base (default: the file the checkpoint records).
    #[arg(long, required_unless_present = "checkpoint")]
    pub init: Option<PathBuf>,
    /// Weights from a checkpoint: a `step-N` directory or a run's --checkpoint-dir (its newest
    /// complete checkpoint); its model is the one it trained.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// LoRA adapters on the `--init` base: a PEFT directory (`adapter_config.json`,
    /// `adapter_model.safetensors`), as PEFT or `train --lora-out` wrote it.
    #[arg(long, requires = "init")]
    pub lora_init: Option<PathBuf>,
}

/// The model a `config.json` describes: a `transformers` GPT-2 config, or one `export` wrote
/// (its `archipelago_model`).
pub fn model_from_config(path: &Path) -> Result<ModelSpec, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the model's {}: {e}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    if let Some(spec) = config.get("archipelago_model").and_then(|v| v.as_str()) {
        return ModelSpec::parse(spec).map_err(|e| format!("{}: {e}", path.display()));
    }
    gpt2_from_config(&config).map_err(|e| format!("{}: {e} (or give --model)", path.display()))
}

impl WeightArgs {
    /// The model, its weights (the runtime's blocks) and where they came from, as the flags say.
    pub fn load(&self) -> Result<(ModelSpec, Vec<Vec<f32>>, String), String> {
        let args = self;
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
            if args.lora_init.is_some() {
                return Err("--lora-init puts a PEFT adapter on --init: drop it with --checkpoint".into());
            }
            if held.lora().is_some() {
                let base = lora_base(&reader, &checkpoint, args.init.as_deref())?;
                let (spec, values, _) = crate::export_merged::from_checkpoint(dir, &base)?;
                let source = format!("{} (adapters) on {} (base)", checkpoint.display(), base.display());
                return Ok((spec, values, source));
            }
            if args.init.is_some() {
                return Err(format!(
                    "--checkpoint {} holds the whole of `{held}`: drop --init (it gives the base of a LoRA run's checkpoint)",
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
}

/// The frozen base of a LoRA run's checkpoint: `init` when given, else the file the checkpoint
/// records; refused when the checkpoint records another file's SHA-256 (adapters on weights they
/// were not trained on).
fn lora_base(reader: &CheckpointReader, checkpoint: &Path, init: Option<&Path>) -> Result<PathBuf, String> {
    let recorded = reader.manifest().run.as_ref().and_then(|run| run.base.clone());
    let base = match (init, &recorded) {
        (Some(init), _) => init.to_path_buf(),
        (None, Some(recorded)) => PathBuf::from(&recorded.path),
        (None, None) => {
            return Err(format!(
                "--checkpoint {} holds LoRA adapters and records no base file: give --init BASE.safetensors (the run's --init)",
                checkpoint.display()
            ));
        }
    };
    if let Some(recorded) = recorded {
        let hash = sha256_of(&base)?;
        if hash != recorded.sha256 {
            return Err(format!(
                "--checkpoint {}'s adapters were trained on {} (SHA-256 {}), and {} has SHA-256 {hash}: give --init {}",
                checkpoint.display(),
                recorded.path,
                recorded.sha256,
                base.display(),
                recorded.path
            ));
        }
    }
    Ok(base)
}

/// SHA-256 of a file's bytes, hex.
fn sha256_of(path: &Path) -> Result<String, String> {
    use sha2::Digest;
    let mut file = std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// How the weights are held: f32, bf16, or the linear layers in int8 (`eval`, `serve`).
#[derive(Debug, Clone, Args, serde::Serialize, serde::Deserialize)]
pub struct QuantizeArgs {
    /// `int8`: the attention and MLP projections in int8 with a scale per output column
    /// (LLM.int8; embeddings, LayerNorms and the head stay f32).
    #[arg(long, value_parser = ["int8"])]
    pub quantize: Option<String>,
    /// With --quantize int8: input features whose magnitude reaches this go through f32.
    #[arg(long, default_value_t = DEFAULT_OUTLIER_THRESHOLD)]
    pub outlier_threshold: f32,
    /// The weights' precision: `f32`, or `bf16` (half the bytes; activations in bf16, the logits
    /// and the cache in f32). Not with --quantize int8.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub precision: String,
}

impl QuantizeArgs {
    /// Whether the weights are held in bf16.
    pub fn bf16(&self) -> bool {
        self.precision == "bf16"
    }

    /// Refuses flags that do not go together, before any weight is read.
    pub fn check(&self) -> Result<(), String> {
        if self.bf16() && self.quantize.is_some() {
            return Err(
                "--precision bf16 and --quantize int8 do not go together (int8 runs its outliers in f32): \
                 choose one"
                    .into(),
            );
        }
        Ok(())
    }

    /// Quantizes or casts `model` as the flags say; int8's bytes before and after when it
    /// quantized.
    pub fn apply(&self, model: &mut WholeModel) -> Result<Option<Int8Bytes>, String> {
        self.check()?;
        if self.bf16() {
            model.to_bf16();
        }
        match self.quantize.as_deref() {
            Some(_) => model.quantize_int8(self.outlier_threshold).map(Some),
            None => Ok(None),
        }
    }

    /// One line on what int8 did to the linear weights.
    pub fn describe(bytes: &Int8Bytes) -> String {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        format!(
            "int8: {} linear layers, weights {:.2} MiB f32 -> {:.2} MiB int8 + {:.3} MiB column scales ({:.2}x smaller)",
            bytes.layers,
            mib(bytes.f32_bytes),
            mib(bytes.int8_bytes),
            mib(bytes.scale_bytes),
            bytes.f32_bytes as f64 / (bytes.int8_bytes + bytes.scale_bytes).max(1) as f64
        )
    }
}
