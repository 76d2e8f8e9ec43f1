//! Failover of a chain-replicated parameter server (Li et al., OSDI 2014, §4.3, after van
//! Renesse and Schneider's chain replication, OSDI 2004): the messages a driver sends the live
//! servers when one server's host is lost, and how the live servers answer them.
//!
//! 1. [`Freeze`] with the ring less the lost server and the next epoch: every live server stops
//!    taking pushes and pulls (answered "moved", so workers wait and ask again) and returns, for
//!    every key it holds whose new chain has members the old chain lacked, a copy for those new
//!    members — sent by exactly one server per key, the first of the new chain that held it.
//! 2. [`Install`] at every new member: the copies (values, update state, and which clock of
//!    every worker each key has applied, so that a push retried after the failover is applied
//!    once).
//! 3. [`Commit`] at every live server: the new ring and epoch take effect, pushes and pulls are
//!    taken again. Every key is back on `R` servers.
//!
//! Workers learn the new ring with [`GetRing`] when a call to the lost server fails or a server
//! answers "moved". The driver's side (watching the servers, naming a range lost with all its
//! replicas) is `archipelago_controller::ps_job`'s.

use serde::{Deserialize, Serialize};

use super::ring::{Ring, ServerId};
use super::server::{PsServer, ServerFault};
use super::update::ServerUpdate;
use super::versions::RangeVersion;
use crate::runtime::{Context, Handler, Message};

/// Stops pushes and pulls and asks for the copies the ring `ring` (of version `epoch`) needs
/// from this server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Freeze {
    /// The ring without the lost server.
    pub ring: Ring,
    /// Its version.
    pub epoch: u64,
}

/// Copies of keys for one new chain member.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Entries {
    /// The keys.
    pub keys: Vec<u64>,
    /// Their values, `width` each.
    pub values: Vec<f32>,
    /// Their update state, the rule's state length each.
    pub state: Vec<f32>,
    /// The version vectors of the ranges handed over (what the copies hold).
    pub versions: Vec<RangeVersion>,
    /// The pushes kept for clocks not yet applied to those ranges (aggregating models), their
    /// keys in the ranges handed over.
    #[serde(default)]
    pub pending: Vec<PendingPush>,
}

/// Part of a worker's push of a clock not yet applied, handed over with its ranges.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PendingPush {
    /// The clock.
    pub clock: u64,
    /// The worker.
    pub worker: usize,
    /// The keys.
    pub keys: Vec<u64>,
    /// Their gradients, `width` each.
    pub grads: Vec<f32>,
}

/// What a frozen server hands over: copies per new chain member.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Handover {
    /// `(server, copies)` for every server that needs keys from this one.
    pub copies: Vec<(ServerId, Entries)>,
}

impl Message for Freeze {
    type Reply = Result<Handover, String>;
}

impl<U: ServerUpdate> Handler<Freeze> for PsServer<U> {
    async fn handle(&mut self, freeze: Freeze, _ctx: &Context<Self>) -> Result<Handover, String> {
        if freeze.epoch <= self.epoch {
            return Err(format!(
                "a freeze for ring version {} on server {} at version {}",
                freeze.epoch, self.params.index, self.epoch
            ));
        }
        self.frozen = true;
        let (r, me) = (self.params.replicas, self.params.index);
        let old = &self.params.ring;
        let mut copies: Vec<(ServerId, Entries)> = Vec::new();
        for (key, values, state) in self.store.entries() {
            let before = old.chain(key, r);
            let after = freeze.ring.chain(key, r);
            // The first member of the new chain that held the key sends it.
            if after.iter().find(|&&s| before.contains(&s)) != Some(&me) {
                continue;
            }
            for &target in after.iter().filter(|&&s| !before.contains(&s)) {
                let at = match copies.iter().position(|(s, _)| *s == target) {
                    Some(at) => at,
                    None => {
                        copies.push((target, Entries::default()));
                        copies.len() - 1
                    }
                };
                let entries = &mut copies[at].1;
                entries.keys.push(key);
                entries.values.extend_from_slice(values);
                entries.state.extend_from_slice(state);
            }
        }
        for (target, arc) in self.versions.handover(old, &freeze.ring, me, r) {
            let at = match copies.iter().position(|(s, _)| *s == target) {
                Some(at) => at,
                None => {
                    copies.push((target, Entries::default()));
                    copies.len() - 1
                }
            };
            let width = self.params.width;
            let pending = match self.params.fault {
                ServerFault::ForgetPendingOnHandover => &Default::default(),
                _ => &self.pending,
            };
            for (&clock, pushes) in pending {
                for (worker, push) in
                    (pushes.iter().enumerate()).flat_map(|(w, parts)| parts.iter().map(move |p| (w, p)))
                {
                    let mut part = PendingPush {
                        clock,
                        worker,
                        ..PendingPush::default()
                    };
                    for (key, grad) in push.keys.iter().zip(push.grads.chunks_exact(width)) {
                        if arc.contains(super::ring::ring_position(*key)) {
                            part.keys.push(*key);
                            part.grads.extend_from_slice(grad);
                        }
                    }
                    if !part.keys.is_empty() {
                        copies[at].1.pending.push(part);
                    }
                }
            }
            copies[at].1.versions.push(arc);
        }
        Ok(Handover { copies })
    }
}

