//! What a training run is asked to do, and what it tells a caller after each step: the options
//! every way of running a job takes (local, submitted to a controller, run on a cluster).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use archipelago_actors::collectives::Collectives;
use archipelago_actors::fabric::DataPath;

/// How long a receive may wait before the actor reports a hang naming its peer.
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(120);

/// What the controller tells a progress callback after each step.
#[derive(Debug, Clone)]
pub struct StepProgress {
    /// The step just finished, from 1.
    pub step: u64,
    /// Steps in the run.
    pub steps: u64,
    /// Global loss of the step.
    pub loss: f32,
    /// Wall time of the step.
    pub time_s: f64,
    /// The learning rate the step's update used.
    pub lr: Option<f32>,
    /// The global gradient L2 norm before clipping (when the step computed it: with
    /// --clip-grad-norm or lamb).
    pub grad_norm: Option<f32>,
    /// The scale the step's loss was multiplied by (f16's loss scaling).
    pub loss_scale: Option<f32>,
    /// The step's gradients overflowed somewhere and no actor updated (loss scaling).
    pub skipped: bool,
}

/// Called after every step.
pub type ProgressFn = Arc<dyn Fn(&StepProgress) + Send + Sync>;

/// Options of a training run.
#[derive(Clone)]
pub struct TrainOptions {
    /// Steps to run.
    pub steps: u64,
    /// Job name (appears in every error).
    pub job: String,
    /// How long a receive may wait for a peer before it is reported as a hang.
    pub patience: Duration,
    /// The flags as given, copied into the report's `plan` key.
    pub flags: serde_json::Value,
    /// Progress callback.
    pub on_step: Option<ProgressFn>,
    /// Write a Chrome/Perfetto trace of the steps here.
    pub trace: Option<PathBuf>,
    /// Write checkpoints under this directory (`step-NNNNNNNN/`, manifest last).
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (and always after the last); 0: only after the last.
    pub checkpoint_every: u64,
    /// Start from the newest complete checkpoint under `checkpoint_dir` (any layout).
    pub resume: bool,
    /// The settings a resume may change from the checkpoint's run (`optimizer`, `lr-schedule`,
    /// `clip`, `steps`, `data`, `precision`: see [`crate::train::resume_check`]); any other
    /// difference refuses the resume.
    pub resume_override: Vec<String>,
    /// Several hosts: when a host dies, re-plan on the hosts that remain, load the last complete
    /// checkpoint (resharded) and go on.
    pub restart_on_failure: bool,
    /// Several hosts: how tensors travel between them (shared memory between processes of one
    /// machine and raw TCP between machines, unless a path is pinned).
    pub data_path: DataPath,
    /// A dashboard to feed with the job's steps (see [`crate::dashboard`]).
    pub dashboard: Option<Arc<crate::dashboard::Dashboard>>,
    /// A local run: how the devices' groups reduce — through each other's buffers (the
    /// default) or as rings of messages (as groups that span hosts do). Hosts of a cluster
    /// always use shared buffers among their own devices.
    pub collectives: Collectives,
    /// Copy every parameter every actor holds at the end into the report's
    /// [`TrainReport::held_params`](crate::TrainReport::held_params) (not written to the JSON):
    /// how the equivalence tests see each replica, stage and shard. Costs a copy of the model
    /// per actor; for tests and small models.
    pub keep_params: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            steps: 30,
            job: "train".into(),
            patience: DEFAULT_PATIENCE,
            flags: serde_json::Value::Null,
            on_step: None,
            trace: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            resume: false,
            resume_override: Vec::new(),
            restart_on_failure: false,
            data_path: DataPath::Auto,
            dashboard: None,
            collectives: Collectives::Shared,
            keep_params: false,
        }
    }
}
