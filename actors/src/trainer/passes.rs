//! The trainer's passes: forward of a segment (with activation checkpointing), the loss, the
//! backward from the loss or an upstream gradient, ZB-H1's split backward, and the gradient
//! buckets that add up the micro-batches.

use archipelago_dataflow::TensorId;
use std::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::AutodiffBackend;

use super::seq_shards::sum_of;
use super::vocab_loss::{VocabStats, logit_count, logit_rows};
use super::{BlockCopies, Segment, Trainer};
use crate::block::{Activation, Block, read_flat};
use crate::executor::TensorTable;
use crate::host_tensor::into_burn;
use crate::transfer::{TransferKind, download};
use crate::typed_tensor::TypedTensor;

impl<B: AutodiffBackend> Trainer<B> {
    /// A received tensor from the table as an activation.
    pub(super) fn import(&self, name: &TensorId, table: &mut TensorTable) -> Result<Activation<B>, String> {
        let t = table
            .remove(name)
            .ok_or_else(|| format!("`{name}` was neither produced here nor received"))?;
        let t = self.shaped(name, t)?;
        let compute = crate::precision::plan_dtype(self.stage.compute);
        if t.dtype() != compute {
            return Err(format!(
                "`{name}` arrived as {}; activations cross stages in the compute dtype, {compute}",
                t.dtype()
            ));
        }
        let activation = match t.shape().len() {
            2 => Activation::Rows(into_burn::<B, 2>(t, &self.stage.device)),
            3 => Activation::Seq(into_burn::<B, 3>(t, &self.stage.device)),
            r => return Err(format!("`{name}` has rank {r}; activations have rank 2 or 3")),
        };
        // An activation, or an upstream gradient, meets blocks that compute in their dtype.
        Ok(activation.cast(self.stage.compute))
    }

    /// Runs `blocks` on `x`, each on a fresh copy (see [`Block::fresh_copy`]); returns the
    /// output and the copies.
    pub(super) fn run_blocks(
        &self,
        blocks: Range<usize>,
        x: Activation<B>,
    ) -> Result<(Activation<B>, BlockCopies<B>), String> {
        let mut y = x;
        let mut copies = Vec::with_capacity(blocks.len());
        for index in blocks {
            let copy = self.block(index)?.fresh_copy();
            y = copy.forward(y);
            copies.push(copy);
        }
        Ok((y, copies))
    }

    pub(super) fn forward(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let output = outputs.first().ok_or("the forward names no output")?;
        // Sequence parallelism: a segment reading the residual stream takes the sum of its
        // input and the residual as its input (one leaf), and passes that sum on as the stream.
        let parts =
            (inputs.iter().map(|input| self.forward_input(input, table))).collect::<Result<_, _>>()?;
        let x = sum_of(parts)?.leaf();
        let checkpoint = outputs.iter().find(|t| matches!(t, TensorId::Checkpoint { .. }));
        let residual = outputs.iter().find(|t| matches!(t, TensorId::Residual { .. }));
        let passed_on = residual.map(|_| x.clone().untracked());
        let input_form = self.stage.desc.blocks[blocks.start].tp.unwrap_or_default().input;
        let checkpointed = self.checkpoints.checkpoints(blocks.start, input_form);
        let (kept, copies) = if checkpointed {
            // No graph at all: burn frees a recorded graph only at a backward, so a forward run
            // with one and then detached would hold every segment's activations until then.
            let mut y = x.clone().untracked();
            for index in blocks.clone() {
                y = self.block(index)?.untracked_copy().forward(y);
            }
            (y, Vec::new())
        } else {
            self.run_blocks(blocks.clone(), x.clone())?
        };
        let key = (blocks.start, mb);
        let (input, part) = match checkpointed {
            true => self.keep_input(blocks.start, x, checkpoint, table)?,
            false => (Some(x), None),
        };
        if let Some(name) = checkpoint {
            if part.is_some() {
                self.step.checkpoints.insert(name.clone(), key);
            } else if let Some(t) = table.get(name) {
                self.step
                    .offloaded_bytes
                    .insert(name.clone(), t.byte_len() as u64);
            }
        }
        self.step.segments.insert(
            key,
            Segment {
                input,
                output: Some(kept),
                residual: passed_on,
                residual_grad: None,
                checkpointed,
                last: blocks.end == self.stage.desc.blocks.len(),
                kept: part,
                copies,
                batch: None,
                summed: None,
                vocab: None,
            },
        );
        self.note_checkpoint_bytes();
        self.step.by_name.insert(output.clone(), key);
        if let Some(residual) = residual {
            self.step.by_name.insert(residual.clone(), key);
        }
        let chunk = (self.chunk_of(blocks.start), mb);
        *self.step.live.entry(chunk).or_default() += 1;
        self.step.peak_live = self.step.peak_live.max(self.step.live.len());
        Ok(())
    }

