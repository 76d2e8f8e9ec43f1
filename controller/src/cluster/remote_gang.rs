//! The actors of a job spread over hosts, driven from the controller through the runtime API:
//! a runtime on the job's hosts' actor ports ([`Runtime::on_cluster`]), one
//! [`HostPart`] spawned on each host, every step a [`RunPart`] call to every host part at once
//! (Pathways-style parallel dispatch), each host part then calling its device actors. Meanwhile
//! the hosts' sessions tell of lost hosts and the heartbeats of hangs: a lost host ends the step
//! with a report naming the host, its actors and the instruction each was running.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::mpsc::UnboundedReceiver;

use archipelago_actors::checkpoint::ShardFile;
use archipelago_actors::executor::{HeldParams, StepReport};
use archipelago_actors::fabric::DataPath;
use archipelago_actors::proto::{ActorState, Stop, controller_message};
use archipelago_actors::runtime::remote::Liveness;
use archipelago_actors::runtime::{ActorRef, Call, CallError, Message, Runtime, Slot, SpawnOptions};
use archipelago_actors::trust::Credentials;
use archipelago_dataflow::{ActorId, Plan};

use super::host_part::{
    self, HostPart, PartBlockSquares, PartError, PartHeldParams, PartParams, RunPart, SavePart, StartPart,
};
use super::registry::{HostEvent, HostInfo, Registry};
use crate::JobError;
use crate::error::HostLoss;
use crate::gang::Gang;
use crate::hang::{find_hang, progress_of};
use archipelago_actors::progress::ProgressSnapshot;

/// How often a job's heartbeat states are looked at for a hang.
const HANG_SAMPLE: Duration = Duration::from_millis(500);

/// Launches of this controller so far (each launch's key on the hosts is unique).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// The actors' progress counters when they last moved, with each host's heartbeat count then.
#[derive(Default)]
struct QuietSince {
    beats: Vec<(ActorId, u64)>,
    heartbeats: Vec<u64>,
    at: Option<Instant>,
}

/// A job's actors on several hosts.
pub struct RemoteGang {
    job: String,
    /// This launch's key on the hosts (named by `Stop`).
    launch: String,
    registry: Arc<Registry>,
    /// The job's hosts with their actors.
    hosts: BTreeMap<u32, (HostInfo, Vec<ActorId>)>,
    events: UnboundedReceiver<HostEvent>,
    /// The plan (devices and instructions of every actor, named in loss reports).
    plan: Arc<Plan>,
    watchdog: Duration,
    /// How long a secondary failure waits for the loss of a host that explains it.
    grace: Duration,
    step: u64,
    /// The runtime on the hosts' actor ports; dropped (on a plain thread) by `stop`.
    runtime: Option<Runtime>,
    /// Each host's part of the job, by host id.
    parts: BTreeMap<u32, ActorRef<HostPart>>,
}

/// What a launch needs besides the plan.
pub struct LaunchSpec<'a> {
    /// The host of each actor.
    pub placement: &'a [HostInfo],
    /// A checkpoint directory to load the actors' state from.
    pub restore: Option<&'a Path>,
    /// How tensors travel between the hosts.
    pub data_path: DataPath,
    /// How long a receive may wait.
    pub patience: Duration,
    /// How long a secondary failure waits for the loss of a host that explains it.
    pub grace: Duration,
    /// The cluster's credentials (the hosts' actor ports ask for them).
    pub credentials: &'a Credentials,
}

/// What one wait on the host parts saw first.
enum Seen<T> {
    Answer(u32, Result<Result<T, PartError>, CallError>),
    Event(Option<HostEvent>),
    Quiet,
}

