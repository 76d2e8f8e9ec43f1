//! What a parameter-server job is: the model it trains ([`PsModel`]) and the job itself
//! ([`PsJob`]: servers, workers, replicas, consistency, clocks, key caching and the filter),
//! with the checks that refuse one that cannot run before anything is spawned.

use std::path::PathBuf;

use archipelago_actors::ps::Consistency;
use archipelago_actors::ps::server::ServerFault;
use archipelago_actors::ps::sparse_lr::CtrSpec;
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::data::DataSpec;

/// The model a job trains.
#[derive(Debug, Clone, PartialEq)]
pub enum PsModel {
    /// A zoo model, its flat parameters cut into keys of `width` values.
    Dense {
        /// The model.
        model: ModelSpec,
        /// Its data.
        data: DataSpec,
        /// Seed of the initial parameters.
        seed: u64,
        /// Values per key.
        width: usize,
    },
    /// Sparse logistic regression on synthetic click-through data (keys of width 1).
    SparseLr(CtrSpec),
}

impl PsModel {
    /// Values per key.
    pub fn width(&self) -> usize {
        match self {
            PsModel::Dense { width, .. } => *width,
            PsModel::SparseLr(_) => 1,
        }
    }
}

/// A parameter-server job.
#[derive(Debug, Clone)]
pub struct PsJob<U> {
    /// What it trains.
    pub model: PsModel,
    /// The servers' update rule.
    pub update: U,
    /// Server actors.
    pub servers: usize,
    /// Worker actors.
    pub workers: usize,
    /// Copies of every key range (chain replication; at most `servers`).
    pub replicas: usize,
    /// Virtual nodes per server on the ring.
    pub vnodes: usize,
    /// The consistency model.
    pub consistency: Consistency,
    /// Rows per worker per clock.
    pub local_batch: usize,
    /// Clocks this job runs (from 0, or from the checkpoint's clock with `resume`).
    pub clocks: u64,
    /// Milliseconds each worker sleeps per clock, by rank (missing ranks do not sleep).
    pub delay_ms: Vec<u64>,
    /// Write a checkpoint here after the last clock.
    pub checkpoint_dir: Option<PathBuf>,
    /// Resume from the checkpoint in this directory.
    pub resume: Option<PathBuf>,
    /// Keep the servers' clock logs (for tests of the bound).
    pub log_clocks: bool,
    /// Key caching (Li et al. §3.5): key lists sent again go as their hash.
    pub key_caching: bool,
    /// The significantly-modified filter's threshold (Li et al. §3.4; none: off).
    pub filter: Option<f32>,
    /// A planted server fault (tests only).
    #[doc(hidden)]
    pub fault: ServerFault,
    /// A planted worker failure: `(rank, clock)` (tests only).
    #[doc(hidden)]
    pub fail_at: Option<(usize, u64)>,
}

impl<U> PsJob<U> {
    /// Rows per clock over all workers.
    pub fn global_batch(&self) -> usize {
        self.workers * self.local_batch
    }

    /// Devices the job needs: one per server, then one per worker.
    pub fn devices(&self) -> usize {
        self.servers + self.workers
    }

    /// Refuses a job that cannot run, naming the fix.
    pub fn check(&self) -> Result<(), String> {
        if self.servers == 0 {
            return Err("--servers 0: a parameter server needs at least one server".into());
        }
        if self.workers == 0 {
            return Err("--workers 0: a parameter server needs at least one worker".into());
        }
        if let Some(threshold) = self.filter
            && !(threshold.is_finite() && threshold >= 0.0)
        {
            return Err(format!(
                "--filter {threshold}: the filter's threshold is a magnitude; give a number ≥ 0 (or leave it off)"
            ));
        }
        if self.replicas == 0 {
            return Err("--replicas 0: every key range needs at least one copy (use --replicas 1)".into());
        }
        if self.replicas > self.servers {
            return Err(format!(
                "--replicas {} with --servers {}: a range cannot have more replicas than there are servers; \
                 use --replicas {} or more --servers",
                self.replicas, self.servers, self.servers
            ));
        }
        if self.local_batch == 0 {
            return Err("--batch must give every worker at least one row".into());
        }
        if self.vnodes == 0 {
            return Err("--vnodes 0: every server needs at least one point on the ring".into());
        }
        match &self.model {
            PsModel::Dense { width: 0, .. } => Err("--key-width 0: a key holds at least one value".into()),
            PsModel::SparseLr(spec) => spec.check(),
            PsModel::Dense { .. } => Ok(()),
        }
    }
}
