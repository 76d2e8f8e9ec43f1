//! Collectives on top of the fabric, and the worker thread that runs them beside compute.
//!
//! A group whose members all live in one process reduces through their buffers
//! ([`shared`]); any other group runs the chunked ring of messages ([`ring_all_reduce()`]).
//! [`all_reduce`], [`reduce_scatter`] and [`all_gather`] pick between them by asking the fabric
//! ([`crate::fabric::Fabric::shared_group`]), so every member of a group picks the same.

pub mod hierarchical;
pub mod ring_all_reduce;
pub mod shared;
pub mod worker;

pub use hierarchical::hierarchical_all_reduce;
pub use ring_all_reduce::{ChunkPool, ring_all_gather, ring_all_reduce, ring_reduce_scatter, shard_range};
pub use shared::SharedCollectives;
pub use worker::{CollectiveWorker, PendingCollective};

use archipelago_dataflow::ActorId;

use crate::fabric::{Fabric, FabricError};

/// Default chunk of a pipelined collective: 1 MiB of f32 (fits in cache, amortises messaging).
pub const DEFAULT_CHUNK_ELEMS: usize = 1 << 18;

/// How the groups of an in-process fabric run their collectives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Collectives {
    /// Through each other's buffers, without messages (the default).
    #[default]
    Shared,
    /// As rings of messages, like groups that span processes.
    Ring,
}

impl std::str::FromStr for Collectives {
    type Err = String;
    fn from_str(s: &str) -> Result<Collectives, String> {
        match s {
            "shared" => Ok(Collectives::Shared),
            "ring" => Ok(Collectives::Ring),
            other => Err(format!("collectives are `shared` or `ring`, not `{other}`")),
        }
    }
}

impl std::fmt::Display for Collectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Collectives::Shared => "shared",
            Collectives::Ring => "ring",
        })
    }
}

/// Sums `data` over `group` in place (shared buffers where the fabric offers them, else the
/// ring); every member calls it with the same `edge`, `group` and length.
pub fn all_reduce(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [f32],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    match fabric.shared_group(group) {
        Some(shared) => shared.all_reduce(me, group, edge, data),
        None => ring_all_reduce(fabric, me, group, edge, data, chunk_elems, pool),
    }
}

/// Reduce-scatter (sum) in place: member `i` ends with the total of
/// `data[shard_range(len, n, i)]` (see [`ring_reduce_scatter`]).
pub fn reduce_scatter(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [f32],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    match fabric.shared_group(group) {
        Some(shared) => shared.reduce_scatter(me, group, edge, data),
        None => ring_reduce_scatter(fabric, me, group, edge, data, chunk_elems, pool),
    }
}

/// All-gather in place: member `i` brings `data[shard_range(len, n, i)]` (see
/// [`ring_all_gather`]).
pub fn all_gather(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [f32],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    match fabric.shared_group(group) {
        Some(shared) => shared.all_gather(me, group, edge, data),
        None => ring_all_gather(fabric, me, group, edge, data, chunk_elems, pool),
    }
}
