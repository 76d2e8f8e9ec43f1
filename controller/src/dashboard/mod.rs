//! `--dashboard ADDR`: a live web page of the cluster and the running job, served with axum.
//!
//! The page (`page.html` with `page.css`, `chart.js`, `timeline.js` and `page.js` put in, all
//! bundled into the binary: nothing is loaded from the network) shows the job (step, loss and
//! learning rate by step on axes with values on hover, restarts marked, throughput, step time),
//! a timeline of the last steps with one lane per actor named by host and device, a legend of
//! its colours and a time axis (pipeline bubbles are the gaps), the cluster (islands, hosts —
//! lost ones marked lost, with when —, devices, memory per device) and failures as they
//! happen. It renders the state embedded in the page at request time, then every server-sent
//! event (`/events`), each carrying the whole state. JSON endpoints serve the same data:
//! `/api/state`, `/api/cluster`, `/api/job`, `/api/timeline`, `/api/failures`, `/api/actors`
//! (the actors of a program on the runtime API, with their message rates and failures),
//! `/api/serving` (the serving jobs, a row per replica: host, address, load, cache blocks, how
//! they ended).
//!
//! Nothing listens openly (see [`access`]): on a loopback address the page is open to this
//! machine; on any other address every request must carry the cluster token
//! ([`Dashboard::require_token`]), and serving there without one is refused.

pub mod access;
mod cluster;
pub mod history;
mod serving;
mod timeline;
mod views;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Json};
use axum::routing::get;
use tokio::sync::broadcast;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::BroadcastStream;

use archipelago_actors::executor::StepReport;
use archipelago_dataflow::Plan;

use crate::report::StepRecord;
pub use views::{
    ActorView, DashboardView, DeviceMemoryView, FailureView, HostRow, HostView, JobView, LaneView,
    RestartView, ServingView, SpanView, TimelineView,
};

