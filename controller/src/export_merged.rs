//! `archipelago export --merge-lora`: a LoRA model's adapters merged into its base, `W + α/r ·
//! A·B` for every adapted projection, written as the base model's weights (GPT-2's
//! `save_pretrained` layout for gpt2) with its `config.json` — a model that loads and runs with
//! no LoRA code. The adapters come from a LoRA run's checkpoint or a PEFT directory
//! (`--lora-init`), the base from `--init`.

use std::path::Path;

use archipelago_actors::inference::read_weights;
use archipelago_actors::peft::{self, read_config};
use archipelago_actors::weights_file::write_weights;
use archipelago_dataflow::ModelSpec;

use crate::eval::model_from_config;
use crate::export::{ExportArgs, checkpoint_adapters, open_checkpoint};

/// Writes the merged model; gives the spec (with its adapters) and where the adapters came from.
pub fn export_merged(args: &ExportArgs) -> Result<(ModelSpec, String), String> {
    let init = args
        .init
        .as_deref()
        .ok_or("--merge-lora needs --init BASE.safetensors (the base)")?;
    let (spec, values, source) = match (&args.checkpoint_dir, &args.lora_init) {
        (Some(dir), None) => from_checkpoint(dir, init)?,
        (None, Some(adapters)) => {
            let base = model_from_config(&init.with_file_name("config.json"))?;
            let spec = base.with_lora(read_config(adapters)?)?;
            let values = read_weights(&spec, init, Some(adapters))?;
            (spec, values, adapters.display().to_string())
        }
        _ => {
            return Err(
                "--merge-lora takes the adapters of a checkpoint or of --lora-init DIR, one of them".into(),
            );
        }
    };
    let merged = peft::merge(&spec, &values)?;
    write_weights(&args.out, &spec.base(), &merged)?;
    let config = args.out.with_file_name("config.json");
    let text = serde_json::to_string_pretty(&spec.base().config()).map_err(|e| e.to_string())?;
    std::fs::write(&config, text).map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    Ok((spec, source))
}

/// A LoRA run's checkpoint: its model, the base from `init` with the checkpoint's adapters.
pub(crate) fn from_checkpoint(dir: &Path, init: &Path) -> Result<(ModelSpec, Vec<Vec<f32>>, String), String> {
    let (reader, spec, checkpoint, _) = open_checkpoint(dir)?;
    if spec.lora().is_none() {
        return Err(format!(
            "--merge-lora: {} holds `{spec}`, which has no LoRA adapters: export it without --merge-lora",
            checkpoint.display()
        ));
    }
    let mut values = read_weights(&spec, init, None)?;
    let adapters = checkpoint_adapters(&reader, &spec)?;
    for (params, flat) in spec.block_params().iter().zip(&mut values) {
        let mut at = 0;
        for p in params {
            if let Some(v) = adapters.get(&p.name) {
                flat[at..at + p.len()].copy_from_slice(v);
            }
            at += p.len();
        }
    }
    Ok((spec, values, checkpoint.display().to_string()))
}
