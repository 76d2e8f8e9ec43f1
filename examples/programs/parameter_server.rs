//! A parameter server on the runtime API, after Li et al., "Scaling Distributed Machine Learning
//! with the Parameter Server" (OSDI 2014): `S` [`Server`] actors each own a contiguous key range
//! of the model's flat f32 parameter vector (range `s` is `s·N/S .. (s+1)·N/S`), with its
//! optimizer state and a vector clock; `W` [`Worker`] actors each build the burn model on their
//! own device (in their constructor) and compute the gradient of their data shard. Each worker
//! pulls every range, computes, and pushes each server its slice of the gradient tagged with its
//! clock. `examples/parameter_server.rs` runs it; `examples/tests/programs.rs` checks it on this
//! process and `examples/tests/cluster.rs` on two host processes of the example's binary.
//!
//! # Consistency: bounded delay `K`
//! A worker's *clock* is the number of clocks it has pushed (the clock it works on next). A
//! worker may start clock `c` only when the slowest worker has pushed at least `c − K` clocks
//! (Li et al.'s bounded delay; the stale synchronous parallel model of Ho et al., NIPS 2013):
//! `K = 0` is sequential (bulk synchronous), a larger `K` lets fast workers run up to `K` clocks
//! ahead. Servers enforce it: a [`Pull`] of clock `c` is granted only when it holds. A server
//! applies clock `c` once all `W` pushes of `c` are in (Li et al.'s Algorithm 1: aggregate, then
//! update), as the sum of the pushes in worker order, with the library's flat optimizer
//! ([`FlatOptimizer`](archipelago_actors::flat_optimizer::FlatOptimizer)); so pulled values
//! include exactly the clocks every worker has finished, and a worker at clock `c` always sees
//! every update older than `c − K`. Each server logs, at every granted pull and every applied
//! update, the clock of every worker ([`ClockEvent`]).
//!
//! # Why a pull that must wait answers "not yet" (and cannot deadlock)
//! A handler's reply is its return value and an actor handles one message at a time, its
//! `.await`s included: a server that awaited inside `Pull` until the bound held would never
//! handle the `Push`es that make it hold — a deadlock. The runtime has no reply that completes
//! later (a reply port kept by the actor), so a `Pull` never waits: it answers [`Pulled::Wait`]
//! and the worker asks again after a back-off (50 µs, doubling up to 2 ms). A server never
//! waits for another actor, and the slowest worker's pull is always granted (`c = min ≤ min +
//! K`), so every run finishes.
//!
//! # Where the loops run
//! Each worker runs its whole loop in one [`Train`] handler, holding the servers'
//! [`ActorRef`]s it was handed in that message: it pulls, computes and pushes itself, and on a
//! cluster the values and gradients go worker host ↔ server host, never through the program.
//! The program only spawns the actors (servers on its first slots, workers on the next: on
//! this process's devices or on the hosts running its binary, the same code), starts every
//! loop, and reads the servers' final state. Every message is serde and registered
//! ([`registry`]); in one process the vectors move and nothing is encoded. If a loop fails the
//! program stops the servers, so the other loops, which would wait for that worker's clocks
//! forever, fail too.
//!
//! # Scaling, data, equivalence
//! Worker `r`'s loss is the sum over its `B` rows of `−log p(label)` divided by the global batch
//! `W·B`, as the library's trainer scales each data-parallel replica's loss; the sum of the `W`
//! gradients is then the gradient of the mean loss over the global batch, and the sum of the
//! losses is the global loss. Clock `c` trains on step `c + 1` of the cluster pool (the
//! controller counts steps from 1) with global batch `W·B`, and worker `r` takes rows
//! `r·B .. (r+1)·B`, as data-parallel rank `r` does. Parameters start from
//! [`deterministic_init`](archipelago_actors::block::deterministic_init) under the seed, as the
//! trainer's do. At `K = 0` the program is therefore synchronous data parallelism: the test
//! compares it with `Controller::train`.
//!
//! # Not here (yet)
//! Li et al.'s consistent-hash ring of ranges, chain replication of a range, other consistency
//! models than bounded delay, and sparse keys: every range is dense and has one owner.
//!
//! The server actor is in `parameter_server/server.rs`, the worker actor in
//! `parameter_server/worker.rs`; this file holds the run's configuration and the program that starts it.

