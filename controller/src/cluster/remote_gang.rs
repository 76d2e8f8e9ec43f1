//! The actors of a job spread over hosts, driven from the controller through the hosts' sessions:
//! `Launch` to every host at once, `Step` to every host at once and one `StepDone` from each
//! (Pathways-style parallel dispatch), questions as `Ask`/`Answer`. A lost host ends the step
//! with a report naming the host, its actors and the instruction each was running.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedReceiver;

use archipelago_actors::ActorFailure;
use archipelago_actors::checkpoint::ShardFile;
use archipelago_actors::executor::StepReport;
use archipelago_actors::fabric::DataPath;
use archipelago_actors::proto::{ActorState, Ask, Launch, Step, Stop, controller_message, host_message};
use archipelago_dataflow::{ActorId, Plan};

use super::registry::{HostEvent, HostInfo, Registry};
use crate::JobError;
use crate::error::HostLoss;
use crate::gang::Gang;
use crate::hang::{find_hang, progress_of};
use archipelago_actors::progress::ProgressSnapshot;

/// How often a job's heartbeat states are looked at for a hang.
const HANG_SAMPLE: Duration = Duration::from_millis(500);

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
    registry: Arc<Registry>,
    /// The job's hosts with their actors.
    hosts: BTreeMap<u32, (HostInfo, Vec<ActorId>)>,
    events: UnboundedReceiver<HostEvent>,
    /// The plan (devices and instructions of every actor, named in loss reports).
    plan: Arc<Plan>,
    watchdog: Duration,
    /// How long a secondary failure waits for the loss of a host that explains it.
    grace: Duration,
    next_ask: u64,
    step: u64,
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
}

