//! Communication compression over a long run (issue 43): gpt-tiny at dp=2 for 300 steps
//! (WORKLOADS.md's data and batch) uncompressed and with each codec built — `--compress int8`,
//! `qsgd:8`, `qsgd:4` and `terngrad` (the gradient all-reduce), and under ZeRO-3 `--quantize-grads int8` (qgZ), `--quantize-weights
//! int8` (qwZ) and both — each run's mean loss of the last 20 steps against the uncompressed run
//! of its layout, and its fabric bytes per step (measured, the plan's prediction, and the ratio to
//! the uncompressed run's), with the median step time. The bound is 5%; the figures are
//! printed, not asserted (a benchmark, not a test).

use serde_json::{Value, json};

use archipelago_dataflow::{Compression, DeviceSpec, FabricBytes, ModelSpec, ParallelPlan, Program};

use crate::train::TrainOptions;
use crate::{Controller, TrainReport};

/// Steps whose mean loss is compared.
const LAST: usize = 20;

/// The compressed runs: name, ZeRO stage, `--compress`, `--quantize-grads`, `--quantize-weights`.
const RUNS: [(&str, u8, Compression, bool, bool); 7] = [
    ("--compress int8", 0, Compression::Int8, false, false),
    (
        "--compress qsgd:8",
        0,
        Compression::Qsgd { bits: 8 },
        false,
        false,
    ),
    (
        "--compress qsgd:4",
        0,
        Compression::Qsgd { bits: 4 },
        false,
        false,
    ),
    ("--compress terngrad", 0, Compression::TernGrad, false, false),
    ("ZeRO-3 --quantize-grads int8", 3, Compression::None, true, false),
    (
        "ZeRO-3 --quantize-weights int8",
        3,
        Compression::None,
        false,
        true,
    ),
    (
        "ZeRO-3 --quantize-weights int8 --quantize-grads int8",
        3,
        Compression::None,
        true,
        true,
    ),
];

/// gpt-tiny at dp=2 under ZeRO `zero` for `steps` steps, compressed as the flags say.
fn run(
    zero: u8,
    (compress, grads, weights): (Compression, bool, bool),
    steps: u64,
) -> anyhow::Result<TrainReport> {
    let plan = ParallelPlan {
        dp: 2,
        zero,
        batch: 16,
        ..ParallelPlan::default()
    };
    let mut program = Program::new(ModelSpec::parse("gpt-tiny")?)
        .with_plan(plan)
        .with_compression(compress);
    (program.quantize_grads, program.quantize_weights) = (grads, weights);
    let options = TrainOptions {
        steps,
        job: format!("bench-compression-zero{zero}-{compress}-{grads}-{weights}").replace(':', "-"),
        ..TrainOptions::default()
    };
    Ok(Controller::local(DeviceSpec::cpus(2)).train(&program, &options)?)
}

/// The mean loss of the last [`LAST`] steps (of all, when fewer).
fn mean_last(report: &TrainReport) -> f64 {
    let tail = &report.steps[report.steps.len().saturating_sub(LAST)..];
    tail.iter().map(|s| s.loss as f64).sum::<f64>() / tail.len().max(1) as f64
}

/// A run's figures, against `plain` (the uncompressed run of its layout) when given.
fn figures(name: &str, report: &TrainReport, plain: Option<&TrainReport>) -> Value {
    let measured = report.actors.iter().fold(FabricBytes::default(), |mut all, a| {
        all.add_all(&a.fabric_bytes_per_step);
        all
    });
    let predicted = report.predicted_fabric_bytes_per_step();
    let loss = mean_last(report);
    let against = plain.map(|plain| {
        let base = plain.actors.iter().fold(FabricBytes::default(), |mut all, a| {
            all.add_all(&a.fabric_bytes_per_step);
            all
        });
        let ratio = |a: u64, b: u64| if b == 0 { None } else { Some(a as f64 / b as f64) };
        json!({
            "relative_loss_gap": (loss - mean_last(plain)).abs() / mean_last(plain),
            "gradient_bytes_fewer": ratio(base.gradients, measured.gradients),
            "parameter_bytes_fewer": ratio(base.parameters, measured.parameters),
        })
    });
    json!({
        "run": name,
        "mean_last_loss": loss,
        "first_loss": report.steps.first().map(|s| s.loss),
        "fabric_bytes_per_step": measured,
        "predicted_fabric_bytes_per_step": predicted,
        "measured_equals_predicted": measured == predicted,
        "against_uncompressed": against,
        "median_step_s": crate::report::median(&mut report.steps.iter().map(|s| s.time_s).collect::<Vec<_>>()),
    })
}

/// Every run's mean loss of the last steps, bytes and step time.
pub fn convergence(steps: u64) -> anyhow::Result<Value> {
    let plain = [
        run(0, (Compression::None, false, false), steps)?,
        run(3, (Compression::None, false, false), steps)?,
    ];
    let mut runs = vec![
        figures("dp=2 uncompressed", &plain[0], None),
        figures("dp=2 ZeRO-3 uncompressed", &plain[1], None),
    ];
    for (name, zero, compress, grads, weights) in RUNS {
        let report = run(zero, (compress, grads, weights), steps)?;
        let base = &plain[usize::from(zero == 3)];
        runs.push(figures(name, &report, Some(base)));
    }
    Ok(json!({
        "model": "gpt-tiny", "dp": 2, "global_batch": 16, "steps": steps, "mean_of_last": LAST,
        "bound": "within 5% of the uncompressed run's loss (issue 43)",
        "runs": runs,
    }))
}
