//! Supervision: what a caller learns when an actor fails or stops, the restart policy, and the
//! state every reference to one actor shares (its identity, message counters, how it ended).
//!
//! A panic in a handler fails that call and every call already sent to the actor (queued behind it),
//! each with the same [`ActorFailure`] naming actor, type, host, device and the message that
//! panicked. With restarts left ([`SpawnOptions::max_restarts`]) the constructor runs again with
//! the same parameters and later messages go to the new instance; without, the actor ends and
//! [`ActorRef::ended`](super::ActorRef::ended) resolves to [`ActorEnd::Failed`].
//!
//! An actor on another host is a [`RemoteActor`]: a chain of [`Incarnation`]s. When the host of
//! an actor the driver spawned with restarts left is lost, the driver re-places it on a live host
//! (`cluster.rs`); meanwhile calls and casts wait in order, then go to the new incarnation.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use archipelago_dataflow::{ActorId, DeviceSpec};
use tokio::sync::watch;

use super::remote::HostConnection;
use crate::error::ActorFailure;

/// Who an actor is: enough to name it in every error.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ActorInfo {
    /// Its id, unique in the runtime.
    pub id: ActorId,
    /// The Rust type of the actor.
    pub type_name: String,
    /// The name given at spawn (or `TYPE-ID`).
    pub name: String,
    /// Its device.
    pub device: DeviceSpec,
    /// The host that runs it.
    pub host: String,
}

impl fmt::Display for ActorInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "actor {} \"{}\" (`{}`) on {} of host {}",
            self.id, self.name, self.type_name, self.device, self.host
        )
    }
}

/// How to spawn an actor.
#[derive(Debug, Clone, Default)]
pub struct SpawnOptions {
    /// Its name in errors and on the dashboard (default `TYPE-ID`).
    pub name: Option<String>,
    /// How many times a panicking actor is rebuilt (constructor re-run with the same
    /// parameters) before it ends; 0 = never restart.
    pub max_restarts: u32,
    /// On a cluster, how `spawn_with` picks a device of the kind it names (locally the device
    /// named is used).
    pub placement: super::Placement,
    /// Whether it lives on when every handle to it is dropped (until stopped, killed, failed,
    /// or its runtime ends; on a cluster, until its host ends); otherwise it ends once the last
    /// clone of the reference its spawn returned is dropped.
    pub detached: bool,
}

impl SpawnOptions {
    /// Options with a name.
    pub fn named(name: impl Into<String>) -> SpawnOptions {
        SpawnOptions {
            name: Some(name.into()),
            ..SpawnOptions::default()
        }
    }

    /// The same options with `max_restarts`.
    pub fn restarts(mut self, max_restarts: u32) -> SpawnOptions {
        self.max_restarts = max_restarts;
        self
    }

    /// The same options placing the actor where this program placed the fewest actors, across
    /// hosts first (the default; Ray's `SPREAD`).
    pub fn spread(mut self) -> SpawnOptions {
        self.placement = super::Placement::Spread;
        self
    }

    /// The same options for an actor that outlives its handles (Ray's `lifetime="detached"`):
    /// give it a name to find it again with [`RuntimeHandle::find`](super::RuntimeHandle::find).
    pub fn detached(mut self) -> SpawnOptions {
        self.detached = true;
        self
    }

    /// The same options filling hosts in slot order (Ray's `PACK`).
    pub fn pack(mut self) -> SpawnOptions {
        self.placement = super::Placement::Pack;
        self
    }
}

/// How an actor ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ActorEnd {
    /// It was stopped (by [`ActorRef::stop`](super::ActorRef::stop) or the runtime's shutdown).
    Stopped {
        /// Why.
        reason: String,
    },
    /// It failed and had no restart left (or its constructor failed on a restart).
    Failed(Box<ActorFailure>),
}

/// What an actor has done so far: what the dashboard and `actor_stats` show.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ActorStats {
    /// Who it is.
    pub info: ActorInfo,
    /// Messages taken off its queue.
    pub handled: u64,
    /// Messages waiting.
    pub queue_depth: u64,
    /// Restarts after panics.
    pub restarts: u32,
    /// Handler panics.
    pub failures: u64,
    /// How it ended (`None` while it runs).
    pub ended: Option<String>,
}

