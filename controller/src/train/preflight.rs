//! What a training job checks and loads before any actor starts, wherever it runs: options that
//! cannot work together, data and initial weights the model cannot use, and the checkpoint to
//! resume from. A job that fails here has started nothing.

use std::path::Path;
use std::sync::Arc;

use archipelago_actors::batch_file::BatchFile;
use archipelago_actors::checkpoint::{self, CheckpointReader};
use archipelago_actors::weights_file::{InitWeights, adapter_start};
use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::{InputKind, Program};

use super::options::TrainOptions;
use crate::JobError;

/// Where a job starts: the checkpoint to load (none when starting fresh) and the first step.
pub(crate) struct StartPoint {
    /// The checkpoint every actor loads its state from.
    pub restore: Option<Arc<CheckpointReader>>,
    /// The first step to run (1 when starting fresh).
    pub first_step: u64,
    /// What the user is told before the job starts: newer checkpoints passed over (each a
    /// warning) and where the run resumes. The caller says them where the user sees them (this
    /// process's stderr, or a cluster job's client).
    pub notes: Vec<String>,
}

/// Checks `options` and `program`'s data and weights, then finds where the job starts.
pub(crate) fn preflight(program: &Program, options: &TrainOptions) -> Result<StartPoint, JobError> {
    check_options(options)?;
    check_data(program)?;
    resume_point(program, options)
}

/// Refuses option combinations that cannot work.
fn check_options(options: &TrainOptions) -> Result<(), JobError> {
    if options.resume && options.checkpoint_dir.is_none() {
        return Err(JobError::Runtime(
            "resuming needs the checkpoint directory (--resume DIR)".into(),
        ));
    }
    Ok(())
}

/// Refuses `--data` a model cannot train on (bytes outside a gpt's vocabulary, too short; a
/// safetensors file without the tensors the model reads) and `--init` weights that are not
/// exactly the model's. A file this process cannot read is left to the hosts to read.
fn check_data(program: &Program) -> Result<(), JobError> {
    let path_here = |path: &str| Path::new(path).exists();
    match (&program.data, program.model.input) {
        (DataSpec::TextFile { path, tokenizer }, InputKind::Tokens { ctx, vocab }) => {
            // The text with its tokenizer (loaded once), or the tokenizer alone.
            if path_here(path) && tokenizer.as_deref().is_none_or(path_here) {
                archipelago_actors::text_tokens::text_stream(path, tokenizer.as_deref(), ctx, vocab)
                    .map_err(JobError::Runtime)?;
            } else if let Some(t) = tokenizer.as_deref().filter(|t| path_here(t)) {
                archipelago_actors::text_tokens::load(t, vocab).map_err(JobError::Runtime)?;
            }
        }
        (DataSpec::TensorFile { path }, input) if path_here(path) => {
            BatchFile::open(Path::new(path), input).map_err(JobError::Runtime)?;
        }
        _ => {}
    }
    if let Some(path) = program.init.as_deref().filter(|p| path_here(p)) {
        InitWeights::open(Path::new(path), &program.model, adapter_start(program))
            .map_err(JobError::Runtime)?;
    }
    Ok(())
}

/// The newest complete checkpoint under `checkpoint_dir` when resuming (it must be of this
/// model and seed), else a fresh start.
fn resume_point(program: &Program, options: &TrainOptions) -> Result<StartPoint, JobError> {
    let Some(root) = options.checkpoint_dir.as_ref().filter(|_| options.resume) else {
        return Ok(StartPoint {
            restore: None,
            first_step: 1,
            notes: Vec::new(),
        });
    };
    let (latest, skipped) = checkpoint::latest_complete(root);
    let mut notes: Vec<String> = (skipped.iter())
        .map(|why| format!("warning: checkpoint {why}"))
        .collect();
    let Some((dir, manifest)) = latest else {
        let why = if skipped.is_empty() {
            " (it holds no `step-N` directory: pass the --checkpoint-dir of the run to go on from)"
                .to_string()
        } else {
            format!(" ({})", skipped.join("; "))
        };
        return Err(JobError::Runtime(format!(
            "no complete checkpoint under {} to resume from{why}",
            root.display()
        )));
    };
    if manifest.model != program.model.name || manifest.seed != program.seed {
        return Err(JobError::Runtime(format!(
            "the checkpoint in {} is of model `{}` seed {}, this job trains `{}` seed {}",
            dir.display(),
            manifest.model,
            manifest.seed,
            program.model.name,
            program.seed
        )));
    }
    super::resume_check::check(&manifest, &dir, program, options.steps, &options.resume_override)
        .map_err(JobError::Runtime)?;
    let reader = CheckpointReader::open(&dir).map_err(JobError::Runtime)?;
    let plan = &program.plan;
    let line = format!(
        "resuming from step {} of {} (written on {}; now dp={} pp={} tp={} zero={})",
        manifest.step,
        dir.display(),
        super::resume_check::layout_words(&manifest.layout),
        plan.dp,
        plan.pp,
        plan.tp,
        plan.zero
    );
    notes.push(line);
    let topk = matches!(
        program.compression,
        archipelago_dataflow::Compression::TopK { .. }
    );
    if topk && !super::launch::same_layout(&manifest.layout, program) {
        notes.push(format!(
            "warning: --compress topk's error-feedback residuals start at zero (and, under SGD with momentum, each replica's velocity): the checkpoint was written on another layout ({}), whose buckets differ, so what each replica held back before step {} is dropped",
            super::resume_check::layout_words(&manifest.layout),
            manifest.next_step
        ));
    } else if topk && !super::launch::same_exchange(&manifest, program) {
        let then = manifest
            .run
            .as_ref()
            .map(|r| r.compression.to_string())
            .unwrap_or_default();
        notes.push(format!(
            "warning: --compress topk's error-feedback residuals start at zero (and, under SGD with momentum, each replica's velocity): the checkpoint was written under --compress {then}, whose per-replica state is not top-k's"
        ));
    }
    if let archipelago_dataflow::Compression::OneBitAdam { freeze_step, .. } = program.compression
        && manifest.step > u64::from(freeze_step)
        && !super::launch::same_layout(&manifest.layout, program)
    {
        return Err(JobError::Plan(archipelago_dataflow::PlanError::Conflict(
            format!(
                "--optimizer onebit-adam: the checkpoint at step {} is past the freeze (step {freeze_step}), and 1-bit Adam's exchange state (momentum, frozen variance, both errors) is kept per bucket of the layout that wrote it ({}), which differs from this one; resume on that layout, or go on as plain Adam with --optimizer adam --resume-override compress",
                manifest.step,
                super::resume_check::layout_words(&manifest.layout),
            ),
        )));
    }
    for note in &notes {
        tracing::info!("{note}");
    }
    Ok(StartPoint {
        restore: Some(Arc::new(reader)),
        first_step: manifest.next_step,
        notes,
    })
}