/// The page; its style sheet and scripts are put in where it names them.
const PAGE: &str = include_str!("page.html");
const STYLE: &str = include_str!("page.css");
const SCRIPTS: [(&str, &str); 3] = [
    ("/*CHART_JS*/", include_str!("chart.js")),
    ("/*TIMELINE_JS*/", include_str!("timeline.js")),
    ("/*PAGE_JS*/", include_str!("page.js")),
];
/// Steps kept in the timeline.
const TIMELINE_STEPS: usize = 3;

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
    /// The host of each actor of the job, where the cluster placed it (see
    /// [`Dashboard::set_actor_hosts`]).
    actor_hosts: Mutex<Vec<String>>,
    events: broadcast::Sender<String>,
    /// The cluster token a request must carry when the page is served on a non-loopback address.
    token: Mutex<Option<String>>,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Dashboard {
    /// An empty dashboard.
    pub fn new() -> Arc<Dashboard> {
        let (events, _) = broadcast::channel(64);
        Arc::new(Dashboard {
            view: Mutex::default(),
            recent: Mutex::default(),
            actor_hosts: Mutex::default(),
            events,
            token: Mutex::default(),
        })
    }

    /// Every request must carry `token` (the cluster token) when this dashboard is served on an
    /// address other than loopback; without one, [`serve`] refuses such an address.
    pub fn require_token(&self, token: &str) {
        *lock(&self.token) = Some(token.to_string());
    }

    /// Shows these actors (a program on the runtime API).
    pub fn set_actors(&self, actors: Vec<ActorView>) {
        self.update(|v| v.actors = actors);
    }

    /// A copy of what the page shows.
    pub fn view(&self) -> DashboardView {
        lock(&self.view).clone()
    }

    fn update(&self, change: impl FnOnce(&mut DashboardView)) {
        let mut view = lock(&self.view);
        change(&mut view);
        if let Ok(json) = serde_json::to_string(&*view) {
            // No page open: nobody receives, nothing is kept beyond the channel's 64 slots.
            let _ = self.events.send(json);
        }
    }

    /// The live hosts of the cluster are now `hosts`; a host no longer among them stays in the
    /// table, marked lost.
    pub fn set_cluster(&self, hosts: Vec<HostView>) {
        self.update(|v| cluster::set_hosts(&mut v.cluster, hosts, unix_now()));
    }

    /// Host `name` was lost (`message` says how): marked lost in the table, with the time, and
    /// the message added to the failures.
    pub fn host_lost(&self, name: &str, message: &str) {
        self.update(|v| {
            cluster::mark_lost(&mut v.cluster, name, unix_now(), message);
            push_failure(v, message.to_string());
        });
    }

    /// The next job's actors run on these hosts (one name per actor, in actor order); a job
    /// in this process needs none (its actors are on the one host of the table).
    pub fn set_actor_hosts(&self, hosts: Vec<String>) {
        *lock(&self.actor_hosts) = hosts;
    }

    /// A job starts on `plan`.
    pub fn job_started(&self, plan: &Plan, name: &str, steps: u64) {
        lock(&self.recent).clear();
        let p = &plan.program;
        let job = JobView {
            name: name.to_string(),
            model: p.model.name.clone(),
            params: p.model.distinct_params(),
            mesh: plan.mesh.to_string(),
            batch: p.plan.batch,
            steps,
            state: "running".into(),
            device_bytes: plan.memory.iter().map(|m| m.total()).collect(),
            ..JobView::default()
        };
        self.update(|v| {
            // A restart of the same job keeps its curves and its restarts.
            let kept = v.job.take().filter(|old| old.name == name);
            v.job = Some(match kept {
                Some(old) => JobView {
                    losses: old.losses,
                    step_times: old.step_times,
                    lrs: old.lrs,
                    grad_norms: old.grad_norms,
                    history_stride: old.history_stride,
                    restarts: old.restarts,
                    ..job
                },
                None => job,
            });
            v.timeline = TimelineView::default();
        });
    }

    /// The step of `record` finished with `reports` (one per actor).
    pub fn step_done(&self, plan: &Plan, record: &StepRecord, reports: &[StepReport]) {
        let step = record.step;
        let mut recent = lock(&self.recent);
        recent.retain(|(s, _)| *s < step);
        recent.push((step, reports.to_vec()));
        let keep = recent.len().saturating_sub(TIMELINE_STEPS);
        recent.drain(..keep);
        let named = lock(&self.actor_hosts).clone();
        self.update(|v| {
            let hosts = cluster::actor_hosts(plan, &named, &v.cluster);
            v.timeline = timeline::timeline(plan, &recent, &hosts);
            cluster::set_memory(&mut v.cluster, plan, reports, &hosts);
            let Some(job) = &mut v.job else {
                return;
            };
            let point = history::Point {
                step,
                loss: record.loss,
                time_s: record.time_s,
                lr: record.lr,
                grad_norm: record.grad_norm,
            };
            history::record(job, point);
            job.step = step;
            job.samples_per_s = job.batch as f64 / record.time_s.max(1e-9);
            if let Some(restart) = job.restarts.last_mut() {
                restart.resumed_at_step.get_or_insert(step);
            }
        });
    }

    /// The job restarts after a host loss; `after_step` was the last step finished, `message`
    /// says what happened and where it goes on from (also added to the failures).
    pub fn restart(&self, after_step: u64, message: &str) {
        self.update(|v| {
            if let Some(job) = &mut v.job {
                job.restarts.push(RestartView {
                    after_step,
                    resumed_at_step: None,
                    unix_s: unix_now(),
                    message: message.to_string(),
                });
            }
            push_failure(v, message.to_string());
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

    /// A failure or hang report that did not (yet) end the job.
    pub fn failure(&self, message: &str) {
        self.update(|v| push_failure(v, message.to_string()));
    }
}

/// The page with its style sheet and scripts put in.
fn assembled_page() -> &'static str {
    static ASSEMBLED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ASSEMBLED.get_or_init(|| {
        let page = PAGE.replace("/*PAGE_CSS*/", STYLE);
        SCRIPTS
            .iter()
            .fold(page, |page, (mark, js)| page.replace(mark, js))
    })
}

/// The page with the current state embedded (rendered before the page's load event).
async fn page(State(d): State<Arc<Dashboard>>) -> Html<String> {
    let state = serde_json::to_string(&d.view())
        .unwrap_or_else(|_| "null".into())
        .replace("</", "<\\/");
    Html(assembled_page().replace("/*INITIAL_STATE*/null", &state))
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

async fn serving_json(State(d): State<Arc<Dashboard>>) -> impl IntoResponse {
    Json(d.view().serving)
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
        .route("/api/serving", get(serving_json))
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
