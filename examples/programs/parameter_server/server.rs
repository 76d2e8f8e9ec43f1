//! The server of the parameter server (Li et al., OSDI 2014; see `../parameter_server.rs`): one
//! key range of the flat parameters, its optimizer state and a vector clock of the workers. A
//! [`Pull`] is granted only within the bounded delay and otherwise answered [`Pulled::Wait`] at
//! once (a handler never waits for other workers' pushes); a clock is applied, as the sum of its
//! pushes in worker order, as soon as every worker has pushed it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use archipelago_actors::flat_optimizer::FlatOptimizer;
use archipelago_controller::prelude::*;

use super::worker::build_model;
use super::{Fault, PsConfig, Role};

/// What a server logs about the workers' clocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ClockEvent {
    /// `worker` was allowed to start `clock`; `pushed[v]` is worker `v`'s clock then.
    Granted {
        /// The worker.
        worker: usize,
        /// The clock it starts.
        clock: u64,
        /// Every worker's clock (clocks pushed) at that moment.
        pushed: Vec<u64>,
    },
    /// The sum of all pushes of `clock` was applied.
    Applied {
        /// The clock.
        clock: u64,
        /// Every worker's clock at that moment.
        pushed: Vec<u64>,
    },
}

/// One key range of the parameters, its optimizer state and the workers' clocks.
pub struct Server {
    config: PsConfig,
    values: Vec<f32>,
    optimizer: FlatOptimizer,
    /// Per worker: clocks pushed.
    pushed: Vec<u64>,
    /// Pushes of clocks not yet applied: per clock, per worker.
    pending: BTreeMap<u64, Vec<Option<Vec<f32>>>>,
    /// Clocks applied (every worker has pushed all of them).
    applied: u64,
    log: Vec<ClockEvent>,
}

impl Actor for Server {
    type Params = Role;
    async fn new(role: Role, _ctx: &Context<Self>) -> Result<Self, String> {
        let (_, flat) = build_model(&role.config.model, role.config.seed);
        let values = flat[role.config.key_range(role.index, flat.len())].to_vec();
        Ok(Server {
            optimizer: FlatOptimizer::new(role.config.optimizer, values.len()),
            values,
            pushed: vec![0; role.config.workers],
            pending: BTreeMap::new(),
            applied: 0,
            log: Vec::new(),
            config: role.config,
        })
    }
}

impl Server {
    fn check_clock(&self, worker: usize, clock: u64, what: &str) -> Result<(), String> {
        match self.pushed.get(worker) {
            None => Err(format!(
                "{what} from worker {worker}, but there are {}",
                self.pushed.len()
            )),
            Some(&at) if at != clock => Err(format!("worker {worker} at clock {at} {what}s clock {clock}")),
            Some(_) => Ok(()),
        }
    }

    /// Applies every clock all workers have pushed, in clock order.
    fn apply_complete(&mut self) {
        let slowest = self.pushed.iter().copied().min().unwrap_or(0);
        while self.applied < slowest {
            let clock = self.applied;
            let pushes = self
                .pending
                .remove(&clock)
                .expect("the pushes of a complete clock");
            let mut sum = vec![0.0f32; self.values.len()];
            for (worker, push) in pushes.into_iter().enumerate() {
                let push = push.expect("every worker pushed a complete clock");
                if self.config.fault != Fault::DropPushOf(worker) {
                    sum.iter_mut().zip(&push).for_each(|(s, g)| *s += g);
                }
            }
            if self.config.fault == Fault::AveragePushes {
                let w = self.config.workers as f32;
                sum.iter_mut().for_each(|s| *s /= w);
            }
            self.optimizer.begin_step();
            self.optimizer.update(0, &mut self.values, &sum);
            self.applied += 1;
            let pushed = self.pushed.clone();
            self.log.push(ClockEvent::Applied { clock, pushed });
        }
    }
}

/// Asks for the server's values before starting `clock`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pull {
    /// The worker asking.
    pub worker: usize,
    /// The clock it wants to start.
    pub clock: u64,
}

/// A server's answer to a [`Pull`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Pulled {
    /// The bound holds: the range's values, with the clocks they include.
    Granted {
        /// Clocks applied to `values`.
        applied: u64,
        /// The range's current values.
        values: Vec<f32>,
    },
    /// Too far ahead of the slowest worker: ask again later.
    Wait {
        /// The slowest worker's clock.
        slowest: u64,
    },
}

impl Message for Pull {
    type Reply = Result<Pulled, String>;
}

impl Handler<Pull> for Server {
    async fn handle(&mut self, Pull { worker, clock }: Pull, _ctx: &Context<Self>) -> Result<Pulled, String> {
        self.check_clock(worker, clock, "pull")?;
        let slowest = self.pushed.iter().copied().min().unwrap_or(0);
        if clock > slowest + self.config.staleness {
            return Ok(Pulled::Wait { slowest });
        }
        let pushed = self.pushed.clone();
        self.log.push(ClockEvent::Granted {
            worker,
            clock,
            pushed,
        });
        Ok(Pulled::Granted {
            applied: self.applied,
            values: self.values.clone(),
        })
    }
}

/// A worker's gradient of this server's range for `clock`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Push {
    /// The worker.
    pub worker: usize,
    /// The clock it computed.
    pub clock: u64,
    /// Its gradient of the range.
    pub grad: Vec<f32>,
}

impl Message for Push {
    type Reply = Result<(), String>;
}

impl Handler<Push> for Server {
    async fn handle(&mut self, push: Push, _ctx: &Context<Self>) -> Result<(), String> {
        self.check_clock(push.worker, push.clock, "push")?;
        if push.grad.len() != self.values.len() {
            let (got, want) = (push.grad.len(), self.values.len());
            return Err(format!(
                "worker {} pushed {got} values for a range of {want}",
                push.worker
            ));
        }
        let workers = self.config.workers;
        let slots = self
            .pending
            .entry(push.clock)
            .or_insert_with(|| vec![None; workers]);
        slots[push.worker] = Some(push.grad);
        self.pushed[push.worker] += 1;
        self.apply_complete();
        Ok(())
    }
}

/// Asks a server for its values, clocks applied and log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot;

/// A server's state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerState {
    /// The range's values.
    pub values: Vec<f32>,
    /// Clocks applied.
    pub applied: u64,
    /// Its log of the workers' clocks.
    pub log: Vec<ClockEvent>,
}

impl Message for Snapshot {
    type Reply = ServerState;
}

impl Handler<Snapshot> for Server {
    async fn handle(&mut self, _: Snapshot, _ctx: &Context<Self>) -> ServerState {
        ServerState {
            values: self.values.clone(),
            applied: self.applied,
            log: self.log.clone(),
        }
    }
}
