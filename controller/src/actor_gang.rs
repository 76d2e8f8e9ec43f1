//! A gang of device actors started together for one job: all or nothing.
//!
//! Starting spawns every actor and waits until each has built its computation; a step is put
//! straight into every executor thread's queue (no actor-mailbox hop) and one `StepDone` is
//! collected from each. The first failure stops the
//! gang and is reported with its root cause (an actor that failed on its own, not one that only
//! stopped because a peer did); silence past the watchdog names the actors that did not report.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorRef};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio::task::JoinHandle;

use archipelago_actors::ActorFailure;
use archipelago_actors::checkpoint::ShardFile;
use archipelago_actors::device_actor::{
    ActorEvent, ComputationFactory, DeviceActor, DeviceActorArgs, DeviceMsg, WorkQueue, work_queue,
};
use archipelago_actors::executor::StepReport;
use archipelago_actors::fabric::Fabric;
use archipelago_actors::progress::ActorProgress;
use archipelago_dataflow::{ActorId, ActorStream, DeviceSpec};

use crate::JobError;
use crate::gang::Gang;
use crate::hang::find_hang;

/// How often the gang samples its actors' progress; two samples without progress, with an actor
/// blocked for good, make a hang report.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Running device actors of one job.
pub struct ActorGang {
    job: String,
    actors: Vec<ActorRef<DeviceMsg>>,
    /// Actor id and device of each spawned actor, with what it is running.
    ids: Vec<(ActorId, DeviceSpec, Arc<ActorProgress>)>,
    handles: Vec<JoinHandle<()>>,
    events: UnboundedReceiver<ActorEvent>,
    fabric: Arc<dyn Fabric>,
    watchdog: Duration,
    /// The streams launched (to name the instruction an actor blocks on).
    streams: Vec<ActorStream>,
    /// Each actor's executor queue: steps go straight to the threads.
    queues: Vec<WorkQueue>,
}

impl ActorGang {
    /// Spawns one actor per stream (with the matching computation factory) and waits until all
    /// are ready.
    pub async fn start(
        job: &str,
        streams: Vec<ActorStream>,
        factories: Vec<ComputationFactory>,
        fabric: Arc<dyn Fabric>,
        watchdog: Duration,
    ) -> Result<ActorGang, JobError> {
        let (tx, events) = unbounded_channel();
        let mut gang = ActorGang {
            job: job.to_string(),
            actors: Vec::new(),
            ids: Vec::new(),
            handles: Vec::new(),
            events,
            fabric,
            watchdog,
            streams: streams.clone(),
            queues: Vec::new(),
        };
        for (stream, computation) in streams.into_iter().zip(factories) {
            let progress = Arc::new(ActorProgress::default());
            gang.ids.push((stream.actor, stream.device, progress.clone()));
            let (queue, inbox) = work_queue();
            gang.queues.push(queue.clone());
            let args = DeviceActorArgs {
                inbox,
                queue,
                job: job.to_string(),
                actor: stream.actor,
                device: stream.device,
                stream: stream.instructions,
                computation,
                fabric: gang.fabric.clone(),
                events: tx.clone(),
                progress,
            };
            match Actor::spawn(None, DeviceActor, args).await {
                Ok((actor, handle)) => {
                    gang.actors.push(actor);
                    gang.handles.push(handle);
                }
                Err(e) => {
                    gang.stop().await;
                    return Err(JobError::Runtime(format!(
                        "cannot spawn actor {}: {e}",
                        stream.actor
                    )));
                }
            }
        }
        if let Err(e) = gang
            .collect(0, |event| matches!(event, ActorEvent::Ready { .. }).then_some(()))
            .await
        {
            gang.stop().await;
            return Err(e);
        }
        Ok(gang)
    }

    /// Every actor's progress counter, in actor order.
    fn beats(&self) -> Vec<u64> {
        self.ids.iter().map(|(.., p)| p.snapshot().beats).collect()
    }

    /// Every actor's progress, `None` for an actor whose thread has ended.
    fn snapshots(&self) -> Vec<(ActorId, Option<archipelago_actors::progress::ProgressSnapshot>)> {
        (self.ids.iter().zip(&self.handles))
            .map(|((id, _, p), handle)| (*id, (!handle.is_finished()).then(|| p.snapshot())))
            .collect()
    }

    /// Each actor's id, device and what it is running now.
    pub fn progress(&self) -> &[(ActorId, DeviceSpec, Arc<ActorProgress>)] {
        &self.ids
    }

    /// Runs step `n` on every actor; the reports come back in actor order.
    pub async fn step(&mut self, n: u64) -> Result<Vec<StepReport>, JobError> {
        // Straight to the executor threads; one whose thread ended reported why already, and
        // collect names it.
        for queue in &self.queues {
            queue.step(n);
        }
        let mut reports = self
            .collect(n, |event| match event {
                ActorEvent::StepDone(report) => Some(*report),
                _ => None,
            })
            .await?;
        reports.sort_by_key(|r| r.actor);
        Ok(reports)
    }

