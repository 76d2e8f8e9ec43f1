//! Data parallelism (DDP): replicate the step over the `dp` axis, bucket the gradients, and join
//! the replicas' buckets with all-reduce edges.
//!
//! Follows PyTorch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
//! Training", VLDB 2020): buckets are filled in reverse block order, so the all-reduce of the last
//! bucket starts while the backward of the earlier blocks still runs.

use serde::{Deserialize, Serialize};

use crate::graph::Graph;
use crate::instruction::{CollectiveKind, ComputeOp};
use crate::mesh::Mesh;
use crate::model_spec::ModelDesc;

/// A gradient bucket: a contiguous range of blocks whose gradients are all-reduced together.
/// Buckets are also the segments of forward and backward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Bucket index, in forward order.
    pub id: usize,
    /// First block.
    pub start: usize,
    /// One past the last block.
    pub end: usize,
    /// Gradient bytes (f32).
    pub bytes: u64,
}

/// Cuts the blocks into buckets of about `bucket_bytes`, filling from the last block backwards.
pub fn buckets(model: &ModelDesc, bucket_bytes: u64) -> Vec<Bucket> {
    let mut ranges = Vec::new();
    let mut end = model.blocks.len();
    let mut bytes = 0u64;
    for i in (0..model.blocks.len()).rev() {
        bytes += 4 * model.blocks[i].params;
        if bytes >= bucket_bytes || i == 0 {
            ranges.push((i, end, bytes));
            end = i;
            bytes = 0;
        }
    }
    ranges.reverse();
    ranges
        .into_iter()
        .enumerate()
        .map(|(id, (start, end, bytes))| Bucket {
            id,
            start,
            end,
            bytes,
        })
        .collect()
}

/// Name of bucket `k`'s gradient tensor.
pub fn grad_name(k: usize) -> String {
    format!("grad.{k}")
}

/// Builds the graph of one data-parallel training step on `mesh` (axis `dp`).
///
/// Each replica: load its batch slice, forward segment by segment, loss, then backward segment by
/// segment from the last, each followed by the all-reduce of that segment's gradient bucket, and
/// finally the optimizer step (which waits for every bucket).
pub fn build_step(model: &ModelDesc, mesh: &Mesh, batch: usize, buckets: &[Bucket]) -> Graph {
    let dp = mesh.axis_size("dp");
    let mut graph = Graph::new(mesh.size());
    let per_replica = batch / dp;
    let blocks = model.blocks.len();
    for b in buckets {
        graph.tensor_bytes.insert(grad_name(b.id), b.bytes);
    }
    for rank in 0..mesh.size() {
        let r = mesh.coord(rank, "dp");
        graph.compute(
            rank,
            ComputeOp::LoadBatch {
                start: r * per_replica,
                end: (r + 1) * per_replica,
            },
            &[],
            &["batch"],
        );
    }
    for b in buckets {
        let input = if b.id == 0 {
            "batch".to_string()
        } else {
            format!("act.{}", b.id - 1)
        };
        for rank in 0..mesh.size() {
            let op = ComputeOp::Forward {
                start: b.start,
                end: b.end,
                mb: 0,
            };
            graph.compute(rank, op, &[&input], &[&format!("act.{}", b.id)]);
        }
    }
    let last = buckets.len() - 1;
    for rank in 0..mesh.size() {
        graph.compute(
            rank,
            ComputeOp::Loss { mb: 0 },
            &[&format!("act.{last}"), "batch"],
            &["loss"],
        );
    }
    for b in buckets.iter().rev() {
        let upstream = if b.id == last {
            "loss".to_string()
        } else {
            format!("dact.{}", b.id + 1)
        };
        let grad = grad_name(b.id);
        let mut outputs = vec![grad.clone()];
        if b.id > 0 {
            outputs.push(format!("dact.{}", b.id));
        }
        let outputs: Vec<&str> = outputs.iter().map(String::as_str).collect();
        for rank in 0..mesh.size() {
            let op = ComputeOp::Backward {
                start: b.start,
                end: b.end,
                mb: 0,
            };
            graph.compute(rank, op, &[&upstream], &outputs);
        }
        if dp > 1 {
            for rank in 0..mesh.size() {
                if mesh.coord(rank, "dp") == 0 {
                    graph.collective(CollectiveKind::AllReduceSum, mesh.group(rank, "dp"), &grad);
                }
            }
        }
    }
    let grads: Vec<String> = buckets.iter().map(|b| grad_name(b.id)).collect();
    let grads: Vec<&str> = grads.iter().map(String::as_str).collect();
    for rank in 0..mesh.size() {
        graph.compute(
            rank,
            ComputeOp::OptimizerStep {
                start: 0,
                end: blocks,
            },
            &grads,
            &[],
        );
    }
    graph
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
}
