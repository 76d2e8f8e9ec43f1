//! `--dashboard ADDR`: a live web page of the cluster and the running job, served with axum.
//!
//! The page (`page.html`, bundled into the binary: nothing is loaded from the network) shows the
//! cluster (islands, hosts, devices, memory per device), the job (step, loss curve, throughput,
//! step time), a timeline of the last steps with one lane per actor (pipeline bubbles are the
//! gaps), and failures as they happen. It renders the state embedded in the page at request time,
//! then every server-sent event (`/events`), each carrying the whole state. JSON endpoints serve the same data:
//! `/api/state`, `/api/cluster`, `/api/job`, `/api/timeline`, `/api/failures`, `/api/actors`
//! (the actors of a program on the runtime API, with their message rates and failures).
//!
//! Nothing listens openly (see [`access`]): on a loopback address the page is open to this
//! machine; on any other address every request must carry the cluster token
//! ([`Dashboard::require_token`]), and serving there without one is refused.

pub mod access;
pub mod history;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Json};
use axum::routing::get;
use serde::Serialize;
use tokio::sync::broadcast;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::BroadcastStream;

use archipelago_actors::executor::StepReport;
use archipelago_dataflow::Plan;

use crate::trace::classify_label;

const PAGE: &str = include_str!("page.html");
/// Steps kept in the timeline.
const TIMELINE_STEPS: usize = 3;

/// A host as the page shows it.
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
    /// [`history::MAX_POINTS`] + 1 points, however long the job).
    pub losses: Vec<(u64, f32)>,
    /// Wall time of the same steps.
    pub step_times: Vec<f64>,
    /// One step in this many is on the curve (1 until the curve is full).
    pub history_stride: u64,
    /// Samples per second of the last step.
    pub samples_per_s: f64,
    /// Estimated device bytes per actor.
    pub device_bytes: Vec<u64>,
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

/// Everything the page shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DashboardView {
    /// The actors of a program on the runtime API (empty for training jobs).
    pub actors: Vec<ActorView>,
    /// The hosts.
    pub cluster: Vec<HostView>,
    /// The running (or last) job.
    pub job: Option<JobView>,
    /// Its last steps.
    pub timeline: TimelineView,
    /// Failures so far.
    pub failures: Vec<FailureView>,
}

/// Failures the page keeps (the newest).
const FAILURES_KEPT: usize = 100;

/// Adds a failure to the view, dropping the oldest beyond [`FAILURES_KEPT`].
fn push_failure(v: &mut DashboardView, message: String) {
    v.failures.push(FailureView {
        unix_s: unix_now(),
        message,
    });
    let over = v.failures.len().saturating_sub(FAILURES_KEPT);
    v.failures.drain(..over);
}

