//! The worker's side of the parameter server (Li et al., OSDI 2014, §3.2 push and pull): a
//! [`PsClient`] splits a key list by the [`Ring`] into one list per server, pulls every server
//! at every clock (an empty list where the worker needs none of its keys, so that every server
//! can hold the worker to the bound), asks again after a back-off while a server answers "not
//! yet", and puts the values back in the order asked. The client runs inside the worker's own
//! actor: on a cluster values and gradients go worker host ↔ server host, never through the
//! program that started the job.
//!
//! With `R` replicas a key is held by the `R` servers of its chain ([`Ring::chain`]). Pulls go to
//! the chain's head. A push walks the chains: part 0 (every key at its head) to every server,
//! then, once all took it, part 1 (every key at its second) and so on, so a push is acknowledged
//! only when every chain's tail has it. When a call fails because a server's host was lost, or a
//! server answers "moved" (a failover is under way), the client asks the live servers for the
//! new ring ([`GetRing`]) and does the pull or the whole push again on it; servers apply a
//! retried push once per key. With [`PsClient::logging_acked`] it keeps the sum of every
//! acknowledged push per key (what a test checks the final model against).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::failover::GetRing;
use super::filter::SignificanceFilter;
use super::key_cache::ClientKeyCache;
use super::ring::{Ring, ServerId};
use super::server::{Assign, PsServer, Pull, Pulled, Push, Pushed};
use super::update::ServerUpdate;
use crate::runtime::ActorRef;

/// The first back-off of a refused pull.
const MIN_BACKOFF: Duration = Duration::from_micros(50);
/// The longest back-off.
const MAX_BACKOFF: Duration = Duration::from_millis(2);
/// How long a worker waits for a new ring after a server's loss before giving up.
const RING_PATIENCE: Duration = Duration::from_secs(60);

/// What a pull returned.
#[derive(Debug, Clone, PartialEq)]
pub struct PulledValues {
    /// The values of the keys asked, `width` each, in the order asked.
    pub values: Vec<f32>,
    /// The fewest clocks applied over the servers that answered.
    pub applied: u64,
    /// Times a server answered "not yet" before every server granted.
    pub refused: u32,
}

/// A worker's traffic, as its client counted it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientFigures {
    /// Pull requests sent (retries included).
    pub pulls: u64,
    /// Push requests sent.
    pub pushes: u64,
    /// Payload bytes sent (keys and gradients).
    pub bytes_out: u64,
    /// Payload bytes received (values).
    pub bytes_in: u64,
    /// Rings adopted after a failover.
    pub failovers: u64,
    /// Bytes the worker's process wrote on actor-port connections while its loop ran (the
    /// wire's count: every actor of the process is in it, so it is this worker's alone when the
    /// worker has its process to itself, as with one host per worker; 0 in one process).
    #[serde(default)]
    pub wire_bytes_out: u64,
}

/// One worker's handle on the servers of a job.
#[derive(Debug, Clone)]
pub struct PsClient<U: ServerUpdate> {
    worker: usize,
    width: usize,
    ring: Ring,
    replicas: usize,
    epoch: u64,
    servers: Vec<ActorRef<PsServer<U>>>,
    figures: ClientFigures,
    acked: Option<HashMap<u64, Vec<f32>>>,
    key_lists: ClientKeyCache,
    filter: Option<SignificanceFilter>,
}

/// `keys` split by server for one chain position: per live server, the keys and their
/// positions in `keys`.
type Split = Vec<(ServerId, Vec<u64>, Vec<usize>)>;

/// What to do after a round of calls.
enum Next {
    Done,
    Again,
    /// A server held no list for a hash: ask it again with the keys whole, at once.
    Resend,
    NewRing(Option<ServerId>, String),
}