impl RemoteGang {
    /// Spawns every host's part of `plan` and waits until all actors have built their
    /// computations.
    pub async fn launch(
        job: &str,
        registry: Arc<Registry>,
        plan: Arc<Plan>,
        spec: LaunchSpec<'_>,
    ) -> Result<RemoteGang, JobError> {
        let LaunchSpec {
            placement,
            restore,
            data_path,
            patience,
            grace,
            credentials,
        } = spec;
        host_part::registry().install();
        let events = registry.subscribe();
        let mut hosts: BTreeMap<u32, (HostInfo, Vec<ActorId>)> = BTreeMap::new();
        for (actor, host) in placement.iter().enumerate() {
            hosts
                .entry(host.id)
                .or_insert_with(|| (host.clone(), Vec::new()))
                .1
                .push(actor);
        }
        let launch = format!("{job}@{}", LAUNCHES.fetch_add(1, Ordering::Relaxed));
        let mut gang = RemoteGang {
            job: job.to_string(),
            launch,
            registry,
            hosts,
            events,
            plan: plan.clone(),
            watchdog: patience + Duration::from_secs(10),
            grace,
            step: 0,
            runtime: None,
            parts: BTreeMap::new(),
        };
        let result = gang.start(&plan, restore, data_path, patience, credentials).await;
        if let Err(e) = result {
            gang.stop();
            return Err(e);
        }
        Ok(gang)
    }

    async fn start(
        &mut self,
        plan: &Plan,
        restore: Option<&Path>,
        data_path: DataPath,
        patience: Duration,
        credentials: &Credentials,
    ) -> Result<(), JobError> {
        // One slot per host: its part lives on the host's first device's thread.
        let slots: Vec<Slot> = (self.hosts.values())
            .map(|(h, _)| Slot {
                host: h.name.clone(),
                island: h.island.clone(),
                addr: h.actor_addr.clone(),
                device: h.devices[0],
            })
            .collect();
        let liveness = Liveness {
            ping_every: Duration::from_millis(250),
            // The registry declares a silent host lost first, and names it.
            patience: 2 * self.grace,
        };
        let (job, credentials) = (self.launch.clone(), credentials.clone());
        let connect =
            tokio::task::spawn_blocking(move || Runtime::on_cluster(&job, slots, credentials, liveness));
        let connected = self
            .guarded(connect)
            .await?
            .map_err(|e| JobError::Runtime(format!("job {}: {e}", self.job)))?;
        let runtime = match connected {
            Ok(runtime) => runtime,
            Err(e) => {
                let error = JobError::Runtime(format!("job {}: cannot reach the job's hosts: {e}", self.job));
                return Err(self.explained(error).await);
            }
        };
        let peers: Vec<String> = (self.hosts.values())
            .flat_map(|(h, actors)| actors.iter().map(move |&a| (a, h)))
            .collect::<BTreeMap<_, _>>()
            .into_values()
            .map(|h| {
                // A shared-memory ring is set up over the raw-TCP tensor port.
                if data_path.uses_tcp_port() {
                    h.tcp_addr.clone()
                } else {
                    h.fabric_addr.clone()
                }
            })
            .collect();
        let spawns: Vec<_> = (self.hosts.iter().enumerate())
            .map(|(slot, (&id, (_, actors)))| {
                // Each host gets its own actors' streams and everyone's placement.
                let params = PartParams {
                    job: self.job.clone(),
                    launch: self.launch.clone(),
                    plan: plan.for_actors(actors),
                    actors: actors.clone(),
                    peers: peers.clone(),
                    patience,
                    restore: restore.map(|p| p.display().to_string()),
                    data_path,
                };
                (
                    id,
                    runtime.spawn_at::<HostPart>(slot, params, SpawnOptions::default()),
                )
            })
            .collect();
        self.runtime = Some(runtime);
        for (id, spawn) in spawns {
            match self.guarded(spawn).await? {
                Ok(part) => {
                    self.parts.insert(id, part);
                }
                Err(e) => {
                    let name = &self.hosts[&id].0.name;
                    let error = JobError::Runtime(format!(
                        "job {}: cannot start the job's part on host `{name}`: {e}",
                        self.job
                    ));
                    return Err(self.explained(error).await);
                }
            }
        }
        self.call_all(|| StartPart).await?;
        Ok(())
    }

