//! Stopping cleanly before a scheduler's time limit: on SIGUSR1 (Slurm's `--signal=B:USR1@120`
//! as `examples/slurm/train.sbatch` forwards it) the running job finishes its current step,
//! writes a checkpoint when it has a checkpoint directory, and stops with
//! [`JobError::Preempted`](crate::JobError::Preempted); the requeued job resumes from it.
//!
//! The request is process-wide: one signal, one controller, the job it drives.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Asks the running job to checkpoint after its current step and stop.
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Whether a stop was asked for (it stays asked: a preempted process runs no further job).
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// Turns SIGUSR1 into [`request`] for the life of the process (on the current tokio runtime).
#[cfg(unix)]
pub fn on_sigusr1() -> std::io::Result<()> {
    let mut signals = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())?;
    tokio::spawn(async move {
        while signals.recv().await.is_some() {
            tracing::warn!("SIGUSR1: the job checkpoints after its current step and stops (to be requeued)");
            request();
        }
    });
    Ok(())
}

/// Without Unix signals there is nothing to forward.
#[cfg(not(unix))]
pub fn on_sigusr1() -> std::io::Result<()> {
    Ok(())
}