impl<U: ServerUpdate> PsClient<U> {
    /// Worker `worker`'s client of `servers` (by ring index), keys of `width` values, one copy
    /// of every range (see [`PsClient::replicated`]).
    pub fn new(
        worker: usize,
        width: usize,
        ring: Ring,
        servers: Vec<ActorRef<PsServer<U>>>,
    ) -> Result<Self, String> {
        if let Some(s) = ring.servers().into_iter().find(|&s| s >= servers.len()) {
            return Err(format!(
                "the ring names server {s}, but {} were given",
                servers.len()
            ));
        }
        Ok(PsClient {
            worker,
            width,
            ring,
            replicas: 1,
            epoch: 0,
            servers,
            figures: ClientFigures::default(),
            acked: None,
            key_lists: ClientKeyCache::default(),
            filter: None,
        })
    }

    /// The same client for ranges held by `replicas` servers each.
    pub fn replicated(mut self, replicas: usize) -> Result<Self, String> {
        let n = self.ring.servers().len();
        if replicas == 0 || replicas > n {
            return Err(format!(
                "{replicas} replicas on a ring of {n} servers: give 1 to {n}"
            ));
        }
        self.replicas = replicas;
        Ok(self)
    }

    /// The same client, with (when `on`) key caching: a key list already sent to a server goes
    /// as its hash ([`super::key_cache`]).
    pub fn caching_keys(mut self, on: bool) -> Self {
        self.key_lists.enabled = on;
        self
    }

    /// The same client, holding back (with `Some(θ)`) a key's gradient until its accumulated
    /// magnitude exceeds θ ([`super::filter`]).
    pub fn filtering(mut self, threshold: Option<f32>) -> Self {
        self.filter = threshold.map(SignificanceFilter::new);
        self
    }

    /// The same client, keeping (when `on`) the sum of every acknowledged push per key.
    pub fn logging_acked(mut self, on: bool) -> Self {
        self.acked = on.then(HashMap::new);
        self
    }

    /// The sum of every acknowledged push per key, ascending by key (empty unless logged).
    pub fn acked(&self) -> Vec<(u64, Vec<f32>)> {
        let mut acked: Vec<_> = self
            .acked
            .iter()
            .flatten()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        acked.sort_unstable_by_key(|(k, _)| *k);
        acked
    }

    /// The traffic so far.
    pub fn figures(&self) -> ClientFigures {
        self.figures
    }

    /// The ring the client splits keys by now.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// `keys` by the live server at chain position `position` (`None`: every member).
    fn split(&self, keys: &[u64], position: Option<usize>) -> Split {
        let live = self.ring.servers();
        let mut split: Split = live.iter().map(|&s| (s, Vec::new(), Vec::new())).collect();
        for (i, &key) in keys.iter().enumerate() {
            let chain = self.ring.chain(key, self.replicas);
            let members = match position {
                Some(p) => chain.get(p..p + 1).unwrap_or(&[]),
                None => &chain[..],
            };
            for s in members {
                let at = live.binary_search(s).expect("a chain member is on the ring");
                split[at].1.push(key);
                split[at].2.push(i);
            }
        }
        split
    }