    /// Ends the job's part on every host still there.
    pub fn stop(&mut self) {
        for &id in self.hosts.keys() {
            let stop = Stop {
                job: self.launch.clone(),
                reason: "the job ended".into(),
            };
            let _ = self.registry.send(id, controller_message::Kind::Stop(stop));
        }
        self.parts.clear();
        if let Some(runtime) = self.runtime.take() {
            // A runtime is not dropped inside an async context; its connections close with it,
            // which stops the host parts.
            std::thread::spawn(move || drop(runtime));
        }
    }

    /// A host part's error with the host named in its actor's failure.
    fn with_host_named(&self, id: u32, mut part: PartError) -> PartError {
        if let Some(failure) = part.failure.as_mut()
            && failure.host.is_empty()
            && let Some((info, _)) = self.hosts.get(&id)
        {
            failure.host = info.name.clone();
        }
        part
    }

    /// The failure to report once `first` (a secondary failure, or a host that did not answer)
    /// came: for up to the grace period, the loss of a host explains it, or another host's
    /// actor that failed on its own.
    async fn root_cause<T, F>(&mut self, first: JobError, pending: &mut FuturesUnordered<F>) -> JobError
    where
        F: Future<Output = (u32, Result<Result<T, PartError>, CallError>)>,
    {
        enum Seen<T> {
            Answer(u32, Result<Result<T, PartError>, CallError>),
            Event(Option<HostEvent>),
            Late,
        }
        let deadline = tokio::time::sleep(self.grace);
        tokio::pin!(deadline);
        loop {
            let seen = tokio::select! {
                Some((id, answer)) = pending.next() => Seen::Answer(id, answer),
                event = self.events.recv() => Seen::Event(event),
                _ = &mut deadline => Seen::Late,
            };
            match seen {
                Seen::Answer(id, Ok(Err(part))) if !part.secondary() => {
                    return self.with_host_named(id, part).into();
                }
                Seen::Answer(..) => {}
                Seen::Event(Some(HostEvent::Gone(info, why, states)))
                    if self.hosts.contains_key(&info.id) =>
                {
                    return self.lost(&info, &why, &states);
                }
                Seen::Event(Some(_)) => {}
                Seen::Event(None) | Seen::Late => return first,
            }
        }
    }

    /// Waits for `work` (connecting to the hosts, spawning a part) while watching for the loss
    /// of one of the job's hosts, for at most the watchdog: a host that accepts a connection but
    /// never answers (stopped, overloaded) ends the launch instead of hanging it.
    async fn guarded<T>(&mut self, work: impl Future<Output = T>) -> Result<T, JobError> {
        // A value that lives for one turn of the loop: its size does not matter.
        #[allow(clippy::large_enum_variant)]
        enum Seen<T> {
            Done(T),
            Event(Option<HostEvent>),
            Late,
        }
        tokio::pin!(work);
        let deadline = tokio::time::sleep(self.watchdog);
        tokio::pin!(deadline);
        loop {
            let seen = tokio::select! {
                out = &mut work => Seen::Done(out),
                event = self.events.recv() => Seen::Event(event),
                _ = &mut deadline => Seen::Late,
            };
            match seen {
                Seen::Done(out) => return Ok(out),
                Seen::Event(Some(HostEvent::Gone(info, why, states))) => {
                    if self.hosts.contains_key(&info.id) {
                        return Err(self.lost(&info, &why, &states));
                    }
                }
                Seen::Event(None) => {
                    return Err(JobError::Runtime(format!(
                        "job {}: the registry closed",
                        self.job
                    )));
                }
                Seen::Late => {
                    return Err(JobError::Hang {
                        job: self.job.clone(),
                        step: self.step,
                        silent: self.hosts.values().flat_map(|(_, a)| a.iter().copied()).collect(),
                        waited_s: self.watchdog.as_secs_f64(),
                    });
                }
            }
        }
    }

    /// `error`, or the loss of a host that explains it (a call to a vanished host fails before
    /// the registry names the host).
    async fn explained(&mut self, error: JobError) -> JobError {
        self.wait_for_loss().await.unwrap_or(error)
    }

