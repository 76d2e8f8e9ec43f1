//! A serving job on the cluster (`archipelago serve --controller`), the controller's side: it
//! places the job on the registered `archipelago host` with the fewest serving jobs, spawns the
//! job's [`ServePart`] there over the host's actor port, tells the client where the service
//! listens, shows the job on the dashboard with its replicas' load (asked every second), and
//! keeps it for as long as the client's call is open. The job ends when the client goes away
//! (the part is stopped with the connection) or fails when its host is lost or its part stops
//! answering — the client hears why, naming the host.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tonic::Status;

use archipelago_actors::proto::{JobEvent, ServingAt, job_event};
use archipelago_actors::runtime::remote::Liveness;
use archipelago_actors::runtime::{ActorRef, Runtime, Slot, SpawnOptions};
use archipelago_actors::trust::Credentials;

use super::registry::{ClusterConfig, HostEvent, HostInfo, Registry};
use super::serve_part::{ServePart, ServingLoad, ServingParams, ServingStarted, StartServing};
use crate::serve::ServeArgs;

/// How often the dashboard's figures of a serving job are refreshed.
const LOAD_EVERY: Duration = Duration::from_secs(1);

/// The longest name a serving job may have.
const MAX_NAME: usize = 64;

/// The serving jobs the controller runs: their names and how many each host holds.
#[derive(Default)]
pub struct ServingJobs {
    started: AtomicU64,
    by_host: Mutex<BTreeMap<u32, usize>>,
    running: Mutex<BTreeSet<String>>,
}

