//! LoRA against full fine-tuning of the same model, in one window (issue 40): gpt-tiny (its
//! size is the bench's GPT-2 stand-in until the tied head trains: the gpt family's head is
//! untied) at dp=2, full fine-tuning against adapters of rank 8 on `qkv` (PEFT's default) and on
//! every projection, alternated A B A B: steps/s, model-state and optimizer bytes per actor
//! (measured and planned), and gradient bytes on the fabric per step.

use serde_json::{Value, json};

use archipelago_dataflow::family::LoraSpec;
use archipelago_dataflow::{DeviceSpec, FabricKind, ModelSpec, ParallelPlan};

use crate::process_stats::load_avg;
use crate::report::median;

/// One run of `spec` at dp=2, batch 16: its figures.
fn run(name: &str, spec: &ModelSpec, warmup: u64, timed: u64) -> anyhow::Result<Value> {
    let plan = ParallelPlan {
        dp: 2,
        batch: 16,
        ..ParallelPlan::default()
    };
    let devices = DeviceSpec::cpus(2);
    let job = format!("bench-lora-{name}");
    let (report, step_s) =
        super::training::timed_model_on(&spec.to_string(), plan, devices, warmup, timed, job)?;
    let actor = &report.actors[0];
    Ok(json!({
        "name": name,
        "model": spec.to_string(),
        "params": report.params,
        "trainable_params": report.trainable_params,
        "median_step_s": step_s,
        "steps_per_s": 1.0 / step_s,
        "model_state_bytes_actor0": actor.model_state_bytes,
        "estimated_model_state_bytes_actor0": actor.estimated_model_state_bytes,
        "optimizer_state_bytes_actor0": actor.optimizer_state_bytes,
        "estimated_optimizer_state_bytes_actor0": actor.estimated_optimizer_state_bytes,
        "gradient_fabric_bytes_per_step_actor0": actor.fabric_bytes_per_step.of_kind(FabricKind::Gradients),
        "final_loss": report.final_loss,
        "load_avg": load_avg(),
    }))
}

/// Full fine-tuning and two LoRA configurations of gpt-tiny, alternated over `rounds`.
pub fn lora_vs_full(warmup: u64, timed: u64, rounds: usize) -> anyhow::Result<Value> {
    let base = ModelSpec::gpt_tiny();
    let lora = |targets: &[&str]| LoraSpec {
        rank: 8,
        alpha: 16.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
    };
    let variants = [
        ("full", base.clone()),
        (
            "lora r=8 qkv",
            base.clone()
                .with_lora(lora(&["qkv"]))
                .map_err(anyhow::Error::msg)?,
        ),
        (
            "lora r=8 qkv,proj,fc1,fc2",
            base.clone()
                .with_lora(lora(&["qkv", "proj", "fc1", "fc2"]))
                .map_err(anyhow::Error::msg)?,
        ),
    ];
    let mut runs = Vec::new();
    for round in 0..rounds {
        for (name, spec) in &variants {
            let mut figures = run(name, spec, warmup, timed)?;
            figures["round"] = json!(round);
            runs.push(figures);
        }
    }
    let step = |name: &str| {
        let mut times: Vec<f64> = (runs.iter())
            .filter(|r| r["name"] == name)
            .filter_map(|r| r["median_step_s"].as_f64())
            .collect();
        median(&mut times)
    };
    let full = step("full");
    let ratios: Vec<Value> = (variants.iter().skip(1))
        .map(|(name, _)| json!({ "name": name, "step_s_over_full": step(name) / full }))
        .collect();
    Ok(json!({
        "config": { "model": "gpt-tiny", "dp": 2, "global_batch": 16, "warmup_steps": warmup, "timed_steps": timed, "rounds": rounds, "order": "full, lora qkv, lora all, repeated" },
        "runs": runs,
        "step_time_ratios": ratios,
    }))
}
