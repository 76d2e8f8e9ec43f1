//! The step loop every training job runs, on any [`Gang`] (actors in this process or on hosts):
//! run a step on every actor at once, record it (loss, time, trace, dashboard, progress
//! callback), checkpoint when due, stop with a checkpoint when the job is preempted; at the end,
//! write the trace and make the report.

use std::path::Path;
use std::time::Instant;

use archipelago_actors::checkpoint::{self, MANIFEST, Manifest};
use archipelago_actors::executor::StepReport;
use archipelago_dataflow::Plan;

use super::figures::{StepFigures, final_report};
use super::options::{StepProgress, TrainOptions};
use crate::JobError;
use crate::gang::Gang;
use crate::report::{StepRecord, TrainReport};
use crate::trace::TraceRecorder;

/// Runs steps `first_step..=options.steps` on `gang`, checkpointing as asked; `steps` keeps the
/// step records (across restarts: records from `first_step` on are replaced).
pub(crate) async fn drive<G: Gang>(
    gang: &mut G,
    plan: &Plan,
    options: &TrainOptions,
    first_step: u64,
    steps: &mut Vec<StepRecord>,
) -> Result<TrainReport, JobError> {
    steps.retain(|s| s.step < first_step);
    if let Some(d) = &options.dashboard {
        d.job_started(plan, &options.job, options.steps);
    }
    let mut figures = StepFigures::new(plan);
    let mut trace = options.trace.as_ref().map(|_| TraceRecorder::new());
    let mut last: Vec<StepReport> = Vec::new();
    for step in first_step..=options.steps {
        let (reports, record) = run_step(gang, plan, options, step).await?;
        figures.add(plan, &reports, step > first_step || options.steps == first_step);
        if let Some(trace) = &mut trace {
            trace.record(plan, step, &reports);
        }
        tell_step_done(plan, options, &record, &reports);
        steps.push(record);
        last = reports;
        checkpoint_when_due(gang, plan, options, step).await?;
    }
    if let (Some(trace), Some(path)) = (&trace, &options.trace) {
        write_trace(trace, plan, path)?;
    }
    final_report(gang, plan, options, steps, &last, figures).await
}

/// Runs step `step` on every actor: the actors' reports and the step's record.
async fn run_step<G: Gang>(
    gang: &mut G,
    plan: &Plan,
    options: &TrainOptions,
    step: u64,
) -> Result<(Vec<StepReport>, StepRecord), JobError> {
    let began = Instant::now();
    let span = tracing::info_span!(
        "step",
        job = %options.job,
        step,
        actors = plan.actors.len(),
        loss = tracing::field::Empty
    );
    let reports = tracing::Instrument::instrument(gang.step(step), span.clone()).await?;
    let time_s = began.elapsed().as_secs_f64();
    let loss: f32 = reports.iter().filter_map(|r| r.metrics.loss).sum();
    span.record("loss", loss);
    let record = StepRecord {
        step,
        loss,
        time_s,
        lr: reports.iter().find_map(|r| r.metrics.lr),
        grad_norm: reports.iter().find_map(|r| r.metrics.grad_norm),
        loss_scale: reports.iter().find_map(|r| r.metrics.loss_scale),
        skipped: reports.iter().any(|r| r.metrics.skipped),
        transfers: reports.iter().fold(Default::default(), |mut all, r| {
            all.add(&r.metrics.transfers);
            all
        }),
        fabric: reports.iter().fold(Default::default(), |mut all, r| {
            all.add_all(&r.metrics.fabric);
            all
        }),
        fabric_crossing_islands: reports.iter().fold(Default::default(), |mut all, r| {
            all.add_all(&r.metrics.fabric_crossing_islands);
            all
        }),
    };
    Ok((reports, record))
}

/// Tells the dashboard and the progress callback that a step is done.
fn tell_step_done(plan: &Plan, options: &TrainOptions, record: &StepRecord, reports: &[StepReport]) {
    if let Some(d) = &options.dashboard {
        d.step_done(plan, record, reports);
    }
    if let Some(callback) = &options.on_step {
        callback(&StepProgress {
            step: record.step,
            steps: options.steps,
            loss: record.loss,
            time_s: record.time_s,
            lr: record.lr,
            grad_norm: record.grad_norm,
            loss_scale: record.loss_scale,
            skipped: record.skipped,
        });
    }
}

/// Checkpoints after `step` when one is due (every `checkpoint_every` steps, after the last, or
/// on preemption); a preempted job then stops with [`JobError::Preempted`].
async fn checkpoint_when_due<G: Gang>(
    gang: &mut G,
    plan: &Plan,
    options: &TrainOptions,
    step: u64,
) -> Result<(), JobError> {
    let preempted = crate::preemption::requested() && step < options.steps;
    if let Some(root) = &options.checkpoint_dir {
        let every = options.checkpoint_every;
        if (every > 0 && step.is_multiple_of(every)) || step == options.steps || preempted {
            save_checkpoint(gang, plan, options, root, step).await?;
        }
    }
    if !preempted {
        return Ok(());
    }
    let checkpoint = match &options.checkpoint_dir {
        Some(root) => format!(
            "resume with --resume {} (checkpoint {})",
            root.display(),
            checkpoint::step_dir(root, step).display()
        ),
        None => "no checkpoint (no --checkpoint-dir)".into(),
    };
    Err(JobError::Preempted {
        job: options.job.clone(),
        step,
        checkpoint,
    })
}

/// Every actor writes its shard after `step`; then the manifest, which completes the checkpoint.
async fn save_checkpoint<G: Gang>(
    gang: &mut G,
    plan: &Plan,
    options: &TrainOptions,
    root: &Path,
    step: u64,
) -> Result<(), JobError> {
    let dir = checkpoint::step_dir(root, step);
    // A checkpoint of this step from before a restart is incomplete from the moment its shards
    // start to change.
    let _ = std::fs::remove_file(dir.join(MANIFEST));
    let files = gang.checkpoint(&dir, step).await?;
    let program = &plan.program;
    let manifest = Manifest {
        job: options.job.clone(),
        step,
        next_step: step + 1,
        model: program.model.name.clone(),
        seed: program.seed,
        layout: serde_json::to_value(&program.plan).unwrap_or_default(),
        run: Some(super::resume_check::record(program, options.steps)),
        files,
    };
    checkpoint::write_manifest(&dir, &manifest).map_err(JobError::Runtime)
}

/// Writes the Chrome/Perfetto trace of the steps to `path`.
fn write_trace(trace: &TraceRecorder, plan: &Plan, path: &Path) -> Result<(), JobError> {
    let text = serde_json::to_string(&trace.to_json(plan)).map_err(|e| JobError::Runtime(e.to_string()))?;
    std::fs::write(path, text)
        .map_err(|e| JobError::Runtime(format!("cannot write the trace to {}: {e}", path.display())))
}
