//! The device store's side of the trainer (`--state device`): building the device state from
//! the host copies (at start and after a restore) and reading it back into them (before a
//! report or a checkpoint reads them), and the update with the state on the device — each
//! bucket updates its segment there and the modules take their parameters as slices of the
//! segment's master tensor (see `device_state.rs`, `device_lamb.rs`).

use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::passes::optimizer::{GRAD_SQUARES, TRUST_SQUARES};
use archipelago_dataflow::{StatePlacement, TensorId, UpdateScope};

use super::Trainer;
use super::cpu_buffers::is_cpu;
use super::device_state::{DeviceState, SegmentPlace};
use super::store::Store;
use crate::executor::TensorTable;
use crate::typed_tensor::TypedTensor;

impl<B: AutodiffBackend> Trainer<B> {
    /// Moves the held parameters and optimizer state onto the device when the plan puts the
    /// state there (`--state device`), from the host copies; leaves them in host memory
    /// otherwise.
    pub(super) fn with_state_where_planned(mut self, placement: StatePlacement) -> Trainer<B> {
        if placement == StatePlacement::Device {
            self.upload_state();
        }
        self
    }

    /// With the state on the device, updates it with tensor ops even on the CPU backend (whose
    /// buffers the optimizer's flat loops otherwise update in place): the GPU path, for tests.
    pub fn with_tensor_op_update(mut self, on: bool) -> Trainer<B> {
        // Only the CPU backend has two ways to update: elsewhere the state already uploaded is
        // the one the flag asks for, and is not moved again.
        let changes = on != self.state.tensor_op_update && is_cpu::<B::InnerBackend>();
        self.state.tensor_op_update = on;
        if changes && self.state.store.device().is_some() {
            self.download_state();
            self.upload_state();
        }
        self
    }

    /// (Re)builds the device state from the host copies (at start, and after a restore).
    pub(super) fn upload_state(&mut self) {
        let segments: Vec<SegmentPlace> = (self.state.sharding.segments.values())
            .map(|s| SegmentPlace {
                start: s.start,
                range: self.stage.offsets[s.start]..self.stage.offsets[s.end],
                update: s.updated.clone(),
                held: s.held.clone(),
                grads: s.grads.clone(),
                state_at: s.state_at,
            })
            .collect();
        let optimizer = &self.state.optimizer;
        let held = &self.state.held;
        let by_start = &self.state.sharding.segments;
        let state = DeviceState::upload(
            optimizer.spec(),
            &segments,
            |place| {
                let s = &by_start[&place.start];
                held[s.in_held(&s.held)].to_vec()
            },
            |range| {
                let (m, v) = optimizer.state(range);
                (m.to_vec(), v.to_vec())
            },
            optimizer.layout(),
            &self.stage.device,
            self.state.tensor_op_update,
        );
        self.state.store = Store::Device(state);
        // The device's state is the state: no host mirror of the moments is kept (one is made
        // by `sync_host` for a checkpoint, and freed again at the next step's end).
        self.state.optimizer.release_state();
    }

    /// After the host copies changed (a restore): the device state, if the state lives there,
    /// is built again from them.
    pub(super) fn refresh_device_state(&mut self) {
        if self.state.store.device().is_some() {
            self.upload_state();
        }
    }

    /// Reads the device state back into the host copies (the held vector, the optimizer's
    /// moments), for a report or a checkpoint.
    pub(super) fn download_state(&mut self) {
        let Store::Device(state) = &self.state.store else {
            return;
        };
        self.state.optimizer.ensure_state();
        let (held, optimizer) = (&mut self.state.held, &mut self.state.optimizer);
        let by_start = &self.state.sharding.segments;
        state.download_into(|place, params, m, v| {
            let at = by_start[&place.start].held_at;
            held[at..at + params.len()].copy_from_slice(&params);
            optimizer.set_state(place.state_at, &m, &v);
        });
    }