/// Why a call did not produce a reply.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum CallError {
    /// The actor panicked while handling this message or one ahead of it in its queue (or its host was
    /// lost).
    #[error("{0}")]
    Failed(Box<ActorFailure>),
    /// The actor had ended before it handled the message.
    #[error(
        "{actor} has ended ({reason}) before handling `{message}`; spawn a new actor, or watch `ended()` to learn when one ends"
    )]
    Stopped {
        /// The actor.
        actor: String,
        /// The message.
        message: String,
        /// How it ended.
        reason: String,
    },
    /// No reply came within the call's timeout; the message is cancelled if it had not started.
    #[error(
        "no reply to `{message}` from {actor} within {after:?}; the message will not run if it had not started (raise the timeout, or look at what the actor is doing)"
    )]
    Timeout {
        /// The actor.
        actor: String,
        /// The message.
        message: String,
        /// The timeout.
        after: Duration,
    },
    /// The caller cancelled the call before the actor started handling it.
    #[error("the call `{message}` to {actor} was cancelled")]
    Cancelled {
        /// The actor.
        actor: String,
        /// The message.
        message: String,
    },
    /// A handler called its own actor: handlers run one at a time, so the reply could never
    /// come.
    #[error(
        "{actor} called itself with `{message}` from a handler and would wait forever for its own reply (handlers run one at a time); use `cast`, or call the method on `self` directly"
    )]
    SelfCall {
        /// The actor.
        actor: String,
        /// The message.
        message: String,
    },
    /// A compiled program could not be compiled or run: what went wrong, with the fix.
    #[error("compiled program: {reason}")]
    Program {
        /// What went wrong.
        reason: String,
    },
    /// The message cannot cross processes: its type (or its reply's) is not registered, or the
    /// bytes did not decode.
    #[error("`{message}` to {actor} cannot cross processes: {reason}")]
    NotRemote {
        /// The actor.
        actor: String,
        /// The message.
        message: String,
        /// What is missing, with the fix.
        reason: String,
    },
}

/// What every reference to one actor shares with the actor's cell.
pub(crate) struct ActorShared {
    pub(crate) info: ActorInfo,
    pub(crate) job: String,
    /// The runtime of this process the actor lives in (unset for a reference to an actor of
    /// another process).
    pub(crate) home: std::sync::OnceLock<std::sync::Weak<super::system::RuntimeInner>>,
    /// The device thread it runs on, in its runtime (a device named twice has two).
    pub(crate) thread: std::sync::OnceLock<usize>,
    /// Whether calls to this actor of this process are checked as if they crossed a process
    /// (its runtime's strict registration mode when it was spawned).
    pub(crate) strict: std::sync::atomic::AtomicBool,
    /// Sequence number of the next message sent (calls and casts).
    next_seq: AtomicU64,
    /// Messages taken off the queue.
    pub(crate) handled: AtomicU64,
    pub(crate) restarts: AtomicU32,
    /// Handler panics so far.
    pub(crate) failures: AtomicU64,
    /// Messages with a sequence number up to this one fail with this failure (set by a panic).
    failed_upto: Mutex<Option<(u64, Box<ActorFailure>)>>,
    /// How the actor is ending, decided (by a stop or a final panic) before it has ended.
    ending: Mutex<Option<ActorEnd>>,
    /// How it ended, published once it has (its store released, its hook run).
    end: watch::Sender<Option<ActorEnd>>,
}

impl ActorShared {
    pub(crate) fn new(info: ActorInfo, job: String) -> ActorShared {
        ActorShared {
            info,
            job,
            home: std::sync::OnceLock::new(),
            thread: std::sync::OnceLock::new(),
            strict: std::sync::atomic::AtomicBool::new(false),
            next_seq: AtomicU64::new(0),
            handled: AtomicU64::new(0),
            restarts: AtomicU32::new(0),
            failures: AtomicU64::new(0),
            failed_upto: Mutex::new(None),
            ending: Mutex::new(None),
            end: watch::Sender::new(None),
        }
    }

    pub(crate) fn label(&self) -> String {
        self.info.to_string()
    }

