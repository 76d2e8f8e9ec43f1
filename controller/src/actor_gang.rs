//! A gang of device actors started together for one job: all or nothing.
//!
//! The actors are actors of the runtime API ([`archipelago_actors::runtime`]): the gang starts a
//! runtime with one device thread per actor (one device named twice gets two threads), spawns a
//! [`DeviceActor`] on each, and records the step once as a compiled program of that runtime
//! ([`Recorder`]): the step number fanned out as a [`RunStep`] call to every actor, the replies
//! gathered. Each step is one run of that program. A failure is reported with its root cause
//! (an actor that failed on its own, not one that only stopped because a peer did: a failing
//! actor aborts the fabric, which ends its peers' steps); silence past the watchdog names the
//! actors still inside the step, and two heartbeats without progress with an actor blocked for
//! good name who waits for whom.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use archipelago_actors::ActorFailure;
use archipelago_actors::checkpoint::ShardFile;
use archipelago_actors::device_actor::{
    BlockParams, BlockSquares, ComputationFactory, DeviceActor, DeviceActorParams, RunStep, SaveCheckpoint,
};
use archipelago_actors::executor::{HeldParams, StepReport};
use archipelago_actors::fabric::Fabric;
use archipelago_actors::progress::ActorProgress;
use archipelago_actors::runtime::compiled::{CompiledProgram, Recorder};
use archipelago_actors::runtime::{ActorRef, CallError, Runtime, SpawnError, SpawnOptions};
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
    /// The runtime the actors live on (one device thread each); dropped by [`ActorGang::stop`].
    runtime: Option<Runtime>,
    actors: Vec<ActorRef<DeviceActor>>,
    /// Actor id and device of each spawned actor, with what it is running.
    ids: Vec<(ActorId, DeviceSpec, Arc<ActorProgress>)>,
    fabric: Arc<dyn Fabric>,
    watchdog: Duration,
    /// The streams launched (to name the instruction an actor blocks on).
    streams: Vec<ActorStream>,
    /// One step: `RunStep(n)` to every actor, the replies gathered in actor order.
    program: Option<CompiledProgram<u64, Vec<StepReply>>>,
}

/// What a device actor answers to [`RunStep`].
type StepReply = Result<StepReport, Box<ActorFailure>>;

/// The runtime's device threads for `streams`, and the thread of each actor: an actor with
/// instructions to run (compute, a receive, a collective: work that blocks) keeps a thread of
/// its own; actors with an empty stream never block, so they share one thread — a step then
/// wakes one thread for all of them instead of one per actor, which is what dispatching a step
/// to thousands of idle actors costs (issue 18).
fn device_threads(streams: &[ActorStream]) -> (Vec<DeviceSpec>, Vec<usize>) {
    let mut devices = Vec::new();
    let mut idle_thread = None;
    let slots = streams
        .iter()
        .map(|stream| {
            let own = |devices: &mut Vec<DeviceSpec>| {
                devices.push(stream.device);
                devices.len() - 1
            };
            if stream.instructions.is_empty() {
                *idle_thread.get_or_insert_with(|| own(&mut devices))
            } else {
                own(&mut devices)
            }
        })
        .collect();
    (devices, slots)
}

impl ActorGang {
    /// Spawns one actor per stream (with the matching computation factory) and waits until all
    /// are built; each takes top-k's residuals from checkpoint directory `residuals_from` when
    /// given, and counts the bytes it reads from actors on other `islands` (the island of each
    /// actor, by id; empty for one island) apart.
    pub async fn start(
        job: &str,
        (streams, factories): (Vec<ActorStream>, Vec<ComputationFactory>),
        fabric: Arc<dyn Fabric>,
        watchdog: Duration,
        (residuals_from, islands): (Option<std::path::PathBuf>, Vec<usize>),
    ) -> Result<ActorGang, JobError> {
        let islands = Arc::new(islands);
        let (devices, slots) = device_threads(&streams);
        let runtime = Runtime::new(job, "local", devices);
        // Local-only by construction: the gang's actors are this process's threads (their
        // parameters hold the fabric and the computation) and the steps' data moves over the
        // fabric, never as actor messages, so strict registration mode has nothing to check.
        runtime.set_strict_registry(false);
        let params: Vec<DeviceActorParams> = (streams.iter().zip(factories))
            .map(|(stream, factory)| DeviceActorParams {
                job: job.to_string(),
                actor: stream.actor,
                device: stream.device,
                stream: Arc::new(stream.instructions.clone()),
                computation: Arc::new(Mutex::new(Some(factory))),
                fabric: fabric.clone(),
                progress: Arc::new(ActorProgress::default()),
                residuals_from: residuals_from.clone(),
                islands: islands.clone(),
            })
            .collect();
        let mut gang = ActorGang {
            job: job.to_string(),
            runtime: None,
            actors: Vec::new(),
            ids: params
                .iter()
                .map(|p| (p.actor, p.device, p.progress.clone()))
                .collect(),
            fabric,
            watchdog,
            streams,
            program: None,
        };
        // Every actor builds at once, each on its thread.
        let spawns: Vec<_> = (params.iter().zip(&slots))
            .map(|(p, &slot)| runtime.spawn_at::<DeviceActor>(slot, p.clone(), SpawnOptions::default()))
            .collect();
        gang.runtime = Some(runtime);
        let mut failed = None;
        for (spawn, p) in spawns.into_iter().zip(&params) {
            match tokio::time::timeout(watchdog, spawn).await {
                Ok(Ok(actor)) => gang.actors.push(actor),
                Ok(Err(SpawnError::Constructor { reason, .. })) => {
                    failed = failed.or(Some(JobError::Actor(Box::new(p.start_failure(reason)))));
                }
                Ok(Err(other)) => {
                    failed = failed.or(Some(JobError::Runtime(format!(
                        "cannot spawn actor {}: {other}",
                        p.actor
                    ))));
                }
                Err(_) => {
                    failed = failed.or(Some(JobError::Hang {
                        job: job.to_string(),
                        step: 0,
                        silent: vec![p.actor],
                        waited_s: watchdog.as_secs_f64(),
                    }));
                }
            }
        }
        if failed.is_none() {
            match gang.record_step() {
                Ok(program) => gang.program = Some(program),
                Err(e) => failed = Some(JobError::Runtime(format!("cannot compile the step: {e}"))),
            }
        }
        if let Some(error) = failed {
            gang.fabric.abort("an actor of the gang failed to start");
            gang.stop().await;
            return Err(error);
        }
        Ok(gang)
    }

