//! The trainer's side of offload (ZeRO-Offload): each reduced gradient bucket (this replica's
//! shard of it under ZeRO ≥ 1) goes to the offload actor as soon as the stream reaches its
//! `OffloadGrads`; the step's `OptimizerStep` takes the updated parameters back and puts them
//! where the ZeRO stage keeps them (the master copy and modules, a gathered buffer for the
//! all-gather, or the ZeRO-3 shard master — nowhere under `--offload-params`).
//!
//! With clipping the update is deferred: each bucket is staged with the offload actor (its sum
//! of squares kept for `GradNorm`), and the `OptimizerStep`, which reads the reduced global norm,
//! has the staged updates applied with the clipping factor before collecting them.

use archipelago_dataflow::TensorId;
use archipelago_dataflow::ZeroStage;
use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use super::zero::SegmentShard;
use crate::executor::TensorTable;
use crate::offload::OffloadActor;
use crate::optim::{StepContext, clip_factor, sum_of_squares};
use crate::typed_tensor::TypedTensor;
use archipelago_dataflow::passes::optimizer::GRAD_SQUARES;

/// Whole gradient buffers kept for the next step under offload (the rest are freed: the point
/// of offloading is the device memory).
const SPARE_BUFFERS: usize = 2;

impl<B: AutodiffBackend> Trainer<B> {
    fn offload_actor(&self) -> Result<&OffloadActor, String> {
        self.state
            .offload
            .as_ref()
            .ok_or_else(|| "this actor has no offload actor (the plan has no --offload)".to_string())
    }

    /// Hands the reduced bucket `name` (or this replica's shard of it) to the offload actor.
    pub(super) fn offload_grads(&mut self, name: &TensorId, table: &mut TensorTable) -> Result<(), String> {
        let (grad, blocks) = self.take_bucket(name, table)?;
        let len = self.stage.offsets[blocks.end] - self.stage.offsets[blocks.start];
        let range = self.state.sharding.optimizer_range(blocks.start, len)?;
        let part = self.state.sharding.part(name, grad.f32s(), len, &range)?;
        let deferred = self.state.update.clip.is_some();
        if deferred {
            // GradNorm counts this actor's share (its count shard of a replicated bucket).
            let own = &self.state.sharding.segment(blocks.start)?.own;
            self.state.update.staged_squares +=
                sum_of_squares(self.state.sharding.part(name, grad.f32s(), len, own)?);
        }
        let grads = if part.len() == grad.elements() {
            grad.into_f32_vec() // already the shard (or the whole bucket is the range): no copy
        } else {
            let shard = part.to_vec();
            if self.step.spare_buffers.len() < SPARE_BUFFERS {
                self.step.spare_buffers.push(grad.into_f32_vec());
            }
            shard
        };
        self.step.offload_traffic.to_tier += 4 * grads.len() as u64;
        if deferred {
            self.offload_actor()?.stage(blocks.start, grads)?;
        } else {
            let step = self.offloaded_step(1.0);
            let return_params = !self.state.offload_params;
            self.offload_actor()?
                .update(step, blocks.start, grads, return_params)?;
        }
        self.state.handed_off.push(blocks.start);
        Ok(())
    }

    /// The context of this step's offloaded update, with clipping factor `grad_scale`.
    fn offloaded_step(&self, grad_scale: f32) -> StepContext {
        StepContext {
            t: self.state.steps_done + 1,
            lr: self.state.optimizer.next_lr(),
            grad_scale,
        }
    }

    /// Clipping with offload: the factor from the reduced global norm, and the staged updates
    /// applied with it.
    fn apply_deferred(&mut self, max: f32, table: &mut TensorTable) -> Result<(), String> {
        let squares = table
            .remove(&GRAD_SQUARES)
            .ok_or("clipping needs the reduced gradient norm, and it is missing")?;
        let [total] = squares.f32s()[..] else {
            return Err(format!(
                "`{GRAD_SQUARES}` holds {} values, not 1",
                squares.elements()
            ));
        };
        self.state.update.grad_norm = Some(total.max(0.0).sqrt());
        let step = self.offloaded_step(clip_factor(total as f64, max));
        self.offload_actor()?
            .apply_staged(step, !self.state.offload_params)
    }

    /// Takes every handed-off segment's updated parameters back from the offload actor.
    pub(super) fn collect_offloaded(
        &mut self,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        if let Some(max) = self.state.update.clip {
            self.apply_deferred(max, table)?;
        }
        let mut starts: Vec<usize> = self.state.sharding.segments.keys().copied().collect();
        starts.sort_unstable();
        if self.state.handed_off.len() != starts.len() {
            return Err(format!(
                "the optimizer step found {} of this actor's {} gradient buckets handed to the offload actor",
                self.state.handed_off.len(),
                starts.len()
            ));
        }
        for _ in 0..std::mem::take(&mut self.state.handed_off).len() {
            let (start, params) = self.offload_actor()?.next_updated()?;
            self.step.offload_traffic.from_tier += 4 * params.len() as u64;
            let SegmentShard { end, own, state } = self.state.sharding.segment(start)?.clone();
            let range = self.stage.offsets[start]..self.stage.offsets[end];
            match self.state.sharding.zero {
                ZeroStage::Replicated => {
                    self.state.master[range].copy_from_slice(&params);
                    self.reload(start..end)?;
                }
                ZeroStage::ShardedOptimizer | ZeroStage::ShardedGradients => {
                    let mut gathered = self.gather_buffer(range.len());
                    gathered[own].copy_from_slice(&params);
                    let k = starts
                        .iter()
                        .position(|&s| s == start)
                        .expect("a segment of this actor");
                    let out = outputs.get(k).ok_or_else(|| {
                        format!("the optimizer step names no output for blocks {start}..{end}")
                    })?;
                    table.insert(out.clone(), TypedTensor::flat(gathered));
                }
                _ if self.state.offload_params => {}
                _ => self.state.shard_master[state..state + own.len()].copy_from_slice(&params),
            }
        }
        self.state.steps_done += 1;
        // The update ran on the offload actor; the schedule's position is kept here.
        self.state
            .optimizer
            .set_schedule_step(self.state.optimizer.schedule_step() + 1);
        Ok(())
    }
}
