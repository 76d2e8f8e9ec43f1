//! The parameter server of Li et al., "Scaling Distributed Machine Learning with the Parameter
//! Server" (OSDI 2014), as a library on the runtime API: server actors hold a model as `u64`
//! keys with `width` f32 values each, workers pull values and push gradients for the keys their
//! data touches, the consistency model is chosen per task, and the server's update is the
//! user's.
//!
//! - [`Ring`] ([`ring`]): key ranges on a consistent-hash ring over the servers, with virtual
//!   nodes; adding or removing a server moves only the ranges it gains or loses.
//! - [`PsServer`] ([`server`]): one server — its keys ([`KeyStore`], created on first touch),
//!   the workers' clocks, the pushes of clocks not yet applied, its figures, its checkpoint.
//! - [`ServerUpdate`] ([`update`]): ps-lite's server handle — [`Sgd`], [`ProximalL1`], [`Adam`]
//!   provided, any other rule a type of the program's own.
//! - [`PsClient`] ([`client`]): a worker's pull and push, split by the ring.
//! - [`Consistency`] ([`clock`]): sequential, bounded delay `K`, eventual.
//! - Workers: [`DenseWorker`] (any zoo model, its flat parameters cut into keys) and
//!   [`SparseLrWorker`] (sparse logistic regression with L1 on synthetic click-through data).
//! - [`checkpoint`]: servers write their keys, state and clocks; a job stops and resumes.
//!
//! The driver that spawns a job, runs it and writes its report is the controller's
//! (`archipelago_controller::ps_job`, `archipelago ps`).
//!
//! # Consistency, precisely
//! A worker's clock is the number of clocks it has pushed. Every worker pulls from and pushes to
//! every server at every clock (empty key lists where it needs none of a server's keys), so every
//! server knows every worker's clock and enforces the bound itself.
//! - **Sequential** (`K = 0`): a pull of clock `c` is granted once every worker has pushed clock
//!   `c − 1`; a server applies clock `c` once all `W` pushes of `c` are in, as their sum (worker
//!   order) through the update rule, once per key. A pull of `c` sees exactly clocks `0 .. c`.
//!   With [`Sgd`] this is synchronous data-parallel SGD, step for step.
//! - **Bounded delay `K`**: a pull of clock `c` is granted once the slowest worker has pushed
//!   `c − K` clocks (it waits only while the slowest is more than `K` behind); clocks are applied
//!   whole, as under `K = 0`, so a pull of `c` sees every clock `< c − K`, and perhaps more.
//! - **Eventual** (`K = ∞`): pulls are always granted and a push is applied alone, on arrival.
//!
//! A pull that must wait is answered "not yet" and retried by the client after a back-off (a
//! handler cannot wait for other messages of its own actor). Servers count pushes, pulls,
//! refusals, payload bytes and the most clocks a granted pull was ahead of the slowest worker.
//!
//! # Chain replication and failover
//! With `R` replicas ([`ServerParams::replicas`]) every key is held by the `R` servers of
//! [`Ring::chain`]: its owner (the head, which answers pulls), then the next distinct servers
//! clockwise. A worker's push walks the chains ([`Push::part`]): part 0 to every server (the keys
//! it heads), then part 1 once all took part 0, …, so that a push is acknowledged only once every
//! chain's tail has it. Every replica applies the same pushes; under the aggregating models
//! (`K` finite) each applies the same clock sums.
//!
//! When a server's host is lost (SIGKILL), the driver ([`failover`]; the controller's
//! `ps_job::failover`) removes it from the ring ([`Ring::remove`] hands each of its arcs to the
//! next point's server, the chain's second), freezes the live servers, has the first surviving
//! member of every changed chain copy its keys (values and update state) and the version vectors
//! of their ranges to the new members, and commits the ring under a new version. Workers
//! whose call failed, or who were answered "moved", fetch the new ring from the servers and do
//! their pull or whole push again; a push that already reached a range (its version vector says
//! so) is not applied there again, so a retried push is counted once. A range whose `R` replicas are all lost is named and the job
//! stops. Under a finite `K` the servers keep the pushes of clocks not yet applied: a clock is
//! applied to a range once every worker's push of it reached the range (its version vector), a
//! failover hands those kept pushes over with the range, and a worker's retried push completes
//! the clock there — never applied in two pieces, never twice (`server/apply.rs`).
//!
//! # Filters and key caching
//! **The significantly-modified filter** ([`filter`], §3.4) holds back a key's gradient until its
//! accumulated magnitude passes a threshold (`--filter θ`). **Key caching** ([`key_cache`], §3.5):
//! a key list a worker already sent to a server goes as its hash (a push by the hash of the list
//! its pull sent; a dense model's lists every clock); a server that does not keep the list
//! answers "unknown" and gets it whole.
//!
//! # Version vectors per key range
//! [`versions`] (§4.1): per arc of the ring it holds, a server keeps the next clock of every
//! worker whose push has not reached the arc — one vector per range, not per key, since every
//! push covers whole ranges. They make a retried push count once, let a pull ask for "at least
//! version `v`" ([`Pull::at_least`], [`client::PsClient::pull_at_least`]), travel with the keys
//! in a failover, and are in every server's [`Stats`] and [`Dump`], so the driver compares what
//! each replica of a range holds (`Replication::version_mismatches` in the controller's report).

pub mod checkpoint;
pub mod client;
pub mod clock;
pub mod dense_worker;
pub mod failover;
#[cfg(test)]
mod failover_tests;
pub mod filter;
pub mod key_cache;
pub mod ring;
pub mod server;
#[cfg(test)]
mod server_tests;
pub mod sparse_lr;
pub mod store;
pub mod update;
pub mod versions;
pub mod worker;

pub use client::{ClientFigures, PsClient, PulledValues};
pub use clock::{ClockEvent, Consistency, WorkerClocks};
pub use dense_worker::{DenseLayout, DenseWorker, DenseWorkerParams};
pub use failover::{Commit, Entries, Freeze, GetRing, Handover, Install, PendingPush, RingVersion};
pub use ring::{KeyRange, Ring, RingError, ServerId};
pub use server::{
    Assign, Dump, Dumped, PsServer, Pull, Pulled, Push, Pushed, SaveCheckpoint, ServerFigures, ServerParams,
    ServerReport, Stats, register_server,
};
pub use sparse_lr::{CtrSpec, SparseLrParams, SparseLrWorker};
pub use store::KeyStore;
pub use update::{Adam, BuiltinUpdate, Initializer, ProximalL1, Rule, ServerUpdate, Sgd};
pub use worker::{LoopSettings, SeedModel, SlowWindow, Train, WorkerRun, WorkerStep};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::runtime::Registry;

/// Registers a job's servers and both kinds of worker for update rule `U`, so that they and
/// their messages cross processes (merge it into the program's registry).
pub fn registry<U>() -> Registry
where
    U: ServerUpdate + Serialize + DeserializeOwned,
{
    register_server::<U>(Registry::new())
        .actor::<DenseWorker<U>>()
        .handles::<DenseWorker<U>, Train<U>>()
        .handles::<DenseWorker<U>, SeedModel<U>>()
        .actor::<SparseLrWorker<U>>()
        .handles::<SparseLrWorker<U>, Train<U>>()
}
