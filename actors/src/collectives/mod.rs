//! Collectives on top of the fabric, and the worker thread that runs them beside compute.
//!
//! A group whose members all live in one process reduces through their buffers ([`shared`], on
//! the fabric's [`SharedBuffers`](crate::fabric::SharedBuffers)); any other group runs the
//! chunked ring of messages ([`ring_all_reduce()`]). [`all_reduce`], [`reduce_scatter`] and
//! [`all_gather`] pick between them by asking the fabric ([`Fabric::shared_buffers`]), so every
//! member of a group picks the same. Whoever builds an in-process fabric chooses with
//! [`Collectives`] ([`InProcessFabric::with_collectives`]); the fabric itself knows nothing of
//! collectives.

pub mod element;
pub mod hierarchical;
pub mod onebit;
pub mod quantized;
pub mod residual_file;
pub mod ring_all_reduce;
pub mod shared;
pub mod sparse;
pub mod stochastic;
pub mod worker;

pub use element::Reducible;
pub use hierarchical::hierarchical_all_reduce;
pub use ring_all_reduce::{ChunkPool, ring_all_gather, ring_all_reduce, ring_reduce_scatter, shard_range};
pub use shared::SharedCollectives;
pub use worker::{CollectiveWorker, PendingCollective};

use std::time::Duration;

use archipelago_dataflow::ActorId;

use crate::fabric::{Fabric, FabricError, InProcessFabric};
use crate::typed_tensor::Element;

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

impl InProcessFabric {
    /// A fabric for `actors` actors (receives give up after `patience`) whose groups run their
    /// collectives as `collectives` says: through the fabric's
    /// [`SharedBuffers`](crate::fabric::SharedBuffers), or as rings.
    pub fn with_collectives(actors: usize, patience: Duration, collectives: Collectives) -> InProcessFabric {
        InProcessFabric::with_shared_buffers(actors, patience, collectives == Collectives::Shared)
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
/// ring); every member calls it with the same `edge`, `group`, element type and length. 16-bit
/// sums accumulate in f32 and are rounded once ([`element`]).
pub fn all_reduce<T: Reducible>(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    match fabric.shared_buffers(group) {
        Some(shared) => shared.all_reduce(me, group, edge, data),
        None => ring_all_reduce(fabric, me, group, edge, data, chunk_elems, pool),
    }
}

/// Reduce-scatter (sum) in place: member `i` ends with the total of
/// `data[shard_range(len, n, i)]` (see [`ring_reduce_scatter`]).
pub fn reduce_scatter<T: Reducible>(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    match fabric.shared_buffers(group) {
        Some(shared) => shared.reduce_scatter(me, group, edge, data),
        None => ring_reduce_scatter(fabric, me, group, edge, data, chunk_elems, pool),
    }
}

/// All-gather in place (any element type): member `i` brings `data[shard_range(len, n, i)]`
/// (see [`ring_all_gather`]).
pub fn all_gather<T: Element>(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [T],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    match fabric.shared_buffers(group) {
        Some(shared) => shared.all_gather(me, group, edge, data),
        None => ring_all_gather(fabric, me, group, edge, data, chunk_elems, pool),
    }
}

/// Element-wise maximum of `data` over `group`, in place: every member ends with the maximum
/// of every member's values (f32 only; a NaN anywhere makes that element NaN everywhere).
/// Every member calls it with the same `edge`, `group` and length. It all-gathers every member's
/// `len` values into a `n·len` buffer (member `i`'s at shard `i`, through [`all_gather`]), then
/// takes the maximum locally, in member order: member `i` reads `(n − 1)·len` elements.
pub fn all_reduce_max(
    fabric: &dyn Fabric,
    me: ActorId,
    group: &[ActorId],
    edge: u64,
    data: &mut [f32],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    let i = group
        .iter()
        .position(|&a| a == me)
        .ok_or(FabricError::NoSuchActor(me))?;
    let (n, len) = (group.len(), data.len());
    if n < 2 {
        return Ok(());
    }
    // Every member's values, member `j`'s at shard `j`.
    let mut gathered = vec![0.0f32; n * len];
    gathered[i * len..(i + 1) * len].copy_from_slice(data);
    all_gather(fabric, me, group, edge, &mut gathered, chunk_elems, pool)?;
    if len == 0 {
        return Ok(());
    }
    let (first, others) = gathered.split_at(len);
    data.copy_from_slice(first);
    for member in others.chunks_exact(len) {
        for (max, &value) in data.iter_mut().zip(member) {
            if value > *max || value.is_nan() {
                *max = value;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod across_hosts_tests;
#[cfg(test)]
mod members_tests;
#[cfg(test)]
mod typed_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-process fabric offers its groups shared buffers unless built for rings (what a
    /// local job asks by default), and only to groups whose members are all its own.
    #[test]
    fn in_process_groups_meet_at_shared_buffers_unless_rings_are_asked_for() {
        let patience = Duration::from_secs(1);
        assert_eq!(Collectives::default(), Collectives::Shared);
        let shared = InProcessFabric::with_collectives(2, patience, Collectives::default());
        assert!(shared.shared_buffers(&[0, 1]).is_some());
        assert!(
            shared.shared_buffers(&[0, 2]).is_none(),
            "actor 2 is not on the fabric"
        );
        assert!(
            InProcessFabric::new(2, patience)
                .shared_buffers(&[1, 0])
                .is_some()
        );
        let rings = InProcessFabric::with_collectives(2, patience, Collectives::Ring);
        assert!(rings.shared_buffers(&[0, 1]).is_none());
    }
}
