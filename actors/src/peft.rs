//! LoRA adapters as Hugging Face PEFT stores them: a directory with `adapter_config.json` and
//! `adapter_model.safetensors`, whose keys are `base_model.model.{module}.lora_A.weight`
//! (`[r, d_in]`) and `….lora_B.weight` (`[d_out, r]`): `--lora-init DIR` reads one (PEFT's or
//! ours), `--lora-out DIR` writes one that `peft.PeftModel.from_pretrained` loads.
//!
//! What this runtime does not implement is refused by field: `use_dora`, `use_rslora`,
//! `modules_to_save`, a `bias` other than "none", a non-empty `rank_pattern` or
//! `alpha_pattern`, another `peft_type`. Dropout (`lora_dropout`) is not applied in training.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value, json};

use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::family::{LoraSpec, lora::is_adapter};
use archipelago_dataflow::param_names::NamedParam;

use crate::tensor_file::TensorFile;

/// The adapter file's name in a PEFT directory.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// The adapter config's name in a PEFT directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// What PEFT puts before a module's path in its keys.
const PEFT_PREFIX: &str = "base_model.model.";

/// The LoRA spec an `adapter_config.json` describes (rank, α, targets), refusing by field what
/// is not implemented.
pub fn read_config(dir: &Path) -> Result<LoraSpec, String> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("--lora-init: cannot read {}: {e}", path.display()))?;
    let config: Value = serde_json::from_str(&text)
        .map_err(|e| format!("--lora-init: {} is not JSON: {e}", path.display()))?;
    let field = |name: &str| config.get(name).filter(|v| !v.is_null());
    let refuse = |name: &str, why: &str| {
        Err(format!(
            "--lora-init: {} has `{name}` {}: {why}",
            path.display(),
            field(name).map_or("absent".into(), Value::to_string)
        ))
    };
    if field("peft_type").and_then(Value::as_str) != Some("LORA") {
        return refuse("peft_type", "only \"LORA\" adapters are read");
    }
    for flag in ["use_dora", "use_rslora"] {
        if field(flag).and_then(Value::as_bool).unwrap_or(false) {
            return refuse(flag, "not implemented here; train a plain LoRA adapter");
        }
    }
    if field("modules_to_save").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
        return refuse(
            "modules_to_save",
            "fully trained modules beside the adapters are not implemented",
        );
    }
    if field("bias").and_then(Value::as_str).is_some_and(|b| b != "none") {
        return refuse("bias", "only \"none\" is implemented (biases stay frozen)");
    }
    for pattern in ["rank_pattern", "alpha_pattern"] {
        if field(pattern).is_some_and(|v| v.as_object().is_none_or(|o| !o.is_empty())) {
            return refuse(pattern, "per-module ranks and alphas are not implemented");
        }
    }
    let rank = field("r").and_then(Value::as_u64).filter(|&r| r > 0);
    let Some(rank) = rank else {
        return refuse("r", "expected a rank of 1 or more");
    };
    let alpha = field("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let targets: Vec<String> = match field("target_modules") {
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        Some(Value::String(one)) => vec![one.clone()],
        _ => return refuse("target_modules", "expected a list of module names"),
    };
    if targets.is_empty() {
        return refuse("target_modules", "expected at least one module name");
    }
    Ok(LoraSpec {
        rank: rank as usize,
        alpha,
        targets,
    })
}

/// A PEFT adapter file checked against a model with adapters: each adapter's values on demand.
#[derive(Debug)]
pub struct PeftAdapters {
    file: TensorFile,
}

impl PeftAdapters {
    /// Opens `dir`'s adapter file for `spec`, which must hold exactly `spec`'s adapters with
    /// their shapes (an adapter on a module the model lacks, or of another shape, is refused).
    pub fn open(dir: &Path, spec: &ModelSpec) -> Result<PeftAdapters, String> {
        let path = dir.join(ADAPTER_FILE);
        let file = TensorFile::open(&path).map_err(|e| format!("--lora-init: {e}"))?;
        let adapters: Vec<NamedParam> = (spec.block_params().into_iter().flatten())
            .filter(|p| is_adapter(&p.name))
            .collect();
        let expected: HashMap<String, &NamedParam> = adapters
            .iter()
            .map(|p| (format!("{PEFT_PREFIX}{}", p.name), p))
            .collect();
        let mut problems = Vec::new();
        let extra: Vec<&str> = file
            .names()
            .into_iter()
            .filter(|n| !expected.contains_key(*n))
            .collect();
        if !extra.is_empty() {
            problems.push(format!("adapters on no module of {spec}: {}", extra.join(", ")));
        }
        let mut missing = Vec::new();
        for (key, p) in &expected {
            match file.info(key) {
                None => missing.push(key.as_str()),
                Some((dtype, shape))
                    if dtype != safetensors::Dtype::F32 || shape != p.torch_shape().as_slice() =>
                {
                    problems.push(format!(
                        "`{key}` is {dtype:?} {shape:?}, expected F32 {:?}",
                        p.torch_shape()
                    ));
                }
                Some(_) => {}
            }
        }
        if !missing.is_empty() {
            missing.sort_unstable();
            problems.push(format!("missing {}", missing.join(", ")));
        }
        if problems.is_empty() {
            return Ok(PeftAdapters { file });
        }
        Err(format!(
            "--lora-init: {} does not fit {spec}: {}",
            path.display(),
            problems.join("; ")
        ))
    }

