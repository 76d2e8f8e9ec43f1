//! Hierarchical all-reduce across islands (as NCCL's tree/ring hybrids and Horovod's hierarchical
//! allreduce): reduce-scatter inside each island, all-reduce of each shard across islands among
//! the members at the same place in their island, all-gather inside each island. Each member
//! sends only 2·(k−1)/k of the buffer inside its island and 2·(I−1)/I of a 1/k shard across
//! islands (k members per island, I islands), so the slow links carry k times less.

use archipelago_dataflow::ActorId;

use super::ring_all_reduce::{ChunkPool, shard_range};
use super::{all_gather, all_reduce, reduce_scatter};
use crate::fabric::{Fabric, FabricError};

/// Marks the edge of the cross-island phase (the inner phases use the collective's own edge).
const CROSS_ISLAND: u64 = 1 << 62;

/// The members of a collective listed island by island, `size` members per island.
#[derive(Debug, Clone, Copy)]
pub struct Islands<'a> {
    /// The members.
    pub members: &'a [ActorId],
    /// Members per island.
    pub size: usize,
}

/// Sums `data` over the members of `islands`.
pub fn hierarchical_all_reduce(
    fabric: &dyn Fabric,
    me: ActorId,
    islands: Islands<'_>,
    edge: u64,
    data: &mut [f32],
    chunk_elems: usize,
    pool: &mut ChunkPool,
) -> Result<(), FabricError> {
    let group = islands.members;
    let at = group
        .iter()
        .position(|&a| a == me)
        .ok_or(FabricError::NoSuchActor(me))?;
    let k = islands.size.max(1);
    if !group.len().is_multiple_of(k) {
        return Err(FabricError::Aborted(format!(
            "a hierarchical all-reduce over {} members cannot have islands of {k}",
            group.len()
        )));
    }
    let (island, place) = (at / k, at % k);
    let mine = &group[island * k..(island + 1) * k];
    reduce_scatter(fabric, me, mine, edge, data, chunk_elems, pool)?;
    let own = shard_range(data.len(), k, place);
    let peers: Vec<ActorId> = group.iter().skip(place).step_by(k).copied().collect();
    all_reduce(
        fabric,
        me,
        &peers,
        edge | CROSS_ISLAND,
        &mut data[own],
        chunk_elems,
        pool,
    )?;
    all_gather(fabric, me, mine, edge, data, chunk_elems, pool)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::Collectives;
    use crate::fabric::InProcessFabric;
    use std::sync::Arc;
    use std::time::Duration;

    /// Six members in three islands of two: every member ends with the sum, through shared
    /// buffers and as rings.
    #[test]
    fn sums_across_three_islands_of_two() {
        for collectives in [Collectives::Shared, Collectives::Ring] {
            sums_across_three_islands_of_two_with(collectives);
        }
    }

    fn sums_across_three_islands_of_two_with(collectives: Collectives) {
        let patience = Duration::from_secs(10);
        let fabric = Arc::new(InProcessFabric::with_collectives(6, patience, collectives));
        let group = vec![4, 0, 1, 5, 2, 3];
        let len = 1000;
        let handles: Vec<_> = (0..6)
            .map(|me| {
                let (fabric, group) = (fabric.clone(), group.clone());
                std::thread::spawn(move || {
                    let mut data: Vec<f32> = (0..len).map(|i| (me * 1000 + i) as f32).collect();
                    let mut pool = ChunkPool::default();
                    let islands = Islands {
                        members: &group,
                        size: 2,
                    };
                    hierarchical_all_reduce(fabric.as_ref(), me, islands, 7, &mut data, 64, &mut pool)
                        .unwrap();
                    data
                })
            })
            .collect();
        for h in handles {
            let data = h.join().unwrap();
            for i in [0, 1, 333, 999] {
                assert_eq!(data[i], (15_000 + 6 * i) as f32, "element {i}");
            }
        }
    }
}
