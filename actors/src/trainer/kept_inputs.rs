//! What a checkpointed segment keeps of its input between its forward and the backward that
//! recomputes it (Chen et al. 2016), where the plan names it (`TensorId::Checkpoint`): each
//! tensor-parallel rank's 1/tp of an input the group holds whole (ZeRO-R's partitioned activation
//! checkpoints, Rajbhandari et al. 2019 §6), all-gathered by the plan before the backward; or the
//! input in host memory (`--offload-activations cpu`). Also the step's count of the checkpoint
//! bytes held on the device and in host memory, whose peaks the step reports.

use archipelago_dataflow::{CheckpointBytes, KeptInput, TensorId, shard_range};
use std::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::{Segment, Trainer, to_host};
use crate::block::Activation;
use crate::executor::TensorTable;
use crate::host_tensor::{from_burn, into_burn};
use crate::typed_tensor::TypedTensor;

/// This rank's part of a partitioned checkpoint: flat elements `range` of an input of `shape`.
pub(super) struct KeptPart<B: AutodiffBackend> {
    values: PartValues<B>,
    range: Range<usize>,
    shape: Vec<usize>,
}

/// What a segment keeps of its input: the input where the trainer keeps it whole, and this
/// rank's part where it is partitioned (both `None`: in the table, offloaded).
pub(super) type Kept<B> = (Option<Activation<B>>, Option<KeptPart<B>>);

/// Where a kept part waits.
enum PartValues<B: AutodiffBackend> {
    /// On the actor's device.
    Device(Tensor<B, 1>),
    /// In host memory (`--offload-activations cpu`).
    Host(TypedTensor),
}

/// Bytes of an activation's values (token ids, which the batch holds anyway, count none).
pub(super) fn activation_bytes<B: AutodiffBackend>(a: &Activation<B>) -> u64 {
    let (elements, dtype) = match a {
        Activation::Rows(t) => (t.dims().iter().product::<usize>(), t.dtype()),
        Activation::Seq(t) => (t.dims().iter().product::<usize>(), t.dtype()),
        Activation::Tokens(_) => return 0,
    };
    (elements * dtype.size()) as u64
}

/// A buffer of `shape`, zeros but `part` at flat elements `at`: what a member brings to an
/// all-gather (the gather fills the rest).
pub(super) fn placed_in_whole(
    part: &TypedTensor,
    shape: Vec<usize>,
    at: Range<usize>,
) -> Result<TypedTensor, String> {
    if at.len() != part.elements() {
        return Err(format!(
            "a part of {} elements placed at {} of them",
            part.elements(),
            at.len()
        ));
    }
    let mut whole = TypedTensor::zeros(part.dtype(), shape).map_err(|e| format!("{e:?}"))?;
    let size = part.dtype().size();
    whole.bytes_mut()[at.start * size..at.end * size].copy_from_slice(part.bytes());
    Ok(whole)
}

impl<B: AutodiffBackend> Trainer<B> {
    /// How the plan keeps the input of the segment starting at block `start` (`None`: the
    /// trainer keeps it whole on the device, or the segment is not checkpointed).
    fn kept_input(&self, start: usize) -> Option<KeptInput> {
        let input = self.stage.desc.blocks[start].tp.unwrap_or_default().input;
        self.checkpoints.kept_input(self.stage.tp.size, start, input)
    }

