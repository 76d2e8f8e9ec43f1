//! The server actor of the parameter server (Li et al., OSDI 2014): the keys of its ranges on the
//! [`Ring`], their values and update state ([`KeyStore`]), every worker's clock, and the pushes
//! of clocks not yet applied. The consistency rules are those of [`super::clock`].
//!
//! A [`Pull`] that the bound does not allow yet is answered [`Pulled::Wait`] at once: a handler
//! runs to completion before the actor takes its next message, so a server that awaited inside
//! a pull would never take the pushes that end the wait. The worker's client asks again after a
//! back-off; the slowest worker's pull is always granted, so a run cannot deadlock.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::checkpoint;
use super::clock::{ClockEvent, Consistency, WorkerClocks};
use super::key_cache::{KeyList, ServerKeyCache};
use super::ring::{Ring, ServerId};
use super::store::KeyStore;
use super::update::ServerUpdate;
use super::versions::RangeVersions;
use crate::runtime::{Actor, Context, Handler, Message};

mod apply;
mod queries;
pub use queries::{Dump, Dumped, SaveCheckpoint, ServerReport, Stats};

/// A fault planted on purpose so that a test can show its comparison catches it (never set by
/// the library itself).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ServerFault {
    /// The server as it should be.
    #[default]
    None,
    /// Pushes of this worker are counted but their gradients dropped.
    DropPushOf(usize),
    /// A clock's pushes are averaged instead of summed.
    AveragePushes,
    /// Keeps no key list, so that every hashed list is answered "unknown" (the resend path).
    ForgetKeyLists,
    /// Hands over no kept push in a failover (the ranges' pushes of unfinished clocks lost).
    ForgetPendingOnHandover,
}

/// What a server is built from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerParams<U> {
    /// The server's index on the ring.
    pub index: ServerId,
    /// Workers of the job.
    pub workers: usize,
    /// Values per key.
    pub width: usize,
    /// The task's consistency model.
    pub consistency: Consistency,
    /// The update rule (and first-touch initialiser).
    pub update: U,
    /// The ring: which keys are this server's.
    pub ring: Ring,
    /// Copies of every key range (chain replication): a key is held by the first `replicas`
    /// distinct servers of [`Ring::chain`], its owner (the chain's head) first.
    pub replicas: usize,
    /// The clock every worker starts at (0, or the checkpoint's on resume).
    pub first_clock: u64,
    /// Resume the keys this ring gives the server from the checkpoint in this directory.
    pub resume: Option<PathBuf>,
    /// Keep a [`ClockEvent`] per granted pull and applied clock (tests; costs memory per clock).
    pub log_clocks: bool,
    /// A planted fault (tests only).
    #[doc(hidden)]
    pub fault: ServerFault,
}

/// One server of a parameter-server job.
pub struct PsServer<U: ServerUpdate> {
    pub(super) params: ServerParams<U>,
    pub(super) store: KeyStore,
    clocks: WorkerClocks,
    /// Pushes of clocks not yet applied (aggregating models): per clock, per worker, the parts
    /// in arrival order (each with the chain position and ring version it came for; parts
    /// handed over by a failover have neither).
    pub(super) pending: BTreeMap<u64, Vec<Vec<Push>>>,
    /// The key lists workers sent to be kept (key caching).
    key_lists: ServerKeyCache,
    /// Parts of its current clock's push each worker has sent (aggregating models).
    pub(super) parts_in: Vec<usize>,
    /// Per key range, per worker: the next clock whose push has not reached the range here
    /// (so that a push retried after a failover is applied once, and a pull may ask for a
    /// version).
    pub(super) versions: RangeVersions,
    /// The ring's version: bumped by every failover; pushes and pulls of another are refused.
    pub(super) epoch: u64,
    /// Between a failover's freeze and its commit: pushes and pulls wait.
    pub(super) frozen: bool,
    applied: u64,
    figures: ServerFigures,
    log: Vec<ClockEvent>,
}

/// A server's traffic and holdings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerFigures {
    /// The server.
    pub index: ServerId,
    /// Pushes taken as the head of their keys' chains (part 0; retries included).
    pub pushes: u64,
    /// Pushes taken further down the chains (parts 1 .. R; replication traffic).
    #[serde(default)]
    pub chained: u64,
    /// Pulls granted.
    pub pulls: u64,
    /// Pulls answered "not yet".
    pub refused: u64,
    /// Payload bytes received (keys and gradients of pushes, keys of pulls).
    pub bytes_in: u64,
    /// Payload bytes sent (values of granted pulls).
    pub bytes_out: u64,
    /// Keys held.
    pub keys: u64,
    /// Bytes of values and state held.
    pub held_bytes: u64,
    /// Clocks applied.
    pub applied: u64,
    /// The most clocks a granted pull was ahead of the slowest worker.
    pub max_lead: u64,
}