    /// Asks actor `actor` (by id) a question and waits for the answer.
    pub async fn ask<T: Send + 'static>(
        &self,
        actor: ActorId,
        message: impl FnOnce(ractor::RpcReplyPort<T>) -> DeviceMsg,
    ) -> Result<T, JobError> {
        let at = self
            .ids
            .iter()
            .position(|(id, ..)| *id == actor)
            .ok_or_else(|| JobError::Runtime(format!("actor {actor} is not in this gang")))?;
        self.actors[at]
            .call(message, Some(self.watchdog))
            .await
            .map_err(|e| JobError::Runtime(format!("actor {actor} did not answer: {e}")))?
            .success_or(())
            .map_err(|_| JobError::Runtime(format!("actor {actor} did not answer in time")))
    }

    /// Stops every actor and waits for them.
    pub async fn stop(&mut self) {
        // The executor threads end once every sender of their queue is gone: ours first.
        self.queues.clear();
        for actor in &self.actors {
            actor.stop(None);
        }
        for handle in self.handles.drain(..) {
            let _ = handle.await;
        }
        self.actors.clear();
    }

    /// Waits for one event per actor that `accept` turns into a value; fails on the first
    /// failure (after looking briefly for its root cause) or on silence.
    async fn collect<T>(
        &mut self,
        step: u64,
        accept: impl Fn(ActorEvent) -> Option<T>,
    ) -> Result<Vec<T>, JobError> {
        let mut waiting: BTreeSet<usize> = self.ids.iter().map(|(id, ..)| *id).collect();
        let mut out = Vec::with_capacity(self.actors.len());
        let mut last_event = Instant::now();
        let (mut beats, mut progressed) = (self.beats(), Instant::now());
        while !waiting.is_empty() {
            let left = self.watchdog.saturating_sub(last_event.elapsed());
            let event = match tokio::time::timeout(HEARTBEAT.min(left), self.events.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) => return Err(JobError::Runtime("every actor is gone".into())),
                Err(_) if last_event.elapsed() >= self.watchdog => {
                    self.fabric
                        .abort("the controller's watchdog stopped a silent step");
                    return Err(JobError::Hang {
                        job: self.job.clone(),
                        step,
                        silent: waiting.into_iter().collect(),
                        waited_s: last_event.elapsed().as_secs_f64(),
                    });
                }
                Err(_) => {
                    let now = self.beats();
                    if now != beats {
                        (beats, progressed) = (now, Instant::now());
                    } else if progressed.elapsed() >= 2 * HEARTBEAT
                        && let Some(report) =
                            find_hang(&self.snapshots(), |a| self.streams.iter().find(|s| s.actor == a))
                    {
                        let detected_s = progressed.elapsed().as_secs_f64();
                        self.fabric
                            .abort(&format!("the controller found a hang: {report}"));
                        return Err(JobError::Deadlock {
                            job: self.job.clone(),
                            report: Box::new(report),
                            detected_s,
                        });
                    }
                    continue;
                }
            };
            last_event = Instant::now();
            match event {
                ActorEvent::Failed(failure) => return Err(self.root_cause(*failure).await),
                ActorEvent::Ready { actor } => {
                    waiting.remove(&actor);
                    if let Some(v) = accept(ActorEvent::Ready { actor }) {
                        out.push(v);
                    }
                }
                ActorEvent::StepDone(report) => {
                    waiting.remove(&report.actor);
                    if let Some(v) = accept(ActorEvent::StepDone(report)) {
                        out.push(v);
                    }
                }
            }
        }
        Ok(out)
    }

    async fn root_cause(&mut self, first: ActorFailure) -> JobError {
        self.fabric.abort(&format!("actor {} failed", first.actor));
        let mut root = first;
        let deadline = Instant::now() + Duration::from_secs(5);
        while root.secondary {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.events.recv()).await {
                Ok(Some(ActorEvent::Failed(f))) if !f.secondary => root = *f,
                Ok(Some(_)) => {}
                _ => break,
            }
        }
        JobError::Actor(Box::new(root))
    }
}

impl Gang for ActorGang {
    async fn step(&mut self, n: u64) -> Result<Vec<StepReport>, JobError> {
        ActorGang::step(self, n).await
    }

    async fn block_squares(&mut self) -> Result<Vec<(usize, f64)>, JobError> {
        let mut all = Vec::new();
        let ids: Vec<ActorId> = self.ids.iter().map(|(id, ..)| *id).collect();
        for id in ids {
            all.extend(self.ask(id, DeviceMsg::BlockSquares).await?);
        }
        Ok(all)
    }

    async fn checkpoint(&mut self, dir: &std::path::Path, step: u64) -> Result<Vec<ShardFile>, JobError> {
        // Every actor writes at once (each its own file); the answers come back in actor order.
        let calls: Vec<_> = self
            .actors
            .iter()
            .map(|actor| {
                let (actor, dir, watchdog) = (actor.clone(), dir.to_path_buf(), self.watchdog);
                tokio::spawn(async move {
                    actor
                        .call(|reply| DeviceMsg::Checkpoint(dir, reply), Some(watchdog))
                        .await
                })
            })
            .collect();
        let mut files = Vec::new();
        for (call, (id, device, _)) in calls.into_iter().zip(&self.ids) {
            let answer = call
                .await
                .map_err(|e| JobError::Runtime(format!("actor {id}'s checkpoint task failed: {e}")))?
                .map_err(|e| JobError::Runtime(format!("actor {id} did not answer: {e}")))?
                .success_or(())
                .map_err(|_| JobError::Runtime(format!("actor {id} did not write its checkpoint in time")))?;
            match answer {
                Ok(file) => files.extend(file),
                Err(message) => {
                    return Err(JobError::Actor(Box::new(ActorFailure {
                        job: self.job.clone(),
                        step,
                        actor: *id,
                        device: *device,
                        index: None,
                        instruction: format!("writing its checkpoint shard into {}", dir.display()),
                        message,
                        secondary: false,
                        actor_type: String::new(),
                        host: String::new(),
                    })));
                }
            }
        }
        Ok(files)
    }
}
