//! One replica of a serving job on the cluster, the controller's side: it reaches the replica's
//! host over its actor port, spawns the job's [`ServePart`] there, starts its service, tells
//! the client where it listens, refreshes the dashboard's figures of it every second, and keeps
//! it while the client's call is open. It ends when the client goes away ([`Ended::Stopped`]) or
//! fails when its host is lost or its part stops answering ([`Ended::Failed`], naming the job,
//! the replica and the host); the job (`serving_job`) decides what a
//! failure means for the job (a lost replica while others serve, or the job's end).

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

/// How often the dashboard's figures of a serving replica are refreshed.
const LOAD_EVERY: Duration = Duration::from_secs(1);

/// How long a load query may go unanswered before each warning naming the part and its host
/// (the host is alive — a lost one ends the wait — so the part itself is stuck or starved).
const LOAD_PATIENCE: Duration = Duration::from_secs(10);

/// `work`'s result, with `warn(waited)` called each `every` it is still pending: a wait that
/// never ends is reported, not silent.
async fn reported<T>(work: impl Future<Output = T>, every: Duration, mut warn: impl FnMut(Duration)) -> T {
    tokio::pin!(work);
    let started = tokio::time::Instant::now();
    loop {
        match tokio::time::timeout(every, &mut work).await {
            Ok(result) => return result,
            Err(_) => warn(started.elapsed()),
        }
    }
}

/// Why a serving replica ended.
pub enum Ended {
    /// Its client closed the call.
    Stopped,
    /// It failed: why, naming the job, the replica and the host.
    Failed(String),
}

/// The serving job a replica belongs to, as its replicas share it.
pub struct ReplicaJob<'job> {
    /// The job's name.
    pub name: &'job str,
    /// `serve`'s flags, as the client gave them.
    pub args: &'job ServeArgs,
    /// The cluster's hosts.
    pub registry: &'job Registry,
    /// The cluster's settings (and dashboard).
    pub config: &'job ClusterConfig,
    /// The cluster's credentials (shown at the host's actor port).
    pub credentials: &'job Credentials,
    /// The client's events.
    pub events: &'job UnboundedSender<Result<JobEvent, Status>>,
}

impl ReplicaJob<'_> {
    /// Sends `kind` to the client (gone already: nothing to do).
    pub fn send(&self, kind: job_event::Kind) {
        let _ = self.events.send(Ok(JobEvent { kind: Some(kind) }));
    }
}

/// One replica of a job: which, of how many, on which host.
pub struct ServingReplica<'job> {
    /// The job it serves.
    pub job: &'job ReplicaJob<'job>,
    /// Its index (0-based).
    pub index: usize,
    /// The job's replicas.
    pub replicas: usize,
    /// Where it runs.
    pub host: HostInfo,
}

