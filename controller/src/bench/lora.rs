//! LoRA against full fine-tuning of the same model, in one window (issue 40): a GPT-2 of
//! gpt-tiny's size (`gpt2:vocab=256,ctx=128,d=256,layers=4,heads=4`, its head tied) at dp=2,
//! full fine-tuning against adapters of rank 8 on `c_attn` (PEFT's default) and on every
//! projection, alternated A B A B: steps/s, the backward's seconds per step, model-state and
//! optimizer bytes per actor (measured and planned), and gradient bytes on the fabric per step.

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
    // Each instruction's median over the timed steps, summed: the backward's seconds per step.
    let seconds = |prefix: &str| -> f64 {
        (actor.instructions.iter())
            .filter(|i| i.instruction.starts_with(prefix))
            .map(|i| i.median_s)
            .sum()
    };
    Ok(json!({
        "name": name,
        "model": spec.to_string(),
        "params": report.params,
        "trainable_params": report.trainable_params,
        "median_step_s": step_s,
        "steps_per_s": 1.0 / step_s,
        "forward_s_actor0": seconds("Forward"),
        "backward_s_actor0": seconds("Backward"),
        "optimizer_s_actor0": seconds("OptimizerStep"),
        "model_state_bytes_actor0": actor.model_state_bytes,
        "estimated_model_state_bytes_actor0": actor.estimated_model_state_bytes,
        "optimizer_state_bytes_actor0": actor.optimizer_state_bytes,
        "estimated_optimizer_state_bytes_actor0": actor.estimated_optimizer_state_bytes,
        "gradient_fabric_bytes_per_step_actor0": actor.fabric_bytes_per_step.of_kind(FabricKind::Gradients),
        "final_loss": report.final_loss,
        "load_avg": load_avg(),
    }))
}

/// GPT-2 at gpt-tiny's size.
const MODEL: &str = "gpt2:vocab=256,ctx=128,d=256,layers=4,heads=4";

/// Full fine-tuning and two LoRA configurations of [`MODEL`], alternated over `rounds`.
pub fn lora_vs_full(warmup: u64, timed: u64, rounds: usize) -> anyhow::Result<Value> {
    let base = ModelSpec::parse(MODEL).map_err(anyhow::Error::msg)?;
    let lora = |targets: &[&str]| LoraSpec {
        rank: 8,
        alpha: 16.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
    };
    let variants = [
        ("full", base.clone()),
        (
            "lora r=8 c_attn",
            base.clone()
                .with_lora(lora(&["c_attn"]))
                .map_err(anyhow::Error::msg)?,
        ),
        (
            "lora r=8 c_attn,c_proj,c_fc",
            base.clone()
                .with_lora(lora(&["c_attn", "c_proj", "c_fc"]))
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
    // The median over the rounds of run `name`'s figure `key`.
    let median_of = |name: &str, key: &str| {
        let mut values: Vec<f64> = (runs.iter())
            .filter(|r| r["name"] == name)
            .filter_map(|r| r[key].as_f64())
            .collect();
        median(&mut values)
    };
    let step = |name: &str| median_of(name, "median_step_s");
    let backward = |name: &str| median_of(name, "backward_s_actor0");
    let (full, full_backward) = (step("full"), backward("full"));
    let ratios: Vec<Value> = (variants.iter().skip(1))
        .map(|(name, _)| {
            json!({
                "name": name,
                "step_s_over_full": step(name) / full,
                "backward_s_over_full": backward(name) / full_backward,
            })
        })
        .collect();
    Ok(json!({
        "config": { "model": MODEL, "dp": 2, "global_batch": 16, "warmup_steps": warmup, "timed_steps": timed, "rounds": rounds, "order": "full, lora c_attn, lora all, repeated" },
        "runs": runs,
        "step_time_ratios": ratios,
    }))
}