/// The dashboard's state; the job loop and the registry feed it.
pub struct Dashboard {
    view: Mutex<DashboardView>,
    /// Raw step reports of the last steps, for the timeline.
    recent: Mutex<Vec<(u64, Vec<StepReport>)>>,
    events: broadcast::Sender<String>,
    /// The cluster token a request must carry when the page is served on a non-loopback address.
    token: Mutex<Option<String>>,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Dashboard {
    /// An empty dashboard.
    pub fn new() -> Arc<Dashboard> {
        let (events, _) = broadcast::channel(64);
        Arc::new(Dashboard {
            view: Mutex::default(),
            recent: Mutex::default(),
            events,
            token: Mutex::default(),
        })
    }

    /// Every request must carry `token` (the cluster token) when this dashboard is served on an
    /// address other than loopback; without one, [`serve`] refuses such an address.
    pub fn require_token(&self, token: &str) {
        *self.token.lock().unwrap_or_else(|p| p.into_inner()) = Some(token.to_string());
    }

    /// Shows these actors (a program on the runtime API).
    pub fn set_actors(&self, actors: Vec<ActorView>) {
        self.update(|v| v.actors = actors);
    }

    /// A copy of what the page shows.
    pub fn view(&self) -> DashboardView {
        self.view.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn update(&self, change: impl FnOnce(&mut DashboardView)) {
        let mut view = self.view.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut view);
        if let Ok(json) = serde_json::to_string(&*view) {
            // No page open: nobody receives, nothing is kept beyond the channel's 64 slots.
            let _ = self.events.send(json);
        }
    }

    /// The hosts of the cluster changed.
    pub fn set_cluster(&self, hosts: Vec<HostView>) {
        self.update(|v| v.cluster = hosts);
    }

    /// A job starts on `plan`.
    pub fn job_started(&self, plan: &Plan, name: &str, steps: u64) {
        self.recent.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let p = &plan.program;
        let job = JobView {
            name: name.to_string(),
            model: p.model.name.clone(),
            params: p.model.params(),
            mesh: plan.mesh.to_string(),
            batch: p.plan.batch,
            steps,
            state: "running".into(),
            device_bytes: plan.memory.iter().map(|m| m.total()).collect(),
            ..JobView::default()
        };
        self.update(|v| {
            // A restart of the same job keeps its loss curve.
            let kept = v.job.take().filter(|old| old.name == name);
            v.job = Some(match kept {
                Some(old) => JobView {
                    losses: old.losses,
                    step_times: old.step_times,
                    history_stride: old.history_stride,
                    ..job
                },
                None => job,
            });
            v.timeline = TimelineView::default();
        });
    }

    /// Step `step` finished with `reports` (one per actor).
    pub fn step_done(&self, plan: &Plan, step: u64, loss: f32, time_s: f64, reports: &[StepReport]) {
        let timeline = {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            recent.retain(|(s, _)| *s < step);
            recent.push((step, reports.to_vec()));
            let keep = recent.len().saturating_sub(TIMELINE_STEPS);
            recent.drain(..keep);
            timeline(plan, &recent)
        };
        self.update(|v| {
            if let Some(job) = &mut v.job {
                let (losses, times, stride) = (&mut job.losses, &mut job.step_times, &mut job.history_stride);
                history::record(losses, times, stride, step, loss, time_s);
                job.step = step;
                job.samples_per_s = job.batch as f64 / time_s.max(1e-9);
            }
            v.timeline = timeline;
        });
    }

    /// The job ended (with the error, when it failed).
    pub fn job_ended(&self, error: Option<&str>) {
        self.update(|v| {
            if let Some(job) = &mut v.job {
                job.state = if error.is_some() { "failed" } else { "finished" }.into();
            }
            if let Some(message) = error {
                push_failure(v, message.to_string());
            }
        });
    }

    /// A failure or hang report that did not (yet) end the job, e.g. a lost host.
    pub fn failure(&self, message: &str) {
        self.update(|v| push_failure(v, message.to_string()));
    }
}

fn timeline(plan: &Plan, recent: &[(u64, Vec<StepReport>)]) -> TimelineView {
    let origin = recent
        .iter()
        .flat_map(|(_, rs)| rs.iter().map(|r| r.began_unix_s))
        .fold(f64::INFINITY, f64::min);
    let mut lanes: Vec<LaneView> = plan
        .actors
        .iter()
        .map(|a| LaneView {
            actor: a.actor,
            device: a.device.to_string(),
            stage: a.stage,
            replica: a.replica,
            spans: Vec::new(),
        })
        .collect();
    let mut end: f64 = 0.0;
    for (step, reports) in recent {
        for r in reports {
            let Some(lane) = lanes.get_mut(r.actor) else {
                continue;
            };
            let stream = &plan.actors[r.actor].stream.instructions;
            for t in &r.timings {
                let Some(instruction) = stream.get(t.index) else {
                    continue;
                };
                let (cat, name) = classify_label(instruction);
                let start_s = r.began_unix_s - origin + t.start_s;
                end = end.max(start_s + t.seconds);
                lane.spans.push(SpanView {
                    step: *step,
                    name,
                    cat: cat.to_string(),
                    start_s,
                    dur_s: t.seconds,
                });
            }
        }
    }
    TimelineView {
        steps: recent.iter().map(|(s, _)| *s).collect(),
        span_s: end,
        lanes,
    }
}

/// The page with the current state embedded (rendered before the page's load event).
async fn page(State(d): State<Arc<Dashboard>>) -> Html<String> {
    let state = serde_json::to_string(&d.view())
        .unwrap_or_else(|_| "null".into())
        .replace("</", "<\\/");
    Html(PAGE.replace("/*INITIAL_STATE*/null", &state))
}

async fn state(State(d): State<Arc<Dashboard>>) -> Json<DashboardView> {
    Json(d.view())
}

async fn cluster(State(d): State<Arc<Dashboard>>) -> impl IntoResponse {
    Json(d.view().cluster)
}

async fn job(State(d): State<Arc<Dashboard>>) -> impl IntoResponse {
    Json(d.view().job)
}

async fn timeline_json(State(d): State<Arc<Dashboard>>) -> impl IntoResponse {
    Json(d.view().timeline)
}

async fn failures(State(d): State<Arc<Dashboard>>) -> impl IntoResponse {
    Json(d.view().failures)
}

async fn actors(State(d): State<Arc<Dashboard>>) -> impl IntoResponse {
    Json(d.view().actors)
}

async fn events(
    State(d): State<Arc<Dashboard>>,
) -> Sse<impl tokio_stream::Stream<Item = Result<Event, Infallible>>> {
    // A slow page skips states (each event is the whole state): lagged events are dropped.
    let stream = BroadcastStream::new(d.events.subscribe())
        .filter_map(|e| e.ok())
        .map(|json| Ok(Event::default().data(json)));
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// Serves `dashboard` on `listener` (on the current tokio runtime); returns its address.
///
/// On a loopback address the page is open; on any other it answers only requests with the
/// token given to [`Dashboard::require_token`] (401 and a log line otherwise), and without such
/// a token this returns a `PermissionDenied` error that says what to change.
pub fn serve(listener: tokio::net::TcpListener, dashboard: Arc<Dashboard>) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let token = dashboard.token.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let token = access::token_for(addr, token.as_deref())?;
    let app = Router::new()
        .route("/", get(page))
        .route("/api/state", get(state))
        .route("/api/cluster", get(cluster))
        .route("/api/job", get(job))
        .route("/api/timeline", get(timeline_json))
        .route("/api/failures", get(failures))
        .route("/api/actors", get(actors))
        .route("/events", get(events))
        .with_state(dashboard);
    let app = match token {
        Some(token) => app.layer(axum::middleware::from_fn_with_state(token, access::guard)),
        None => app,
    };
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, service).await {
            tracing::error!("the dashboard on {addr} stopped: {e}");
        }
    });
    Ok(addr)
}
