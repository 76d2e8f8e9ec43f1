//! Training benchmarks: mlp-8x1024 steps/s at dp=1 and dp=2, and at pp=2 (GPipe and 1F1B, eight
//! micro-batches) with the measured bubble beside the simulator's; one core per actor.

use serde_json::{Value, json};

use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Program};

use crate::process_stats::load_avg;
use crate::report::median;
use crate::train::TrainOptions;
use crate::{Controller, TrainReport};

/// Trains mlp-8x1024 (global batch 64) under `plan` for `warmup + timed` steps on one CPU
/// device per actor; returns the report and the median step time (the controller's step wall
/// time, i.e. the slowest actor) over the timed steps.
pub(super) fn timed_mlp(
    plan: ParallelPlan,
    warmup: u64,
    timed: u64,
    job: String,
) -> anyhow::Result<(TrainReport, f64)> {
    timed_model(
        "mlp-8x1024",
        ParallelPlan { batch: 64, ..plan },
        warmup,
        timed,
        job,
    )
}

/// [`timed_mlp`] for any zoo model at the plan's batch.
fn timed_model(
    model: &str,
    plan: ParallelPlan,
    warmup: u64,
    timed: u64,
    job: String,
) -> anyhow::Result<(TrainReport, f64)> {
    let devices = DeviceSpec::cpus(plan.actors());
    timed_model_on(model, plan, devices, warmup, timed, job)
}

/// [`timed_model`] on the given devices (one per actor).
pub(super) fn timed_model_on(
    model: &str,
    plan: ParallelPlan,
    devices: Vec<DeviceSpec>,
    warmup: u64,
    timed: u64,
    job: String,
) -> anyhow::Result<(TrainReport, f64)> {
    let spec = ModelSpec::parse(model)?;
    let sequence_parallel = plan.sequence_parallel;
    let mut program = Program::new(spec.clone()).with_plan(plan);
    if sequence_parallel {
        program = program.sequence_parallel(&spec)?;
    }
    let options = TrainOptions {
        steps: warmup + timed,
        job,
        ..TrainOptions::default()
    };
    let report = Controller::local(devices).train(&program, &options)?;
    let mut times: Vec<f64> = report
        .steps
        .iter()
        .skip(warmup as usize)
        .map(|s| s.time_s)
        .collect();
    let step_s = median(&mut times);
    Ok((report, step_s))
}

/// Median step time (slowest rank: the controller's step wall time) after `warmup` steps.
pub fn mlp_dp_scaling(warmup: u64, timed: u64) -> anyhow::Result<Value> {
    let mut runs = Vec::new();
    let mut steps_per_s = Vec::new();
    for dp in [1, 2] {
        let plan = ParallelPlan {
            dp,
            ..ParallelPlan::default()
        };
        let (report, step_s) = timed_mlp(plan, warmup, timed, format!("bench-dp{dp}"))?;
        steps_per_s.push(1.0 / step_s);
        runs.push(json!({
            "name": format!("mlp-8x1024 dp={dp}"),
            "config": { "model": "mlp-8x1024", "dp": dp, "global_batch": 64, "warmup_steps": warmup, "timed_steps": timed, "cores_per_actor": 1 },
            "median_step_s": step_s,
            "steps_per_s": 1.0 / step_s,
            "samples_per_s": 64.0 / step_s,
            "compute_s_per_actor": report.actors.iter().map(|a| a.compute_s).collect::<Vec<_>>(),
            "comm_wait_s_per_actor": report.actors.iter().map(|a| a.comm_wait_s).collect::<Vec<_>>(),
            "host_device_bytes_per_step": report.steps.last().map(|s| s.transfers),
            "fabric_bytes_per_step": report.steps.last().map(|s| s.fabric),
            "predicted_fabric_bytes_per_step": report.predicted_fabric_bytes_per_step(),
            "final_loss": report.final_loss,
            "load_avg": load_avg(),
        }));
    }
    Ok(json!({ "runs": runs, "dp2_speedup_over_dp1": steps_per_s[1] / steps_per_s[0] }))
}

/// mlp-8x1024 at pp=2 with eight micro-batches under GPipe and 1F1B: steps/s, and per stage the
/// measured bubble, the cost model's prediction and the replay with measured pass times.
pub fn mlp_pipeline(warmup: u64, timed: u64) -> anyhow::Result<Value> {
    let mut runs = Vec::new();
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let plan = ParallelPlan {
            pp: 2,
            microbatches: 8,
            schedule,
            ..ParallelPlan::default()
        };
        let (report, step_s) = timed_mlp(plan, warmup, timed, format!("bench-pp2-{schedule}"))?;
        runs.push(json!({
            "name": format!("mlp-8x1024 pp=2 {schedule} m=8"),
            "config": { "model": "mlp-8x1024", "pp": 2, "schedule": schedule.to_string(), "microbatches": 8, "global_batch": 64, "warmup_steps": warmup, "timed_steps": timed, "cores_per_actor": 1 },
            "median_step_s": step_s,
            "steps_per_s": 1.0 / step_s,
            "samples_per_s": 64.0 / step_s,
            "bubble_measured": report.actors.iter().map(|a| a.bubble).collect::<Vec<_>>(),
            "bubble_predicted": report.actors.iter().map(|a| a.predicted_bubble).collect::<Vec<_>>(),
            "bubble_replayed": report.actors.iter().map(|a| a.replayed_bubble).collect::<Vec<_>>(),
            "peak_microbatches_held": report.actors.iter().map(|a| a.peak_microbatches_held).collect::<Vec<_>>(),
            "predicted_step_s": report.predicted_step_s,
            "replayed_step_s": report.replayed_step_s,
            "final_loss": report.final_loss,
            "load_avg": load_avg(),
        }));
    }
    Ok(json!({ "runs": runs }))
}

