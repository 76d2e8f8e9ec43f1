//! The driver's side of a parameter-server failover (`archipelago_actors::ps::failover` is the
//! servers'): one thread per server waits for it to end; when a server fails (its host lost to
//! a SIGKILL, say) while the job runs, the ring less that server is computed, and then either
//!
//! - some key range had all its `R` replicas on lost servers: the range is named, every server is
//!   stopped (so the workers' loops end) and the job ends with that error; or
//! - every range still has a copy: the live servers are frozen, each hands the copies the new
//!   chains need to their new members, the new ring is committed, and the range is back on `R`
//!   servers. The seconds from the loss being seen to `R` copies again are kept per failover.
//!
//! Workers learn the new ring from the servers themselves and retry their unacknowledged
//! pushes there.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use archipelago_actors::ps::{Commit, Freeze, Install, PsServer, Ring, ServerId, ServerUpdate};
use archipelago_actors::runtime::{ActorEnd, ActorRef};

/// One failover: a server lost and its ranges back on `R` servers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailoverEvent {
    /// The lost server.
    pub server: ServerId,
    /// Its host.
    pub host: String,
    /// Why it ended, as the runtime said.
    pub reason: String,
    /// When the driver saw the loss (seconds since the Unix epoch).
    pub detected_unix_s: f64,
    /// When every range was back on `R` servers (seconds since the Unix epoch).
    pub restored_unix_s: f64,
    /// Seconds from seeing the loss to `R` copies again.
    pub restore_s: f64,
    /// Keys copied to new chain members.
    pub keys_copied: u64,
    /// The ring's version after the failover.
    pub epoch: u64,
}

struct State {
    ring: Ring,
    epoch: u64,
    dead: BTreeSet<ServerId>,
    events: Vec<FailoverEvent>,
    lost: Option<String>,
    over: bool,
}

/// The watch over a job's servers.
pub(super) struct Watch {
    state: Arc<Mutex<State>>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Watch {
    /// Starts watching `servers` (on `ring`, `replicas` copies per range).
    pub(super) fn start<U: ServerUpdate>(
        servers: &[ActorRef<PsServer<U>>],
        ring: Ring,
        replicas: usize,
    ) -> Watch {
        let state = Arc::new(Mutex::new(State {
            ring,
            epoch: 0,
            dead: BTreeSet::new(),
            events: Vec::new(),
            lost: None,
            over: false,
        }));
        for index in 0..servers.len() {
            let (state, servers) = (state.clone(), servers.to_vec());
            std::thread::spawn(move || {
                let end = servers[index].ended().get();
                let mut st = state.lock().expect("failover state");
                if st.over || st.lost.is_some() {
                    return;
                }
                if let ActorEnd::Failed(failure) = end {
                    let reason = failure.to_string();
                    lose(&mut st, &servers, index, reason, replicas);
                }
            });
        }
        Watch { state }
    }

    /// The job is over: later ends are the driver's own stops.
    pub(super) fn finish(&self) {
        self.state.lock().expect("failover state").over = true;
    }

    /// Why the job cannot go on (a range lost with all its replicas), if it cannot.
    pub(super) fn lost(&self) -> Option<String> {
        self.state.lock().expect("failover state").lost.clone()
    }

    /// The servers still live, ascending.
    pub(super) fn live(&self) -> Vec<ServerId> {
        self.state.lock().expect("failover state").ring.servers()
    }

    /// Every failover so far.
    pub(super) fn events(&self) -> Vec<FailoverEvent> {
        self.state.lock().expect("failover state").events.clone()
    }

    /// The ring now.
    pub(super) fn ring(&self) -> Ring {
        self.state.lock().expect("failover state").ring.clone()
    }
}

/// Server `index` failed: fail over, or name the lost range and stop the job.
fn lose<U: ServerUpdate>(
    st: &mut State,
    servers: &[ActorRef<PsServer<U>>],
    index: ServerId,
    reason: String,
    replicas: usize,
) {
    let detected = Instant::now();
    let detected_unix_s = unix_now();
    st.dead.insert(index);
    let stop_all = |why: &str| servers.iter().for_each(|s| s.stop(why));
    let lost: Vec<_> = st
        .ring
        .ranges()
        .into_iter()
        .filter(|r| {
            st.ring
                .range_chain(r, replicas)
                .iter()
                .all(|s| st.dead.contains(s))
        })
        .collect();
    if let Some(first) = lost.first() {
        let error = format!(
            "key range ({:#018x}, {:#018x}] (one of {} ranges) is lost: its {replicas} replica(s) {:?} are gone \
             (server {index}: {reason}); no server holds its keys, so the job stops. Run with --replicas 2 or \
             more (and at least as many servers) so that a range outlives a server",
            first.start,
            first.end,
            lost.len(),
            st.ring.range_chain(first, replicas),
        );
        st.lost = Some(error.clone());
        stop_all(&error);
        return;
    }
    let live = st.ring.servers().len() - 1;
    if live < replicas {
        let error = format!(
            "server {index} was lost ({reason}); {live} servers are left for ranges of {replicas} replicas, \
             so no range can be back on {replicas} servers and the job stops. Run with more --servers than \
             --replicas so that the job outlives a server"
        );
        st.lost = Some(error.clone());
        stop_all(&error);
        return;
    }
    match fail_over(st, servers, index) {
        Ok(keys_copied) => st.events.push(FailoverEvent {
            server: index,
            host: servers[index].info().host.clone(),
            reason,
            detected_unix_s,
            restored_unix_s: unix_now(),
            restore_s: detected.elapsed().as_secs_f64(),
            keys_copied,
            epoch: st.epoch,
        }),
        Err(e) => {
            let error = format!("the failover after server {index} was lost ({reason}) failed: {e}");
            st.lost = Some(error.clone());
            stop_all(&error);
        }
    }
}

/// Freezes the live servers on the ring without `index`, moves the copies the new chains need,
/// commits the ring. Returns the keys copied.
fn fail_over<U: ServerUpdate>(
    st: &mut State,
    servers: &[ActorRef<PsServer<U>>],
    index: ServerId,
) -> Result<u64, String> {
    let mut ring = st.ring.clone();
    ring.remove(index).map_err(|e| e.to_string())?;
    let epoch = st.epoch + 1;
    let live = ring.servers();
    let freezes: Vec<_> = live
        .iter()
        .map(|&s| {
            let freeze = Freeze {
                ring: ring.clone(),
                epoch,
            };
            (s, servers[s].call(freeze))
        })
        .collect();
    let mut installs = Vec::new();
    for (s, freeze) in freezes {
        let handover = freeze
            .get()
            .map_err(|e| format!("freezing server {s}: {e}"))?
            .map_err(|e| format!("freezing server {s}: {e}"))?;
        for (target, entries) in handover.copies {
            installs.push((target, servers[target].call(Install { entries })));
        }
    }
    let mut copied = 0;
    for (target, install) in installs {
        copied += install
            .get()
            .map_err(|e| format!("copying keys to server {target}: {e}"))?
            .map_err(|e| format!("copying keys to server {target}: {e}"))?;
    }
    let commits: Vec<_> = live
        .iter()
        .map(|&s| {
            let commit = Commit {
                ring: ring.clone(),
                epoch,
            };
            (s, servers[s].call(commit))
        })
        .collect();
    for (s, commit) in commits {
        commit
            .get()
            .map_err(|e| format!("committing the ring on server {s}: {e}"))?;
    }
    st.ring = ring;
    st.epoch = epoch;
    Ok(copied)
}
