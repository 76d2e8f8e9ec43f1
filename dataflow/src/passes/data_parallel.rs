//! Data parallelism (DDP): gradient buckets, and the pass that joins the replicas along the `dp`
//! axis with one all-reduce per bucket, started right after the bucket's last writer (a pure
//! data-parallel step is a one-stage pipeline of [`super::pipeline`] with this pass over it).
//!
//! Follows PyTorch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
//! Training", VLDB 2020): buckets are filled in reverse block order, so the all-reduce of the last
//! bucket starts while the backward of the earlier blocks still runs.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::graph::{Graph, NodeOp};
use crate::instruction::CollectiveKind;
use crate::model_spec::ModelDesc;
use crate::passes::layout::Layout;
use crate::passes::runs::{Run, insert_before, segment_runs};
use crate::tensor_id::TensorId;

/// A gradient bucket: a contiguous range of blocks whose gradients are all-reduced together.
/// The plan cuts the compute segments of forward and backward on the same boundaries (one
/// segment per bucket), but they are two notions: a segment is what one compute instruction
/// runs, a bucket what one collective moves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Bucket index, in forward order.
    pub id: usize,
    /// First block.
    pub start: usize,
    /// One past the last block.
    pub end: usize,
    /// Gradient bytes (of the trainable parameters, each in its dtype).
    pub bytes: u64,
}

/// Cuts the blocks into buckets of about `bucket_bytes` of gradients (the trainable parameters'
/// bytes, from their descriptions), filling from the last block backwards.
pub fn buckets(model: &ModelDesc, bucket_bytes: u64) -> Vec<Bucket> {
    buckets_in(model, 0..model.blocks.len(), bucket_bytes, 0)
}

/// Cuts blocks `range` into buckets of about `bucket_bytes` (filled from the back), numbered
/// from `first_id`.
pub fn buckets_in(model: &ModelDesc, range: Range<usize>, bucket_bytes: u64, first_id: usize) -> Vec<Bucket> {
    let mut ranges = Vec::new();
    let mut end = range.end;
    let mut bytes = 0u64;
    for i in range.clone().rev() {
        bytes += model.blocks[i].grad_bytes();
        if bytes >= bucket_bytes || i == range.start {
            ranges.push((i, end, bytes));
            end = i;
            bytes = 0;
        }
    }
    ranges.reverse();
    ranges
        .into_iter()
        .enumerate()
        .map(|(i, (start, end, bytes))| Bucket {
            id: first_id + i,
            start,
            end,
            bytes,
        })
        .collect()
}

/// Inserts, for every gradient bucket, its all-reduce over the dp group of the bucket's pipeline
/// device right after the last run that writes it (so it overlaps the rest of the backward).
/// Nothing on one replica.
pub fn reduce_gradients(graph: &mut Graph, layout: &Layout) {
    super::tensor_parallel::reduce_replicated_grads(graph, layout);
    if layout.mesh.axis_size("dp") == 1 {
        return;
    }
    let last_writer = last_grad_writers(graph, layout);
    // One reduction per tensor-parallel rank: the replicas holding the same slice.
    let inserts = last_writer
        .values()
        .flat_map(|run| {
            layout.dp_groups(run.device).into_iter().map(|group| {
                let reduce = NodeOp::Collective {
                    kind: CollectiveKind::AllReduceSum,
                    group,
                    tensor: TensorId::GradBucket { segment: run.segment },
                    dtype: crate::DType::F32,
                    codec: crate::Codec::None,
                };
                (run.last + 1, reduce)
            })
        })
        .collect();
    insert_before(graph, inserts);
}

/// The last run that writes each segment's gradient bucket, by segment.
pub(super) fn last_grad_writers(graph: &Graph, layout: &Layout) -> BTreeMap<usize, Run> {
    let mut last_writer = BTreeMap::new();
    for run in segment_runs(graph, layout).into_iter().filter(|r| r.writes_grads) {
        last_writer.insert(run.segment, run);
    }
    last_writer
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelSpec;

    #[test]
    fn buckets_fill_from_the_back_and_cover_every_block() {
        let model = ModelSpec::mlp_8x1024().desc();
        let b = buckets(&model, 25 << 20);
        assert_eq!(b.first().unwrap().start, 0);
        assert_eq!(b.last().unwrap().end, model.blocks.len());
        assert!(b.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(b.iter().map(|b| b.bytes).sum::<u64>(), 4 * model.params());
        assert_eq!(b.len(), 2, "33.6 MB in 25 MiB buckets: {b:?}");
        assert_eq!(buckets(&model, u64::MAX).len(), 1);
        assert_eq!(buckets(&model, 1).len(), model.blocks.len());
    }

    fn reductions(graph: &Graph) -> Vec<(usize, &TensorId, &Vec<usize>)> {
        graph
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match n {
                NodeOp::Collective {
                    tensor, group, kind, ..
                } => {
                    assert_eq!(*kind, CollectiveKind::AllReduceSum);
                    Some((i, tensor, group))
                }
                _ => None,
            })
            .collect()
    }

    /// dp = 2 × pp = 2: one all-reduce per bucket over its stage's dp group, right after the last
    /// node of the run that finishes the bucket, and after every write of it; none at dp = 1.
    #[test]
    fn each_bucket_is_reduced_once_after_its_last_writer() {
        let (layout, orders) = crate::passes::runs::tests::layout(2, 2, 3);
        let mut graph = crate::passes::pipeline::build(&layout, 12, &orders);
        reduce_gradients(&mut graph, &layout);
        let reduced = reductions(&graph);
        assert_eq!(reduced.len(), layout.segments.len());
        for (at, tensor, group) in reduced {
            let TensorId::GradBucket { segment } = *tensor else {
                panic!("{tensor}")
            };
            assert_eq!(*group, layout.dp_group(layout.device_of_segment(segment)));
            let writes =
                |n: &NodeOp| matches!(n, NodeOp::Compute { outputs, .. } if outputs.contains(tensor));
            assert!(writes(&graph.nodes[at - 1]) || !matches!(graph.nodes[at - 1], NodeOp::Compute { .. }));
            assert!(
                !graph.nodes[at..].iter().any(writes),
                "bucket {segment} written after its reduction"
            );
        }
        let (single, orders) = crate::passes::runs::tests::layout(1, 2, 3);
        let mut graph = crate::passes::pipeline::build(&single, 12, &orders);
        let before = graph.clone();
        reduce_gradients(&mut graph, &single);
        assert_eq!(graph, before);
    }
}
