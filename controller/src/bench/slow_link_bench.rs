//! `bench --slow-link-only` (issue 43): mlp-8x1024 at dp=2 on two host processes over a loopback
//! shaped to 100 Mbit/s (`bench::slow_link`, raw TCP), uncompressed and with each compression
//! that should beat the link — `--compress topk:0.01` and `--optimizer onebit-adam --freeze-step
//! 5` — one after the other in one window: median step time (steps after the first; for 1-bit
//! Adam after its freeze, where its exchange runs), steps/s and
//! its ratio to the uncompressed run's, gradient fabric bytes per step and the bytes the link
//! carried per step. The bound is ≥ 3× the uncompressed steps/s; printed, not asserted.

use serde_json::{Value, json};

use archipelago_actors::fabric::DataPath;

use super::slow_link::{self, SlowLinkRun};
use crate::TrainReport;

/// The link's rate, Mbit/s.
const RATE_MBIT: u32 = 100;

/// A run: its name, its flags beyond the base job, and the first step its step time counts from.
struct LinkRun(&'static str, &'static [&'static str], u64);

const RUNS: &[LinkRun] = &[
    LinkRun("uncompressed", &[], 2),
    LinkRun("--compress topk:0.01", &["--compress", "topk:0.01"], 2),
    LinkRun(
        "--optimizer onebit-adam --freeze-step 5",
        &["--optimizer", "onebit-adam", "--freeze-step", "5"],
        6,
    ),
];

/// The runs over the slow link, `steps` each (uncompressed: a third of them, at least 3: a
/// dense step takes seconds there).
pub(super) fn slow_link(steps: u64) -> anyhow::Result<Value> {
    if let Err(why) = slow_link::available() {
        return Ok(json!({ "not_run": why }));
    }
    let exe = std::env::current_exe()?;
    let dir = std::env::temp_dir().join(format!("archipelago-bench-slow-link-{}", std::process::id()));
    let mut figures = Vec::new();
    let mut uncompressed_steps_per_s = None;
    for (index, LinkRun(name, flags, from)) in RUNS.iter().enumerate() {
        let steps = if index == 0 { (steps / 3).max(3) } else { steps };
        let mut train: Vec<String> = ["--model", "mlp-8x1024", "--dp", "2", "--steps"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        train.push(steps.to_string());
        train.extend(flags.iter().map(|s| s.to_string()));
        let run = slow_link::run(
            &exe,
            RATE_MBIT,
            DataPath::Tcp,
            &train,
            &dir.join(index.to_string()),
        );
        let run = run.inspect_err(|_| eprintln!("bench: slow link: logs kept in {}", dir.display()))?;
        let figure = run_figures(name, &run, *from);
        let steps_per_s = figure["steps_per_s"].as_f64();
        if index == 0 {
            uncompressed_steps_per_s = steps_per_s;
        }
        let mut figure = figure;
        figure["steps_per_s_over_uncompressed"] =
            json!(steps_per_s.zip(uncompressed_steps_per_s).map(|(a, b)| a / b));
        eprintln!("bench: slow link, {name}: {figure}");
        figures.push(figure);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "model": "mlp-8x1024",
        "layout": "dp=2, two host processes, one device each, --data-path tcp",
        "rate_mbit": RATE_MBIT,
        "burst_kib": slow_link::DEFAULT_BURST_KIB,
        "duplex": "both directions share the rate (one qdisc on the namespace's loopback)",
        "runs": figures,
    }))
}

/// A run's figures: step times from step `from` on.
fn run_figures(name: &str, run: &SlowLinkRun, from: u64) -> Value {
    let report: &TrainReport = &run.report;
    let mut times: Vec<f64> = report
        .steps
        .iter()
        .filter(|s| s.step >= from)
        .map(|s| s.time_s)
        .collect();
    times.sort_by(f64::total_cmp);
    let median = (!times.is_empty()).then(|| times[times.len() / 2]);
    let gradient_bytes: u64 = report
        .actors
        .iter()
        .map(|a| a.fabric_bytes_per_step.gradients)
        .sum();
    let predicted = report.predicted_fabric_bytes_per_step();
    json!({
        "run": name,
        "steps": report.steps.len(),
        "timed_from_step": from,
        "median_step_s": median,
        "steps_per_s": median.map(|m| 1.0 / m),
        "gradient_fabric_bytes_per_step": gradient_bytes,
        "predicted_gradient_fabric_bytes_per_step": predicted.gradients,
        "link_bytes_per_step": run.link.sent_bytes / report.steps.len().max(1) as u64,
        "link_overlimits": run.link.overlimits,
        "final_loss": report.final_loss,
    })
}