    /// The next message's sequence number.
    pub(crate) fn sequence(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Messages sent and not yet taken off the queue.
    pub(crate) fn queue_depth(&self) -> u64 {
        self.next_seq
            .load(Ordering::Relaxed)
            .saturating_sub(self.handled.load(Ordering::Relaxed))
    }

    /// Its figures now.
    pub(crate) fn stats(&self) -> ActorStats {
        let ended = self.end().map(|end| match end {
            ActorEnd::Stopped { reason } => format!("stopped: {reason}"),
            ActorEnd::Failed(failure) => format!("failed: {failure}"),
        });
        ActorStats {
            info: self.info.clone(),
            handled: self.handled.load(Ordering::Relaxed),
            queue_depth: self.queue_depth(),
            restarts: self.restarts.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            ended,
        }
    }

    /// Fails every message sent so far that has not been handled yet.
    pub(crate) fn fail_pending(&self, failure: Box<ActorFailure>) {
        let upto = self.next_seq.load(Ordering::SeqCst);
        *self.failed_upto.lock().expect("failure record") = Some((upto, failure));
    }

    /// The failure a message with sequence `seq` inherits from an earlier panic, if any.
    pub(crate) fn inherited_failure(&self, seq: u64) -> Option<Box<ActorFailure>> {
        match &*self.failed_upto.lock().expect("failure record") {
            Some((upto, failure)) if seq < *upto => Some(failure.clone()),
            _ => None,
        }
    }

    /// Records how the actor is ending (the first decision wins); published by
    /// [`ActorShared::publish_end`] once it has ended.
    pub(crate) fn set_end(&self, end: ActorEnd) {
        self.ending.lock().expect("actor end").get_or_insert(end);
    }

    /// Publishes the end decided (or a plain stop) to everyone watching.
    pub(crate) fn publish_end(&self) {
        let end = self
            .ending
            .lock()
            .expect("actor end")
            .clone()
            .unwrap_or(ActorEnd::Stopped {
                reason: "stopped".into(),
            });
        self.end.send_if_modified(|slot| {
            if slot.is_none() {
                *slot = Some(end);
                true
            } else {
                false
            }
        });
    }

    /// How the actor ended, or is ending.
    pub(crate) fn end(&self) -> Option<ActorEnd> {
        self.end
            .borrow()
            .clone()
            .or_else(|| self.ending.lock().expect("actor end").clone())
    }

    /// How the actor ended, only once it has.
    pub(crate) fn ended(&self) -> Option<ActorEnd> {
        self.end.borrow().clone()
    }

    pub(crate) fn subscribe_end(&self) -> watch::Receiver<Option<ActorEnd>> {
        self.end.subscribe()
    }

    /// The error of a message that found the actor ended (or its reply channel closed by the
    /// actor's end).
    pub(crate) fn ended_error(&self, message: &str) -> CallError {
        match self.end() {
            Some(ActorEnd::Failed(failure)) => CallError::Failed(failure),
            Some(ActorEnd::Stopped { reason }) => CallError::Stopped {
                actor: self.label(),
                message: message.to_string(),
                reason,
            },
            None => CallError::Stopped {
                actor: self.label(),
                message: message.to_string(),
                reason: "its runtime shut down".into(),
            },
        }
    }

    /// The failure of this actor because its host was lost (`why`) while it was `doing` something.
    pub(crate) fn host_lost(&self, doing: &str, why: &str) -> Box<ActorFailure> {
        Box::new(ActorFailure {
            job: self.job.clone(),
            step: 0,
            actor: self.info.id,
            device: self.info.device,
            index: None,
            instruction: format!("\"{}\" {doing}", self.info.name),
            message: why.to_string(),
            secondary: false,
            actor_type: self.info.type_name.clone(),
            host: self.info.host.clone(),
        })
    }

    /// The failure of a handler of `message` (sequence `seq`, from 0) that panicked with `text`:
    /// message `seq + 1` of the actor, as a user counts.
    pub(crate) fn failure(&self, message: &str, seq: u64, text: String) -> Box<ActorFailure> {
        Box::new(ActorFailure {
            job: self.job.clone(),
            step: seq + 1,
            actor: self.info.id,
            device: self.info.device,
            index: None,
            instruction: format!("\"{}\" handling message {} `{message}`", self.info.name, seq + 1),
            message: text,
            secondary: false,
            actor_type: self.info.type_name.clone(),
            host: self.info.host.clone(),
        })
    }
}

/// One incarnation of an actor of another host: the connection to its host and its state as
/// this process sees it. Set once, the link to the incarnation that replaced it never changes,
/// so references borrow the latest one from the chain.
pub(crate) struct Incarnation {
    pub(crate) connection: Arc<HostConnection>,
    pub(crate) shared: Arc<ActorShared>,
    next: OnceLock<Arc<Incarnation>>,
}

impl Incarnation {
    pub(crate) fn new(connection: Arc<HostConnection>, shared: Arc<ActorShared>) -> Arc<Incarnation> {
        Arc::new(Incarnation {
            connection,
            shared,
            next: OnceLock::new(),
        })
    }

