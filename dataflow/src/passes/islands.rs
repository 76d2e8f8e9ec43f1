//! The islands pass: a gradient all-reduce whose dp group spans islands (hosts, or groups of
//! devices joined by a fast link) becomes hierarchical — reduce-scatter inside each island,
//! all-reduce of each shard across islands, all-gather inside each island — so that only
//! `1/island_size` of the bytes cross the slow links (as NCCL's tree/ring hierarchy and
//! Horovod's hierarchical all-reduce do).

use crate::ActorId;
use crate::graph::{Graph, NodeOp};
use crate::instruction::CollectiveKind;
use crate::passes::layout::Layout;
use crate::tensor_id::TensorId;

/// The all-reduce over `group`: hierarchical when the group spans islands with the same number
/// (≥ 2) of members in each (listed island by island), a flat ring otherwise.
pub fn all_reduce(layout: &Layout, group: &[ActorId]) -> (CollectiveKind, Vec<ActorId>) {
    let flat = (CollectiveKind::AllReduceSum, group.to_vec());
    if layout.islands.is_empty() {
        return flat;
    }
    let mut by_island: Vec<(usize, Vec<ActorId>)> = Vec::new();
    for &a in group {
        let island = layout.islands[a];
        match by_island.iter_mut().find(|(i, _)| *i == island) {
            Some((_, members)) => members.push(a),
            None => by_island.push((island, vec![a])),
        }
    }
    let size = by_island[0].1.len();
    if by_island.len() < 2 || size < 2 || by_island.iter().any(|(_, m)| m.len() != size) {
        return flat;
    }
    let ordered = by_island.into_iter().flat_map(|(_, m)| m).collect();
    (
        CollectiveKind::HierarchicalAllReduceSum { island_size: size },
        ordered,
    )
}

/// Makes every gradient all-reduce of `graph` hierarchical where its group spans islands.
pub fn apply(graph: &mut Graph, layout: &Layout) {
    for node in &mut graph.nodes {
        if let NodeOp::Collective {
            kind, group, tensor, ..
        } = node
            && *kind == CollectiveKind::AllReduceSum
            && matches!(tensor, TensorId::GradBucket { .. })
        {
            (*kind, *group) = all_reduce(layout, group);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::runs::tests::layout;

    /// Four replicas on islands a, b, a, b: hierarchical, listed island by island; uneven or
    /// single-island groups and other tensors stay flat.
    #[test]
    fn groups_spanning_even_islands_reduce_hierarchically() {
        let (mut layout, _) = layout(4, 1, 1);
        layout.islands = vec![0, 1, 0, 1];
        let (kind, members) = all_reduce(&layout, &[0, 1, 2, 3]);
        assert_eq!(kind, CollectiveKind::HierarchicalAllReduceSum { island_size: 2 });
        assert_eq!(members, [0, 2, 1, 3]);
        layout.islands = vec![0, 0, 0, 1];
        assert_eq!(all_reduce(&layout, &[0, 1, 2, 3]).0, CollectiveKind::AllReduceSum);
        layout.islands = vec![0, 1, 0, 1];
        let mut graph = Graph::new(4);
        graph.collective(
            CollectiveKind::AllReduceSum,
            vec![0, 1, 2, 3],
            &TensorId::GradBucket { segment: 0 },
        );
        graph.collective(
            CollectiveKind::AllReduceSum,
            vec![0, 1, 2, 3],
            &TensorId::GradSquares,
        );
        apply(&mut graph, &layout);
        let kinds: Vec<CollectiveKind> = graph
            .nodes
            .iter()
            .map(|n| match n {
                NodeOp::Collective { kind, .. } => *kind,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                CollectiveKind::HierarchicalAllReduceSum { island_size: 2 },
                CollectiveKind::AllReduceSum
            ]
        );
    }
}