impl ServingJobs {
    /// A new job's name, now taken: the client's (at most 64 of `A-Z a-z 0-9 . _ -`,
    /// not one running), or `serve-N`.
    pub fn name(&self, asked: &str) -> Result<String, String> {
        let mut running = self.running.lock().expect("serving jobs");
        let name = match asked {
            "" => loop {
                let n = self.started.fetch_add(1, Ordering::Relaxed) + 1;
                let name = format!("serve-{n}");
                if !running.contains(&name) {
                    break name;
                }
            },
            name if name.len() > MAX_NAME
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) =>
            {
                return Err(format!(
                    "serving job name `{}`: use at most {MAX_NAME} of A-Z a-z 0-9 . _ -",
                    name.chars().take(MAX_NAME).collect::<String>().escape_debug()
                ));
            }
            name if running.contains(name) => {
                return Err(format!(
                    "a serving job named `{name}` already runs: give another --job"
                ));
            }
            name => name.to_string(),
        };
        running.insert(name.clone());
        Ok(name)
    }

    /// The job named `name` ended: the name is free again.
    fn ended(&self, name: &str) {
        self.running.lock().expect("serving jobs").remove(name);
    }

    /// The host among `hosts` holding the fewest serving jobs (the first of those), counted as
    /// holding one more.
    fn place(&self, hosts: &[HostInfo]) -> Option<HostInfo> {
        let mut by_host = self.by_host.lock().expect("serving jobs by host");
        let host = hosts
            .iter()
            .min_by_key(|h| by_host.get(&h.id).copied().unwrap_or(0))?;
        *by_host.entry(host.id).or_default() += 1;
        Some(host.clone())
    }

    fn release(&self, host: u32) {
        let mut by_host = self.by_host.lock().expect("serving jobs by host");
        if let Some(n) = by_host.get_mut(&host) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Everything a serving job uses on the controller.
pub struct ServingJob {
    /// The cluster's hosts.
    pub registry: Arc<Registry>,
    /// The cluster's settings (and dashboard).
    pub config: ClusterConfig,
    /// The cluster's credentials (shown at the host's actor port).
    pub credentials: Credentials,
    /// The controller's serving jobs.
    pub jobs: Arc<ServingJobs>,
    /// The job's name.
    pub name: String,
    /// `serve`'s flags.
    pub args: ServeArgs,
    /// The client's events.
    pub events: UnboundedSender<Result<JobEvent, Status>>,
}

/// Why a serving job ended.
enum Ended {
    /// Its client closed the call.
    Stopped,
    /// It failed: why, naming the host.
    Failed(String),
}

impl ServingJob {
    /// Places and runs the job until its client goes away or it fails.
    pub async fn run(self) {
        let wait = self.config.wait_for_hosts;
        let hosts = self.registry.wait_for_devices(1, wait, false).await;
        let Some(host) = self.jobs.place(&hosts) else {
            self.jobs.ended(&self.name);
            self.send(job_event::Kind::Error(format!(
                "serving job {}: no `archipelago host` registered with the controller after waiting {wait:?}; start one (`archipelago host --controller …`)",
                self.name
            )));
            return;
        };
        let dashboard = self.config.dashboard.clone();
        if let Some(d) = &dashboard {
            d.serving_placed(&self.name, &host.name);
        }
        self.send(job_event::Kind::Info(format!(
            "serving job {} placed on host `{}` ({})",
            self.name, host.name, host.devices[0]
        )));
        // The part's types, known here as on every host.
        super::serve_part::registry().install();
        let mut losses = self.registry.watch();
        let (runtime, ended) = self.serve_on(&host, &mut losses).await;
        if let Some(runtime) = runtime {
            // A runtime is not dropped inside an async context; its connection closes with it,
            // which stops the part and its service.
            std::thread::spawn(move || drop(runtime));
        }
        self.jobs.release(host.id);
        self.jobs.ended(&self.name);
        let failure = match &ended {
            Ended::Stopped => None,
            Ended::Failed(why) => Some(why.as_str()),
        };
        if let Some(d) = &dashboard {
            d.serving_ended(&self.name, failure);
        }
        match failure {
            Some(why) => {
                tracing::error!(job = %self.name, host = %host.name, "{why}");
                self.send(job_event::Kind::Error(why.to_string()));
            }
            None => {
                tracing::info!(job = %self.name, host = %host.name, "serving job stopped: its client went away")
            }
        }
    }

    /// Starts the part on `host` and keeps it while the client listens; the runtime that reaches
    /// it (to be dropped off the async context) and how the job ended.
    async fn serve_on(
        &self,
        host: &HostInfo,
        losses: &mut UnboundedReceiver<HostEvent>,
    ) -> (Option<Runtime>, Ended) {
        let named = |why: String| format!("serving job {} on host `{}`: {why}", self.name, host.name);
        let slot = Slot {
            host: host.name.clone(),
            island: host.island.clone(),
            addr: host.actor_addr.clone(),
            device: host.devices[0],
        };
        let liveness = Liveness {
            ping_every: Duration::from_millis(250),
            // The registry declares a silent host lost first, and names it.
            patience: 2 * self.config.host_timeout,
        };
        let (job, credentials) = (self.name.clone(), self.credentials.clone());
        let connect =
            tokio::task::spawn_blocking(move || Runtime::on_cluster(&job, vec![slot], credentials, liveness));
        let runtime = match self.unless_lost(host, losses, connect).await {
            Err(lost) => return (None, lost),
            Ok(Ok(Ok(runtime))) => runtime,
            Ok(Ok(Err(e))) => return (None, Ended::Failed(named(format!("cannot reach the host: {e}")))),
            Ok(Err(e)) => return (None, Ended::Failed(named(format!("cannot reach the host: {e}")))),
        };
        let params = ServingParams {
            job: self.name.clone(),
            args: self.args.clone(),
        };
        let spawn = runtime.spawn_at::<ServePart>(0, params, SpawnOptions::default());
        let part = match self.unless_lost(host, losses, spawn).await {
            Err(lost) => return (Some(runtime), lost),
            Ok(Ok(part)) => part,
            Ok(Err(e)) => {
                return (
                    Some(runtime),
                    Ended::Failed(named(format!("cannot start its part: {e}"))),
                );
            }
        };
        let started = match self.unless_lost(host, losses, part.call(StartServing)).await {
            Err(lost) => return (Some(runtime), lost),
            Ok(Ok(Ok(started))) => started,
            Ok(Ok(Err(why))) => return (Some(runtime), Ended::Failed(why)),
            Ok(Err(e)) => return (Some(runtime), Ended::Failed(named(e.to_string()))),
        };
        let ended = self.serving(host, losses, &part, started).await;
        (Some(runtime), ended)
    }

    /// The service is up: tell the client and the dashboard, then follow it.
    async fn serving(
        &self,
        host: &HostInfo,
        losses: &mut UnboundedReceiver<HostEvent>,
        part: &ActorRef<ServePart>,
        started: ServingStarted,
    ) -> Ended {
        let dashboard = self.config.dashboard.clone();
        if let Some(d) = &dashboard {
            d.serving_started(&self.name, &started.url, &started.summary);
        }
        self.send(job_event::Kind::Serving(ServingAt {
            job: self.name.clone(),
            host: host.name.clone(),
            url: started.url.clone(),
            summary: started.summary,
        }));
        tracing::info!(job = %self.name, host = %host.name, url = %started.url, "serving");
        loop {
            tokio::select! {
                _ = self.events.closed() => return Ended::Stopped,
                _ = tokio::time::sleep(LOAD_EVERY) => {}
            }
            let figures = match self.unless_lost(host, losses, part.call(ServingLoad)).await {
                // The part's own error names the job and the host.
                Err(lost) => return lost,
                Ok(Ok(Ok(figures))) => figures,
                Ok(Ok(Err(why))) => return Ended::Failed(why),
                Ok(Err(e)) => {
                    return Ended::Failed(format!(
                        "serving job {}: its part on host `{}` stopped answering: {e}",
                        self.name, host.name
                    ));
                }
            };
            if let Some(d) = &dashboard {
                d.serving_load(&self.name, figures);
            }
        }
    }

    /// `work`'s result, unless `host` is lost (or the client goes away) first.
    async fn unless_lost<T>(
        &self,
        host: &HostInfo,
        losses: &mut UnboundedReceiver<HostEvent>,
        work: impl Future<Output = T>,
    ) -> Result<T, Ended> {
        tokio::pin!(work);
        loop {
            tokio::select! {
                result = &mut work => return Ok(result),
                _ = self.events.closed() => return Err(Ended::Stopped),
                event = losses.recv() => match event {
                    Some(HostEvent::Gone(lost, why, _)) if lost.id == host.id => {
                        return Err(Ended::Failed(format!(
                            "serving job {}: host `{}` (pid {}) was lost: {why}; its service and the requests in flight there ended with it",
                            self.name, lost.name, lost.pid
                        )));
                    }
                    Some(_) => {}
                    None => return Ok(work.await),
                },
            }
        }
    }

    fn send(&self, kind: job_event::Kind) {
        let _ = self.events.send(Ok(JobEvent { kind: Some(kind) }));
    }
}
