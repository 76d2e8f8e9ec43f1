//! Typed tensor ids: what an instruction reads and writes, as data rather than `format!` strings.
//!
//! Every tensor a training step names is one variant here (a micro-batch's activations, a segment's
//! gradient bucket, ZeRO's gathered parameters, the norms of clipping and LAMB); user graphs and
//! compiled programs name theirs freely ([`TensorId::Named`]). The executor keys its tables by
//! these ids, the verifier and the simulator read the micro-batch off them, and nothing parses a
//! name back. [`std::fmt::Display`] prints the short names of the plan's printout (`act.3.1`,
//! `grad.0`, `wparam.2.F1`), which are also what errors and hang reports show.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which pass of a segment a ZeRO-3 all-gather of its parameters serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GatherFor {
    /// The forward (the first computation that needs the whole parameters).
    Forward,
    /// The backward (the parameters were dropped after the forward and are gathered again).
    Backward,
}

/// A tensor local to one actor, named by what it is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TensorId {
    /// Micro-batch `mb` of this actor's slice of the step's batch (inputs and targets).
    Batch {
        /// Micro-batch.
        mb: usize,
    },
    /// Segment `segment`'s output for micro-batch `mb`.
    Activation {
        /// Segment (gradient bucket) index, in forward order.
        segment: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// The gradient of segment `segment`'s input for micro-batch `mb`.
    ActivationGrad {
        /// Segment index.
        segment: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// Micro-batch `mb`'s loss (its backward seed).
    Loss {
        /// Micro-batch.
        mb: usize,
    },
    /// Segment `segment`'s gradient bucket, accumulated over the micro-batches.
    GradBucket {
        /// Segment index.
        segment: usize,
    },
    /// ZeRO-1/2: segment `segment`'s parameters after the update, gathered from every shard.
    UpdatedParams {
        /// Segment index.
        segment: usize,
    },
    /// ZeRO-3: segment `segment`'s parameters gathered for one pass of micro-batch `mb`.
    GatheredParams {
        /// Segment index.
        segment: usize,
        /// The pass the gather serves.
        pass: GatherFor,
        /// Micro-batch.
        mb: usize,
    },
    /// The squared global gradient norm (one value; clipping).
    GradSquares,
    /// LAMB's per-parameter sums of squares of the parameters and of their update directions.
    TrustSquares,
    /// A tensor of a user graph or compiled program, named by whoever built it.
    Named(String),
    /// Vocabulary-parallel cross-entropy: each token's largest logit of micro-batch `mb`
    /// (this rank's slice's, then the group's after the all-reduce of the maximum).
    LossMax {
        /// Micro-batch.
        mb: usize,
    },
    /// Vocabulary-parallel cross-entropy: each token's `Σ exp(z − max)` and target logit of
    /// micro-batch `mb` (this rank's slice's, then the group's after the all-reduce).
    LossSums {
        /// Micro-batch.
        mb: usize,
    },
    /// Tensor parallelism: the gradients of segment `segment`'s replicated trainable parameters
    /// (this rank's summands, then the group's sum after the all-reduce).
    TpGrads {
        /// Segment index.
        segment: usize,
    },
    /// A tie ([`crate::ties`]): the gradient of the mirror in block `block`, summed over the
    /// step's micro-batches, on its way to the actor holding the parameter it mirrors.
    TiedGrads {
        /// The mirror's block.
        block: usize,
    },
    /// A tie: the values of the parameter the mirror in block `block` mirrors, as the step
    /// starts, on their way to the mirror.
    TiedValues {
        /// The mirror's block.
        block: usize,
    },
    /// Activation checkpointing: segment `segment`'s input for micro-batch `mb`, kept from the
    /// forward for the backward's recompute where the plan names it — each tp rank's 1/tp of it
    /// under `--partition-activations` (ZeRO-R), all-gathered before the backward; in host
    /// memory under `--offload-activations cpu`.
    Checkpoint {
        /// Segment index.
        segment: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// Sequence parallelism: the residual stream segment `segment` passes on beside its output
    /// for micro-batch `mb` (this rank's tokens), read by the next segment that adds it.
    Residual {
        /// Segment index (the one passing it on).
        segment: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// Sequence parallelism: the gradient of the residual stream segment `segment` reads (its
    /// second input) for micro-batch `mb`, an upstream gradient of the segment that passed it on.
    ResidualGrad {
        /// Segment index (the one reading the residual).
        segment: usize,
        /// Micro-batch.
        mb: usize,
    },
}

impl TensorId {
    /// A user-named tensor.
    pub fn named(name: impl Into<String>) -> TensorId {
        TensorId::Named(name.into())
    }

    /// The micro-batch this tensor belongs to, when it belongs to one.
    pub fn microbatch(&self) -> Option<usize> {
        match self {
            TensorId::Batch { mb }
            | TensorId::Activation { mb, .. }
            | TensorId::ActivationGrad { mb, .. }
            | TensorId::Loss { mb }
            | TensorId::LossMax { mb }
            | TensorId::LossSums { mb }
            | TensorId::Checkpoint { mb, .. }
            | TensorId::Residual { mb, .. }
            | TensorId::ResidualGrad { mb, .. }
            | TensorId::GatheredParams { mb, .. } => Some(*mb),
            _ => None,
        }
    }

    /// The segment this tensor belongs to, when it belongs to one.
    pub fn segment(&self) -> Option<usize> {
        match self {
            TensorId::Activation { segment, .. }
            | TensorId::ActivationGrad { segment, .. }
            | TensorId::GradBucket { segment }
            | TensorId::UpdatedParams { segment }
            | TensorId::GatheredParams { segment, .. }
            | TensorId::Checkpoint { segment, .. }
            | TensorId::Residual { segment, .. }
            | TensorId::ResidualGrad { segment, .. }
            | TensorId::TpGrads { segment } => Some(*segment),
            _ => None,
        }
    }
}

impl From<&str> for TensorId {
    fn from(name: &str) -> TensorId {
        TensorId::Named(name.to_string())
    }
}

impl From<String> for TensorId {
    fn from(name: String) -> TensorId {
        TensorId::Named(name)
    }
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorId::Batch { mb } => write!(f, "batch.{mb}"),
            TensorId::Activation { segment, mb } => write!(f, "act.{segment}.{mb}"),
            TensorId::ActivationGrad { segment, mb } => write!(f, "dact.{segment}.{mb}"),
            TensorId::Loss { mb } => write!(f, "loss.{mb}"),
            TensorId::GradBucket { segment } => write!(f, "grad.{segment}"),
            TensorId::UpdatedParams { segment } => write!(f, "param.{segment}"),
            TensorId::GatheredParams { segment, pass, mb } => {
                let pass = match pass {
                    GatherFor::Forward => 'F',
                    GatherFor::Backward => 'B',
                };
                write!(f, "wparam.{segment}.{pass}{mb}")
            }
            TensorId::GradSquares => write!(f, "gradsq"),
            TensorId::TrustSquares => write!(f, "trustsq"),
            TensorId::Named(name) => write!(f, "{name}"),
            TensorId::LossMax { mb } => write!(f, "lossmax.{mb}"),
            TensorId::LossSums { mb } => write!(f, "losssums.{mb}"),
            TensorId::TpGrads { segment } => write!(f, "tpgrad.{segment}"),
            TensorId::TiedGrads { block } => write!(f, "tiedgrad.{block}"),
            TensorId::TiedValues { block } => write!(f, "tiedval.{block}"),
            TensorId::Checkpoint { segment, mb } => write!(f, "ckpt.{segment}.{mb}"),
            TensorId::Residual { segment, mb } => write!(f, "res.{segment}.{mb}"),
            TensorId::ResidualGrad { segment, mb } => write!(f, "dres.{segment}.{mb}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The printed names are the plan printout's (and distinct for distinct ids), and the
    /// micro-batch comes from the id, not from parsing its name: a user tensor called `act.0.7`
    /// has no micro-batch.
    #[test]
    fn ids_print_short_names_and_carry_their_microbatch() {
        let ids = [
            TensorId::Batch { mb: 1 },
            TensorId::Activation { segment: 3, mb: 1 },
            TensorId::ActivationGrad { segment: 3, mb: 1 },
            TensorId::Loss { mb: 1 },
            TensorId::GradBucket { segment: 3 },
            TensorId::UpdatedParams { segment: 3 },
            TensorId::GatheredParams {
                segment: 3,
                pass: GatherFor::Backward,
                mb: 1,
            },
            TensorId::GradSquares,
            TensorId::TrustSquares,
        ];
        let names: Vec<String> = ids.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "batch.1",
                "act.3.1",
                "dact.3.1",
                "loss.1",
                "grad.3",
                "param.3",
                "wparam.3.B1",
                "gradsq",
                "trustsq"
            ]
        );
        let microbatches: Vec<Option<usize>> = ids.iter().map(TensorId::microbatch).collect();
        assert_eq!(
            microbatches,
            [
                Some(1),
                Some(1),
                Some(1),
                Some(1),
                None,
                None,
                Some(1),
                None,
                None
            ]
        );
        assert_eq!(TensorId::named("act.0.7").microbatch(), None);
        assert_eq!(TensorId::from("act.0.7").to_string(), "act.0.7");
        assert_ne!(TensorId::named("grad.3"), TensorId::GradBucket { segment: 3 });
    }
}