    /// A segment's input: a batch, the table's tensor, or the output of this actor's segment
    /// before (or the residual stream it passed on), read once (see [`Trainer::read_own`]). The
    /// table comes before this actor's own output: a tensor-parallel collective (Megatron's g, or
    /// sequence parallelism's reduce-scatter and all-gather) leaves the group's result there
    /// under the same name as what this actor produced.
    fn forward_input(&mut self, input: &TensorId, table: &mut TensorTable) -> Result<Activation<B>, String> {
        if let Some(batch) = self.step.batches.get(input) {
            return Ok(batch.input.clone().cast(self.stage.compute));
        }
        if table.get(input).is_some() {
            self.read_own(input, false)?;
            return self.import(input, table);
        }
        match self.read_own(input, true)? {
            Some(own) => Ok(own),
            None => self.import(input, table),
        }
    }

    /// This actor's own output `name` (when `value`), counted as read: a checkpointed segment's
    /// output is dropped once read (its backward recomputes it), but the model's last (the loss
    /// reads it); or the residual stream a segment passed on, which its one reader takes. `None`:
    /// no segment here produced it, or the value was not asked for.
    pub(super) fn read_own(&mut self, name: &TensorId, value: bool) -> Result<Option<Activation<B>>, String> {
        let Some(segment) =
            (self.step.by_name.get(name).copied()).and_then(|key| self.step.segments.get_mut(&key))
        else {
            return Ok(None);
        };
        if matches!(name, TensorId::Residual { .. }) {
            let residual = segment
                .residual
                .take()
                .ok_or_else(|| format!("`{name}` was read twice"))?;
            return Ok(value.then_some(residual));
        }
        let value = match value {
            true => Some(segment.output()?.clone()),
            false => None,
        };
        if segment.checkpointed && !segment.last {
            segment.output = None;
        }
        Ok(value)
    }

    /// The loss of `segment` (the last) against `batch`'s targets, summed over its tokens and
    /// scaled to the global batch's mean, in f32; under tensor parallelism the tensor whose
    /// gradient is the loss's (the vocabulary-parallel surrogate; a partial output's gradient
    /// passed straight through the group's sum).
    pub(super) fn loss_of(&self, segment: &Segment<B>, batch: &TensorId) -> Result<Tensor<B, 1>, String> {
        let batch = (self.step.batches.get(batch)).ok_or_else(|| format!("batch `{batch}` is not loaded"))?;
        let per_global_sample = 1.0 / (self.global_batch * self.stage.desc.input.tokens_per_sample()) as f32;
        // The loss in f32 whatever the compute dtype (its backward casts the gradient back).
        let mut logits = logit_rows(segment.output()?)?;
        if let Some(sum) = &segment.summed {
            // g's backward is the identity: the sum's value, the partial's gradient.
            logits = logits.clone() + (sum.clone() - logits.detach());
        }
        if let Some(stats) = &segment.vocab {
            let surrogate = self.vocab_surrogate(logits, stats, &batch.labels)?;
            return Ok(surrogate.mul_scalar(per_global_sample));
        }
        let [n, _] = logits.dims();
        let picked = log_softmax(logits, 1).gather(1, batch.targets.clone().reshape([n, 1]));
        Ok(picked.sum().neg().mul_scalar(per_global_sample))
    }

    /// `Loss` of the logits `inputs[0]` against batch `inputs[1]` (with vocabulary-parallel
    /// logits, the group's statistics `inputs[2..4]`), kept under `loss` for the backward; the
    /// first rank of a tp group reports it.
    pub(super) fn compute_loss(
        &mut self,
        inputs: &[TensorId],
        loss: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let [logits, batch, stats @ ..] = inputs else {
            return Err("Loss names no logits or no batch".into());
        };
        let key =
            *(self.step.by_name.get(logits)).ok_or_else(|| format!("no segment produced `{logits}`"))?;
        // Megatron's g left the group's sum of a partial output in the table.
        let summed = match table.get(logits) {
            Some(_) => Some(logit_rows(&self.import(logits, table)?)?.detach()),
            None => None,
        };
        let tokens = logit_count(self.step.segments[&key].output()?)?;
        let vocab = match stats {
            [max, sums] => Some(VocabStats::take(table, max, sums, tokens)?),
            [] => None,
            _ => {
                return Err(format!(
                    "Loss reads {} statistics; the vocabulary-parallel loss reads 2",
                    stats.len()
                ));
            }
        };
        let scalar = match &vocab {
            Some(stats) => {
                let per_global_sample =
                    1.0 / (self.global_batch * self.stage.desc.input.tokens_per_sample()) as f64;
                (stats.loss_sum() * per_global_sample) as f32
            }
            None => {
                let segment = self.step.segments.get_mut(&key).expect("segment");
                segment.summed = summed.clone();
                let value = self.loss_of(&self.step.segments[&key], batch)?;
                download(value, TransferKind::Scalar)
                    .convert::<f32>()
                    .as_slice::<f32>()
                    .map_err(|e| format!("the loss: {e:?}"))?[0]
            }
        };
        // Every rank of a tp group holds the same loss: the first one reports it.
        if self.stage.tp.leads() {
            *self.step.loss_sum.get_or_insert(0.0) += scalar;
        }
        let segment = self.step.segments.get_mut(&key).expect("segment");
        segment.batch = Some(batch.clone());
        segment.summed = summed;
        segment.vocab = vocab;
        if segment.checkpointed {
            // The backward recomputes the logits: nothing reads these any more.
            segment.output = None;
        }
        self.step.losses.insert(loss.clone(), key);
        Ok(())
    }