impl RemoteGang {
    /// Sends every host its part of `plan` and waits until all actors have built their
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
        } = spec;
        let events = registry.subscribe();
        let mut hosts: BTreeMap<u32, (HostInfo, Vec<ActorId>)> = BTreeMap::new();
        for (actor, host) in placement.iter().enumerate() {
            hosts
                .entry(host.id)
                .or_insert_with(|| (host.clone(), Vec::new()))
                .1
                .push(actor);
        }
        let mut gang = RemoteGang {
            job: job.to_string(),
            registry,
            hosts,
            events,
            plan: plan.clone(),
            watchdog: patience + Duration::from_secs(10),
            grace,
            next_ask: 0,
            step: 0,
        };
        let actor_addrs: Vec<String> = placement
            .iter()
            .map(|h| {
                // A shared-memory ring is set up over the raw-TCP tensor port.
                if data_path.uses_tcp_port() {
                    h.tcp_addr.clone()
                } else {
                    h.fabric_addr.clone()
                }
            })
            .collect();
        for (&id, (_, actors)) in &gang.hosts {
            // Each host gets its own actors' streams and everyone's placement (`Plan::for_actors`).
            let plan_bytes = archipelago_actors::codec::encode(&plan.for_actors(actors))
                .map_err(|e| JobError::Runtime(e.to_string()))?;
            let launch = Launch {
                job: job.to_string(),
                plan: plan_bytes.into(),
                actors: actors.iter().map(|&a| a as u32).collect(),
                actor_addrs: actor_addrs.clone(),
                patience_ms: patience.as_millis() as u64,
                restore: restore.map(|p| p.display().to_string()).unwrap_or_default(),
                data_path: data_path.to_string(),
            };
            gang.registry
                .send(id, controller_message::Kind::Launch(launch))
                .map_err(JobError::Runtime)?;
        }
        if let Err(e) = gang
            .collect(|kind| matches!(kind, host_message::Kind::Ready(_)).then_some(()))
            .await
        {
            gang.stop();
            return Err(e);
        }
        Ok(gang)
    }

    /// Tells every host still there to stop the job's actors.
    pub fn stop(&mut self) {
        for &id in self.hosts.keys() {
            let stop = Stop {
                job: self.job.clone(),
                reason: "the job ended".into(),
            };
            let _ = self.registry.send(id, controller_message::Kind::Stop(stop));
        }
    }

    fn send_all(&self, kind: impl Fn() -> controller_message::Kind) -> Result<(), JobError> {
        for &id in self.hosts.keys() {
            self.registry.send(id, kind()).map_err(JobError::Runtime)?;
        }
        Ok(())
    }

    async fn ask_all<T: serde::de::DeserializeOwned>(
        &mut self,
        what: &str,
        path: &str,
        step: u64,
    ) -> Result<Vec<T>, JobError> {
        self.next_ask += 1;
        let id = self.next_ask;
        let job = self.job.clone();
        self.send_all(|| {
            controller_message::Kind::Ask(Ask {
                job: job.clone(),
                id,
                what: what.to_string(),
                path: path.to_string(),
                step,
            })
        })?;
        let answers = self
            .collect(|kind| match kind {
                host_message::Kind::Answer(a) if a.id == id => Some(a.body),
                _ => None,
            })
            .await?;
        let mut out = Vec::new();
        for body in answers {
            let part: Vec<T> = serde_json::from_slice(&body)
                .map_err(|e| JobError::Runtime(format!("unreadable answer to `{what}`: {e}")))?;
            out.extend(part);
        }
        Ok(out)
    }

    /// Waits for one accepted message from every host of the job; fails on a failure, a lost
    /// host or silence past the watchdog.
    async fn collect<T>(
        &mut self,
        accept: impl Fn(host_message::Kind) -> Option<T>,
    ) -> Result<Vec<T>, JobError> {
        let mut waiting: BTreeSet<u32> = self.hosts.keys().copied().collect();
        let mut out = Vec::with_capacity(waiting.len());
        let started = Instant::now();
        let (mut quiet, mut last_event) = (QuietSince::default(), Instant::now());
        while !waiting.is_empty() {
            let left = self.watchdog.saturating_sub(last_event.elapsed());
            let event = match tokio::time::timeout(HANG_SAMPLE.min(left), self.events.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) => return Err(JobError::Runtime("the registry closed".into())),
                Err(_) if last_event.elapsed() < self.watchdog => {
                    if let Some(hang) = self.hang(&mut quiet) {
                        return Err(hang);
                    }
                    continue;
                }
                Err(_) => {
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
            };
            last_event = Instant::now();
            if let HostEvent::Message(_, kind) = &event
                && job_of(kind) != Some(self.job.as_str())
            {
                continue; // a message of an earlier launch (before a restart)
            }
            match event {
                HostEvent::Gone(info, why, states) => {
                    if self.hosts.contains_key(&info.id) {
                        return Err(self.lost(&info, &why, &states));
                    }
                }
                HostEvent::Message(host, host_message::Kind::Failure(f)) => {
                    if !self.hosts.contains_key(&host) {
                        continue;
                    }
                    let failure: Option<ActorFailure> = serde_json::from_slice(&f.actor_failure).ok();
                    let secondary = failure.as_ref().is_none_or(|f| f.secondary);
                    let error = match failure {
                        Some(f) => JobError::Actor(Box::new(f)),
                        None => JobError::Runtime(f.message),
                    };
                    // A peer that stopped because a host vanished: report the vanished host.
                    if secondary && let Some(lost) = self.wait_for_loss().await {
                        return Err(lost);
                    }
                    return Err(error);
                }
                HostEvent::Message(host, kind) => {
                    if !waiting.contains(&host) {
                        continue;
                    }
                    if let Some(v) = accept(kind) {
                        waiting.remove(&host);
                        out.push(v);
                    }
                }
            }
        }
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
        let report = find_hang(&states, |a| self.plan.actors.get(a).map(|p| &p.stream))?;
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
                let (device, instructions) = (
                    self.plan.actors[a].device,
                    &self.plan.actors[a].stream.instructions,
                );
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
                        instructions
                            .get(s.index as usize)
                            .map_or_else(|| "?".to_string(), ToString::to_string)
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
        let job = self.job.clone();
        self.send_all(|| {
            controller_message::Kind::Step(Step {
                job: job.clone(),
                step: n,
            })
        })?;
        let parts = self
            .collect(|kind| match kind {
                host_message::Kind::StepDone(done) if done.step == n => Some(done.reports),
                _ => None,
            })
            .await?;
        let mut reports = Vec::new();
        for bytes in parts {
            let part: Vec<StepReport> = archipelago_actors::codec::decode(&bytes)
                .map_err(|e| JobError::Runtime(format!("unreadable step report: {e}")))?;
            reports.extend(part);
        }
        reports.sort_by_key(|r| r.actor);
        Ok(reports)
    }

    async fn block_squares(&mut self) -> Result<Vec<(usize, f64)>, JobError> {
        self.ask_all("block_squares", "", self.step).await
    }

    async fn checkpoint(&mut self, dir: &Path, step: u64) -> Result<Vec<ShardFile>, JobError> {
        let path = dir.display().to_string();
        let mut files: Vec<ShardFile> = self.ask_all("checkpoint", &path, step).await?;
        files.sort_by_key(|f| f.header.actor);
        Ok(files)
    }
}

/// The job a host's message is about.
fn job_of(kind: &host_message::Kind) -> Option<&str> {
    match kind {
        host_message::Kind::Ready(m) => Some(&m.job),
        host_message::Kind::StepDone(m) => Some(&m.job),
        host_message::Kind::Failure(m) => Some(&m.job),
        host_message::Kind::Answer(m) => Some(&m.job),
        host_message::Kind::Register(_) | host_message::Kind::Heartbeat(_) => None,
    }
}
