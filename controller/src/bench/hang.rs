//! Time from a hang to its report: a pp=2 job whose stage 1 never sends its last gradient
//! (the chain ends at an idle actor) and one whose stages each wait for the other (a cycle),
//! with 1 s heartbeats and the fabric's patience at 60 s (the report must not wait for it).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Program, TestFault};

use crate::{Controller, JobError, TrainOptions};

/// Seconds from the start of the hung step to the hang report, for both hangs.
pub fn hang_to_report() -> anyhow::Result<Value> {
    let mut out = serde_json::Map::new();
    for (name, fault) in [
        ("skipped_send", TestFault::SkipLastSend { actor: 1 }),
        ("cycle", TestFault::RecvBeforeSend { actor: 0 }),
    ] {
        let mut program =
            Program::new(ModelSpec::parse("mlp:in=16,hidden=16,layers=4,out=4")?).with_plan(ParallelPlan {
                pp: 2,
                microbatches: 2,
                batch: 8,
                ..ParallelPlan::default()
            });
        program.test_fault = Some(fault);
        let options = TrainOptions {
            steps: 1,
            patience: Duration::from_secs(60),
            ..TrainOptions::default()
        };
        let started = Instant::now();
        let found = match Controller::local(DeviceSpec::cpus(2)).train(&program, &options) {
            Err(JobError::Deadlock { detected_s, .. }) => detected_s,
            Err(other) => anyhow::bail!("the {name} hang was not reported as one: {other}"),
            Ok(_) => anyhow::bail!("the {name} hang did not hang"),
        };
        out.insert(
            name.into(),
            json!({ "job_to_report_s": started.elapsed().as_secs_f64(), "last_progress_to_report_s": found }),
        );
    }
    Ok(json!({
        "config": { "heartbeat_s": 1.0, "fabric_patience_s": 60, "model": "mlp pp=2, 2 micro-batches" },
        "aim_s": 5.0,
        "hangs": out,
    }))
}
