//! Errors of a job as the controller reports them.

use archipelago_actors::ActorFailure;
use archipelago_dataflow::PlanError;

/// Why a job did not finish.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The plan was refused before any actor started. (Not a `source`: the message already
    /// holds the refusal, and a chain printer would say it twice.)
    #[error("plan refused: {0}")]
    Plan(PlanError),
    /// An actor failed; the run was stopped.
    #[error("{0}")]
    Actor(Box<ActorFailure>),
    /// Actors went silent past the watchdog's patience.
    #[error(
        "job {job}, step {step}: no report for {waited_s:.0} s from actors {silent:?} (the others finished the step); they are stuck or dead"
    )]
    Hang {
        /// The job.
        job: String,
        /// The step.
        step: u64,
        /// Actors that did not report.
        silent: Vec<usize>,
        /// Seconds waited.
        waited_s: f64,
    },
    /// No actor made progress for two heartbeats and the wait-for chains prove that some can
    /// never resume; the job was stopped with the chains.
    #[error("job {job}: hang found {detected_s:.1} s after the last progress; {report}")]
    Deadlock {
        /// The job.
        job: String,
        /// Who waits for whom.
        report: Box<crate::hang::HangReport>,
        /// Seconds from the last progress to the report.
        detected_s: f64,
    },
    /// A host died, closed its session or went silent; the job stopped.
    #[error("{0}")]
    HostLost(Box<HostLoss>),
    /// The job failed on a remote controller (its message, as the controller reported it).
    #[error("{0}")]
    Remote(String),
    /// The runtime itself failed (spawning an actor, a closed channel).
    #[error("runtime: {0}")]
    Runtime(String),
    /// Asked to stop before a time limit (SIGUSR1 to the controller): the job stopped after
    /// `step`, with a checkpoint of it when it had a checkpoint directory.
    #[error("job {job}: stopped after step {step} as asked (SIGUSR1, before a time limit); {checkpoint}")]
    Preempted {
        /// The job.
        job: String,
        /// The last step done.
        step: u64,
        /// Where its checkpoint is, or that there is none.
        checkpoint: String,
    },
}

/// A lost host, as reported: which, how, and what its actors were running.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "job {job}, step {step}: host `{host}` (pid {pid}, fabric {addr}) is lost: {why}; its actors: {actors}"
)]
pub struct HostLoss {
    /// The job.
    pub job: String,
    /// The step running.
    pub step: u64,
    /// The host's name.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// Its fabric address.
    pub addr: String,
    /// How it was lost (session closed, silent for N s).
    pub why: String,
    /// Its actors and the instruction each was running when last heard of.
    pub actors: String,
}

impl From<PlanError> for JobError {
    fn from(e: PlanError) -> JobError {
        JobError::Plan(e)
    }
}