mod server;
mod worker;

pub use server::{ClockEvent, Pull, Pulled, Push, Server, ServerState, Snapshot};
pub use worker::{Train, Worker};

use std::ops::Range;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use archipelago_controller::prelude::*;
use archipelago_dataflow::{InputKind, ModelSpec, OptimizerSpec};

/// A fault planted on purpose, so that a test can show its comparison catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fault {
    /// None: the parameter server as it should be.
    None,
    /// Servers count this worker's pushes but drop their gradients.
    DropPushOf(usize),
    /// Servers apply the mean of the pushes instead of their sum.
    AveragePushes,
    /// This worker's loop fails when it reaches this clock (the others must not wait forever).
    FailAt(usize, u64),
}

/// What a run trains and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PsConfig {
    /// The zoo model (an mlp: the cluster pool is its data).
    pub model: ModelSpec,
    /// Seed of the initial parameters and of the data, as `Program::with_seed`.
    pub seed: u64,
    /// The optimizer the servers run on their ranges.
    pub optimizer: OptimizerSpec,
    /// Server actors (key ranges).
    pub servers: usize,
    /// Worker actors.
    pub workers: usize,
    /// Rows per worker per clock (the global batch is `workers × local_batch`).
    pub local_batch: usize,
    /// Clocks (steps) every worker runs.
    pub clocks: u64,
    /// The bounded delay `K`.
    pub staleness: u64,
    /// Milliseconds each worker sleeps per clock (by rank; missing ranks do not sleep).
    pub delay_ms: Vec<u64>,
    /// A planted fault (for negative controls).
    pub fault: Fault,
}

impl PsConfig {
    /// Rows per clock over all workers.
    pub fn global_batch(&self) -> usize {
        self.workers * self.local_batch
    }

    /// Devices a run needs: one per server, then one per worker.
    pub fn devices(&self) -> usize {
        self.servers + self.workers
    }

    /// The key range of `server` in a flat vector of `n` parameters.
    pub fn key_range(&self, server: usize, n: usize) -> Range<usize> {
        server * n / self.servers..(server + 1) * n / self.servers
    }

    fn check(&self, slots: usize) -> Result<(), String> {
        let n = self.model.desc().params() as usize;
        if self.servers == 0 || self.workers == 0 || self.local_batch == 0 {
            return Err("a parameter server needs at least one server, one worker and one row".into());
        }
        if self.servers > n {
            return Err(format!(
                "{} servers for {n} parameters: some ranges would be empty",
                self.servers
            ));
        }
        if self.devices() > slots {
            return Err(format!(
                "{} servers and {} workers need {} devices; the runtime has {slots}",
                self.servers,
                self.workers,
                self.devices()
            ));
        }
        match self.model.desc().input {
            InputKind::Dense { .. } => Ok(()),
            other => Err(format!(
                "the parameter server example trains mlp models, not {other:?}"
            )),
        }
    }
}

/// What a server or worker is built from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Role {
    /// The server's or worker's index.
    pub index: usize,
    /// The run.
    pub config: PsConfig,
}

/// The types the program sends across processes.
pub fn registry() -> Registry {
    Registry::new()
        .actor::<Server>()
        .actor::<Worker>()
        .handles::<Server, Pull>()
        .handles::<Server, Push>()
        .handles::<Server, Snapshot>()
        .handles::<Worker, Train>()
}

/// One clock of one worker, as its loop saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStep {
    /// The clock.
    pub clock: u64,
    /// Clocks applied to the values it computed on (the fewest over the servers).
    pub applied: u64,
    /// Its share of the global loss.
    pub loss: f32,
    /// Pulls refused before every range was granted.
    pub refused: u32,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The final flat parameters (every server's range, in order).
    pub params: Vec<f32>,
    /// The global loss of each clock (the sum of the workers' shares).
    pub losses: Vec<f32>,
    /// Each worker's clocks, by rank.
    pub workers: Vec<Vec<WorkerStep>>,
    /// Each server's log of the workers' clocks.
    pub logs: Vec<Vec<ClockEvent>>,
    /// Seconds the workers' loops took.
    pub wall_s: f64,
    /// Where each server, then each worker, ran: `(host, device)`.
    pub placement: Vec<(String, DeviceSpec)>,
}