impl<U: ServerUpdate> Actor for PsServer<U> {
    type Params = ServerParams<U>;

    async fn new(params: ServerParams<U>, _ctx: &Context<Self>) -> Result<Self, String> {
        if params.width == 0 || params.workers == 0 || params.replicas == 0 {
            return Err(
                "a server needs keys of at least one value, at least one worker and at least one replica"
                    .into(),
            );
        }
        let mut store = KeyStore::new(params.width, params.update.state_len(params.width));
        if let Some(dir) = &params.resume {
            checkpoint::restore(&mut store, &params, dir)?;
        }
        Ok(PsServer {
            clocks: WorkerClocks::new(params.workers, params.first_clock),
            applied: params.first_clock,
            figures: ServerFigures {
                index: params.index,
                applied: params.first_clock,
                ..ServerFigures::default()
            },
            store,
            pending: BTreeMap::new(),
            key_lists: match params.fault {
                ServerFault::ForgetKeyLists => ServerKeyCache::forgetful(),
                _ => ServerKeyCache::default(),
            },
            parts_in: vec![0; params.workers],
            versions: RangeVersions::new(
                &params.ring,
                params.index,
                params.replicas,
                params.workers,
                params.first_clock,
            ),
            epoch: 0,
            frozen: false,
            log: Vec::new(),
            params,
        })
    }
}

impl<U: ServerUpdate> PsServer<U> {
    /// Checks that this server is at chain position `position` of every key (`None`: at any
    /// position) and that `values` fits the keys.
    fn check_keys(
        &self,
        keys: &[u64],
        values: usize,
        what: &str,
        position: Option<usize>,
    ) -> Result<(), String> {
        let (ring, r, me) = (&self.params.ring, self.params.replicas, self.params.index);
        let wrong = |k: &u64| {
            let chain = ring.chain(*k, r);
            match position {
                Some(p) => chain.get(p) != Some(&me),
                None => !chain.contains(&me),
            }
        };
        if let Some(&key) = keys.iter().find(|&&k| wrong(&k)) {
            let chain = ring.chain(key, r);
            return Err(format!(
                "a {what} for key {key}, which the ring gives server {} (chain {chain:?}), not server {me}{}",
                ring.owner(key),
                position
                    .map(|p| format!(" at chain position {p}"))
                    .unwrap_or_default()
            ));
        }
        if values != keys.len() * self.params.width {
            return Err(format!(
                "a {what} of {values} values for {} keys of width {}",
                keys.len(),
                self.params.width
            ));
        }
        Ok(())
    }

    fn figures(&self) -> ServerFigures {
        ServerFigures {
            keys: self.store.len() as u64,
            held_bytes: self.store.bytes(),
            applied: self.applied,
            ..self.figures.clone()
        }
    }
}

/// A worker asks for the values of `keys` (this server's) before starting `clock`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pull {
    /// The worker.
    pub worker: usize,
    /// The clock it wants to start.
    pub clock: u64,
    /// The keys it needs from this server (whose chains this server heads); empty when
    /// `list` names a list the server kept.
    pub keys: Vec<u64>,
    /// How `keys` travel (key caching).
    pub list: KeyList,
    /// The ring's version the worker split its keys by.
    pub epoch: u64,
    /// Grant only once every key's range is at this version or later (every worker's pushes
    /// of the clocks below it have reached the range); `None`: the consistency model alone.
    #[serde(default)]
    pub at_least: Option<u64>,
}

/// A server's answer to a [`Pull`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Pulled {
    /// The bound holds: the keys' values (`width` each, in the order asked).
    Granted {
        /// Clocks applied to the values.
        applied: u64,
        /// The values.
        values: Vec<f32>,
    },
    /// Too far ahead of the slowest worker: ask again later.
    Wait {
        /// The slowest worker's clock.
        slowest: u64,
    },
    /// The ring changed (a failover) or is changing: ask the servers for the ring of `epoch`
    /// or later and split the keys again.
    Moved {
        /// The server's ring version.
        epoch: u64,
    },
    /// The key list's hash names no list this server keeps: send the keys whole.
    UnknownKeys,
}

impl Message for Pull {
    type Reply = Result<Pulled, String>;
}

