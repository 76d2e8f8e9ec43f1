//! Model descriptions: the pure per-block facts the compiler plans with (each parameter's
//! description, activation sizes). The zoo's specs (`mlp-8x1024`, `gpt-tiny`, `gpt2`, parametric
//! `FAMILY:key=value,…`) are [`ModelSpec`]s of the families in [`crate::family`].
//!
//! The definitions follow `shared/WORKLOADS.md` exactly. A model is an ordered list of blocks;
//! the compiler never sees weights, only their descriptions ([`ParamDesc`]: name, shape, dtype,
//! trainable or frozen, split, initialisation).

use serde::{Deserialize, Serialize};

use crate::PlanError;
pub use crate::family::ModelSpec;
use crate::param_desc::ParamDesc;
use crate::tensor_parallel::{BlockTp, TpHeld};

/// What a model eats: dense feature rows with class labels, or token sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InputKind {
    /// Rows of `features` floats, labels in `0..classes`.
    Dense {
        /// Features per row.
        features: usize,
        /// Number of classes.
        classes: usize,
    },
    /// Sequences of `ctx` tokens in `0..vocab`, next-token targets.
    Tokens {
        /// Vocabulary size.
        vocab: usize,
        /// Tokens per sequence.
        ctx: usize,
    },
}

impl InputKind {
    /// Tokens in one sample (1 for dense rows).
    pub fn tokens_per_sample(&self) -> usize {
        match self {
            InputKind::Dense { .. } => 1,
            InputKind::Tokens { ctx, .. } => *ctx,
        }
    }
}

/// The facts the compiler knows about one block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// A readable name, e.g. `linear_relu.3`.
    pub name: String,
    /// Number of parameter elements (the sum of [`BlockInfo::param_descs`]' lengths when they
    /// are given; [`ModelDesc::check`] holds them to it).
    pub params: u64,
    /// Each parameter, in the runtime's flattening order. Empty for a user model that gives only
    /// a count: the runtime then describes its parameters from the burn module (f32, trainable,
    /// replicated) and the compiler counts them as f32 and trainable.
    #[serde(default)]
    pub param_descs: Vec<ParamDesc>,
    /// f32 activations kept for backward, per sample.
    pub activation_floats_per_sample: u64,
    /// f32 values of the block's output per sample (what crosses to the next pipeline stage, and
    /// what activation checkpointing keeps of a stage's input).
    #[serde(default)]
    pub output_floats_per_sample: u64,
    /// How its input and output are held across a tensor-parallel group (`None`: the block has
    /// no tensor-parallel form, and `--tp` above 1 is refused).
    #[serde(default)]
    pub tp: Option<BlockTp>,
}

/// A model as the compiler sees it: a name, what it eats, and its blocks in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDesc {
    /// The spec string or a user-chosen name.
    pub name: String,
    /// What a sample is.
    pub input: InputKind,
    /// Blocks in forward order.
    pub blocks: Vec<BlockInfo>,
}

impl BlockInfo {
    /// A block described parameter by parameter (its count is their sum).
    pub fn described(
        name: impl Into<String>,
        param_descs: Vec<ParamDesc>,
        activation_floats_per_sample: u64,
        output_floats_per_sample: u64,
    ) -> BlockInfo {
        BlockInfo {
            name: name.into(),
            params: param_descs.iter().map(|p| p.len() as u64).sum(),
            param_descs,
            activation_floats_per_sample,
            output_floats_per_sample,
            tp: None,
        }
    }

    /// This block with its tensor-parallel form.
    pub fn with_tp(mut self, input: TpHeld, output: TpHeld) -> BlockInfo {
        self.tp = Some(BlockTp::new(input, output));
        self
    }

    /// Of its activations, the floats per sample tp cuts (see [`BlockTp::sharded_activations`]);
    /// nothing without a tensor-parallel form.
    pub fn with_sharded_activations(mut self, floats: u64) -> BlockInfo {
        if let Some(tp) = self.tp.as_mut() {
            tp.sharded_activations = floats;
        }
        self
    }

    /// Number of parameter elements (cheap: no walk over the descriptions).
    pub fn param_count(&self) -> u64 {
        self.params
    }

    /// Bytes of the parameters' values, from each one's dtype (f32 when not described).
    pub fn param_bytes(&self) -> u64 {
        if self.param_descs.is_empty() {
            return 4 * self.params;
        }
        self.param_descs.iter().map(ParamDesc::bytes).sum()
    }

    /// Bytes of the gradients: those of the trainable parameters (frozen ones have none).
    pub fn grad_bytes(&self) -> u64 {
        if self.param_descs.is_empty() {
            return 4 * self.params;
        }
        self.param_descs.iter().map(ParamDesc::grad_bytes).sum()
    }

    /// Elements of the trainable parameters: the length of the block's trained vector
    /// ([`crate::TrainedLayout`]), which the trainer reduces, shards and updates and the optimizer
    /// keeps state for.
    pub fn trained_params(&self) -> u64 {
        if self.param_descs.is_empty() {
            return self.params;
        }
        self.param_descs.iter().map(ParamDesc::optimized_len).sum()
    }

    /// Bytes of the frozen parameters' values (kept whole by each actor holding the block).
    pub fn frozen_bytes(&self) -> u64 {
        self.param_bytes() - self.grad_bytes()
    }

    /// Whether any parameter is frozen.
    pub fn has_frozen(&self) -> bool {
        self.param_descs.iter().any(|p| !p.trainable)
    }
}

impl ModelDesc {
    /// Total parameter count.
    pub fn params(&self) -> u64 {
        self.blocks.iter().map(|b| b.params).sum()
    }

    /// Checks that the trainer can hold every described parameter (f32 today; see
    /// `ParamDesc::not_trainable_yet`): what `compile` refuses, so that no actor refuses it.
    pub fn check_trainable(&self) -> Result<(), PlanError> {
        for (block, info) in self.blocks.iter().enumerate() {
            if let Some(why) = info.param_descs.iter().find_map(|p| p.not_trainable_yet()) {
                return Err(PlanError::NotTrainable {
                    block,
                    name: info.name.clone(),
                    why,
                });
            }
        }
        Ok(())
    }

    /// Checks the parameter descriptions: each described block's lengths add up to its count,
    /// no parameter is empty, and names are unique over the model (initialisation and
    /// checkpoints are keyed by them).
    pub fn check(&self) -> Result<(), PlanError> {
        let mut names = std::collections::HashSet::new();
        for (index, block) in self.blocks.iter().enumerate() {
            let bad = |why: String| PlanError::BadParams {
                block: index,
                name: block.name.clone(),
                why,
            };
            if block.param_descs.is_empty() {
                continue;
            }
            let sum: u64 = block.param_descs.iter().map(|p| p.len() as u64).sum();
            if sum != block.params {
                return Err(bad(format!(
                    "its parameters add up to {sum} elements but it counts {}",
                    block.params
                )));
            }
            for p in &block.param_descs {
                if p.is_empty() {
                    return Err(bad(format!(
                        "parameter `{}` has shape {:?}, with no element",
                        p.name, p.shape
                    )));
                }
                if !names.insert(p.name.as_str()) {
                    return Err(bad(format!(
                        "parameter name `{}` is used twice in the model",
                        p.name
                    )));
                }
            }
        }
        self.check_ties()
    }
}

#[cfg(test)]
#[path = "model_spec_tests.rs"]
mod tests;
