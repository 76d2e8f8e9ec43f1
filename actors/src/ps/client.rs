//! The worker's side of the parameter server (Li et al., OSDI 2014, §3.2 push and pull): a
//! [`PsClient`] splits a key list by the [`Ring`] into one list per server, pulls every server
//! at every clock (an empty list where the worker needs none of its keys, so that every server
//! can hold the worker to the bound), asks again after a back-off while a server answers "not
//! yet", and puts the values back in the order asked. Pushes go to every server at every clock
//! the same way. The client runs inside the worker's own actor: on a cluster values and
//! gradients go worker host ↔ server host, never through the program that started the job.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ring::Ring;
use super::server::{Assign, PsServer, Pull, Pulled, Push};
use super::update::ServerUpdate;
use crate::runtime::ActorRef;

/// The first back-off of a refused pull.
const MIN_BACKOFF: Duration = Duration::from_micros(50);
/// The longest back-off.
const MAX_BACKOFF: Duration = Duration::from_millis(2);

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
}

/// One worker's handle on the servers of a job.
#[derive(Debug, Clone)]
pub struct PsClient<U: ServerUpdate> {
    worker: usize,
    width: usize,
    ring: Ring,
    servers: Vec<ActorRef<PsServer<U>>>,
    figures: ClientFigures,
}

/// `keys` split by server: per server, the keys and their positions in `keys`.
struct Split {
    keys: Vec<Vec<u64>>,
    at: Vec<Vec<usize>>,
}

impl<U: ServerUpdate> PsClient<U> {
    /// Worker `worker`'s client of `servers` (by ring index), keys of `width` values.
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
            servers,
            figures: ClientFigures::default(),
        })
    }

    /// The traffic so far.
    pub fn figures(&self) -> ClientFigures {
        self.figures
    }

    fn split(&self, keys: &[u64]) -> Split {
        let n = self.servers.len();
        let mut split = Split {
            keys: vec![Vec::new(); n],
            at: vec![Vec::new(); n],
        };
        for (i, &key) in keys.iter().enumerate() {
            let s = self.ring.owner(key);
            split.keys[s].push(key);
            split.at[s].push(i);
        }
        split
    }

    /// The values of `keys` for starting `clock`, once every server grants it.
    pub async fn pull(&mut self, clock: u64, keys: &[u64]) -> Result<PulledValues, String> {
        let Split { keys: by_server, at } = self.split(keys);
        let mut granted: Vec<Option<Vec<f32>>> = vec![None; self.servers.len()];
        let (mut applied, mut refused, mut backoff) = (u64::MAX, 0u32, MIN_BACKOFF);
        loop {
            let asks: Vec<_> = (0..self.servers.len())
                .filter(|&s| granted[s].is_none())
                .map(|s| {
                    self.figures.pulls += 1;
                    self.figures.bytes_out += 8 * by_server[s].len() as u64;
                    let pull = Pull {
                        worker: self.worker,
                        clock,
                        keys: by_server[s].clone(),
                    };
                    (s, self.servers[s].call(pull))
                })
                .collect();
            for (s, ask) in asks {
                let answer = ask.await.map_err(|e| format!("pull from server {s}: {e}"))??;
                if let Pulled::Granted { applied: a, values } = answer {
                    if values.len() != by_server[s].len() * self.width {
                        return Err(format!(
                            "server {s} answered {} values for {} keys of width {}",
                            values.len(),
                            by_server[s].len(),
                            self.width
                        ));
                    }
                    self.figures.bytes_in += 4 * values.len() as u64;
                    applied = applied.min(a);
                    granted[s] = Some(values);
                }
            }
            if granted.iter().all(Option::is_some) {
                break;
            }
            refused += 1;
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        let w = self.width;
        let mut values = vec![0.0f32; keys.len() * w];
        for (s, got) in granted.into_iter().enumerate() {
            let got = got.expect("every server granted");
            for (j, &i) in at[s].iter().enumerate() {
                values[i * w..(i + 1) * w].copy_from_slice(&got[j * w..(j + 1) * w]);
            }
        }
        Ok(PulledValues {
            values,
            applied,
            refused,
        })
    }

    /// Pushes the gradients of `keys` (`width` each) computed at `clock` to every server.
    pub async fn push(&mut self, clock: u64, keys: &[u64], grads: &[f32]) -> Result<(), String> {
        if grads.len() != keys.len() * self.width {
            return Err(format!(
                "{} gradients for {} keys of width {}",
                grads.len(),
                keys.len(),
                self.width
            ));
        }
        let Split { keys: by_server, at } = self.split(keys);
        let w = self.width;
        let calls: Vec<_> = by_server
            .into_iter()
            .zip(at)
            .enumerate()
            .map(|(s, (keys, at))| {
                let mut part = Vec::with_capacity(at.len() * w);
                at.iter()
                    .for_each(|&i| part.extend_from_slice(&grads[i * w..(i + 1) * w]));
                self.figures.pushes += 1;
                self.figures.bytes_out += 8 * keys.len() as u64 + 4 * part.len() as u64;
                let push = Push {
                    worker: self.worker,
                    clock,
                    keys,
                    grads: part,
                };
                (s, self.servers[s].call(push))
            })
            .collect();
        for (s, call) in calls {
            call.await.map_err(|e| format!("push to server {s}: {e}"))??;
        }
        Ok(())
    }

    /// Sets the values of `keys` on their servers (a dense model's initial values).
    pub async fn assign(&mut self, keys: &[u64], values: &[f32]) -> Result<(), String> {
        let Split { keys: by_server, at } = self.split(keys);
        let w = self.width;
        let calls: Vec<_> = by_server
            .into_iter()
            .zip(at)
            .enumerate()
            .filter(|(_, (keys, _))| !keys.is_empty())
            .map(|(s, (keys, at))| {
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
