//! The trainer's side of tensor parallelism's replicated parameters (Megatron-LM, Shoeybi et al.
//! 2019): a parameter every rank of a tp group holds whole (a LayerNorm, a bias or the positions
//! only the first rank adds) gets a summand of its gradient on each rank. After a bucket's
//! backward the trainer copies those gradients out (`TpGrads`); the plan all-reduces them over
//! the group and `ReplicatedGrads` writes the sum back into the bucket, so every rank updates the
//! same values the same way. Also the rank's parameters in the model's coordinates (what reports
//! and the replica check see): its local slices put back at their global places.

use archipelago_dataflow::tensor_parallel::global_runs;
use archipelago_dataflow::{SegmentPlan, Split, TensorId};
use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use super::zero::grad_part;
use crate::executor::{HeldParams, TensorTable};
use crate::typed_tensor::TypedTensor;

impl<B: AutodiffBackend> Trainer<B> {
    /// Where the trainable replicated parameters of `blocks` sit in their gradient bucket (which
    /// starts at block `blocks.start`'s first trained element).
    pub(super) fn replicated_in_bucket(&self, blocks: Range<usize>) -> Vec<Range<usize>> {
        let base = self.stage.offsets[blocks.start];
        let mut ranges = Vec::new();
        for block in blocks {
            let mut at = self.stage.offsets[block] - base;
            for p in &self.stage.param_descs[block] {
                if p.split == Split::Replicated {
                    ranges.push(at..at + p.len());
                }
                at += p.len();
            }
        }
        ranges
    }

    /// After a backward into bucket `bucket` of `blocks`: its replicated gradients so far (the
    /// micro-batches' sum), in order, as `out` (the plan all-reduces the last one written).
    pub(super) fn share_replicated_grads(
        &mut self,
        blocks: Range<usize>,
        bucket: &TensorId,
        out: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let ranges = self.replicated_in_bucket(blocks);
        let values = match self.state.store.device_mut() {
            Some(state) if table.get(bucket).is_none() => {
                state.read_ranges(bucket, &ranges).ok_or_else(|| {
                    format!("gradient bucket `{bucket}` is neither on the device nor in the table")
                })?
            }
            _ => {
                let grads = table
                    .get(bucket)
                    .ok_or_else(|| format!("gradient bucket `{bucket}` missing"))?;
                let grads = grads.f32s();
                ranges
                    .iter()
                    .flat_map(|r| grads[r.clone()].iter().copied())
                    .collect()
            }
        };
        table.insert(out.clone(), TypedTensor::flat(values));
        Ok(())
    }

    /// `ReplicatedGrads`: the group's sum of the replicated gradients of `blocks` (`inputs[0]`,
    /// all-reduced) written over their place in bucket `outputs[0]`.
    pub(super) fn replicated_grads(
        &mut self,
        blocks: Range<usize>,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (Some(summed), Some(bucket)) = (inputs.first(), outputs.first()) else {
            return Err("ReplicatedGrads names no sum or no bucket".into());
        };
        let ranges = self.replicated_in_bucket(blocks);
        let sum = table
            .remove(summed)
            .ok_or_else(|| format!("`{summed}` was not all-reduced before ReplicatedGrads"))?
            .into_f32_vec();
        let expected: usize = ranges.iter().map(Range::len).sum();
        if sum.len() != expected {
            return Err(format!(
                "`{summed}` holds {} values; the bucket's replicated parameters are {expected}",
                sum.len()
            ));
        }
        if let Some(mut grads) = table.remove(bucket) {
            write_ranges(grads.values_mut::<f32>(), &ranges, &sum);
            table.insert(bucket.clone(), grads);
            return Ok(());
        }
        let device = self.stage.device.clone();
        let written = (self.state.store.device_mut())
            .is_some_and(|state| state.write_ranges(bucket, &ranges, sum, &device));
        match written {
            true => Ok(()),
            false => Err(format!("gradient bucket `{bucket}` missing")),
        }
    }