    /// The step as a compiled program of the gang's runtime, dispatched to the actors' threads.
    fn record_step(&self) -> Result<CompiledProgram<u64, Vec<StepReply>>, CallError> {
        let runtime = self.runtime.as_ref().expect("the gang's runtime");
        let mut recorder = Recorder::<u64>::new();
        let step = recorder.input();
        let replies: Vec<_> = (self.actors.iter())
            .map(|actor| recorder.call(actor, &step, RunStep))
            .collect();
        let gathered = recorder.gather(&replies);
        recorder.compile(runtime.handle(), &gathered)
    }

    /// Every actor's progress counter, in actor order.
    fn beats(&self) -> Vec<u64> {
        self.ids.iter().map(|(.., p)| p.snapshot().beats).collect()
    }

    /// Every actor's progress, `None` for an actor that has ended.
    fn snapshots(&self) -> Vec<(ActorId, Option<archipelago_actors::progress::ProgressSnapshot>)> {
        (self.ids.iter().zip(&self.actors))
            .map(|((id, _, p), actor)| (*id, actor.end().is_none().then(|| p.snapshot())))
            .collect()
    }

    /// Each actor's id, device and what it is running now.
    pub fn progress(&self) -> &[(ActorId, DeviceSpec, Arc<ActorProgress>)] {
        &self.ids
    }

    /// Runs step `n` on every actor; the reports come back in actor order.
    pub async fn step(&mut self, n: u64) -> Result<Vec<StepReport>, JobError> {
        let program = self.program.as_ref().expect("a started gang's step");
        let mut run = program.run(n);
        // The watchdog counts silence: time since any actor last made progress.
        let (mut beats, mut progressed) = (self.beats(), Instant::now());
        let outcome = loop {
            let left = self.watchdog.saturating_sub(progressed.elapsed());
            match tokio::time::timeout(HEARTBEAT.min(left), &mut run).await {
                Ok(outcome) => break outcome,
                Err(_) if progressed.elapsed() >= self.watchdog => {
                    self.fabric
                        .abort("the controller's watchdog stopped a silent step");
                    return Err(JobError::Hang {
                        job: self.job.clone(),
                        step: n,
                        silent: self.inside_step(n),
                        waited_s: progressed.elapsed().as_secs_f64(),
                    });
                }
                Err(_) => {
                    // An actor that ended mid-step (a panic outside its executor) fails the
                    // step now: its peers would wait for its tensors until their patience.
                    if let Some(at) = self.actors.iter().position(|a| a.end().is_some()) {
                        return Err(self.ended_mid_step(n, at));
                    }
                    let now = self.beats();
                    if now != beats {
                        (beats, progressed) = (now, Instant::now());
                    } else if progressed.elapsed() >= 2 * HEARTBEAT
                        && let Some(report) = find_hang(&self.snapshots(), |a, i| {
                            (self.streams.iter().find(|s| s.actor == a))
                                .and_then(|s| s.instructions.get(i).cloned())
                        })
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
                }
            }
        };
        let replies = match outcome {
            Ok(replies) => replies,
            Err(error) => {
                // A call failed outside the executor (the actor itself ended): name the actor
                // that ended.
                self.fabric.abort(&format!("step {n} failed: {error}"));
                return Err(match self.actors.iter().position(|a| a.end().is_some()) {
                    Some(at) => JobError::Actor(self.step_outcome(n, at, Err(error)).unwrap_err()),
                    None => JobError::Runtime(format!("job {}, step {n}: {error}", self.job)),
                });
            }
        };
        let (mut reports, mut failures) = (Vec::with_capacity(replies.len()), Vec::new());
        for reply in replies {
            match reply {
                Ok(report) => reports.push(report),
                Err(failure) => failures.push(failure),
            }
        }
        // The root cause: an actor that failed on its own, not one that only followed a peer.
        if let Some(first) = failures.first() {
            let root = failures.iter().find(|f| !f.secondary).unwrap_or(first);
            return Err(JobError::Actor(root.clone()));
        }
        reports.sort_by_key(|r| r.actor);
        Ok(reports)
    }

