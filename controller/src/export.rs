//! `archipelago export`: the full model of a sharded checkpoint, written as one safetensors file
//! with PyTorch's names and layouts (what `torch.load_state_dict`, Hugging Face and PEFT read).
//!
//! Whatever layout wrote the checkpoint (dp, pp, ZeRO shards, offload), every parameter is read
//! whole, by name, through [`CheckpointReader`] and written by [`write_weights`], which names and transposes each
//! parameter as [`archipelago_dataflow::param_names`] says. The file's metadata names the model
//! and its architecture, and `config.json` beside it holds the same facts (heads, activation,
//! LayerNorm ε, tying: what the weights cannot tell). Reading it back with `--init` starts a
//! run from exactly these weights (and refuses them for another model). Newer checkpoints passed
//! over are named.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::Args;

use archipelago_actors::checkpoint::{self, CheckpointReader, MANIFEST};
use archipelago_actors::weights_file::write_weights;
use archipelago_dataflow::family::lora::is_adapter;
use archipelago_dataflow::{ModelSpec, param_names};

/// Flags of `export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A checkpoint: one `step-N` directory, or a checkpoint directory (its newest complete
    /// checkpoint is taken). With --merge-lora, optional: --lora-init gives the adapters.
    #[arg(required_unless_present = "lora_init")]
    pub checkpoint_dir: Option<PathBuf>,
    /// The safetensors file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Merge LoRA adapters into their base (W + α/r · B·A) and write the base model's format
    /// (GPT-2's for gpt2): the adapters of the checkpoint (a LoRA run's) or of --lora-init, the
    /// base from --init.
    #[arg(long, requires = "init")]
    pub merge_lora: bool,
    /// With --merge-lora: the base weights the adapters were trained on.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// With --merge-lora and no checkpoint: a PEFT adapter directory.
    #[arg(long, requires = "merge_lora")]
    pub lora_init: Option<PathBuf>,
}

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The checkpoint read.
    pub checkpoint: PathBuf,
    /// Its model.
    pub model: ModelSpec,
    /// Its step.
    pub step: u64,
    /// Parameters written.
    pub params: u64,
    /// The `config.json` written beside the weights (the architecture's facts).
    pub config: PathBuf,
    /// Newer checkpoints passed over (incomplete or corrupt), each with why.
    pub skipped: Vec<String>,
}

/// The checkpoint in `dir`: `dir` itself when it holds a manifest, else its newest complete one,
/// with the newer ones passed over and why.
fn checkpoint_in(dir: &Path) -> Result<(PathBuf, Vec<String>), String> {
    if dir.join(MANIFEST).exists() {
        return Ok((dir.to_path_buf(), Vec::new()));
    }
    let (latest, skipped) = checkpoint::latest_complete(dir);
    let passed = skipped.clone();
    latest.map(|(step_dir, _)| (step_dir, passed)).ok_or_else(|| {
        format!(
            "no complete checkpoint in {} (give a `step-N` directory or the --checkpoint-dir of a run){}",
            dir.display(),
            if skipped.is_empty() {
                String::new()
            } else {
                format!("; {}", skipped.join("; "))
            }
        )
    })
}

/// Every block's flat parameters of `model` from a checkpoint, read whole by name (a mirror from
/// the parameter it mirrors).
pub fn checkpoint_weights(reader: &CheckpointReader, model: &ModelSpec) -> Result<Vec<Vec<f32>>, String> {
    // By name, not by block index: the same parameter may sit in another block of a checkpoint
    // written before gpt's layers became two blocks each.
    (param_names::block_params(model).iter())
        .map(|params| {
            let mut values = Vec::new();
            for p in params {
                let name = p.tied_to.as_deref().unwrap_or(&p.name);
                let (v, _) = reader.read_param(name, &p.shape, 0..p.len(), &[])?;
                values.extend(v);
            }
            Ok(values)
        })
        .collect()
}

/// The LoRA adapters of `model` a checkpoint holds (trained parameters, unlike the frozen base),
/// each by name, flat in burn's layout.
pub fn checkpoint_adapters(
    reader: &CheckpointReader,
    model: &ModelSpec,
) -> Result<HashMap<String, Vec<f32>>, String> {
    (model.block_params().into_iter().flatten())
        .filter(|p| is_adapter(&p.name))
        .map(|p| {
            Ok((
                p.name.clone(),
                reader.read_param(&p.name, &p.shape, 0..p.len(), &[])?.0,
            ))
        })
        .collect()
}

/// The model a checkpoint in `dir` holds and its step directory, with the newer ones passed over.
pub fn open_checkpoint(dir: &Path) -> Result<(CheckpointReader, ModelSpec, PathBuf, Vec<String>), String> {
    let (checkpoint, skipped) = checkpoint_in(dir)?;
    let reader = CheckpointReader::open(&checkpoint)?;
    let model = ModelSpec::parse(&reader.manifest().model).map_err(|e| {
        format!(
            "the checkpoint in {} is of `{}`, not a zoo model, so its parameters have no PyTorch names: {e}",
            checkpoint.display(),
            reader.manifest().model
        )
    })?;
    Ok((reader, model, checkpoint, skipped))
}

/// Writes the model of the checkpoint in `dir` to `out` (see the module docs).
pub fn export(dir: &Path, out: &Path) -> Result<Exported, String> {
    let (reader, model, checkpoint, skipped) = open_checkpoint(dir)?;
    if model.lora().is_some() {
        return Err(format!(
            "the checkpoint in {} is a LoRA run's (`{model}`): it holds the adapters, not the frozen \
             base they were trained on; write the merged model with `archipelago export {} \
             --merge-lora --init BASE.safetensors --out FILE.safetensors` (BASE: the run's --init)",
            checkpoint.display(),
            dir.display()
        ));
    }
    let manifest = reader.manifest();
    let desc = model.desc();
    let blocks = checkpoint_weights(&reader, &model)?;
    write_weights(out, &model, &blocks)?;
    let config = out.with_file_name("config.json");
    let text = serde_json::to_string_pretty(&model.config()).map_err(|e| e.to_string())?;
    std::fs::write(&config, text).map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    Ok(Exported {
        step: manifest.step,
        checkpoint,
        params: desc.distinct_params(),
        model,
        config,
        skipped,
    })
}

/// Runs `archipelago export`.
pub fn run(args: &ExportArgs) -> anyhow::Result<()> {
    if args.merge_lora {
        let (spec, source) = crate::export_merged::export_merged(args).map_err(anyhow::Error::msg)?;
        println!(
            "merged the adapters of {source} into {} and wrote {} to {} (config.json beside it)",
            args.init
                .as_ref()
                .map_or(String::new(), |p| p.display().to_string()),
            spec.base(),
            args.out.display()
        );
        return Ok(());
    }
    let Some(dir) = &args.checkpoint_dir else {
        anyhow::bail!("give a checkpoint directory (or --merge-lora with --init and --lora-init)");
    };
    let done = export(dir, &args.out).map_err(anyhow::Error::msg)?;
    for why in &done.skipped {
        eprintln!("passed over a newer checkpoint: {why}");
    }
    println!(
        "exported {} ({} parameters, step {}) from {} to {} (its architecture in {})",
        done.model,
        done.params,
        done.step,
        done.checkpoint.display(),
        args.out.display(),
        done.config.display()
    );
    Ok(())
}