/// mlp-8x1024 at dp=2 under ZeRO 0 and ZeRO 3: steps/s and model state per actor.
pub fn mlp_zero(warmup: u64, timed: u64) -> anyhow::Result<Value> {
    let mut runs = Vec::new();
    for zero in [0u8, 3] {
        let plan = ParallelPlan {
            dp: 2,
            zero,
            ..ParallelPlan::default()
        };
        let (report, step_s) = timed_mlp(plan, warmup, timed, format!("bench-zero{zero}"))?;
        runs.push(json!({
            "name": format!("mlp-8x1024 dp=2 zero={zero}"),
            "config": { "model": "mlp-8x1024", "dp": 2, "zero": zero, "global_batch": 64, "warmup_steps": warmup, "timed_steps": timed, "cores_per_actor": 1 },
            "median_step_s": step_s,
            "steps_per_s": 1.0 / step_s,
            "model_state_bytes_per_actor": report.actors.iter().map(|a| a.model_state_bytes).collect::<Vec<_>>(),
            "estimated_model_state_bytes_per_actor": report.actors.iter().map(|a| a.estimated_model_state_bytes).collect::<Vec<_>>(),
            "final_loss": report.final_loss,
            "load_avg": load_avg(),
        }));
    }
    Ok(json!({ "runs": runs }))
}

/// gpt-tiny (WORKLOADS.md: 16 sequences of 128 tokens per step) at dp=1, dp=2, pp=2 under GPipe
/// and 1F1B with eight micro-batches, ZeRO-3 at dp=2 and tp=2 (Megatron-LM, and with sequence
/// parallelism): steps/s, tokens/s
/// and the fabric bytes each actor read per step, measured and as the plan predicted.
pub fn gpt_tiny(warmup: u64, timed: u64) -> anyhow::Result<Value> {
    let layouts = [
        ("dp=1", ParallelPlan::default()),
        (
            "dp=2",
            ParallelPlan {
                dp: 2,
                ..ParallelPlan::default()
            },
        ),
        (
            "pp=2 gpipe m=8",
            ParallelPlan {
                pp: 2,
                microbatches: 8,
                schedule: Schedule::GPipe,
                ..ParallelPlan::default()
            },
        ),
        (
            "pp=2 1f1b m=8",
            ParallelPlan {
                pp: 2,
                microbatches: 8,
                schedule: Schedule::OneFOneB,
                ..ParallelPlan::default()
            },
        ),
        (
            "dp=2 zero=3",
            ParallelPlan {
                dp: 2,
                zero: 3,
                ..ParallelPlan::default()
            },
        ),
        (
            "tp=2",
            ParallelPlan {
                tp: 2,
                ..ParallelPlan::default()
            },
        ),
        (
            "tp=2 sequence-parallel",
            ParallelPlan {
                tp: 2,
                sequence_parallel: true,
                ..ParallelPlan::default()
            },
        ),
        (
            "tp=2 sequence-parallel partitioned",
            ParallelPlan {
                tp: 2,
                sequence_parallel: true,
                partition_activations: true,
                ..ParallelPlan::default()
            },
        ),
    ];
    let (batch, ctx) = (16, 128);
    let mut runs = Vec::new();
    for (name, layout) in layouts {
        let plan = ParallelPlan { batch, ..layout };
        let config = json!({ "model": "gpt-tiny", "dp": plan.dp, "pp": plan.pp, "tp": plan.tp, "sequence_parallel": plan.sequence_parallel, "partition_activations": plan.partition_activations, "microbatches": plan.microbatches, "schedule": plan.schedule.to_string(), "zero": plan.zero, "global_batch": batch, "tokens_per_step": batch * ctx, "warmup_steps": warmup, "timed_steps": timed, "cores_per_actor": 1 });
        let (report, step_s) =
            timed_model("gpt-tiny", plan, warmup, timed, format!("bench-gpt-tiny-{name}"))?;
        runs.push(json!({
            "name": format!("gpt-tiny {name}"),
            "config": config,
            "median_step_s": step_s,
            "steps_per_s": 1.0 / step_s,
            "tokens_per_s": (batch * ctx) as f64 / step_s,
            "fabric_bytes_per_step": report.steps.last().map(|s| s.fabric),
            "predicted_fabric_bytes_per_step": report.predicted_fabric_bytes_per_step(),
            "final_loss": report.final_loss,
            "load_avg": load_avg(),
        }));
    }
    Ok(json!({ "runs": runs }))
}
