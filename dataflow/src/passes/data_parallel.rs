//! Data parallelism (DDP): gradient buckets, the segments of forward and backward whose
//! all-reduce edges join the replicas along the `dp` axis (inserted by [`super::pipeline`], which
//! builds the whole step: a pure data-parallel step is a one-stage pipeline).
//!
//! Follows PyTorch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
//! Training", VLDB 2020): buckets are filled in reverse block order, so the all-reduce of the last
//! bucket starts while the backward of the earlier blocks still runs.

use serde::{Deserialize, Serialize};

use std::ops::Range;

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

/// Name of bucket `k`'s gradient tensor.
pub fn grad_name(k: usize) -> String {
    format!("grad.{k}")
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