impl Outcome {
    /// The most clocks a worker ever started ahead of the slowest worker's clock, over every
    /// pull every server granted (the bounded delay keeps it at most `K`).
    pub fn max_lead(&self) -> u64 {
        self.logs
            .iter()
            .flatten()
            .filter_map(|event| match event {
                ClockEvent::Granted { clock, pushed, .. } => {
                    Some(clock.saturating_sub(pushed.iter().copied().min().unwrap_or(0)))
                }
                ClockEvent::Applied { .. } => None,
            })
            .max()
            .unwrap_or(0)
    }
}

/// Trains `config` on `runtime`: servers on its first `servers` slots, workers on the next
/// `workers`; returns the final parameters, the losses and the clock logs.
pub fn run(runtime: &Runtime, config: &PsConfig) -> anyhow::Result<Outcome> {
    config.check(runtime.slots().len()).map_err(anyhow::Error::msg)?;
    let role = |index| Role {
        index,
        config: config.clone(),
    };
    let spawn_servers: Vec<_> = (0..config.servers)
        .map(|s| runtime.spawn_at::<Server>(s, role(s), SpawnOptions::named(format!("ps-server-{s}"))))
        .collect();
    let spawn_workers: Vec<_> = (0..config.workers)
        .map(|w| {
            let options = SpawnOptions::named(format!("ps-worker-{w}"));
            runtime.spawn_at::<Worker>(config.servers + w, role(w), options)
        })
        .collect();
    let servers = spawn_servers
        .into_iter()
        .map(|s| s.get())
        .collect::<Result<Vec<_>, _>>()?;
    let workers = spawn_workers
        .into_iter()
        .map(|w| w.get())
        .collect::<Result<Vec<_>, _>>()?;

    let placement = (servers.iter().map(|s| s.info()))
        .chain(workers.iter().map(|w| w.info()))
        .map(|info| (info.host.clone(), info.device))
        .collect();
    let began = Instant::now();
    let train = Train {
        servers: servers.clone(),
    };
    let mut pending: Vec<(usize, _)> = workers
        .iter()
        .map(|w| w.call(train.clone()))
        .enumerate()
        .collect();
    let mut traces = vec![Vec::new(); workers.len()];
    let mut failure = None;
    while !pending.is_empty() {
        let (ranks, calls): (Vec<usize>, Vec<_>) = pending.into_iter().unzip();
        let waited = runtime.wait(calls, 1, None);
        for (i, result) in waited.ready {
            match result
                .map_err(anyhow::Error::from)
                .and_then(|r| r.map_err(anyhow::Error::msg))
            {
                Ok(steps) => traces[ranks[i]] = steps,
                Err(e) if failure.is_none() => {
                    // The other loops would wait for this worker's clocks forever: end them.
                    servers.iter().for_each(|s| s.stop("a worker's loop failed"));
                    failure = Some(e.context(format!("worker {}'s loop", ranks[i])));
                }
                Err(_) => {}
            }
        }
        pending = waited
            .pending
            .into_iter()
            .map(|(i, call)| (ranks[i], call))
            .collect();
    }
    if let Some(error) = failure {
        workers.iter().for_each(|w| w.stop("a worker's loop failed"));
        return Err(error);
    }
    let wall_s = began.elapsed().as_secs_f64();

    let mut params = Vec::new();
    let mut logs = Vec::new();
    for (s, state) in servers.iter().map(|s| s.call(Snapshot)).enumerate() {
        let state = state.get()?;
        anyhow::ensure!(
            state.applied == config.clocks,
            "server {s} applied {} of {} clocks after every worker finished",
            state.applied,
            config.clocks
        );
        params.extend(state.values);
        logs.push(state.log);
    }
    let losses = (0..config.clocks as usize)
        .map(|c| traces.iter().map(|t| t[c].loss).sum())
        .collect();
    servers.iter().for_each(|s| s.stop("the run is over"));
    workers.iter().for_each(|w| w.stop("the run is over"));
    Ok(Outcome {
        params,
        losses,
        workers: traces,
        logs,
        wall_s,
        placement,
    })
}