impl<U: ServerUpdate> Handler<Pull> for PsServer<U> {
    async fn handle(&mut self, mut pull: Pull, _ctx: &Context<Self>) -> Result<Pulled, String> {
        self.clocks.check(pull.worker, pull.clock, "pull")?;
        if pull.epoch != self.epoch || self.frozen {
            return Ok(Pulled::Moved { epoch: self.epoch });
        }
        self.figures.bytes_in += pull.list.wire_bytes(&pull.keys);
        if !self
            .key_lists
            .resolve(pull.worker, &mut pull.keys, std::mem::take(&mut pull.list))
        {
            return Ok(Pulled::UnknownKeys);
        }
        self.check_keys(&pull.keys, pull.keys.len() * self.params.width, "pull", Some(0))?;
        // Keys are looked up only when some range held is behind what the pull needs.
        let behind = pull.at_least.is_some_and(|v| {
            self.versions.min_version() < v && self.versions.version_of(&pull.keys).is_some_and(|at| at < v)
        });
        // Aggregating: the keys' ranges must have every clock below `clock − K` applied (as
        // they do once the slowest worker is there, but for a range a failover just handed over
        // that waits for retried pushes).
        let lagging = (self.params.consistency.bound()).is_some_and(|k| {
            let needed = pull.clock.saturating_sub(k);
            self.versions.min_applied().is_some_and(|a| a < needed)
                && (self.versions.applied_of(&pull.keys)).is_some_and(|a| a < needed)
        });
        let behind = behind || (self.params.consistency.aggregates() && lagging);
        if behind || !self.clocks.may_start(pull.clock, self.params.consistency) {
            self.figures.refused += 1;
            return Ok(Pulled::Wait {
                slowest: self.clocks.slowest(),
            });
        }
        let lead = pull.clock.saturating_sub(self.clocks.slowest());
        self.figures.max_lead = self.figures.max_lead.max(lead);
        self.figures.pulls += 1;
        if self.params.log_clocks {
            let pushed = self.clocks.clocks().to_vec();
            let (worker, clock) = (pull.worker, pull.clock);
            self.log.push(ClockEvent::Granted {
                worker,
                clock,
                pushed,
            });
        }
        let mut values = Vec::new();
        self.store.read(&pull.keys, &self.params.update, &mut values);
        self.figures.bytes_out += 4 * values.len() as u64;
        Ok(Pulled::Granted {
            applied: self.applied,
            values,
        })
    }
}

/// A worker's gradients of `keys` at `clock`, the part for chain position `part`: a worker
/// sends part 0 (the keys whose chain this server heads) to every server, then part 1 once every
/// server has part 0, and so on down the chains, so that a push reaches a chain's tail last and
/// is acknowledged only then. Every worker pushes every part to every server at every clock,
/// with no keys where it touched none.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Push {
    /// The worker.
    pub worker: usize,
    /// The clock it computed.
    pub clock: u64,
    /// The keys; empty when `list` names a list the server kept.
    pub keys: Vec<u64>,
    /// How `keys` travel (key caching).
    pub list: KeyList,
    /// Their gradients, `width` each.
    pub grads: Vec<f32>,
    /// The chain position these keys have this server at (0 = head).
    pub part: usize,
    /// The ring's version the worker split its keys by.
    pub epoch: u64,
}

/// A server's answer to a [`Push`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Pushed {
    /// Taken.
    Done,
    /// The ring changed (a failover) or is changing: nothing was taken; ask the servers for the
    /// ring of `epoch` or later and push again.
    Moved {
        /// The server's ring version.
        epoch: u64,
    },
    /// The key list's hash names no list this server keeps: nothing was taken; send the keys
    /// whole.
    UnknownKeys,
}

impl Message for Push {
    type Reply = Result<Pushed, String>;
}

