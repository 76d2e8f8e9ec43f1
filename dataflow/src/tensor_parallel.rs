//! Which elements of each parameter a tensor-parallel rank holds (Megatron-LM, Shoeybi et al.
//! 2019): the local shape of a split parameter, and the runs that map its local row-major
//! elements onto the global parameter's flat elements.
//!
//! [`global_runs`] is the one contract every layout-crossing path keeps: initialisation (each
//! parameter drawn whole from `(seed, name)`, then these elements taken, so tp=N starts from
//! exactly tp=1's weights), checkpoint pieces, the replica check's assembled parameters, `--init`
//! files and `export`. A split extent tp does not divide (a vocabulary) is padded to the next
//! multiple of tp: the last ranks' padded positions have no global element, start at zero and are
//! masked out of the loss. [`local_model`] is the model as one rank holds it, for the compiler's
//! buckets, state layout and memory.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::model_spec::{BlockInfo, ModelDesc};
use crate::param_desc::{ParamDesc, Split};

/// A block's place in its tensor-parallel group: rank `rank` of `size` (1: no tensor
/// parallelism).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TpPlace {
    /// Its rank in the group.
    pub rank: usize,
    /// The group's size.
    pub size: usize,
}

impl Default for TpPlace {
    fn default() -> Self {
        TpPlace { rank: 0, size: 1 }
    }
}

impl TpPlace {
    /// Rank `rank` of a group of `size`.
    pub fn new(rank: usize, size: usize) -> TpPlace {
        TpPlace { rank, size }
    }

    /// Whether this rank adds what the group holds once (a replicated bias, the residual).
    pub fn leads(&self) -> bool {
        self.rank == 0
    }

    /// `n` cut into this group's equal parts (the plan refuses a width the group does not
    /// divide).
    pub fn part(&self, n: usize) -> usize {
        n / self.size
    }
}

/// How an activation is held across a tensor-parallel group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TpHeld {
    /// Every rank holds all of it (the residual stream, a LayerNorm's input).
    #[default]
    Replicated,
    /// Each rank holds a slice of its last dimension (a column-parallel layer's output, the
    /// vocabulary's logits).
    Sharded,
    /// Each rank holds a summand and the activation is their sum (a row-parallel layer's output
    /// before Megatron's g all-reduces it).
    Partial,
    /// Each rank holds its share of the tokens (sequence parallelism, Korthikanti et al. 2022:
    /// the LayerNorm and residual regions; the micro-batch's `b·s` tokens flattened and cut
    /// into `tp` contiguous shares, rows of the model's width).
    SeqSharded,
}

/// The collective between two blocks of a tensor-parallel group, by how the first leaves its
/// output and the second takes its input; its adjoint runs on the second's input gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpEdge {
    /// Megatron's g: a partial sum all-reduced for a block that takes it whole (the backward
    /// passes the gradient through; f, the all-reduce of a whole input's gradient, is the
    /// block's own).
    AllReduce,
    /// Sequence parallelism after a row-parallel layer: the partial sums reduce-scattered to
    /// each rank's tokens (adjoint: the gradient's all-gather).
    ReduceScatter,
    /// Sequence parallelism before a column-parallel layer: each rank's tokens all-gathered
    /// (adjoint: the gradient's reduce-scatter).
    AllGather,
}

/// Two blocks whose forms do not join: no collective makes the one's output the other's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoJoin;

impl TpEdge {
    /// The edge from an output held `output` to an input held `input` (`Ok(None)`: none, the
    /// input is the output as it is held), or `Err` where the two do not join.
    pub fn between(output: TpHeld, input: TpHeld) -> Result<Option<TpEdge>, NoJoin> {
        use TpHeld::*;
        match (output, input) {
            (Partial, Replicated) => Ok(Some(TpEdge::AllReduce)),
            (Partial, SeqSharded) => Ok(Some(TpEdge::ReduceScatter)),
            (SeqSharded, Replicated) => Ok(Some(TpEdge::AllGather)),
            (a, b) if a == b && a != Partial => Ok(None),
            _ => Err(NoJoin),
        }
    }
}

