//! Supervision: what a caller learns when an actor fails or stops, the restart policy, and the
//! state every reference to one actor shares (its identity, message counters, how it ended).
//!
//! A panic in a handler fails that call and every call already sent to the actor (queued behind it),
//! each with the same [`ActorFailure`] naming actor, type, host, device and the message that
//! panicked. With restarts left ([`SpawnOptions::max_restarts`]) the constructor runs again with
//! the same parameters and later messages go to the new instance; without, the actor ends and
//! [`ActorRef::ended`](super::ActorRef::ended) resolves to [`ActorEnd::Failed`].

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use archipelago_dataflow::{ActorId, DeviceSpec};
use tokio::sync::watch;

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