impl<U: ServerUpdate> Handler<Push> for PsServer<U> {
    async fn handle(&mut self, mut push: Push, _ctx: &Context<Self>) -> Result<Pushed, String> {
        if push.epoch != self.epoch || self.frozen {
            return Ok(Pushed::Moved { epoch: self.epoch });
        }
        let key_bytes = push.list.wire_bytes(&push.keys);
        if push.worker < self.params.workers
            && !self
                .key_lists
                .resolve(push.worker, &mut push.keys, std::mem::take(&mut push.list))
        {
            return Ok(Pushed::UnknownKeys);
        }
        let Some(&at) = self.clocks.clocks().get(push.worker) else {
            return Err(format!(
                "a push from worker {}, but the job has {} workers",
                push.worker, self.params.workers
            ));
        };
        if push.part >= self.params.replicas {
            return Err(format!(
                "a push of part {} from worker {}, but ranges have {} replicas",
                push.part, push.worker, self.params.replicas
            ));
        }
        self.check_keys(&push.keys, push.grads.len(), "push", Some(push.part))?;
        let last = push.part + 1 == self.params.replicas;
        if push.clock > at {
            return Err(format!(
                "a push of clock {} from worker {}, which is at clock {at}",
                push.clock, push.worker
            ));
        }
        // A push of a clock the worker finished here is a retry after a failover (its keys
        // that reached their ranges already are dropped).
        if self.params.consistency.aggregates() && push.clock == at {
            if !self.clocks.may_start(push.clock, self.params.consistency) {
                // A worker that pushes without a granted pull: refused, so that the pushes kept
                // for clocks not yet applied stay within the bound.
                return Err(format!(
                    "worker {} pushed clock {} while the slowest worker is at {}: pull before pushing",
                    push.worker,
                    push.clock,
                    self.clocks.slowest()
                ));
            }
            if push.part != self.parts_in[push.worker] {
                return Err(format!(
                    "part {} of worker {}'s clock {} before part {}",
                    push.part, push.worker, push.clock, self.parts_in[push.worker]
                ));
            }
        }
        match push.part {
            0 => self.figures.pushes += 1,
            _ => self.figures.chained += 1,
        }
        self.figures.bytes_in += key_bytes + 4 * push.grads.len() as u64;
        let (worker, part, clock) = (push.worker, push.part, push.clock);
        // A push retried after a failover is taken once per range: keys whose range it
        // reached already are dropped, then the ranges it reaches are recorded.
        self.drop_reached(&mut push);
        self.versions.record(part, worker, clock);
        if self.params.consistency.aggregates() {
            self.keep_pending(push);
            if clock == at {
                self.parts_in[worker] += 1;
                if last {
                    self.parts_in[worker] = 0;
                    self.clocks.advance(worker);
                }
            }
            self.apply_ready();
        } else {
            // Eventual: applied alone, on arrival.
            if self.params.fault != ServerFault::DropPushOf(worker) {
                let width = self.params.width;
                for (key, grad) in push.keys.iter().zip(push.grads.chunks_exact(width)) {
                    self.store.update(*key, grad, &self.params.update);
                }
            }
            if last && push.clock == at {
                self.clocks.advance(worker);
            }
            let before = self.applied;
            self.applied = self.clocks.slowest();
            if self.params.log_clocks && self.applied > before {
                let pushed = self.clocks.clocks().to_vec();
                self.log.push(ClockEvent::Applied {
                    clock: before,
                    pushed,
                });
            }
        }
        Ok(Pushed::Done)
    }
}

/// Sets the values of `keys` (this server's): how worker 0 seeds a dense model's initial values.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Assign {
    /// The keys.
    pub keys: Vec<u64>,
    /// Their values, `width` each.
    pub values: Vec<f32>,
}

impl Message for Assign {
    type Reply = Result<(), String>;
}

impl<U: ServerUpdate> Handler<Assign> for PsServer<U> {
    async fn handle(&mut self, assign: Assign, _ctx: &Context<Self>) -> Result<(), String> {
        self.check_keys(&assign.keys, assign.values.len(), "seed", None)?;
        let width = self.params.width;
        for (key, values) in assign.keys.iter().zip(assign.values.chunks_exact(width)) {
            self.store.assign(*key, values, None, &self.params.update);
        }
        Ok(())
    }
}

/// The registry entries of a server with update rule `U` (add them to the program's registry
/// so that servers and their messages cross processes).
pub fn register_server<U>(registry: crate::runtime::Registry) -> crate::runtime::Registry
where
    U: ServerUpdate + Serialize + DeserializeOwned,
{
    registry
        .actor::<PsServer<U>>()
        .handles::<PsServer<U>, Pull>()
        .handles::<PsServer<U>, Push>()
        .handles::<PsServer<U>, Assign>()
        .handles::<PsServer<U>, Stats>()
        .handles::<PsServer<U>, Dump>()
        .handles::<PsServer<U>, SaveCheckpoint>()
        .handles::<PsServer<U>, super::failover::Freeze>()
        .handles::<PsServer<U>, super::failover::Install>()
        .handles::<PsServer<U>, super::failover::Commit>()
        .handles::<PsServer<U>, super::failover::GetRing>()
}
