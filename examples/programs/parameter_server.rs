//! A parameter server (Li et al., "Scaling Distributed Machine Learning with the Parameter
//! Server", OSDI 2014) as a *user* of the library: `archipelago_actors::ps` has the server
//! actors (key ranges on a consistent-hash ring, the update rule on the server, consistency per
//! task) and the workers; `archipelago_controller::ps_job` spawns and drives a job. This program
//! only says what to train — an mlp's flat parameters cut into keys of 64 values over `S`
//! servers, `W` workers, bounded delay `K` — and checks what came back.
//! `examples/parameter_server.rs` runs it; `examples/tests/programs.rs` checks it on this
//! process and `examples/tests/cluster.rs` on two host processes of the example's binary.
//!
//! At `K = 0` a server applies each clock as the sum of all `W` pushes of that clock at once,
//! with plain SGD: the run is synchronous data parallelism, and the tests compare it with
//! `Controller::train` element by element. At `K > 0` a worker may start clock `c` once the
//! slowest has pushed `c − K` clocks; the servers log every worker's clock at every granted pull
//! and applied clock, and the tests check the bound from those logs.

use serde::{Deserialize, Serialize};

use archipelago_actors::ps::server::ServerFault;
use archipelago_actors::ps::{BuiltinUpdate, Consistency, Initializer};
use archipelago_controller::prelude::*;
use archipelago_controller::ps_job::{PsJob, PsModel, PsOutcome};
use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::{ModelSpec, OptimizerSpec};

pub use archipelago_actors::ps::{ClockEvent, WorkerStep};

/// Values per key: the mlp's flat parameters are cut into keys of this many.
pub const KEY_WIDTH: usize = 64;

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
    /// The optimizer the servers run (plain SGD or Adam).
    pub optimizer: OptimizerSpec,
    /// Server actors.
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

    /// The library's job for this configuration.
    pub fn job(&self) -> anyhow::Result<PsJob<BuiltinUpdate>> {
        let update =
            BuiltinUpdate::from_spec(self.optimizer, 0.0, Initializer::Zeros).map_err(anyhow::Error::msg)?;
        Ok(PsJob {
            model: PsModel::Dense {
                model: self.model.clone(),
                data: DataSpec::Clusters { seed: self.seed },
                seed: self.seed,
                width: KEY_WIDTH,
            },
            update,
            servers: self.servers,
            workers: self.workers,
            replicas: 1,
            vnodes: 16,
            consistency: Consistency::with_staleness(Some(self.staleness)),
            local_batch: self.local_batch,
            clocks: self.clocks,
            delay_ms: self.delay_ms.clone(),
            checkpoint_dir: None,
            resume: None,
            log_clocks: true,
            key_caching: true,
            filter: None,
            fault: match self.fault {
                Fault::DropPushOf(w) => ServerFault::DropPushOf(w),
                Fault::AveragePushes => ServerFault::AveragePushes,
                Fault::None | Fault::FailAt(..) => ServerFault::None,
            },
            fail_at: match self.fault {
                Fault::FailAt(rank, clock) => Some((rank, clock)),
                _ => None,
            },
        })
    }
}

/// The types the program sends across processes: the library's servers and workers with the
/// built-in update rules.
pub fn registry() -> Registry {
    archipelago_actors::ps::registry::<BuiltinUpdate>()
}

/// Trains `config` on `runtime` with the library's driver: servers on its first `servers`
/// slots, workers on the next `workers`.
pub fn run(runtime: &Runtime, config: &PsConfig) -> anyhow::Result<PsOutcome> {
    archipelago_controller::ps_job::run(runtime, &config.job()?)
}

/// Every server's clock log, one after another.
pub fn clock_log(outcome: &PsOutcome) -> impl Iterator<Item = &ClockEvent> {
    outcome.servers.iter().flat_map(|s| &s.log)
}

/// Every worker's clocks, by rank.
pub fn worker_steps(outcome: &PsOutcome) -> Vec<&[WorkerStep]> {
    outcome.workers.iter().map(|w| &w.steps[..]).collect()
}