    /// The incarnation that replaced this one, once there is one.
    pub(crate) fn next(&self) -> Option<&Arc<Incarnation>> {
        self.next.get()
    }
}

/// A message waiting for the incarnation it goes to.
type Waiting = Box<dyn FnOnce(&Incarnation) + Send>;

/// Where a remote actor's messages go now.
enum Phase {
    /// To its latest incarnation.
    Serving,
    /// Its host was lost and it is being re-placed: they wait, in the order sent.
    Replacing(Vec<Waiting>),
}

/// An actor of another host as every reference to it sees it: its incarnations, in order.
pub(crate) struct RemoteActor {
    first: Arc<Incarnation>,
    phase: Mutex<Phase>,
    /// How the driver spawns it again when its host is lost (`None`: never — no restarts, or a
    /// reference that arrived in a message).
    pub(crate) respawn: Option<super::cluster::Respawn>,
}

impl RemoteActor {
    pub(crate) fn new(first: Arc<Incarnation>, respawn: Option<super::cluster::Respawn>) -> Arc<RemoteActor> {
        Arc::new(RemoteActor {
            first,
            phase: Mutex::new(Phase::Serving),
            respawn,
        })
    }

    /// Its first incarnation (the chain's start).
    pub(crate) fn first(&self) -> &Arc<Incarnation> {
        &self.first
    }

    /// Its latest incarnation (while it is re-placed: the one whose host was lost).
    pub(crate) fn current(&self) -> &Incarnation {
        let mut incarnation = &*self.first;
        while let Some(next) = incarnation.next() {
            incarnation = next;
        }
        incarnation
    }

    /// Runs `op` on the latest incarnation now, or — while the actor is re-placed — keeps it
    /// for the new incarnation (`None`); messages keep the order they were sent in.
    pub(crate) fn send<R>(&self, op: impl FnOnce(&Incarnation) -> R + Send + 'static) -> Option<R> {
        let mut phase = self.phase.lock().expect("remote actor");
        if let Phase::Replacing(waiting) = &mut *phase {
            waiting.push(Box::new(move |incarnation| {
                op(incarnation);
            }));
            return None;
        }
        Some(op(self.current()))
    }

    /// Starts re-placing the actor whose incarnation `lost` was on a lost host; `false` when
    /// that is not its latest incarnation, or it is already ending or being re-placed.
    pub(crate) fn begin_replacing(&self, lost: &Arc<ActorShared>) -> bool {
        let mut phase = self.phase.lock().expect("remote actor");
        let current = &self.current().shared;
        let serving = matches!(*phase, Phase::Serving);
        if !serving || !Arc::ptr_eq(current, lost) || current.end().is_some() {
            return false;
        }
        *phase = Phase::Replacing(Vec::new());
        true
    }

    /// Ends the re-placing: links `next` (the new incarnation) after the lost one, whose end
    /// is `lost_end`, or without `next` ends the actor with `lost_end`; then sends the messages
    /// that waited. When the actor was stopped meanwhile, `next` is stopped too.
    pub(crate) fn replaced(&self, next: Option<Arc<Incarnation>>, lost_end: ActorEnd) {
        let mut phase = self.phase.lock().expect("remote actor");
        let Phase::Replacing(waiting) = std::mem::replace(&mut *phase, Phase::Serving) else {
            if let Some(next) = next {
                let reason = "its reference was stopped while it was re-placed";
                next.connection.stop(next.shared.info.id, reason, false);
            }
            return;
        };
        let lost = self.current();
        if let Some(next) = next {
            let restarts = lost.shared.restarts.load(Ordering::Relaxed) + 1;
            next.shared.restarts.store(restarts, Ordering::Relaxed);
            let _ = lost.next.set(next);
        }
        lost.shared.set_end(lost_end);
        lost.shared.publish_end();
        let latest = self.current();
        waiting.into_iter().for_each(|op| op(latest));
    }

    /// Stops (or kills) the actor; while it is re-placed, it ends at once with `end` and the
    /// messages that waited fail.
    pub(crate) fn stop(&self, end: ActorEnd, reason: &str, kill: bool) {
        let mut phase = self.phase.lock().expect("remote actor");
        let current = self.current();
        current.shared.set_end(end);
        match std::mem::replace(&mut *phase, Phase::Serving) {
            Phase::Replacing(waiting) => {
                current.shared.publish_end();
                waiting.into_iter().for_each(|op| op(current));
            }
            Phase::Serving => current.connection.stop(current.shared.info.id, reason, kill),
        }
    }
}
