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
}

impl BlockTp {
    /// A block from `input` to `output`.
    pub fn new(input: TpHeld, output: TpHeld) -> BlockTp {
        BlockTp { input, output }
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
    let total: usize = shape.iter().product();
    let Some(dim) = split.dim(shape.len()).filter(|_| tp > 1) else {
        return whole(total);
    };
    let n = shape[dim];
    // Elements per step along `dim`, and steps before it (the outer rows).
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    // The global index ranges along `dim` the rank holds, in local order.
    let pieces: Vec<Range<usize>> = match split {
        Split::HeadColumns { parts } => {
            let (group, width) = (n / parts, n / parts / tp);
            (0..parts)
                .map(|p| p * group + rank * width..p * group + (rank + 1) * width)
                .collect()
        }
        _ => {
            let w = local_extent(n, tp);
            vec![Range {
                start: (rank * w).min(n),
                end: ((rank + 1) * w).min(n),
            }]
        }
    };
    let local_width: usize = local_shape(split, shape, tp)[dim];
    let mut runs: Vec<Run> = Vec::new();
    for row in 0..outer {
        let mut at = row * local_width * inner;
        for piece in &pieces {
            let len = piece.len() * inner;
            push_merged(
                &mut runs,
                Run {
                    local: at,
                    global: (row * n + piece.start) * inner,
                    len,
                },
            );
            at += len;
        }
    }
    runs
}

fn whole(total: usize) -> Vec<Run> {
    vec![Run {
        local: 0,
        global: 0,
        len: total,
    }]
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
/// parameter at its local shape (the same on every rank: padding makes it so). Activations are
/// still counted whole.
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
            BlockInfo {
                tp: b.tp,
                ..BlockInfo::described(
                    b.name.clone(),
                    params,
                    b.activation_floats_per_sample,
                    b.output_floats_per_sample,
                )
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