    /// The actors still inside step `n` (not yet past it, or running an instruction); all of
    /// them when none looks so (one stuck between its last instruction and its reply).
    fn inside_step(&self, n: u64) -> Vec<ActorId> {
        let inside: Vec<ActorId> = (self.ids.iter())
            .filter(|(.., p)| {
                let now = p.snapshot();
                now.step < n || now.index.is_some()
            })
            .map(|(id, ..)| *id)
            .collect();
        if inside.is_empty() {
            self.ids.iter().map(|(id, ..)| *id).collect()
        } else {
            inside
        }
    }

    /// Actor `at` ended in step `n`: the fabric is aborted (its peers' steps end) and the failure
    /// names it, its device and the instruction it was running.
    fn ended_mid_step(&self, n: u64, at: usize) -> JobError {
        let message = match self.actors[at].end() {
            Some(archipelago_actors::runtime::ActorEnd::Failed(failure)) => failure.message.clone(),
            Some(archipelago_actors::runtime::ActorEnd::Stopped { reason }) => format!("stopped: {reason}"),
            None => "ended".into(),
        };
        self.fabric
            .abort(&format!("actor {} ended in step {n}", self.ids[at].0));
        let failure = self.step_outcome(
            n,
            at,
            Err(CallError::Program {
                reason: format!("the actor ended during the step: {message}"),
            }),
        );
        JobError::Actor(failure.unwrap_err())
    }

    /// A step's reply as a report or the failure it names (a panic that escaped the executor
    /// is named by the runtime and placed here).
    fn step_outcome(
        &self,
        step: u64,
        at: usize,
        answer: Result<Result<StepReport, Box<ActorFailure>>, CallError>,
    ) -> Result<StepReport, Box<ActorFailure>> {
        answer.unwrap_or_else(|error| {
            let (actor, device, progress) = &self.ids[at];
            let index = progress.snapshot().index;
            let instruction = (self.streams[at].instructions.get(index.unwrap_or(usize::MAX)))
                .map_or_else(|| "between instructions".to_string(), |i| i.to_string());
            Err(Box::new(ActorFailure {
                job: self.job.clone(),
                step,
                actor: *actor,
                device: *device,
                index,
                instruction,
                message: error.to_string(),
                secondary: false,
                actor_type: String::new(),
                host: String::new(),
            }))
        })
    }

    /// Stops every actor and waits for them (their runtime shuts down on a plain thread, each
    /// actor finishing the message it handles).
    pub async fn stop(&mut self) {
        self.program = None;
        self.actors.clear();
        if let Some(runtime) = self.runtime.take() {
            let (done, finished) = tokio::sync::oneshot::channel();
            std::thread::spawn(move || {
                drop(runtime);
                let _ = done.send(());
            });
            let _ = finished.await;
        }
    }
}

impl Gang for ActorGang {
    async fn step(&mut self, n: u64) -> Result<Vec<StepReport>, JobError> {
        ActorGang::step(self, n).await
    }

    async fn block_squares(&mut self) -> Result<Vec<(usize, f64)>, JobError> {
        let mut all = Vec::new();
        for (actor, (id, ..)) in self.actors.iter().zip(&self.ids) {
            let squares = actor.call(BlockSquares).timeout(self.watchdog).await;
            all.extend(squares.map_err(|e| JobError::Runtime(format!("actor {id} did not answer: {e}")))?);
        }
        Ok(all)
    }

    async fn held_params(&mut self) -> Result<Vec<(ActorId, Vec<HeldParams>)>, JobError> {
        let mut all = Vec::new();
        for (actor, (id, ..)) in self.actors.iter().zip(&self.ids) {
            let held = actor.call(BlockParams).timeout(self.watchdog).await;
            all.push((
                *id,
                held.map_err(|e| JobError::Runtime(format!("actor {id} did not answer: {e}")))?,
            ));
        }
        Ok(all)
    }

    async fn checkpoint(&mut self, dir: &std::path::Path, step: u64) -> Result<Vec<ShardFile>, JobError> {
        // Every actor writes at once (each its own file); the answers come back in actor order.
        let calls: Vec<_> = (self.actors.iter())
            .map(|actor| {
                actor
                    .call(SaveCheckpoint(dir.to_path_buf()))
                    .timeout(self.watchdog)
            })
            .collect();
        let mut files = Vec::new();
        for (call, (id, device, _)) in calls.into_iter().zip(&self.ids) {
            let answer = call
                .await
                .map_err(|e| JobError::Runtime(format!("actor {id} did not write its checkpoint: {e}")))?;
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
