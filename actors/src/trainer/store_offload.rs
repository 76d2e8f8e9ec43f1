//! The trainer's side of offload (ZeRO-Offload): each reduced gradient bucket (this replica's
//! shard of it under ZeRO ≥ 1) goes to the offload actor as soon as the stream reaches its
//! `OffloadGrads`; the step's `OptimizerStep` takes the updated parameters back and puts them
//! where the ZeRO stage keeps them (the master copy and modules, a gathered buffer for the
//! all-gather, or the ZeRO-3 shard master — nowhere under `--offload-params`).
//!
//! With clipping the update is deferred: each bucket is staged with the offload actor (its sum
//! of squares kept for `GradNorm`), and the `OptimizerStep`, which reads the reduced global norm,
//! has the staged updates applied with the clipping factor before collecting them. Loss scaling
//! (f16) defers the same way: its vote decides whether the staged updates are applied (with
//! `1/S`) or dropped, the whole step skipped.

use archipelago_dataflow::TensorId;
use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use super::zero::grad_part;
use crate::executor::TensorTable;
use crate::optim::{StepContext, sum_of_squares};

/// Whole gradient buffers kept for the next step under offload (the rest are freed: the point
/// of offloading is the device memory).
const SPARE_BUFFERS: usize = 2;

impl<B: AutodiffBackend> Trainer<B> {
    /// Hands the reduced bucket `name` (the part of it this actor updates) to the offload actor.
    pub(super) fn offload_grads(&mut self, name: &TensorId, table: &mut TensorTable) -> Result<(), String> {
        let (grad, blocks) = self.take_bucket(name, table)?;
        let segment = self.state.sharding.segment(blocks.start)?.clone();
        let part = grad_part(name, grad.f32s(), &segment, &segment.updated)?;
        let deferred = self.state.update.needs_squares();
        if deferred {
            // GradNorm counts this actor's share (its count shard of a replicated bucket).
            let own = grad_part(name, grad.f32s(), &segment, &segment.own)?;
            self.state.update.staged_squares += sum_of_squares(own);
            if !self.stage.tp.leads() {
                // Replicated parameters' gradients, the same on every tp rank, count once.
                let replicated = self.replicated_squares_in(
                    blocks.clone(),
                    name,
                    grad.f32s(),
                    &segment,
                    segment.own.clone(),
                )?;
                self.state.update.staged_squares -= replicated;
            }
        }
        let grads = if part.len() == grad.elements() {
            grad.into_f32_vec() // already the part (the whole bucket, or the shard): no copy
        } else {
            let shard = part.to_vec();
            if self.step.spare_buffers.len() < SPARE_BUFFERS {
                self.step.spare_buffers.push(grad.into_f32_vec());
            }
            shard
        };
        self.step.offload_traffic.to_tier += 4 * grads.len() as u64;
        let step = self.offloaded_step(1.0);
        let store = self.state.store.offload_mut()?;
        if deferred {
            store.actor.stage(blocks.start, grads)?;
        } else {
            store
                .actor
                .update(step, blocks.start, grads, !store.params_in_tier)?;
        }
        store.handed_off.push(blocks.start);
        Ok(())
    }

    /// The context of this step's offloaded update, with clipping factor `grad_scale`.
    fn offloaded_step(&self, grad_scale: f32) -> StepContext {
        StepContext {
            t: self.state.store.steps(&self.state.optimizer) + 1,
            lr: self.state.optimizer.next_lr(),
            grad_scale,
            exchanged_momentum_after: None,
        }
    }

    /// Clipping or loss scaling with offload: the factor from the reduced sum of squares, and
    /// the staged updates applied with it — or dropped, when the vote skips the step. Whether
    /// the step was taken.
    fn apply_deferred(&mut self, table: &mut TensorTable) -> Result<bool, String> {
        let factor = self.gradient_factor(table)?;
        let step = self.offloaded_step(factor.unwrap_or(0.0));
        let store = self.state.store.offload()?;
        match factor {
            Some(_) => store.actor.apply_staged(step, !store.params_in_tier)?,
            None => store.actor.discard_staged(!store.params_in_tier)?,
        }
        Ok(factor.is_some())
    }

    /// Takes every handed-off segment's updated parameters back from the offload actor into
    /// the held parameters (not under `--offload-params`), then does what follows the update.
    pub(super) fn collect_offloaded(
        &mut self,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let taken = !self.state.update.needs_squares() || self.apply_deferred(table)?;
        let handed_off = std::mem::take(&mut self.state.store.offload_mut()?.handed_off);
        let starts: Vec<usize> = self.state.sharding.segments.keys().copied().collect();
        if handed_off.len() != starts.len() {
            return Err(format!(
                "the optimizer step found {} of this actor's {} gradient buckets handed to the offload actor",
                handed_off.len(),
                starts.len()
            ));
        }
        for _ in 0..handed_off.len() {
            let (start, params) = self.state.store.offload()?.actor.next_updated()?;
            self.step.offload_traffic.from_tier += 4 * params.len() as u64;
            let segment = self.state.sharding.segment(start)?.clone();
            let at = segment.in_held(&segment.updated);
            if let Some(into) = (self.state.store).held_mut(&mut self.state.held, at) {
                into.copy_from_slice(&params);
            }
            let k = starts
                .iter()
                .position(|&s| s == start)
                .expect("a segment of this actor");
            let after = self.state.after_update;
            self.after_update(after, &segment, k, outputs, table)?;
        }
        if taken {
            let store = self.state.store.offload_mut()?;
            store.steps_done += 1;
            // The update ran on the offload actor; the schedule's position is kept here.
            self.state
                .optimizer
                .set_schedule_step(self.state.optimizer.schedule_step() + 1);
        }
        Ok(())
    }
}
