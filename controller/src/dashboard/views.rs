//! What the dashboard shows, as the JSON endpoints and the page's server-sent events carry it:
//! the cluster (hosts live and lost, memory per device), the job (loss, learning rate and
//! restarts by step), the timeline of the last steps (one lane per actor, named by host and
//! device), failures and the actors of a program on the runtime API. Fields are only ever added,
//! never renamed, so that scripts reading the JSON keep working.

use serde::Serialize;

/// A host as the cluster tells the dashboard of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostView {
    /// Its name.
    pub name: String,
    /// Its island.
    pub island: String,
    /// Its devices.
    pub devices: Vec<String>,
    /// Memory per device in bytes (0: not given).
    pub device_memory: u64,
}

/// Memory of one device of a host, from the actors of the running job on it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeviceMemoryView {
    /// The device (`cpu:0`, `cuda:1`).
    pub device: String,
    /// Parameters, gradients and optimizer state its actors held at the end of the last step
    /// (measured by the actors; on a CPU this is host RAM).
    pub state_bytes: u64,
    /// The most of that held during the last step.
    pub peak_state_bytes: u64,
    /// The plan's estimate for its actors (state and activations).
    pub planned_bytes: u64,
    /// The GPU memory pool's bytes in use (GPUs only).
    pub pool_bytes: Option<u64>,
}

/// A row of the cluster table: a host, live or lost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostRow {
    /// The host as the cluster told of it.
    #[serde(flatten)]
    pub host: HostView,
    /// `live`, or `lost` (a host that left the cluster stays in the table).
    pub state: String,
    /// When it was lost, seconds since the Unix epoch.
    pub lost_unix_s: Option<f64>,
    /// Why it was lost.
    pub lost_reason: Option<String>,
    /// Memory per device running actors of the job (empty before its first step).
    pub memory: Vec<DeviceMemoryView>,
}

/// A restart of the job after a host loss.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RestartView {
    /// The last step finished before the loss.
    pub after_step: u64,
    /// The first step run after the restart (once it ran).
    pub resumed_at_step: Option<u64>,
    /// When, seconds since the Unix epoch.
    pub unix_s: f64,
    /// What happened and where the job went on from.
    pub message: String,
}

/// The job as the page shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct JobView {
    /// Job name.
    pub name: String,
    /// Model spec.
    pub model: String,
    /// Parameters.
    pub params: u64,
    /// Mesh, printed.
    pub mesh: String,
    /// Global batch.
    pub batch: usize,
    /// Steps in the run.
    pub steps: u64,
    /// Last step finished.
    pub step: u64,
    /// `running`, `finished` or `failed`.
    pub state: String,
    /// `(step, loss)` of every `history_stride`-th step so far and of the newest (at most
    /// [`super::history::MAX_POINTS`] + 1 points, however long the job).
    pub losses: Vec<(u64, f32)>,
    /// Wall time of the same steps.
    pub step_times: Vec<f64>,
    /// The learning rate of the same steps' updates (`null` where the job reports none).
    pub lrs: Vec<Option<f32>>,
    /// The global gradient norm before clipping of the same steps (`null` unless the job clips).
    pub grad_norms: Vec<Option<f32>>,
    /// One step in this many is on the curve (1 until the curve is full).
    pub history_stride: u64,
    /// Samples per second of the last step.
    pub samples_per_s: f64,
    /// Estimated device bytes per actor.
    pub device_bytes: Vec<u64>,
    /// Restarts after host losses, oldest first.
    pub restarts: Vec<RestartView>,
}

/// One instruction on the timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpanView {
    /// The step.
    pub step: u64,
    /// Short name.
    pub name: String,
    /// Category (forward, backward, send, recv, all-reduce, optimizer, …).
    pub cat: String,
    /// Start, seconds after the first step shown began.
    pub start_s: f64,
    /// Duration in seconds.
    pub dur_s: f64,
}

/// One actor's lane.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LaneView {
    /// The actor.
    pub actor: usize,
    /// Its device.
    pub device: String,
    /// Its host (empty where the dashboard does not know it).
    pub host: String,
    /// Its pipeline stage.
    pub stage: usize,
    /// Its replica.
    pub replica: usize,
    /// Its spans.
    pub spans: Vec<SpanView>,
}

/// The timeline of the last steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TimelineView {
    /// The steps shown.
    pub steps: Vec<u64>,
    /// Seconds from the first span's start to the last span's end.
    pub span_s: f64,
    /// One lane per actor.
    pub lanes: Vec<LaneView>,
}

/// A failure or hang report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureView {
    /// When, seconds since the Unix epoch.
    pub unix_s: f64,
    /// The report.
    pub message: String,
}

/// An actor of a program on the runtime API, as the page shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActorView {
    /// Its id on its host.
    pub id: usize,
    /// Its name.
    pub name: String,
    /// Its Rust type.
    pub type_name: String,
    /// Its device.
    pub device: String,
    /// Its host.
    pub host: String,
    /// Messages handled so far.
    pub handled: u64,
    /// Messages handled per second over the last sampling period.
    pub calls_per_s: f64,
    /// Messages waiting.
    pub queue_depth: u64,
    /// Restarts after panics.
    pub restarts: u32,
    /// Handler panics.
    pub failures: u64,
    /// `running`, or how it ended.
    pub state: String,
}

/// A serving job's replica (`archipelago serve --controller`): where it runs and what it does.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ServingView {
    /// The job's name.
    pub job: String,
    /// Which of the job's replicas this row is (0-based; a job of `--replicas R` on the
    /// cluster has a row per replica, each on its own host).
    pub replica: usize,
    /// The job's replicas.
    pub replicas: usize,
    /// The host it runs on.
    pub host: String,
    /// Where its service listens (`http://…`), once it does.
    pub url: String,
    /// The model, its weights and its cache pool.
    pub summary: String,
    /// `starting`, `serving`, `stopped` (its client went away), or `failed` (with `reason`).
    pub state: String,
    /// Why it failed.
    pub reason: String,
    /// When it was placed (Unix seconds).
    pub started_unix_s: f64,
    /// When it stopped or failed.
    pub ended_unix_s: Option<f64>,
    /// Its replicas' figures, refreshed every second (the JSON's fields `waiting`, `running`,
    /// `blocks_used`, `blocks_total`, `generated_tokens`, `finished`).
    #[serde(flatten)]
    pub load: crate::cluster::serve_part::LoadFigures,
}

/// Everything the page shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DashboardView {
    /// The serving jobs, running ones and those that ended (the newest kept).
    pub serving: Vec<ServingView>,
    /// The actors of a program on the runtime API (empty for training jobs).
    pub actors: Vec<ActorView>,
    /// The hosts: the live ones, then those lost.
    pub cluster: Vec<HostRow>,
    /// The running (or last) job.
    pub job: Option<JobView>,
    /// Its last steps.
    pub timeline: TimelineView,
    /// Failures so far.
    pub failures: Vec<FailureView>,
}