impl ServingReplica<'_> {
    /// `serving job NAME`, with `replica I` when the job has several.
    pub fn who(&self) -> String {
        match self.replicas {
            1 => format!("serving job {}", self.job.name),
            _ => format!("serving job {} replica {}", self.job.name, self.index),
        }
    }

    /// The flags its host gets: one replica there; with several, listening on a free port of
    /// the host's published address (the client's router reaches every replica there, and its
    /// own `--listen` is the router's).
    fn args(&self) -> ServeArgs {
        let mut args = self.job.args.clone();
        if self.replicas > 1 {
            args.replicas = 1;
            let published = match self.host.fabric_addr.is_empty() {
                true => &self.host.actor_addr,
                false => &self.host.fabric_addr,
            };
            let ip = published.rsplit_once(':').map_or("127.0.0.1", |(ip, _)| ip);
            args.listen = format!("{ip}:0");
        }
        args
    }

    /// Runs the replica until its client goes away or it fails; its runtime (the connection to
    /// its host) is dropped off the async context, which stops its part and its service.
    pub async fn run(self) -> (Self, Ended) {
        let mut losses = self.job.registry.watch();
        let (runtime, ended) = self.serve_on(&mut losses).await;
        if let Some(runtime) = runtime {
            std::thread::spawn(move || drop(runtime));
        }
        (self, ended)
    }

    /// Starts the part on the host and keeps it while the client listens; the runtime that
    /// reaches it (to be dropped off the async context) and how the replica ended.
    async fn serve_on(&self, losses: &mut UnboundedReceiver<HostEvent>) -> (Option<Runtime>, Ended) {
        let named = |why: String| format!("{} on host `{}`: {why}", self.who(), self.host.name);
        let host = &self.host;
        let slot = Slot {
            host: host.name.clone(),
            island: host.island.clone(),
            addr: host.actor_addr.clone(),
            device: host.devices[0],
        };
        let liveness = Liveness {
            ping_every: Duration::from_millis(250),
            // The registry declares a silent host lost first, and names it.
            patience: 2 * self.job.config.host_timeout,
        };
        let (job, credentials) = (self.job.name.to_string(), self.job.credentials.clone());
        let connect =
            tokio::task::spawn_blocking(move || Runtime::on_cluster(&job, vec![slot], credentials, liveness));
        let runtime = match self.unless_lost(losses, connect).await {
            Err(lost) => return (None, lost),
            Ok(Ok(Ok(runtime))) => runtime,
            Ok(Ok(Err(e))) => return (None, Ended::Failed(named(format!("cannot reach the host: {e}")))),
            Ok(Err(e)) => return (None, Ended::Failed(named(format!("cannot reach the host: {e}")))),
        };
        let params = ServingParams {
            job: self.job.name.to_string(),
            args: self.args(),
        };
        let spawn = runtime.spawn_at::<ServePart>(0, params, SpawnOptions::default());
        let part = match self.unless_lost(losses, spawn).await {
            Err(lost) => return (Some(runtime), lost),
            Ok(Ok(part)) => part,
            Ok(Err(e)) => {
                let why = named(format!("cannot start its part: {e}"));
                return (Some(runtime), Ended::Failed(why));
            }
        };
        let started = match self.unless_lost(losses, part.call(StartServing)).await {
            Err(lost) => return (Some(runtime), lost),
            Ok(Ok(Ok(started))) => started,
            Ok(Ok(Err(why))) => return (Some(runtime), Ended::Failed(why)),
            Ok(Err(e)) => return (Some(runtime), Ended::Failed(named(e.to_string()))),
        };
        let ended = self.serving(losses, &part, started).await;
        (Some(runtime), ended)
    }

    /// The service is up: tell the client and the dashboard, then follow it.
    async fn serving(
        &self,
        losses: &mut UnboundedReceiver<HostEvent>,
        part: &ActorRef<ServePart>,
        started: ServingStarted,
    ) -> Ended {
        let (job, host) = (self.job.name, &self.host.name);
        let dashboard = self.job.config.dashboard.clone();
        if let Some(d) = &dashboard {
            d.serving_started(job, self.index, &started.url, &started.summary);
        }
        self.job.send(job_event::Kind::Serving(ServingAt {
            job: job.to_string(),
            host: host.clone(),
            url: started.url.clone(),
            summary: started.summary,
            replica: self.index as u32,
            replicas: self.replicas as u32,
        }));
        tracing::info!(job = %job, replica = self.index, host = %host, url = %started.url, "serving");
        loop {
            tokio::select! {
                _ = self.job.events.closed() => return Ended::Stopped,
                _ = tokio::time::sleep(LOAD_EVERY) => {}
            }
            let warn = |waited: Duration| {
                tracing::warn!(
                    "{}: its part on host `{host}` has not answered a load query for {:.0} s (the host is alive: the part is stuck or starved)",
                    self.who(),
                    waited.as_secs_f64()
                );
            };
            let load = reported(part.call(ServingLoad), LOAD_PATIENCE, warn);
            let figures = match self.unless_lost(losses, load).await {
                // The part's own error names the job and the host.
                Err(lost) => return lost,
                Ok(Ok(Ok(figures))) => figures,
                Ok(Ok(Err(why))) => return Ended::Failed(why),
                Ok(Err(e)) => {
                    return Ended::Failed(format!(
                        "{}: its part on host `{host}` stopped answering: {e}",
                        self.who()
                    ));
                }
            };
            if let Some(d) = &dashboard {
                d.serving_load(job, self.index, figures);
            }
        }
    }

    /// `work`'s result, unless the replica's host is lost (or the client goes away) first.
    async fn unless_lost<T>(
        &self,
        losses: &mut UnboundedReceiver<HostEvent>,
        work: impl Future<Output = T>,
    ) -> Result<T, Ended> {
        tokio::pin!(work);
        loop {
            tokio::select! {
                result = &mut work => return Ok(result),
                _ = self.job.events.closed() => return Err(Ended::Stopped),
                event = losses.recv() => match event {
                    Some(HostEvent::Gone(lost, why, _)) if lost.id == self.host.id => {
                        return Err(Ended::Failed(format!(
                            "{}: host `{}` (pid {}) was lost: {why}; its service and the requests in flight there ended with it",
                            self.who(), lost.name, lost.pid
                        )));
                    }
                    Some(_) => {}
                    None => return Ok(work.await),
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait is reported at each patience while it lasts, and an answer in time says nothing.
    #[tokio::test(start_paused = true)]
    async fn a_wait_that_lasts_is_reported_each_patience() {
        let mut warned = Vec::new();
        let late = async {
            tokio::time::sleep(Duration::from_secs(35)).await;
            7
        };
        let answer = reported(late, LOAD_PATIENCE, |w| warned.push(w.as_secs())).await;
        assert_eq!((answer, warned), (7, vec![10, 20, 30]));
        let mut quiet = 0;
        let answer = reported(async { 8 }, LOAD_PATIENCE, |_| quiet += 1).await;
        assert_eq!((answer, quiet), (8, 0));
    }
}