    /// Waits for a ring newer than the client's from the live servers and adopts it.
    async fn new_ring(&mut self, failed: Option<ServerId>, why: String) -> Result<(), String> {
        let began = Instant::now();
        let mut backoff = Duration::from_millis(5);
        loop {
            let mut reached = false;
            for s in self.ring.servers().into_iter().filter(|&s| Some(s) != failed) {
                if let Ok(version) = self.servers[s].call(GetRing).await {
                    reached = true;
                    if version.epoch > self.epoch && !version.frozen {
                        self.key_lists.clear();
                        self.ring = version.ring;
                        self.epoch = version.epoch;
                        self.figures.failovers += 1;
                        return Ok(());
                    }
                }
            }
            if !reached {
                return Err(format!("{why}; and no other server of the job answers"));
            }
            if began.elapsed() > RING_PATIENCE {
                return Err(format!(
                    "{why}; the servers named no new ring within {RING_PATIENCE:?}"
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(100));
        }
    }

    /// The values of `keys` for starting `clock`, once every server grants it.
    pub async fn pull(&mut self, clock: u64, keys: &[u64]) -> Result<PulledValues, String> {
        self.pull_at_least(clock, keys, None).await
    }

    /// [`pull`](Self::pull), granted only once the ranges of `keys` are at version `version` or
    /// later on their servers (every worker's pushes of the clocks below it have reached them;
    /// the paper's `pull(keys, t)`): a worker under eventual consistency that must see its own
    /// and everyone's updates up to a clock asks for it here.
    pub async fn pull_at_least(
        &mut self,
        clock: u64,
        keys: &[u64],
        version: Option<u64>,
    ) -> Result<PulledValues, String> {
        let mut refused = 0u32;
        'ring: loop {
            let split = self.split(keys, Some(0));
            let mut granted: Vec<Option<Vec<f32>>> = vec![None; split.len()];
            let (mut applied, mut backoff) = (u64::MAX, MIN_BACKOFF);
            loop {
                let asks: Vec<_> = (0..split.len())
                    .filter(|&i| granted[i].is_none())
                    .map(|i| {
                        let (s, keys, _) = &split[i];
                        let (keys, list) = self.key_lists.encode(*s, keys);
                        self.figures.pulls += 1;
                        self.figures.bytes_out += list.wire_bytes(&keys);
                        let pull = Pull {
                            worker: self.worker,
                            clock,
                            keys,
                            list,
                            epoch: self.epoch,
                            at_least: version,
                        };
                        (i, self.servers[*s].call(pull))
                    })
                    .collect();
                let mut next = Next::Done;
                for (i, ask) in asks {
                    let s = split[i].0;
                    let answer = match ask.await {
                        Ok(answer) => answer?,
                        Err(e) => {
                            next = Next::NewRing(Some(s), format!("pull from server {s}: {e}"));
                            break;
                        }
                    };
                    match answer {
                        Pulled::Granted { applied: a, values } => {
                            if values.len() != split[i].1.len() * self.width {
                                return Err(format!(
                                    "server {s} answered {} values for {} keys of width {}",
                                    values.len(),
                                    split[i].1.len(),
                                    self.width
                                ));
                            }
                            self.figures.bytes_in += 4 * values.len() as u64;
                            applied = applied.min(a);
                            granted[i] = Some(values);
                        }
                        Pulled::Wait { .. } => {
                            if !matches!(next, Next::NewRing(..)) {
                                next = Next::Again
                            }
                        }
                        // A server behind the ring this worker has (a failover's commit reaches
                        // the servers one by one): ask it again, not for a newer ring.
                        Pulled::Moved { epoch } if epoch < self.epoch => {
                            if !matches!(next, Next::NewRing(..)) {
                                next = Next::Again
                            }
                        }
                        Pulled::Moved { .. } => {
                            next = Next::NewRing(None, format!("server {s} moved its keys"))
                        }
                        Pulled::UnknownKeys => {
                            self.key_lists.forget(s, &split[i].1);
                            if matches!(next, Next::Done) {
                                next = Next::Resend;
                            }
                        }
                    }
                }
                match next {
                    Next::Done => {
                        let w = self.width;
                        let mut values = vec![0.0f32; keys.len() * w];
                        for ((_, _, at), got) in split.iter().zip(granted) {
                            let got = got.expect("every server granted");
                            for (j, &i) in at.iter().enumerate() {
                                values[i * w..(i + 1) * w].copy_from_slice(&got[j * w..(j + 1) * w]);
                            }
                        }
                        return Ok(PulledValues {
                            values,
                            applied,
                            refused,
                        });
                    }
                    Next::Again => {
                        refused += 1;
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                    Next::Resend => {}
                    Next::NewRing(failed, why) => {
                        self.new_ring(failed, why).await?;
                        continue 'ring;
                    }
                }
            }
        }
    }

    /// Pushes the gradients of `keys` (`width` each) computed at `clock` down every key's chain;
    /// returns once every chain's tail has them (the push is then acknowledged).
    pub async fn push(&mut self, clock: u64, keys: &[u64], grads: &[f32]) -> Result<(), String> {
        if grads.len() != keys.len() * self.width {
            return Err(format!(
                "{} gradients for {} keys of width {}",
                grads.len(),
                keys.len(),
                self.width
            ));
        }
        let w = self.width;
        let filtered = self.filter.as_mut().map(|f| f.apply(keys, grads, w));
        let (keys, grads) = match &filtered {
            Some((keys, grads)) => (&keys[..], &grads[..]),
            None => (keys, grads),
        };
        'ring: loop {
            for part in 0..self.replicas {
                let split = self.split(keys, Some(part));
                // Servers still to take this part: all, then those that held no list for a hash.
                let mut to_send: Vec<usize> = (0..split.len()).collect();
                while !to_send.is_empty() {
                    let calls: Vec<_> = to_send
                        .iter()
                        .map(|&i| {
                            let (s, keys, at) = &split[i];
                            let mut part_grads = Vec::with_capacity(at.len() * w);
                            at.iter()
                                .for_each(|&i| part_grads.extend_from_slice(&grads[i * w..(i + 1) * w]));
                            let (keys, list) = self.key_lists.encode(*s, keys);
                            self.figures.pushes += 1;
                            self.figures.bytes_out += list.wire_bytes(&keys) + 4 * part_grads.len() as u64;
                            let push = Push {
                                worker: self.worker,
                                clock,
                                keys,
                                list,
                                grads: part_grads,
                                part,
                                epoch: self.epoch,
                            };
                            (i, self.servers[*s].call(push))
                        })
                        .collect();
                    let mut next = Next::Done;
                    let mut again = Vec::new();
                    let mut behind = false;
                    for (i, call) in calls {
                        let s = split[i].0;
                        match call.await {
                            Ok(answer) => match answer? {
                                Pushed::Done => {}
                                // A server behind the ring this worker has: push to it again.
                                Pushed::Moved { epoch } if epoch < self.epoch => {
                                    behind = true;
                                    again.push(i);
                                }
                                Pushed::Moved { .. } => {
                                    next = Next::NewRing(None, format!("server {s} moved its keys"))
                                }
                                Pushed::UnknownKeys => {
                                    self.key_lists.forget(s, &split[i].1);
                                    again.push(i);
                                }
                            },
                            Err(e) => {
                                next = Next::NewRing(Some(s), format!("push to server {s}: {e}"));
                                break;
                            }
                        }
                    }
                    if behind {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    match next {
                        Next::Done => to_send = again,
                        Next::Again | Next::Resend => unreachable!("pushes are never deferred"),
                        Next::NewRing(failed, why) => {
                            self.new_ring(failed, why).await?;
                            continue 'ring;
                        }
                    }
                }
            }
            break;
        }
        if let Some(acked) = &mut self.acked {
            for (key, grad) in keys.iter().zip(grads.chunks_exact(w)) {
                let sum = acked.entry(*key).or_insert_with(|| vec![0.0; w]);
                sum.iter_mut().zip(grad).for_each(|(s, g)| *s += g);
            }
        }
        Ok(())
    }

    /// Sets the values of `keys` on every server of their chains (a dense model's initial
    /// values).
    pub async fn assign(&mut self, keys: &[u64], values: &[f32]) -> Result<(), String> {
        let w = self.width;
        let calls: Vec<_> = self
            .split(keys, None)
            .into_iter()
            .filter(|(_, keys, _)| !keys.is_empty())
            .map(|(s, keys, at)| {
                let mut part = Vec::with_capacity(at.len() * w);
                at.iter()
                    .for_each(|&i| part.extend_from_slice(&values[i * w..(i + 1) * w]));
                (s, self.servers[s].call(Assign { keys, values: part }))
            })
            .collect();
        for (s, call) in calls {
            call.await.map_err(|e| format!("seeding server {s}: {e}"))??;
        }
        Ok(())
    }
}
