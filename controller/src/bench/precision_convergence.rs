//! Mixed precision's loss over a long run (issue 38): gpt-tiny for 300 steps (WORKLOADS.md's
//! data and batch) in f32, bf16 and f16 on one device, and in bf16 at dp=2 under ZeRO-3 and at
//! pp=2 × dp=2 (the list; f16 on those layouts is the tests' `loss_scaling.rs`), each run's mean loss of the last 20 steps against f32's on one
//! device (the same global batch: in f32 every layout trains to the same parameters). The
//! issue's bound is 2%; the figures are printed, not asserted (a benchmark, not a test).

use serde_json::{Value, json};

use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Precision, Program};

use crate::train::TrainOptions;
use crate::{Controller, TrainReport};

/// Steps whose mean loss is compared.
const LAST: usize = 20;

/// The layouts: name, dp, pp, ZeRO stage, micro-batches.
const LAYOUTS: [(&str, usize, usize, u8, usize); 3] = [
    ("one device", 1, 1, 0, 1),
    ("dp=2 ZeRO-3", 2, 1, 3, 1),
    ("pp=2 × dp=2", 2, 2, 0, 2),
];

/// gpt-tiny for `steps` steps in `precision` on a layout of [`LAYOUTS`].
fn run(
    precision: Precision,
    (dp, pp, zero, microbatches): (usize, usize, u8, usize),
    steps: u64,
) -> anyhow::Result<TrainReport> {
    let plan = ParallelPlan {
        dp,
        pp,
        zero,
        microbatches,
        batch: 16,
        ..ParallelPlan::default()
    };
    let program = Program::new(ModelSpec::parse("gpt-tiny")?)
        .with_plan(plan)
        .with_precision(precision);
    let options = TrainOptions {
        steps,
        job: format!("bench-convergence-{}-dp{dp}-pp{pp}-zero{zero}", precision.compute),
        ..TrainOptions::default()
    };
    Ok(Controller::local(DeviceSpec::cpus(dp * pp)).train(&program, &options)?)
}

/// The mean loss of the last [`LAST`] steps (of all, when fewer).
fn mean_last(report: &TrainReport) -> f64 {
    let tail = &report.steps[report.steps.len().saturating_sub(LAST)..];
    tail.iter().map(|s| s.loss as f64).sum::<f64>() / tail.len().max(1) as f64
}

/// Every run's mean loss of the last steps and its distance to f32 on one device.
pub fn convergence(steps: u64) -> anyhow::Result<Value> {
    let parse = |name: &str| Precision::parse(name).map_err(anyhow::Error::msg);
    let reference = run(Precision::default(), (1, 1, 0, 1), steps)?;
    let f32_loss = mean_last(&reference);
    let mut runs = vec![json!({
        "layout": "one device", "precision": "f32", "mean_last_loss": f32_loss,
        "first_loss": reference.steps.first().map(|s| s.loss),
    })];
    for (name, dp, pp, zero, microbatches) in LAYOUTS {
        let precisions: &[&str] = if dp * pp == 1 { &["bf16", "f16"] } else { &["bf16"] };
        for &precision in precisions {
            let report = run(parse(precision)?, (dp, pp, zero, microbatches), steps)?;
            let loss = mean_last(&report);
            runs.push(json!({
                "layout": name,
                "precision": precision,
                "mean_last_loss": loss,
                "relative_gap_to_f32_one_device": (loss - f32_loss).abs() / f32_loss,
                "skipped_steps": report.steps.iter().filter(|s| s.skipped).count(),
                "last_loss_scale": report.steps.last().and_then(|s| s.loss_scale),
                "median_step_s": crate::report::median(&mut report.steps.iter().map(|s| s.time_s).collect::<Vec<_>>()),
            }));
        }
    }
    Ok(json!({
        "model": "gpt-tiny", "global_batch": 16, "steps": steps, "mean_of_last": LAST,
        "bound": "within 2% of f32 on one device (issue 38)",
        "runs": runs,
    }))
}
