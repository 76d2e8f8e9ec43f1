//! What continuous batching steps: a model that extends sequences over a paged cache — one
//! device's [`WholeModel`], or a [`ShardedModel`](crate::inference_sharded::ShardedModel) cut
//! into pipeline stages of tensor-parallel ranks. The [`Batcher`](crate::batching::Batcher) and
//! the serving replicas run either.

use archipelago_dataflow::ModelSpec;

use crate::generate::{PagedCache, Sequence};
use crate::inference::WholeModel;

/// A model the batcher steps.
pub trait StepModel: Send {
    /// The model.
    fn spec(&self) -> &ModelSpec;
    /// An empty sequence.
    fn start(&self) -> Sequence;
    /// The logits of each sequence's new `ids`, their keys and values in `cache`'s blocks
    /// through the sequences' tables ([`WholeModel::extend_paged`]).
    fn extend_paged(
        &self,
        sequences: &mut [&mut Sequence],
        ids: &[&[u32]],
        cache: &mut PagedCache,
    ) -> Result<Vec<Vec<f32>>, String>;
}

impl StepModel for WholeModel {
    fn spec(&self) -> &ModelSpec {
        WholeModel::spec(self)
    }

    fn start(&self) -> Sequence {
        WholeModel::start(self)
    }

    fn extend_paged(
        &self,
        sequences: &mut [&mut Sequence],
        ids: &[&[u32]],
        cache: &mut PagedCache,
    ) -> Result<Vec<Vec<f32>>, String> {
        WholeModel::extend_paged(self, sequences, ids, cache)
    }
}
