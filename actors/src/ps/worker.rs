//! What every worker of the parameter server (Li et al., OSDI 2014) shares, whatever its model:
//! the message that runs its clocks against the servers ([`Train`]), the one that seeds a dense
//! model's initial values ([`SeedModel`]), what it reports per clock ([`WorkerStep`]) and the
//! settings of its loop ([`LoopSettings`]). The workers themselves are [`super::DenseWorker`] (a
//! burn model, chunked into keys) and [`super::SparseLrWorker`] (sparse logistic regression).

use serde::{Deserialize, Serialize};

use super::client::ClientFigures;
use super::ring::Ring;
use super::server::PsServer;
use super::update::ServerUpdate;
use crate::runtime::{ActorRef, Message};

/// Runs clocks `first_clock .. first_clock + clocks` of a worker against `servers`; the reply is
/// each clock as the worker saw it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Train<U: ServerUpdate> {
    /// The servers, by ring index.
    pub servers: Vec<ActorRef<PsServer<U>>>,
    /// The ring over them.
    pub ring: Ring,
    /// The clock to start at.
    pub first_clock: u64,
    /// Clocks to run.
    pub clocks: u64,
    /// Copies of every key range (the chain each push walks).
    pub replicas: usize,
}

impl<U: ServerUpdate> Message for Train<U> {
    type Reply = Result<WorkerRun, String>;
}

/// Sets a dense model's initial values on the servers (sent to one worker, before any [`Train`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(bound = "")]
pub struct SeedModel<U: ServerUpdate> {
    /// The servers, by ring index.
    pub servers: Vec<ActorRef<PsServer<U>>>,
    /// The ring over them.
    pub ring: Ring,
    /// Copies of every key range (every chain member gets the values).
    pub replicas: usize,
}

impl<U: ServerUpdate> Message for SeedModel<U> {
    type Reply = Result<(), String>;
}

/// One clock of one worker, as its loop saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStep {
    /// The clock.
    pub clock: u64,
    /// Clocks applied to the values it computed on (the fewest over the servers).
    pub applied: u64,
    /// Its share of the global loss (its rows' loss sum over the global batch).
    pub loss: f32,
    /// Pulls answered "not yet" before every server granted.
    pub refused: u32,
    /// Seconds the clock took (pull, compute, push).
    pub time_s: f64,
}

/// A worker's whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRun {
    /// Every clock.
    pub steps: Vec<WorkerStep>,
    /// Its traffic.
    pub figures: ClientFigures,
    /// Per key, the sum of its acknowledged pushes, ascending by key (empty unless
    /// [`LoopSettings::log_acked`]).
    #[serde(default)]
    pub acked: Vec<(u64, Vec<f32>)>,
}

/// How a worker's loop runs, beside its model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoopSettings {
    /// The worker's rank.
    pub rank: usize,
    /// Workers of the job.
    pub workers: usize,
    /// Rows per clock (the global batch is `workers × local_batch`).
    pub local_batch: usize,
    /// Milliseconds it sleeps per clock (to make a slow worker).
    pub delay_ms: u64,
    /// Keep the sum of every acknowledged push per key ([`WorkerRun::acked`]).
    #[serde(default)]
    pub log_acked: bool,
    /// Key caching: a key list already sent to a server goes as its hash.
    #[serde(default)]
    pub key_caching: bool,
    /// The significantly-modified filter's threshold (none: every gradient pushed at once).
    #[serde(default)]
    pub filter: Option<f32>,
    /// A window of clocks in which the worker sleeps longer (to make a worker slow for a while).
    #[serde(default)]
    pub slow: Option<SlowWindow>,
    /// A planted failure at this clock (tests only).
    #[doc(hidden)]
    pub fail_at: Option<u64>,
}

/// A window of clocks in which a worker sleeps `extra_ms` more per clock, beside
/// [`LoopSettings::delay_ms`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlowWindow {
    /// The first slowed clock.
    pub first_clock: u64,
    /// Slowed clocks from `first_clock` on.
    pub clocks: u64,
    /// Extra milliseconds of sleep per slowed clock.
    pub extra_ms: u64,
}

impl SlowWindow {
    /// Whether `clock` is in the window.
    pub fn contains(&self, clock: u64) -> bool {
        clock >= self.first_clock && clock - self.first_clock < self.clocks
    }
}

impl LoopSettings {
    /// Rows per clock over all workers.
    pub fn global_batch(&self) -> usize {
        self.workers * self.local_batch
    }

    /// Milliseconds the worker sleeps at `clock`: the delay, plus the slow window's extra
    /// where `clock` is in it.
    pub fn delay_at(&self, clock: u64) -> u64 {
        let extra = self.slow.filter(|w| w.contains(clock)).map_or(0, |w| w.extra_ms);
        self.delay_ms + extra
    }

    /// Sleeps the configured delay and fails where a failure is planted.
    pub async fn before_compute(&self, clock: u64) -> Result<(), String> {
        if self.fail_at == Some(clock) {
            return Err(format!("a planted failure at clock {clock}"));
        }
        let delay = self.delay_at(clock);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_window_adds_its_delay_only_inside_it() {
        let settings = LoopSettings {
            delay_ms: 3,
            slow: Some(SlowWindow {
                first_clock: 5,
                clocks: 3,
                extra_ms: 40,
            }),
            ..LoopSettings::default()
        };
        let delays: Vec<u64> = (3..10).map(|c| settings.delay_at(c)).collect();
        assert_eq!(delays, vec![3, 3, 43, 43, 43, 3, 3]);
        // Negative control: without the window every clock gets the plain delay.
        let plain = LoopSettings {
            slow: None,
            ..settings.clone()
        };
        assert!((3..10).all(|c| plain.delay_at(c) == 3));
        assert_ne!(plain.delay_at(5), settings.delay_at(5));
    }
}
