//! Soak: 10,000 short steps of a tiny model (a few ms each) with a dashboard attached; this
//! process's resident memory at steps 1,000 and 10,000 and the dashboard's size (its JSON view
//! and its loss-curve points) at the same steps. A leak per step shows as growth between the
//! two; the report itself keeps every step's loss and instruction times, a few hundred bytes a
//! step, which is the only growth expected.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{Value, json};

use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec, ParallelPlan, Program};

use crate::dashboard::Dashboard;
use crate::process_stats::{load_avg, rss_bytes};
use crate::{Controller, StepProgress, TrainOptions};

/// Trains `steps` steps (10,000 in the full suite) and samples memory at 1,000 and at the end.
pub fn soak(steps: u64) -> anyhow::Result<Value> {
    let program = Program::new(ModelSpec::parse("mlp:in=8,hidden=16,layers=2,out=4")?)
        .with_seed(1)
        .with_optimizer(OptimizerSpec::sgd(0.01))
        .with_plan(ParallelPlan {
            dp: 2,
            batch: 8,
            ..ParallelPlan::default()
        });
    let dashboard = Dashboard::new();
    let samples: Arc<Mutex<Vec<Value>>> = Arc::default();
    let sample_at = [1_000.min(steps), steps];
    let on_step = {
        let (dashboard, samples) = (dashboard.clone(), samples.clone());
        Arc::new(move |p: &StepProgress| {
            if sample_at.contains(&p.step) {
                let view = dashboard.view();
                let points = view.job.as_ref().map_or(0, |j| j.losses.len());
                let json_bytes = serde_json::to_vec(&view).map_or(0, |v| v.len());
                samples.lock().expect("soak samples").push(json!({
                    "step": p.step,
                    "rss_bytes": rss_bytes(),
                    "dashboard_json_bytes": json_bytes,
                    "dashboard_loss_points": points,
                }));
            }
        })
    };
    let options = TrainOptions {
        steps,
        job: "soak".into(),
        on_step: Some(on_step),
        dashboard: Some(dashboard),
        ..TrainOptions::default()
    };
    let started = Instant::now();
    let report = Controller::local(DeviceSpec::cpus(2)).train(&program, &options)?;
    let samples = samples.lock().expect("soak samples").clone();
    let rss = |i: usize| {
        samples
            .get(i)
            .and_then(|s| s["rss_bytes"].as_f64())
            .unwrap_or(0.0)
    };
    Ok(json!({
        "config": { "model": "mlp:in=8,hidden=16,layers=2,out=4", "dp": 2, "batch": 8, "steps": steps },
        "samples": samples,
        "rss_growth_fraction_1k_to_end": rss(1) / rss(0).max(1.0) - 1.0,
        "rss_bytes_per_step_1k_to_end": (rss(1) - rss(0)) / (steps.saturating_sub(1_000).max(1)) as f64,
        "aim_growth_fraction": 0.05,
        "median_step_s": report.median_step_s,
        "wall_s": started.elapsed().as_secs_f64(),
        "load_avg": load_avg(),
    }))
}