    /// Calls every host's part with `message` at once and gathers the replies by host.
    async fn call_all<M, T>(&mut self, message: impl Fn() -> M) -> Result<Vec<(u32, T)>, JobError>
    where
        M: Message<Reply = Result<T, PartError>>,
        HostPart: archipelago_actors::runtime::Handler<M>,
        T: Send + 'static,
    {
        let calls: Vec<(u32, Call<Result<T, PartError>>)> = (self.parts.iter())
            .map(|(&id, part)| (id, part.call(message())))
            .collect();
        self.gather(calls).await
    }

    /// Waits for every call's reply; fails on a failure, a lost host, a hang among the actors or
    /// silence past the watchdog.
    async fn gather<T>(
        &mut self,
        calls: Vec<(u32, Call<Result<T, PartError>>)>,
    ) -> Result<Vec<(u32, T)>, JobError> {
        let mut waiting: BTreeSet<u32> = calls.iter().map(|(id, _)| *id).collect();
        let mut pending: FuturesUnordered<_> = (calls.into_iter())
            .map(|(id, call)| async move { (id, call.await) })
            .collect();
        let mut out = Vec::with_capacity(waiting.len());
        let started = Instant::now();
        let (mut quiet, mut last_event) = (QuietSince::default(), Instant::now());
        while !waiting.is_empty() {
            let left = self.watchdog.saturating_sub(last_event.elapsed());
            let seen = tokio::select! {
                Some((id, answer)) = pending.next() => Seen::Answer(id, answer),
                event = self.events.recv() => Seen::Event(event),
                _ = tokio::time::sleep(HANG_SAMPLE.min(left)) => Seen::Quiet,
            };
            match seen {
                Seen::Answer(id, answer) => {
                    last_event = Instant::now();
                    waiting.remove(&id);
                    match answer {
                        Ok(Ok(value)) => out.push((id, value)),
                        Ok(Err(part)) => {
                            let part = self.with_host_named(id, part);
                            if !part.secondary() {
                                return Err(part.into());
                            }
                            // A peer that stopped because a host vanished or another actor
                            // failed: report the vanished host or that actor.
                            return Err(self.root_cause(part.into(), &mut pending).await);
                        }
                        Err(call) => {
                            let name = self.hosts.get(&id).map_or("?".into(), |h| h.0.name.clone());
                            let error = JobError::Runtime(format!(
                                "job {}, step {}: host `{name}` did not answer: {call}",
                                self.job, self.step
                            ));
                            return Err(self.root_cause(error, &mut pending).await);
                        }
                    }
                }
                Seen::Event(None) => {
                    return Err(JobError::Runtime(format!(
                        "job {}: the registry closed",
                        self.job
                    )));
                }
                Seen::Event(Some(HostEvent::Gone(info, why, states))) => {
                    if self.hosts.contains_key(&info.id) {
                        return Err(self.lost(&info, &why, &states));
                    }
                }
                Seen::Quiet if last_event.elapsed() < self.watchdog => {
                    if let Some(hang) = self.hang(&mut quiet) {
                        return Err(hang);
                    }
                }
                Seen::Quiet => {
                    let silent: Vec<usize> = waiting
                        .iter()
                        .flat_map(|h| self.hosts[h].1.iter().copied())
                        .collect();
                    return Err(JobError::Hang {
                        job: self.job.clone(),
                        step: self.step,
                        silent,
                        waited_s: started.elapsed().as_secs_f64(),
                    });
                }
            }
        }
        out.sort_by_key(|(id, _)| *id);
        Ok(out)
    }

    /// A hang among the job's actors as the hosts' heartbeats show them: no actor progressed
    /// while every host sent two more heartbeats, and a wait-for chain can never resolve.
    fn hang(&self, quiet: &mut QuietSince) -> Option<JobError> {
        let hosts: Vec<u32> = self.hosts.keys().copied().collect();
        let (states, heartbeats) = self.registry.heartbeat_states(&hosts);
        let progress: Vec<(ActorId, ProgressSnapshot)> = states.iter().map(progress_of).collect();
        let beats: Vec<(ActorId, u64)> = progress.iter().map(|(a, p)| (*a, p.beats)).collect();
        if quiet.beats != beats || heartbeats.len() != hosts.len() {
            *quiet = QuietSince {
                beats,
                heartbeats,
                at: Some(Instant::now()),
            };
            return None;
        }
        let two_more = heartbeats
            .iter()
            .zip(&quiet.heartbeats)
            .all(|(now, then)| *now >= then + 2);
        if !two_more {
            return None;
        }
        let states: Vec<(ActorId, Option<ProgressSnapshot>)> =
            progress.into_iter().map(|(a, p)| (a, Some(p))).collect();
        let report = find_hang(&states, |a, i| {
            (a < self.plan.actors.len()).then(|| self.plan.streams.instruction(a, i))?
        })?;
        Some(JobError::Deadlock {
            job: self.job.clone(),
            report: Box::new(report),
            detected_s: quiet.at.map_or(0.0, |at| at.elapsed().as_secs_f64()),
        })
    }