    /// Adapter `p`'s values in burn's layout (`A` `[d_in, r]`, `B` `[r, d_out]`).
    pub fn read(&self, p: &NamedParam) -> Result<Vec<f32>, String> {
        let values = self.file.read_f32(&format!("{PEFT_PREFIX}{}", p.name))?;
        let torch = p.torch_shape();
        Ok(crate::weights_file::transpose(&values, torch[0], torch[1]))
    }
}

/// Writes `spec`'s adapters to `dir` as PEFT does: `adapters` maps each adapter's name to its
/// values in burn's layout; `base` names the base weights (`base_model_name_or_path`).
pub fn write(
    dir: &Path,
    spec: &ModelSpec,
    adapters: &HashMap<String, Vec<f32>>,
    base: &str,
) -> Result<(), String> {
    let lora = spec
        .lora()
        .ok_or_else(|| format!("{spec} has no LoRA adapters to write"))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("--lora-out: cannot make {}: {e}", dir.display()))?;
    let mut tensors = Vec::new();
    for p in spec
        .block_params()
        .into_iter()
        .flatten()
        .filter(|p| is_adapter(&p.name))
    {
        let values = adapters
            .get(&p.name)
            .ok_or_else(|| format!("no values for adapter `{}`", p.name))?;
        if values.len() != p.len() {
            return Err(format!(
                "adapter `{}` has {} values, expected {}",
                p.name,
                values.len(),
                p.len()
            ));
        }
        let torch = crate::weights_file::transpose(values, p.shape[0], p.shape[1]);
        tensors.push((format!("{PEFT_PREFIX}{}", p.name), p.torch_shape(), torch));
    }
    crate::weights_file::write_f32_tensors(
        &dir.join(ADAPTER_FILE),
        tensors,
        HashMap::from([("format".into(), "pt".into())]),
    )?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": lora.targets,
        "fan_in_fan_out": spec.family().fan_in_fan_out(),
        "bias": "none",
        "base_model_name_or_path": base,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_dora": false,
        "use_rslora": false,
        "modules_to_save": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let text = serde_json::to_string_pretty(&config).map_err(|e| e.to_string())? + "\n";
    let path = dir.join(ADAPTER_CONFIG);
    std::fs::write(&path, text).map_err(|e| format!("--lora-out: cannot write {}: {e}", path.display()))
}

/// The base model of `spec` with its adapters merged in, `W + α/r · A·B` (burn's layout: `A`
/// `[d_in, r]`, `B` `[r, d_out]`, `W` `[d_in, d_out]`): every block's flat parameters of
/// `spec.base()` from `blocks`, `spec`'s (adapters included).
pub fn merge(spec: &ModelSpec, blocks: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, String> {
    let lora = spec
        .lora()
        .ok_or_else(|| format!("{spec} has no LoRA adapters to merge"))?;
    let scale = lora.scale() as f32;
    let named = spec.block_params();
    if named.len() != blocks.len() {
        return Err(format!(
            "{spec} has {} blocks, {} were given",
            named.len(),
            blocks.len()
        ));
    }
    let mut merged = Vec::with_capacity(blocks.len());
    for (params, flat) in named.iter().zip(blocks) {
        let mut at = 0;
        let mut values: HashMap<&str, &[f32]> = HashMap::new();
        for p in params {
            values.insert(&p.name, &flat[at..at + p.len()]);
            at += p.len();
        }
        let mut out = Vec::with_capacity(flat.len());
        for p in params.iter().filter(|p| !is_adapter(&p.name)) {
            let mut w = values[p.name.as_str()].to_vec();
            let module = p.name.strip_suffix(".weight").unwrap_or(&p.name);
            let (a, b) = (
                format!("{module}.lora_A.weight"),
                format!("{module}.lora_B.weight"),
            );
            if let (Some(a), Some(b)) = (values.get(a.as_str()), values.get(b.as_str())) {
                let (d_in, d_out) = (p.shape[0], p.shape[1]);
                let rank = a.len() / d_in;
                for i in 0..d_in {
                    for o in 0..d_out {
                        let update: f32 = (0..rank).map(|k| a[i * rank + k] * b[k * d_out + o]).sum();
                        w[i * d_out + o] += scale * update;
                    }
                }
            }
            out.extend(w);
        }
        merged.push(out);
    }
    Ok(merged)
}