    /// Keeps a checkpointed segment's input `x` as the plan says, under `name` (the forward's
    /// second output, when the plan names one): its part in the trainer (partitioned), or the
    /// whole in the table (offloaded). Gives back the input where the trainer keeps it whole,
    /// and the part.
    pub(super) fn keep_input(
        &self,
        start: usize,
        x: Activation<B>,
        name: Option<&TensorId>,
        table: &mut TensorTable,
    ) -> Result<Kept<B>, String> {
        let (Some(kept), Some(name)) = (self.kept_input(start), name) else {
            return Ok((Some(x), None));
        };
        if !matches!(name, TensorId::Checkpoint { .. }) {
            return Err(format!(
                "the forward's second output is `{name}`, not a checkpoint"
            ));
        }
        // Through host memory even for a part kept on the device: a slice of a device tensor
        // would be a view holding the whole buffer alive.
        let host = to_host(&x)?;
        if !kept.partitioned {
            table.insert(name.clone(), host);
            return Ok((None, None));
        }
        let shape = host.shape().to_vec();
        let range = shard_range(host.elements(), self.stage.tp.size, self.stage.tp.rank);
        let size = host.dtype().size();
        let bytes = &host.bytes()[range.start * size..range.end * size];
        let part = TypedTensor::from_bytes(host.dtype(), vec![range.len()], bytes)
            .map_err(|e| format!("checkpoint `{name}`: {e:?}"))?;
        let values = match kept.offloaded {
            true => PartValues::Host(part),
            false => PartValues::Device(into_burn::<B, 1>(part, &self.stage.device)),
        };
        Ok((None, Some(KeptPart { values, range, shape })))
    }

    /// The checkpoint `name` for the group's all-gather: a buffer as long as the whole input
    /// holding this rank's part at its place (the gather fills the rest).
    pub(super) fn export_checkpoint(&self, name: &TensorId) -> Option<Result<TypedTensor, String>> {
        let key = self.step.checkpoints.get(name)?;
        let part = self.step.segments.get(key)?.kept.as_ref()?;
        Some(part.in_whole().map_err(|e| format!("checkpoint `{name}`: {e}")))
    }

    /// A checkpointed segment's input for its recompute, from the table (gathered, or waiting
    /// in host memory): a fresh autodiff leaf.
    pub(super) fn checkpointed_input(
        &self,
        name: Option<&TensorId>,
        part: Option<&KeptPart<B>>,
        table: &mut TensorTable,
    ) -> Result<Activation<B>, String> {
        let name = name.ok_or("the segment's input was not kept and the backward names no checkpoint")?;
        if let (Some(part), Some(fault)) = (part, &self.fault)
            && fault.skips_checkpoint_gather()
        {
            // The control: the gathered whole dropped, the rank's own part read in its place.
            table.remove(name);
            table.insert(name.clone(), part.in_whole()?);
        }
        Ok(self.import(name, table)?.leaf())
    }

    /// Adds what the step holds of checkpoints now to its peaks.
    pub(super) fn note_checkpoint_bytes(&mut self) {
        if !self.checkpoints.checkpoint {
            return;
        }
        let mut now = CheckpointBytes::default();
        // The model's first segment keeps the batch, which is loaded anyway: not a checkpoint.
        let later = self.step.segments.iter().filter(|((start, _), _)| *start > 0);
        for (_, segment) in later {
            let held = segment.kept_bytes();
            now.device += held.device;
            now.host += held.host;
        }
        now.host += self.step.offloaded_bytes.values().sum::<u64>();
        let peak = &mut self.step.checkpoint_peak;
        peak.device = peak.device.max(now.device);
        peak.host = peak.host.max(now.host);
    }
}

impl<B: AutodiffBackend> KeptPart<B> {
    /// A buffer as long as the whole input, this part at its place and zeros elsewhere.
    fn in_whole(&self) -> Result<TypedTensor, String> {
        let values = match &self.values {
            PartValues::Host(t) => t.clone(),
            PartValues::Device(t) => from_burn(t.clone()),
        };
        placed_in_whole(&values, self.shape.clone(), self.range.clone())
    }
}

impl<B: AutodiffBackend> Segment<B> {
    /// The bytes this segment keeps of its input for a recompute, on the device and in host
    /// memory (none when it is not checkpointed; token ids count none).
    pub(super) fn kept_bytes(&self) -> CheckpointBytes {
        if !self.checkpointed {
            return CheckpointBytes::default();
        }
        let mut held = CheckpointBytes {
            device: self.input.as_ref().map_or(0, activation_bytes),
            host: 0,
        };
        if let Some(part) = &self.kept {
            match &part.values {
                PartValues::Device(t) => held.device += (t.dims()[0] * t.dtype().size()) as u64,
                PartValues::Host(t) => held.host += t.byte_len() as u64,
            }
        }
        held
    }
}