/// How a block's input and output are held under tensor parallelism: what decides where the
/// step puts Megatron's conjugate all-reduces. A block whose output is [`TpHeld::Partial`] is
/// followed by g (all-reduce forward, identity backward); one whose input is
/// [`TpHeld::Replicated`] is preceded by f (identity forward, all-reduce of its input gradient
/// backward); a model whose last output is [`TpHeld::Sharded`] takes the vocabulary-parallel
/// cross-entropy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockTp {
    /// How its input is held.
    pub input: TpHeld,
    /// How its output is held, before any all-reduce.
    pub output: TpHeld,
    /// Of its activations kept for backward (per sample), the floats tp cuts (those between its
    /// column- and row-parallel layers: Korthikanti et al. 2022's `24/t` part); the rest (its
    /// input, LayerNorm's output, a row-parallel layer's output) every rank keeps whole.
    #[serde(default)]
    pub sharded_activations: u64,
    /// Sequence parallelism: the block's input is the sum of what the block before gives and
    /// the residual stream an earlier block passed on (its second input, `TensorId::Residual`).
    #[serde(default)]
    pub residual_in: bool,
    /// Sequence parallelism: the block passes its input on as the residual stream (its second
    /// output, `TensorId::Residual`), to the next block that has `residual_in`.
    #[serde(default)]
    pub residual_out: bool,
}

impl BlockTp {
    /// A block from `input` to `output`.
    pub fn new(input: TpHeld, output: TpHeld) -> BlockTp {
        BlockTp {
            input,
            output,
            sharded_activations: 0,
            residual_in: false,
            residual_out: false,
        }
    }

    /// This form, reading (`input`) and passing on (`output`) the residual stream as a second
    /// tensor (sequence parallelism).
    pub fn with_residual(mut self, input: bool, output: bool) -> BlockTp {
        (self.residual_in, self.residual_out) = (input, output);
        self
    }

    /// How the next block sees this one's output: a partial sum is all-reduced (g) first.
    pub fn output_after_g(self) -> TpHeld {
        match self.output {
            TpHeld::Partial => TpHeld::Replicated,
            held => held,
        }
    }
}

/// One contiguous stretch of a rank's local elements and where it sits in the global parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First local (row-major) element.
    pub local: usize,
    /// First global (row-major) element.
    pub global: usize,
    /// Elements in the stretch.
    pub len: usize,
}

impl Run {
    /// The local elements of the stretch.
    pub fn local_range(&self) -> Range<usize> {
        self.local..self.local + self.len
    }

    /// The global elements of the stretch.
    pub fn global_range(&self) -> Range<usize> {
        self.global..self.global + self.len
    }
}

/// The extent of the split dimension on each rank: `n` padded to a multiple of `tp`, over `tp`.
pub fn local_extent(n: usize, tp: usize) -> usize {
    n.div_ceil(tp)
}

/// The shape rank-local copies of a parameter of global `shape` have under `split` at `tp`.
///
/// # Panics
/// When a [`Split::HeadColumns`] group does not divide by `tp` (the plan refuses that first).
pub fn local_shape(split: Split, shape: &[usize], tp: usize) -> Vec<usize> {
    let mut local = shape.to_vec();
    let Some(dim) = split.dim(shape.len()).filter(|_| tp > 1) else {
        return local;
    };
    local[dim] = match split {
        Split::HeadColumns { parts } => {
            let group = shape[dim] / parts;
            assert!(
                group.is_multiple_of(tp) && shape[dim] == group * parts,
                "{shape:?} cannot be cut per head into {parts} groups over tp={tp}"
            );
            parts * (group / tp)
        }
        _ => local_extent(shape[dim], tp),
    };
    local
}

/// Where rank `rank` of `tp`'s local elements of a parameter of global `shape` sit in the global
/// parameter, in local order, adjacent stretches merged. Padded local positions (past a split
/// extent tp does not divide) appear in no run.
pub fn global_runs(split: Split, shape: &[usize], rank: usize, tp: usize) -> Vec<Run> {
    let local: usize = local_shape(split, shape, tp).iter().product();
    global_runs_within(split, shape, rank, tp, 0..local)
}