    /// The squares of the replicated gradients of bucket `name` in `own` (a range of its
    /// segment): what a tp rank past the first leaves out of the global norm, so that each
    /// counts once over the group.
    pub(super) fn replicated_squares(
        &self,
        name: &TensorId,
        segment: &SegmentPlan,
        own: Range<usize>,
        table: &TensorTable,
    ) -> Result<f64, String> {
        let blocks =
            (self.step.grad_ranges.get(name)).ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
        if let Some(grads) = table.get(name) {
            return self.replicated_squares_in(blocks.clone(), name, grads.f32s(), segment, own);
        }
        let ranges = self.replicated_within(blocks.clone(), &own);
        let values = (self.state.store.device())
            .and_then(|state| state.read_ranges(name, &ranges))
            .ok_or_else(|| format!("gradient `{name}` missing"))?;
        Ok(squares(&values))
    }

    /// [`Self::replicated_squares`] of bucket `name` of `blocks`, whose values `grads` arrived as
    /// the plan's part of `segment`.
    pub(super) fn replicated_squares_in(
        &self,
        blocks: Range<usize>,
        name: &TensorId,
        grads: &[f32],
        segment: &SegmentPlan,
        own: Range<usize>,
    ) -> Result<f64, String> {
        let mut sum = 0.0;
        for r in self.replicated_within(blocks, &own) {
            sum += squares(grad_part(name, grads, segment, &r)?);
        }
        Ok(sum)
    }

    /// The replicated ranges of `blocks`' bucket inside `own`.
    fn replicated_within(&self, blocks: Range<usize>, own: &Range<usize>) -> Vec<Range<usize>> {
        (self.replicated_in_bucket(blocks).into_iter())
            .map(|r| r.start.max(own.start)..r.end.min(own.end))
            .filter(|r| !r.is_empty())
            .collect()
    }

    /// Σx² of block `block`'s frozen parameters, each counted once over the tp group (a
    /// replicated one by the first rank only).
    pub(super) fn frozen_squares(&self, block: usize) -> f64 {
        let values = &self.stage.frozen[block];
        let frozen = self.stage.desc.blocks[block]
            .param_descs
            .iter()
            .filter(|p| !p.trainable);
        let mut at = 0;
        let mut sum = 0.0;
        for p in frozen {
            let end = (at + p.len()).min(values.len());
            if self.stage.tp.leads() || p.split != Split::Replicated {
                sum += squares(&values[at..end]);
            }
            at = end;
        }
        // A block described by counts alone keeps its frozen values as one run.
        sum + squares(&values[at..])
    }

    /// `held` (pieces of blocks' local parameter vectors, declaration order) at their places in
    /// the model's parameters: each split parameter's runs moved to where they sit globally,
    /// padding dropped. Unchanged without tensor parallelism.
    pub(super) fn in_global_coordinates(&self, held: Vec<HeldParams>) -> Vec<HeldParams> {
        let tp = self.stage.tp;
        if tp.size == 1 {
            return held;
        }
        let mut out = Vec::new();
        for piece in held {
            let whole = &self.stage.whole.blocks[piece.block].param_descs;
            let (mut local_at, mut global_at) = (0, 0);
            for p in whole {
                let local_len: usize =
                    archipelago_dataflow::tensor_parallel::local_shape(p.split, &p.shape, tp.size)
                        .iter()
                        .product();
                for run in global_runs(p.split, &p.shape, tp.rank, tp.size) {
                    let local = local_at + run.local..local_at + run.local + run.len;
                    let (from, to) = (local.start.max(piece.range.start), local.end.min(piece.range.end));
                    if from >= to {
                        continue;
                    }
                    let global = global_at + run.global + (from - local.start);
                    out.push(HeldParams {
                        block: piece.block,
                        range: global..global + (to - from),
                        values: piece.values[from - piece.range.start..to - piece.range.start].to_vec(),
                    });
                }
                local_at += local_len;
                global_at += p.len();
            }
        }
        out
    }
}

fn squares(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
}

fn write_ranges(flat: &mut [f32], ranges: &[Range<usize>], values: &[f32]) {
    let mut at = 0;
    for r in ranges {
        flat[r.clone()].copy_from_slice(&values[at..at + r.len()]);
        at += r.len();
    }
}