    /// The update with the state on the device: each bucket (on the device, or reduced by a
    /// collective and moved back onto it) updates its segment there (this replica's shard of it
    /// under ZeRO-1/2), and the segment's modules take their parameters as slices of the new
    /// master tensor — under ZeRO-1/2 after the all-gather, for which the updated shard is
    /// written to the step's output.
    pub(super) fn optimizer_step_on_device(
        &mut self,
        scope: UpdateScope,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let ctx = self.state.optimizer.context();
        // LAMB's moments were updated by TrustNorms; its phase 2 needs the reduced norms.
        let lamb = self.state.optimizer.spec().needs_param_norms();
        if lamb {
            self.take_trust_norms(table)?;
        }
        let trust = self.state.optimizer.trust().to_vec();
        // The clipping norm was read by begin_update.
        let buckets = inputs
            .iter()
            .filter(|n| **n != GRAD_SQUARES && **n != TRUST_SQUARES);
        let skipped = self.state.update.skipped;
        for (k, name) in buckets.enumerate() {
            let blocks = self
                .step
                .grad_ranges
                .remove(name)
                .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?;
            let state = self.state.store.device_mut().ok_or("no device state")?;
            if skipped {
                // An overflow somewhere (loss scaling): the bucket goes unread; the all-gather
                // in every member's stream still takes this replica's (unchanged) shard.
                state.drop_bucket(name);
                table.remove(name);
                if scope == UpdateScope::ShardThenGather {
                    self.gather_shard_from_device(&blocks, k, outputs, table)?;
                }
                continue;
            }
            let master = if lamb {
                state.lamb_apply(blocks.start, &trust, &ctx)?
            } else {
                let reduced = table.remove(name).map(TypedTensor::into_f32_vec);
                let grad = state.bucket(name, reduced, &self.stage.device)?;
                self.step.optimizer_grad_bytes += 4 * grad.shape().num_elements() as u64;
                state.update(blocks.start, grad, &ctx)?
            };
            match scope {
                UpdateScope::Whole => self.load_modules_from(blocks, master)?,
                UpdateScope::ShardThenGather => self.gather_shard_from_device(&blocks, k, outputs, table)?,
                // ZeRO-3: the shard stays on the device until the next forward gathers it.
                UpdateScope::ShardKept => {}
                other => return Err(format!("the device state has no `{other}` update")),
            }
        }
        Ok(())
    }

    /// ZeRO-1/2: the updated shard of segment `blocks` (the `k`th of this actor's) in a buffer
    /// of the segment's length, as the step's output `k` for the all-gather.
    fn gather_shard_from_device(
        &mut self,
        blocks: &Range<usize>,
        k: usize,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let state = self.state.store.device_mut().ok_or("no device state")?;
        let (own, shard) = state.updated_shard(blocks.start)?;
        let len = self.stage.offsets[blocks.end] - self.stage.offsets[blocks.start];
        let mut gathered = self.gather_buffer(len);
        gathered[own].copy_from_slice(&shard);
        let out = outputs.get(k).ok_or_else(|| {
            format!(
                "the sharded optimizer step names no output for blocks {}..{}",
                blocks.start, blocks.end
            )
        })?;
        table.insert(out.clone(), TypedTensor::flat(gathered));
        Ok(())
    }

    /// The modules of `blocks` take their parameters as slices of `master` (the segment's
    /// master tensor on the device).
    pub(super) fn load_modules_from(
        &mut self,
        blocks: Range<usize>,
        master: burn::tensor::Tensor<B::InnerBackend, 1>,
    ) -> Result<(), String> {
        let base = self.stage.offsets[blocks.start];
        for index in blocks {
            let block = self.stage.blocks[index]
                .take()
                .ok_or_else(|| format!("block {index} is not held by this actor"))?;
            let at = self.stage.offsets[index] - base..self.stage.offsets[index + 1] - base;
            self.stage.blocks[index] = Some(block.load_params_from(master.clone().slice([at])));
        }
        Ok(())
    }

    /// `TrustNorms` with the state on the device: each bucket (on the device, or reduced in host
    /// memory and moved onto it) updates its segment's moments there and adds the partial sums
    /// of the elements this replica answers for.
    pub(super) fn trust_norms_on_device(
        &mut self,
        buckets: &[&TensorId],
        sums: &mut [f64],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let ctx = self.state.optimizer.context();
        for &name in buckets {
            let blocks = self
                .step
                .grad_ranges
                .get(name)
                .ok_or_else(|| format!("`{name}` is not a gradient bucket"))?
                .clone();
            let counted = self.state.sharding.segment(blocks.start)?.own.clone();
            let reduced = table.remove(name).map(TypedTensor::into_f32_vec);
            let state = self.state.store.device_mut().ok_or("no device state")?;
            let grad = state.bucket(name, reduced, &self.stage.device)?;
            self.step.optimizer_grad_bytes += 4 * grad.shape().num_elements() as u64;
            state.lamb_moments(blocks.start, grad, counted, &ctx, sums)?;
        }
        Ok(())
    }
}
