//! Sequence parallelism in the trainer (Korthikanti et al. 2022; the plan's side is
//! `archipelago_dataflow::sequence_parallel`): the shapes of tensors cut along the tokens as they
//! cross the group's collectives, and the residual stream a LayerNorm segment adds.
//!
//! A rank's tokens are rows `[n/tp, d]` of the micro-batch's `n = b·s` tokens, flattened. The
//! reduce-scatter leaves the rank's share flat, which [`Trainer::shaped`] makes rows again; the
//! all-gather fills a buffer as long as the whole sequence with the rank's rows in place, which
//! [`Trainer::for_all_gather`] lays out as `[b, s, d]` for the blocks that read it. A segment
//! reading the residual stream ([`TensorId::Residual`]) adds it to its input ([`sum_of`]).

use archipelago_dataflow::tensor_parallel::{TpEdge, TpHeld};
use archipelago_dataflow::{TensorId, shard_range};

use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use super::kept_inputs::placed_in_whole;
use crate::block::Activation;
use crate::typed_tensor::TypedTensor;

/// The sum of `parts` (one part: itself): a segment's input and the residual stream it adds.
pub(super) fn sum_of<B: AutodiffBackend>(parts: Vec<Activation<B>>) -> Result<Activation<B>, String> {
    let mut parts = parts.into_iter();
    let first = parts.next().ok_or("a forward names no input")?;
    parts.try_fold(first, |sum, part| match (sum, part) {
        (Activation::Rows(a), Activation::Rows(b)) if a.dims() == b.dims() => Ok(Activation::Rows(a + b)),
        (Activation::Seq(a), Activation::Seq(b)) if a.dims() == b.dims() => Ok(Activation::Seq(a + b)),
        _ => Err("a segment adds a residual stream of another kind or shape than its input".to_string()),
    })
}

impl<B: AutodiffBackend> Trainer<B> {
    /// How block `k` holds its input and output across the group.
    fn form(&self, k: usize) -> Option<archipelago_dataflow::tensor_parallel::BlockTp> {
        self.stage.desc.blocks.get(k).and_then(|b| b.tp)
    }

    /// The edge of the plan between block `k` and the one after it (under tensor parallelism
    /// every block is its own segment, so segment numbers are block numbers).
    fn edge_after(&self, k: usize) -> Option<TpEdge> {
        let (out, next) = (self.form(k)?, self.form(k + 1)?);
        TpEdge::between(out.output, next.input).ok().flatten()
    }

    /// Whether `name`, exported now, goes to an all-gather of tokens: a block's output cut
    /// along the tokens before a block that reads it whole, or the gradient of an input that a
    /// reduce-scatter cut.
    fn goes_to_all_gather(&self, name: &TensorId) -> bool {
        if self.stage.tp.size < 2 {
            return false;
        }
        match name {
            TensorId::Activation { segment, .. } => self.edge_after(*segment) == Some(TpEdge::AllGather),
            TensorId::ActivationGrad { segment, .. } if *segment > 0 => {
                self.edge_after(segment - 1) == Some(TpEdge::ReduceScatter)
            }
            _ => false,
        }
    }

    /// The model's width at tensor `name` (floats per token), for rows of a reduce-scattered share.
    fn width_at(&self, name: &TensorId) -> Option<usize> {
        let block = match name {
            TensorId::Activation { segment, .. } => *segment,
            TensorId::ActivationGrad { segment, .. } => segment.checked_sub(1)?,
            _ => return None,
        };
        let tokens = self.stage.desc.input.tokens_per_sample().max(1) as u64;
        Some((self.stage.desc.blocks.get(block)?.output_floats_per_sample / tokens) as usize)
    }

    /// A tensor the table holds under `name` in the shape its reader computes with: a
    /// reduce-scattered share (flat) as rows of the model's width; anything else as it is.
    pub(super) fn shaped(&self, name: &TensorId, t: TypedTensor) -> Result<TypedTensor, String> {
        if t.shape().len() != 1 || !self.cut_along_tokens(name) {
            return Ok(t);
        }
        let width = self
            .width_at(name)
            .filter(|w| *w > 0 && t.elements().is_multiple_of(*w));
        let width = width.ok_or_else(|| {
            format!(
                "`{name}`: {} elements are no rows of the model's width",
                t.elements()
            )
        })?;
        TypedTensor::from_bytes(t.dtype(), vec![t.elements() / width, width], t.bytes())
            .map_err(|e| format!("`{name}`: {e:?}"))
    }

    /// Whether the reader of `name` holds it cut along the tokens (the next block's input, or the
    /// block before's output for a gradient).
    fn cut_along_tokens(&self, name: &TensorId) -> bool {
        let held = match name {
            TensorId::Activation { segment, .. } => self.form(segment + 1).map(|f| f.input),
            TensorId::ActivationGrad { segment, .. } if *segment > 0 => {
                self.form(segment - 1).map(|f| f.output)
            }
            _ => None,
        };
        held == Some(TpHeld::SeqSharded)
    }

    /// `part` (this rank's rows `[n/tp, d]`) exported as `name`: for an all-gather of tokens a
    /// buffer `[b, s, d]` as long as the whole micro-batch with the rows at the rank's place.
    pub(super) fn for_all_gather(&self, name: &TensorId, part: TypedTensor) -> Result<TypedTensor, String> {
        if !self.goes_to_all_gather(name) {
            return Ok(part);
        }
        let &[rows, width] = part.shape() else {
            return Err(format!(
                "`{name}` is gathered along the tokens and holds {:?}, not rows",
                part.shape()
            ));
        };
        let (tp, ctx) = (self.stage.tp, self.stage.desc.input.tokens_per_sample().max(1));
        let tokens = rows * tp.size;
        if !tokens.is_multiple_of(ctx) {
            return Err(format!(
                "`{name}`: {tokens} tokens are no whole sequences of {ctx}"
            ));
        }
        let at = shard_range(tokens * width, tp.size, tp.rank);
        placed_in_whole(&part, vec![tokens / ctx, ctx, width], at).map_err(|e| format!("`{name}`: {e}"))
    }
}
