//! Mixed precision in the bench (issue 38): mlp-8x1024 and gpt-tiny at dp=2 in f32, bf16 and f16
//! (with its dynamic loss scale), run alternately (f32, bf16, f16, f32, bf16, f16) so that all see
//! the same machine: steps/s, each 16-bit step over the f32 step of its round, fabric bytes per
//! step, model state and the compute copy per actor, the final losses, and f16's skipped steps.
//! The 300-step loss comparisons are `precision_convergence.rs`'s.

use serde_json::{Value, json};

use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Precision, Program};

use crate::process_stats::load_avg;
use crate::report::median;
use crate::train::TrainOptions;
use crate::{Controller, TrainReport};

/// One timed run of `model` at dp=2 in `precision`: the report and its median step after warmup.
fn timed(
    model: &str,
    batch: usize,
    precision: Precision,
    (warmup, timed): (u64, u64),
) -> anyhow::Result<(TrainReport, f64)> {
    let plan = ParallelPlan {
        dp: 2,
        batch,
        ..ParallelPlan::default()
    };
    let program = Program::new(ModelSpec::parse(model)?)
        .with_plan(plan)
        .with_precision(precision);
    let options = TrainOptions {
        steps: warmup + timed,
        job: format!("bench-precision-{model}-{}", precision.compute),
        ..TrainOptions::default()
    };
    let report = Controller::local(DeviceSpec::cpus(2)).train(&program, &options)?;
    let mut times: Vec<f64> = (report.steps.iter().skip(warmup as usize))
        .map(|s| s.time_s)
        .collect();
    let step_s = median(&mut times);
    Ok((report, step_s))
}

/// What one run shows.
fn figures(report: &TrainReport, step_s: f64) -> Value {
    let fabric: u64 = report
        .actors
        .iter()
        .map(|a| a.fabric_bytes_per_step.total())
        .sum();
    let predicted: u64 = (report.actors.iter())
        .map(|a| a.predicted_fabric_bytes_per_step.total())
        .sum();
    json!({
        "median_step_s": step_s,
        "skipped_steps": report.steps.iter().filter(|s| s.skipped).count(),
        "steps_per_s": 1.0 / step_s,
        "fabric_bytes_per_step": fabric,
        "predicted_fabric_bytes_per_step": predicted,
        "model_state_bytes_per_actor": report.actors.iter().map(|a| a.model_state_bytes).collect::<Vec<_>>(),
        "compute_weight_bytes_per_actor": report.actors.iter().map(|a| a.compute_weight_bytes).collect::<Vec<_>>(),
        "final_loss": report.final_loss,
        "load_avg": load_avg(),
    })
}

/// mlp-8x1024 (batch 64) and gpt-tiny (16 sequences) at dp=2, f32 against bf16 and f16, two
/// rounds each.
pub fn mixed_precision(warmup: u64, timed_steps: u64) -> anyhow::Result<Value> {
    let parse = |name: &str| Precision::parse(name).map_err(anyhow::Error::msg);
    let (bf16, f16) = (parse("bf16")?, parse("f16")?);
    let mut models = Vec::new();
    for (model, batch) in [("mlp-8x1024", 64), ("gpt-tiny", 16)] {
        let mut rounds = Vec::new();
        for _ in 0..2 {
            let (wide, wide_s) = timed(model, batch, Precision::default(), (warmup, timed_steps))?;
            let (brain, brain_s) = timed(model, batch, bf16, (warmup, timed_steps))?;
            let (half, half_s) = timed(model, batch, f16, (warmup, timed_steps))?;
            rounds.push(json!({
                "f32": figures(&wide, wide_s),
                "bf16": figures(&brain, brain_s),
                "f16": figures(&half, half_s),
                "bf16_step_over_f32": brain_s / wide_s,
                "f16_step_over_f32": half_s / wide_s,
            }));
        }
        models.push(json!({
            "name": format!("{model} dp=2, f32 against bf16 and f16"),
            "config": { "model": model, "dp": 2, "global_batch": batch, "warmup_steps": warmup, "timed_steps": timed_steps, "cores_per_actor": 1, "order": "f32, bf16, f16, f32, bf16, f16", "f16_loss_scale": "dynamic from 65536" },
            "rounds": rounds,
        }));
    }
    Ok(json!({ "runs": models }))
}