    /// Runs the backward of segment `(start, mb)` from `upstream`; returns burn's gradients and
    /// the segment (for its input's gradient).
    pub(super) fn backward_pass(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        inputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(B::Gradients, Segment<B>), String> {
        let [upstream, rest @ ..] = inputs else {
            return Err("the backward names no upstream gradient".into());
        };
        let checkpoint: Vec<TensorId> = rest
            .iter()
            .filter(|t| matches!(t, TensorId::Checkpoint { .. }))
            .cloned()
            .collect();
        // Sequence parallelism: the residual stream's gradient, a second upstream.
        let residual = rest.iter().find(|t| matches!(t, TensorId::ResidualGrad { .. }));
        let mut segment = self
            .step
            .segments
            .remove(&(blocks.start, mb))
            .ok_or("backward of a segment that did not run forward")?;
        if segment.checkpointed {
            let input = match segment.input.take() {
                Some(input) => input,
                None => self.checkpointed_input(checkpoint.first(), segment.kept.as_ref(), table)?,
            };
            if let Some(name) = checkpoint.first() {
                self.step.checkpoints.remove(name);
                self.step.offloaded_bytes.remove(name);
            }
            segment.kept = None;
            let (output, copies) = self.run_blocks(blocks.clone(), input.clone())?;
            (segment.input, segment.output, segment.copies) = (Some(input), Some(output), copies);
        }
        let grads = if let Some(key) = self.step.losses.remove(upstream) {
            if key != (blocks.start, mb) {
                return Err(format!("`{upstream}` is not the loss of this segment"));
            }
            let batch = segment.batch.clone().ok_or("no loss computed for this segment")?;
            let loss = self.loss_of(&segment, &batch)?;
            // f16's loss scaling: the backward starts from S × loss (in f32), so every gradient
            // below it, and every activation gradient sent upstream, carries S.
            match self.state.update.scaler {
                Some(scaler) => loss.mul_scalar(scaler.scale).backward(),
                None => loss.backward(),
            }
        } else {
            let g = self.upstream_grad(upstream, table)?;
            segment.output()?.dot(&g).backward()
        };
        if let Some(residual) = residual {
            // The stream this segment passed on: its gradient adds to the input's.
            let g = self.upstream_grad(residual, table)?;
            let dropped = self.fault.as_ref().is_some_and(|f| f.drops_residual_grad());
            segment.residual_grad = (!dropped).then_some(g);
        }
        Ok((grads, segment))
    }

    /// An upstream gradient: this actor's own, or the table's (received, or a collective's).
    fn upstream_grad(&mut self, name: &TensorId, table: &mut TensorTable) -> Result<Activation<B>, String> {
        match self.step.upstream.remove(name) {
            Some(g) => Ok(g),
            None => self.import(name, table),
        }
    }

    /// Moves the segment's weight gradients into its bucket `grad_name`, adding to what earlier
    /// micro-batches left there this step.
    pub(super) fn accumulate(
        &mut self,
        blocks: Range<usize>,
        copies: &[Box<dyn Block<B>>],
        grads: &mut B::Gradients,
        grad_name: &TensorId,
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let range = self.stage.offsets[blocks.start]..self.stage.offsets[blocks.end];
        let first = self.step.grads_started.insert(grad_name.clone());
        let parts = copies.iter().flat_map(|copy| copy.take_grads(grads)).collect();
        // A store that keeps buckets (on the device) sums them there over micro-batches.
        let Some(parts) = self.state.store.keep_grads(grad_name, parts, first) else {
            self.step.grad_ranges.insert(grad_name.clone(), blocks);
            self.step.peak_grad_bytes = self.step.peak_grad_bytes.max(4 * range.len() as u64);
            return Ok(());
        };
        let mut flat = if first {
            match self
                .step
                .spare_buffers
                .iter()
                .position(|b| b.len() == range.len())
            {
                Some(i) => self.step.spare_buffers.swap_remove(i),
                None => vec![0.0f32; range.len()],
            }
        } else {
            table
                .remove(grad_name)
                .ok_or_else(|| format!("gradient bucket `{grad_name}` left the actor mid-step"))?
                .into_f32_vec()
        };
        // On a GPU one device-to-host read for the whole bucket (see `read_flat`).
        read_flat(parts, &mut flat, !first, self.batched_transfers);
        if let Some(fault) = &mut self.fault {
            fault.on_bucket(grad_name, self.step.job_step, &mut flat);
        }
        table.insert(grad_name.clone(), TypedTensor::flat(flat));
        self.step.grad_ranges.insert(grad_name.clone(), blocks);
        let held: u64 = self
            .step
            .grad_ranges
            .keys()
            .filter_map(|n| table.get(n).map(|t| t.byte_len() as u64))
            .sum();
        let spare: u64 = self.step.spare_buffers.iter().map(|b| 4 * b.len() as u64).sum();
        self.step.peak_grad_bytes = self.step.peak_grad_bytes.max(held + spare);
        Ok(())
    }

    pub(super) fn release(&mut self, start: usize, mb: usize) {
        let key = (self.chunk_of(start), mb);
        if let Some(n) = self.step.live.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.step.live.remove(&key);
            }
        }
    }

    pub(super) fn backward(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (mut grads, segment) = self.backward_pass(blocks.clone(), mb, inputs, table)?;
        self.gradients_into_bucket(blocks.clone(), &segment.copies, &mut grads, outputs, table)?;
        self.keep_input_grad(&segment, &mut grads, outputs)?;
        self.release(blocks.start, mb);
        Ok(())
    }

    /// The weight gradients of a backward into their bucket (`outputs[0]`) and, under tensor
    /// parallelism, the replicated ones so far out for their all-reduce (`TpGrads`).
    fn gradients_into_bucket(
        &mut self,
        blocks: Range<usize>,
        copies: &[Box<dyn Block<B>>],
        grads: &mut B::Gradients,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let grad_name = outputs.first().ok_or("the backward names no gradient output")?;
        // A tie's mirror's gradient first: it is not in the bucket.
        self.accumulate_tied(blocks.start, copies, grads);
        self.hand_out_tied(outputs, table)?;
        self.accumulate(blocks.clone(), copies, grads, grad_name, table)?;
        if let Some(shared) = outputs.iter().find(|t| matches!(t, TensorId::TpGrads { .. })) {
            self.share_replicated_grads(blocks, grad_name, shared, table)?;
        }
        Ok(())
    }

    /// Keeps the gradient of the segment's input (with, under sequence parallelism, that of the
    /// stream it passed on added) under the names `outputs` give it: its input's (for the
    /// segment before, or to be sent to the stage before) and the residual stream's it read;
    /// the first segment of the model has none.
    pub(super) fn keep_input_grad(
        &mut self,
        segment: &Segment<B>,
        grads: &mut B::Gradients,
        outputs: &[TensorId],
    ) -> Result<(), String> {
        let is_input_grad =
            |t: &&TensorId| matches!(t, TensorId::ActivationGrad { .. } | TensorId::ResidualGrad { .. });
        let names: Vec<&TensorId> = outputs.iter().filter(is_input_grad).collect();
        if names.is_empty() {
            return Ok(());
        }
        let mut g = (segment.input.as_ref())
            .and_then(|input| input.take_grad(grads))
            .ok_or("the segment input has no gradient")?;
        if let Some(residual) = &segment.residual_grad {
            g = sum_of(vec![g, residual.clone()])?;
        }
        // A sum's parts have its gradient: the input's and the residual stream's (read beside it).
        for name in names {
            self.step.upstream.insert(name.clone(), g.clone());
        }
        Ok(())
    }

    pub(super) fn backward_input(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        inputs: &[TensorId],
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (mut grads, segment) = self.backward_pass(blocks.clone(), mb, inputs, table)?;
        self.keep_input_grad(&segment, &mut grads, outputs)?;
        self.step
            .pending_weights
            .insert((blocks.start, mb), (grads, segment.copies));
        Ok(())
    }

    pub(super) fn backward_weight(
        &mut self,
        blocks: Range<usize>,
        mb: usize,
        outputs: &[TensorId],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let (mut grads, copies) = self
            .step
            .pending_weights
            .remove(&(blocks.start, mb))
            .ok_or("BackwardWeight before its BackwardInput")?;
        self.gradients_into_bucket(blocks.clone(), &copies, &mut grads, outputs, table)?;
        self.release(blocks.start, mb);
        Ok(())
    }
}