/// Copies of keys this server holds from now on (sent while every server is frozen).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Install {
    /// The copies.
    pub entries: Entries,
}

impl Message for Install {
    type Reply = Result<u64, String>;
}

impl<U: ServerUpdate> Handler<Install> for PsServer<U> {
    async fn handle(&mut self, install: Install, _ctx: &Context<Self>) -> Result<u64, String> {
        let e = install.entries;
        let (w, s) = (self.params.width, self.store.state_len());
        if e.values.len() != e.keys.len() * w || e.state.len() != e.keys.len() * s {
            return Err(format!(
                "server {}: copies of {} keys with {} values and {} state (width {w}, state {s})",
                self.params.index,
                e.keys.len(),
                e.values.len(),
                e.state.len(),
            ));
        }
        self.versions
            .install(e.versions)
            .map_err(|reason| format!("server {}: {reason}", self.params.index))?;
        for part in e.pending {
            if part.worker >= self.params.workers || part.grads.len() != part.keys.len() * w {
                return Err(format!(
                    "server {}: a kept push of worker {} with {} keys and {} values (width {w}, {} workers)",
                    self.params.index,
                    part.worker,
                    part.keys.len(),
                    part.grads.len(),
                    self.params.workers
                ));
            }
            self.keep_handed_over(part);
        }
        for (i, &key) in e.keys.iter().enumerate() {
            let state = &e.state[i * s..(i + 1) * s];
            self.store.assign(
                key,
                &e.values[i * w..(i + 1) * w],
                Some(state),
                &self.params.update,
            );
        }
        Ok(e.keys.len() as u64)
    }
}

/// The new ring and its version take effect; pushes and pulls are taken again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Commit {
    /// The ring.
    pub ring: Ring,
    /// Its version.
    pub epoch: u64,
}

impl Message for Commit {
    type Reply = ();
}

impl<U: ServerUpdate> Handler<Commit> for PsServer<U> {
    async fn handle(&mut self, commit: Commit, _ctx: &Context<Self>) {
        self.params.ring = commit.ring;
        self.epoch = commit.epoch;
        let (me, r) = (self.params.index, self.params.replicas);
        self.versions.place(&self.params.ring, me, r);
        self.frozen = false;
        // Every worker whose push was under way when the ring changed does it again, whole,
        // from part 0 (a push of the old ring is answered "moved").
        self.parts_in.iter_mut().for_each(|p| *p = 0);
    }
}

/// Asks a server for its ring and version (a worker after a failed call or a "moved").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GetRing;

/// A server's ring.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RingVersion {
    /// The ring.
    pub ring: Ring,
    /// Its version.
    pub epoch: u64,
    /// Whether a failover is under way (the ring is about to change).
    pub frozen: bool,
}

impl Message for GetRing {
    type Reply = RingVersion;
}

impl<U: ServerUpdate> Handler<GetRing> for PsServer<U> {
    async fn handle(&mut self, _: GetRing, _ctx: &Context<Self>) -> RingVersion {
        RingVersion {
            ring: self.params.ring.clone(),
            epoch: self.epoch,
            frozen: self.frozen,
        }
    }
}