/// [`global_runs`] for the local elements `within` only, cut to them; walks only the rows and
/// per-head pieces they touch (a checkpoint's slice of a huge parameter costs its own length).
pub fn global_runs_within(
    split: Split,
    shape: &[usize],
    rank: usize,
    tp: usize,
    within: Range<usize>,
) -> Vec<Run> {
    let Some(dim) = split.dim(shape.len()).filter(|_| tp > 1) else {
        let total: usize = shape.iter().product();
        let (from, to) = (within.start.min(total), within.end.min(total));
        let run = Run {
            local: from,
            global: from,
            len: to.saturating_sub(from),
        };
        return if run.len > 0 { vec![run] } else { Vec::new() };
    };
    let n = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    // Each row holds `parts` pieces of `width` steps along `dim`: piece `p` starts at global
    // step `first(p)` and holds `valid(p)` of them (the rest pad).
    let (parts, width) = match split {
        Split::HeadColumns { parts } => (parts, n / parts / tp),
        _ => (1, local_extent(n, tp)),
    };
    let first = |p: usize| match split {
        Split::HeadColumns { .. } => p * (n / parts) + rank * width,
        _ => (rank * width).min(n),
    };
    let valid = |p: usize| match split {
        Split::HeadColumns { .. } => width,
        _ => n.saturating_sub(first(p)).min(width),
    };
    let piece_len = width * inner;
    let row_len = parts * piece_len;
    let mut runs: Vec<Run> = Vec::new();
    if piece_len == 0 || within.is_empty() {
        return runs;
    }
    for row in within.start / row_len..within.end.div_ceil(row_len).min(outer) {
        let at = row * row_len;
        let pieces =
            within.start.saturating_sub(at) / piece_len..(within.end - at).div_ceil(piece_len).min(parts);
        for p in pieces {
            let local = at + p * piece_len;
            let (from, to) = (
                local.max(within.start),
                (local + valid(p) * inner).min(within.end),
            );
            if from < to {
                let global = (row * n + first(p)) * inner + (from - local);
                push_merged(
                    &mut runs,
                    Run {
                        local: from,
                        global,
                        len: to - from,
                    },
                );
            }
        }
    }
    runs
}

fn push_merged(runs: &mut Vec<Run>, run: Run) {
    if run.len == 0 {
        return;
    }
    if let Some(last) = runs.last_mut()
        && last.local + last.len == run.local
        && last.global + last.len == run.global
    {
        last.len += run.len;
        return;
    }
    runs.push(run);
}

/// Rank `rank`'s local values of a parameter whose global values are `global` (padding zero).
pub fn take_local(p: &ParamDesc, global: &[f32], rank: usize, tp: usize) -> Vec<f32> {
    let mut local = vec![0.0; local_shape(p.split, &p.shape, tp).iter().product()];
    for run in global_runs(p.split, &p.shape, rank, tp) {
        local[run.local_range()].copy_from_slice(&global[run.global_range()]);
    }
    local
}

/// Trainable replicated elements of `blocks` (what a tp group all-reduces after the backward).
pub fn replicated_trained(blocks: &[BlockInfo]) -> usize {
    (blocks.iter().flat_map(|b| &b.param_descs))
        .filter(|p| p.trainable && p.split == Split::Replicated)
        .map(ParamDesc::len)
        .sum()
}

/// The model as one tensor-parallel rank holds it: the same blocks and names, every split
/// parameter at its local shape (the same on every rank: padding makes it so), the activations
/// it keeps with their sharded part over `tp` (outputs, which cross stages, still whole).
pub fn local_model(model: &ModelDesc, tp: usize) -> ModelDesc {
    let blocks = model
        .blocks
        .iter()
        .map(|b| {
            if b.param_descs.is_empty() {
                return b.clone();
            }
            let params = b
                .param_descs
                .iter()
                .map(|p| ParamDesc {
                    shape: local_shape(p.split, &p.shape, tp),
                    ..p.clone()
                })
                .collect();
            let sharded =
                b.tp.map_or(0, |t| t.sharded_activations.min(b.activation_floats_per_sample));
            let kept = b.activation_floats_per_sample - sharded + sharded.div_ceil(tp.max(1) as u64);
            BlockInfo {
                tp: b.tp,
                ..BlockInfo::described(b.name.clone(), params, kept, b.output_floats_per_sample)
            }
        })
        .collect();
    ModelDesc {
        blocks,
        ..model.clone()
    }
}

#[cfg(test)]
#[path = "tensor_parallel_tests.rs"]
mod tests;