    async fn wait_for_loss(&mut self) -> Option<JobError> {
        let deadline = Instant::now() + self.grace;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.events.recv()).await {
                Ok(Some(HostEvent::Gone(info, why, states))) if self.hosts.contains_key(&info.id) => {
                    return Some(self.lost(&info, &why, &states));
                }
                Ok(Some(_)) => {}
                _ => return None,
            }
        }
    }

    fn lost(&mut self, info: &HostInfo, why: &str, states: &[ActorState]) -> JobError {
        let actors = self.hosts.remove(&info.id).map(|h| h.1).unwrap_or_default();
        let described: Vec<String> = actors
            .iter()
            .map(|&a| {
                let device = self.plan.actors[a].device;
                let doing = match states.iter().find(|s| s.actor as usize == a) {
                    // The last heartbeat came before the running step began.
                    Some(s) if s.step < self.step && self.step > 0 => {
                        format!(
                            "in step {} (no heartbeat since it began; last seen after step {})",
                            self.step, s.step
                        )
                    }
                    None if self.step > 0 => format!("in step {} (no heartbeat since the launch)", self.step),
                    Some(s) if s.index >= 0 => format!(
                        "at step {} instruction {} `{}`",
                        s.step,
                        s.index,
                        (self.plan.streams.instruction(a, s.index as usize))
                            .map_or_else(|| "?".to_string(), |i| i.to_string())
                    ),
                    Some(s) => format!("between steps (after step {})", s.step),
                    None => "not yet heard from".to_string(),
                };
                format!("actor {a} on {device} {doing}")
            })
            .collect();
        JobError::HostLost(Box::new(HostLoss {
            job: self.job.clone(),
            step: self.step,
            host: info.name.clone(),
            pid: info.pid,
            addr: info.fabric_addr.clone(),
            why: why.to_string(),
            actors: described.join(", "),
        }))
    }
}

impl Gang for RemoteGang {
    async fn step(&mut self, n: u64) -> Result<Vec<StepReport>, JobError> {
        self.step = n;
        let parts = self.call_all(|| RunPart(n)).await?;
        let mut reports: Vec<StepReport> = parts.into_iter().flat_map(|(_, r)| r).collect();
        reports.sort_by_key(|r| r.actor);
        Ok(reports)
    }

    async fn block_squares(&mut self) -> Result<Vec<(usize, f64)>, JobError> {
        let parts = self.call_all(|| PartBlockSquares).await?;
        Ok(parts.into_iter().flat_map(|(_, s)| s).collect())
    }

    async fn held_params(&mut self) -> Result<Vec<(ActorId, Vec<HeldParams>)>, JobError> {
        let parts = self.call_all(|| PartHeldParams).await?;
        let mut held: Vec<_> = parts.into_iter().flat_map(|(_, p)| p).collect();
        held.sort_by_key(|(actor, _)| *actor);
        Ok(held)
    }

    async fn checkpoint(&mut self, dir: &Path, step: u64) -> Result<Vec<ShardFile>, JobError> {
        let dir = dir.display().to_string();
        let parts = self
            .call_all(|| SavePart {
                dir: dir.clone(),
                step,
            })
            .await?;
        let mut files: Vec<ShardFile> = parts.into_iter().flat_map(|(_, f)| f).collect();
        files.sort_by_key(|f| f.header.actor);
        Ok(files)
    }
}
