//! What activation checkpointing keeps of each segment's input between its forward and the
//! backward that recomputes it (Chen et al. 2016), and where: whole on the device (the plain
//! case, held by the trainer), each tensor-parallel rank's 1/tp of it (ZeRO-R's partitioned
//! activation checkpoints, Rajbhandari et al. 2019 §6; Megatron-LM's
//! `--distribute-saved-activations`), all-gathered over the group before the recompute, or in host
//! memory (`--offload-activations cpu`, DeepSpeed's `cpu_checkpointing`). One decision, read by
//! the step's graph ([`crate::passes::pipeline`]), the memory estimate and the trainer alike.

use serde::{Deserialize, Serialize};

use crate::program::ParallelPlan;
use crate::tensor_parallel::TpHeld;

/// The plan's activation checkpointing options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivationCheckpoints {
    /// Keep segment inputs only and recompute the forward inside the backward.
    pub checkpoint: bool,
    /// `--partition-activations`: each tp rank keeps its 1/tp of an input the group holds whole.
    pub partition: bool,
    /// `--offload-activations cpu`: what is kept waits in host memory.
    pub offload: bool,
    /// Sequence parallelism with `--partition-activations` and no `--checkpoint-activations`:
    /// only the segments whose input an all-gather brings whole (the mixing blocks, the head)
    /// are checkpointed, each rank keeping its share (Megatron's sequence parallelism keeps the
    /// rank's tokens of a column-parallel layer's input and gathers them again for the backward;
    /// here the backward recomputes the block from them).
    #[serde(default)]
    pub gathered_only: bool,
}

/// How one segment's input is kept for the backward when the plan names it
/// ([`crate::TensorId::Checkpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptInput {
    /// Each tp rank keeps `shard_range(len, tp, rank)` of the flat input; the group all-gathers
    /// it before the backward.
    pub partitioned: bool,
    /// Kept in host memory.
    pub offloaded: bool,
}

/// Bytes of activation checkpoints one actor holds: measured at a step's peak (the trainer's
/// count of the inputs it keeps for recomputes) or estimated by `plan`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointBytes {
    /// On the actor's device.
    pub device: u64,
    /// In host memory (`--offload-activations cpu`).
    pub host: u64,
}

impl ActivationCheckpoints {
    /// The options of `plan` as compiled (ZeRO-3's implied checkpointing already set).
    pub fn of(plan: &ParallelPlan) -> ActivationCheckpoints {
        let gathered_only = plan.sequence_parallel
            && plan.partition_activations
            && !plan.checkpoint_activations
            && plan.tp > 1;
        let checkpoint = plan.checkpoint_activations || gathered_only;
        ActivationCheckpoints {
            checkpoint,
            partition: checkpoint && plan.partition_activations && plan.tp > 1,
            offload: checkpoint && plan.offload_activations,
            gathered_only,
        }
    }

    /// Whether the segment whose first block is `first_block`, its input held `input`, is
    /// checkpointed (its forward keeps only its input; its backward recomputes it).
    pub fn checkpoints(&self, first_block: usize, input: TpHeld) -> bool {
        self.checkpoint && (!self.gathered_only || (first_block > 0 && input == TpHeld::Replicated))
    }

    /// How the input of a segment is kept, when the plan names it: the segment's first block is
    /// `first_block`, its input held `input` across a group of `tp`. `None` for the model's
    /// first segment (its input is the batch, loaded anyway), for a segment not checkpointed
    /// (none without checkpointing; under `gathered_only` all but the mixing blocks), and where
    /// the trainer keeps the input itself on the device (neither partitioned nor offloaded). An
    /// input each rank holds a different slice of (after a column-parallel layer) is already
    /// 1/tp and is never partitioned.
    pub fn kept_input(&self, tp: usize, first_block: usize, input: TpHeld) -> Option<KeptInput> {
        if !self.checkpoints(first_block, input) || first_block == 0 {
            return None;
        }
        let partitioned = self.partition && tp > 1 && input == TpHeld::Replicated;
        (partitioned || self.offload).then_some(KeptInput {
            partitioned,
            offloaded: self.offload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a later segment's whole input is partitioned, and only under tp with checkpointing;
    /// offload names every later segment's input, partitioned or not.
    #[test]
    fn which_inputs_are_kept_and_how() {
        let plan = |tp, partition, offload, checkpoint| ParallelPlan {
            tp,
            partition_activations: partition,
            offload_activations: offload,
            checkpoint_activations: checkpoint,
            ..ParallelPlan::default()
        };
        let partitioned = ActivationCheckpoints::of(&plan(2, true, false, true));
        let whole = Some(KeptInput {
            partitioned: true,
            offloaded: false,
        });
        assert_eq!(partitioned.kept_input(2, 3, TpHeld::Replicated), whole);
        assert_eq!(partitioned.kept_input(2, 0, TpHeld::Replicated), None);
        assert_eq!(partitioned.kept_input(2, 3, TpHeld::Sharded), None);
        let unchecked = ActivationCheckpoints::of(&plan(2, true, true, false));
        assert_eq!(unchecked.kept_input(2, 3, TpHeld::Replicated), None);
        let offloaded = ActivationCheckpoints::of(&plan(1, false, true, true));
        let host = Some(KeptInput {
            partitioned: false,
            offloaded: true,
        });
        assert_eq!(offloaded.kept_input(1, 1, TpHeld::Replicated), host);
        let both = ActivationCheckpoints::of(&plan(2, true, true, true));
        assert_eq!(
            both.kept_input(2, 1, TpHeld::Sharded),
            host,
            "a sharded input is offloaded whole"
        );
        assert_eq!(
            both.kept_input(2, 1, TpHeld::Replicated),
            Some(KeptInput {
                partitioned: true,
                offloaded: true
            })
        );
    }
}
