//! The LoRA flags of `train` and `plan` (Hu et al., 2021; PEFT's names and defaults): adapters
//! of rank `--lora-rank` and scale `--lora-alpha`/r on the modules `--lora-targets` matches by
//! suffix, the rest of the model frozen; or the adapters of a PEFT directory (`--lora-init`);
//! `--lora-out DIR` writes the trained adapters as PEFT does.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Serialize;

use archipelago_actors::peft;
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::family::LoraSpec;

/// The LoRA flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct LoraArgs {
    /// Train LoRA adapters of this rank on the targets, every other parameter frozen (no
    /// gradient, no optimizer state, not all-reduced). Needs --init (the base), or
    /// --lora-random-base.
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// LoRA's α: the update B·A is scaled by α/r (default 8, PEFT's).
    #[arg(long, requires = "lora_rank")]
    pub lora_alpha: Option<f64>,
    /// Modules to adapt, comma-separated, matched by suffix as PEFT's target_modules: `c_proj`
    /// alone matches GPT-2's attention and MLP output projections (default: the family's PEFT
    /// default, `c_attn` for gpt2, `qkv` for gpt).
    #[arg(long, requires = "lora_rank", value_delimiter = ',')]
    pub lora_targets: Vec<String>,
    /// Start the adapters from a PEFT directory (adapter_config.json gives rank, α and targets).
    #[arg(long, conflicts_with_all = ["lora_rank", "lora_alpha", "lora_targets"])]
    pub lora_init: Option<PathBuf>,
    /// Allow LoRA on a seeded random base (no --init): adapters on weights nobody trained.
    #[arg(long)]
    pub lora_random_base: bool,
    /// Write the trained adapters to this directory as PEFT does (adapter_model.safetensors,
    /// adapter_config.json), read from the run's last checkpoint (in --checkpoint-dir, or in
    /// DIR-checkpoints beside DIR).
    #[arg(long)]
    pub lora_out: Option<PathBuf>,
}

impl LoraArgs {
    /// Whether the job trains adapters.
    pub fn any(&self) -> bool {
        self.lora_rank.is_some() || self.lora_init.is_some()
    }

    /// `spec` with the adapters the flags ask for (`init`: the base weights file).
    pub fn apply(&self, spec: ModelSpec, init: Option<&Path>) -> anyhow::Result<ModelSpec> {
        if !self.any() {
            if self.lora_out.is_some() || self.lora_random_base {
                anyhow::bail!("--lora-out and --lora-random-base go with --lora-rank R or --lora-init DIR");
            }
            return Ok(spec);
        }
        if init.is_none() && !self.lora_random_base {
            anyhow::bail!(
                "LoRA adapts a base model's weights and no --init gives them: add --init BASE.safetensors, \
                 or --lora-random-base to adapt the seeded random initialisation"
            );
        }
        let lora = match (&self.lora_init, self.lora_rank) {
            (Some(dir), _) => peft::read_config(dir).map_err(anyhow::Error::msg)?,
            (None, Some(rank)) => LoraSpec {
                rank,
                alpha: self.lora_alpha.unwrap_or(8.0),
                targets: if self.lora_targets.is_empty() {
                    (spec.family().lora_default_targets().iter())
                        .map(|t| t.to_string())
                        .collect()
                } else {
                    self.lora_targets.clone()
                },
            },
            (None, None) => unreachable!("any() holds"),
        };
        spec.with_lora(lora).map_err(anyhow::Error::msg)
    }
}

/// Where `train --lora-out DIR` checkpoints when no --checkpoint-dir is given: `DIR-checkpoints`
/// beside it (the adapters are read from the last checkpoint, so no parameter travels to this
/// process).
pub fn checkpoints_beside(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push("-checkpoints");
    dir.with_file_name(name)
}

/// Writes the adapters of checkpoint `checkpoint` (a `step-N` directory) to `dir` as PEFT does,
/// naming `base` as the base model.
pub fn write_adapters(dir: &Path, checkpoint: &Path, base: &str) -> Result<(), String> {
    let (reader, spec, _, _) = crate::export::open_checkpoint(checkpoint)?;
    peft::write(
        dir,
        &spec,
        &crate::export::checkpoint_adapters(&reader, &spec)?,
        base,
    )
}
