//! The trainer's part of a checkpoint: the pieces of state it owns, and loading any layout's
//! checkpoint into its own blocks and shards (see [`crate::checkpoint`]).
//!
//! What an actor writes is the plan's: the `saved` part of each of its segments (its shard under
//! ZeRO ≥ 1; the whole segment at the group's first replica under ZeRO-0), parameters with their
//! optimizer state, read from whichever store keeps them (`Store::region`); frozen parameters
//! whole, without state, from the group's first replica. Whatever an actor owns of a block is
//! cut at its parameters' boundaries: each piece is one named parameter or a flat range of one,
//! at its place among all its block's parameters, with the optimizer state of those elements
//! under the names of [`archipelago_dataflow::OptimizerSpec::state_names`]; restoring reads each
//! parameter by name, its shape checked against this model's description, into the parts the
//! plan has this actor hold and update.

use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use archipelago_dataflow::tensor_parallel::global_runs;
use archipelago_dataflow::{ParamDesc, SegmentPlan, Split};

use super::Trainer;
use crate::checkpoint::{CheckpointReader, Piece, ShardState, Slice};

/// Where one parameter's part of a block range lies.
struct ParamSpan {
    /// The parameter's index in its block's descriptions.
    param: usize,
    /// Where the parameter starts in the block.
    block_offset: usize,
    /// Its elements in the range.
    in_param: Range<usize>,
    /// The same elements, relative to the range's start.
    in_range: Range<usize>,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Block `block`'s range `in_block` (of its trained vector) cut at its parameters'
    /// boundaries; each span's `block_offset` is the parameter's place among all the block's
    /// parameters (frozen ones included), as a block-wise reader of the checkpoint counts.
    fn param_spans(&self, block: usize, in_block: &Range<usize>) -> Vec<ParamSpan> {
        let in_full = self.stage.layouts[block].runs().iter().filter(|r| r.trained);
        let mut spans = Vec::new();
        let mut at = 0;
        for ((param, p), run) in self.stage.param_descs[block].iter().enumerate().zip(in_full) {
            let span = at..at + p.len();
            let (from, to) = (span.start.max(in_block.start), span.end.min(in_block.end));
            if from < to {
                spans.push(ParamSpan {
                    param,
                    block_offset: run.full.start,
                    in_param: from - span.start..to - span.start,
                    in_range: from - in_block.start..to - in_block.start,
                });
            }
            at = span.end;
        }
        spans
    }

    /// Pieces of block `block`'s range `in_block`: one per parameter it touches, with `values`
    /// and each named state tensor (all of the range's length) cut to that parameter's part.
    fn pieces_of(
        &self,
        block: usize,
        in_block: &Range<usize>,
        values: &[f32],
        state: &[(&str, &[f32])],
    ) -> Vec<Piece> {
        self.param_spans(block, in_block)
            .into_iter()
            .filter_map(|s| {
                let p = &self.stage.param_descs[block][s.param];
                let state: Vec<(&str, &[f32])> = state
                    .iter()
                    .map(|(name, v)| (*name, &v[s.in_range.clone()]))
                    .collect();
                self.piece(block, p, s.block_offset, s.in_param, &values[s.in_range], &state)
            })
            .collect()
    }

    /// The piece of local parameter `p` (at `block_offset` among its block's local parameters)
    /// holding its elements `in_param`: as they are without tensor parallelism; under it, a
    /// slice of the whole parameter at its global place (`Slice::Tp`, padding left out), and
    /// for a replicated parameter the first rank's alone (`None` on the others).
    fn piece(
        &self,
        block: usize,
        p: &ParamDesc,
        block_offset: usize,
        in_param: Range<usize>,
        values: &[f32],
        state: &[(&str, &[f32])],
    ) -> Option<Piece> {
        let tp = self.stage.tp;
        let (whole, whole_offset) = self.whole_param(block, p).unwrap_or((p, block_offset));
        let all = std::iter::once(0..in_param.len()).collect();
        let (slice, kept) = match (tp.size, whole.split) {
            (1, _) => (Slice::flat(in_param.clone()), all),
            (_, Split::Replicated) if !tp.leads() => return None,
            (_, Split::Replicated) => (Slice::flat(in_param.clone()), all),
            (size, split) => {
                let slice = Slice::Tp {
                    split,
                    rank: tp.rank,
                    size,
                    start: in_param.start,
                    end: in_param.end,
                };
                (slice, self.stored_of(whole, in_param.clone()))
            }
        };
        let kept: Vec<Range<usize>> = kept;
        let keep = |v: &[f32]| kept.iter().flat_map(|r| v[r.clone()].iter().copied()).collect();
        Some(Piece {
            block,
            block_offset: whole_offset,
            param: p.name.clone(),
            shape: whole.shape.clone(),
            slice,
            values: keep(values),
            state: state
                .iter()
                .map(|(name, v)| (name.to_string(), keep(v)))
                .collect(),
        })
    }

    /// Under tensor parallelism, the whole parameter `p` is a slice of, and its place among its
    /// block's whole parameters; `None` without tensor parallelism.
    fn whole_param(&self, block: usize, p: &ParamDesc) -> Option<(&ParamDesc, usize)> {
        if self.stage.tp.size == 1 {
            return None;
        }
        let mut at = 0;
        for whole in &self.stage.whole.blocks[block].param_descs {
            if whole.name == p.name {
                return Some((whole, at));
            }
            at += whole.len();
        }
        None
    }

    /// The local runs of `in_param` (relative to its start) that hold elements of the whole
    /// parameter `whole`, in order (what a `Slice::Tp` stores: padding left out).
    fn stored_of(&self, whole: &ParamDesc, in_param: Range<usize>) -> Vec<Range<usize>> {
        let tp = self.stage.tp;
        (global_runs(whole.split, &whole.shape, tp.rank, tp.size).into_iter())
            .filter_map(|r| {
                let (from, to) = (r.local.max(in_param.start), (r.local + r.len).min(in_param.end));
                (from < to).then(|| from - in_param.start..to - in_param.start)
            })
            .collect()
    }

    /// Elements `in_param` of local parameter `p` from `checkpoint` by name, with the state
    /// tensors `state`: under tensor parallelism each stretch read from its global place
    /// (padding left zero).
    fn read_local(
        &self,
        checkpoint: &CheckpointReader,
        block: usize,
        p: &ParamDesc,
        in_param: Range<usize>,
        state: &[&str],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), String> {
        let Some((whole, _)) = self.whole_param(block, p) else {
            return checkpoint.read_param(&p.name, &p.shape, in_param, state);
        };
        let tp = self.stage.tp;
        let mut values = vec![0.0f32; in_param.len()];
        let mut tensors = vec![vec![0.0f32; in_param.len()]; state.len()];
        for r in global_runs(whole.split, &whole.shape, tp.rank, tp.size) {
            let (from, to) = (r.local.max(in_param.start), (r.local + r.len).min(in_param.end));
            if from >= to {
                continue;
            }
            let global = r.global + from - r.local..r.global + to - r.local;
            let (v, st) = checkpoint.read_param(&p.name, &whole.shape, global, state)?;
            let at = from - in_param.start..to - in_param.start;
            values[at.clone()].copy_from_slice(&v);
            for (into, read) in tensors.iter_mut().zip(st) {
                into[at.clone()].copy_from_slice(&read);
            }
        }
        Ok((values, tensors))
    }

    /// Reads block `block`'s range `in_block` from `checkpoint`, parameter by parameter by name:
    /// the values and the state tensors `state`, each of the range's length.
    fn read_range(
        &self,
        checkpoint: &CheckpointReader,
        block: usize,
        in_block: &Range<usize>,
        state: &[&str],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), String> {
        let mut values = vec![0.0f32; in_block.len()];
        let mut tensors = vec![vec![0.0f32; in_block.len()]; state.len()];
        for s in self.param_spans(block, in_block) {
            let p = &self.stage.param_descs[block][s.param];
            let (v, st) = self.read_local(checkpoint, block, p, s.in_param, state)?;
            values[s.in_range.clone()].copy_from_slice(&v);
            for (into, from) in tensors.iter_mut().zip(st) {
                into[s.in_range.clone()].copy_from_slice(&from);
            }
        }
        Ok((values, tensors))
    }

    /// The blocks `range` (of segment `segment`) covers: (block, its elements in the block's
    /// trained vector, the same elements relative to `range`).
    fn blocks_of(
        &self,
        segment: &SegmentPlan,
        range: &Range<usize>,
    ) -> Vec<(usize, Range<usize>, Range<usize>)> {
        let offsets = &self.stage.offsets;
        let base = offsets[segment.start];
        (segment.start..segment.end)
            .filter_map(|block| {
                let from = (offsets[block] - base).max(range.start);
                let to = (offsets[block + 1] - base).min(range.end);
                (from < to).then(|| {
                    let in_block = from + base - offsets[block]..to + base - offsets[block];
                    (block, in_block, from - range.start..to - range.start)
                })
            })
            .collect()
    }

    /// Reads `range` of segment `segment` from `checkpoint`, block by block, parameter by
    /// parameter: the values and the state tensors `state`, each of the range's length.
    fn read_segment(
        &self,
        checkpoint: &CheckpointReader,
        segment: &SegmentPlan,
        range: &Range<usize>,
        state: &[&str],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), String> {
        let mut values = vec![0.0f32; range.len()];
        let mut tensors = vec![vec![0.0f32; range.len()]; state.len()];
        for (block, in_block, in_range) in self.blocks_of(segment, range) {
            let (v, st) = self.read_range(checkpoint, block, &in_block, state)?;
            values[in_range.clone()].copy_from_slice(&v);
            for (into, from) in tensors.iter_mut().zip(st) {
                into[in_range.clone()].copy_from_slice(&from);
            }
        }
        Ok((values, tensors))
    }

    /// This actor's pieces of the model and optimizer state.
    pub(super) fn checkpoint_state(&self) -> Result<Option<ShardState>, String> {
        let names = self.state.optimizer.spec().state_names();
        let mut pieces = Vec::new();
        for segment in self.state.sharding.segments.values() {
            if segment.saved.is_empty() {
                continue;
            }
            let (params, state) = (self.state.store).region(
                &self.state.held,
                &self.state.optimizer,
                segment,
                &segment.saved,
                names,
            )?;
            for (block, in_block, at) in self.blocks_of(segment, &segment.saved) {
                let state: Vec<(&str, &[f32])> = (names.iter().zip(&state))
                    .map(|(name, v)| (*name, &v[at.clone()]))
                    .collect();
                pieces.extend(self.pieces_of(block, &in_block, &params[at], &state));
            }
        }
        // Frozen values are whole on every replica: the first one writes them.
        if self.state.sharding.rank == 0 {
            pieces.extend(self.frozen_pieces());
        }
        if pieces.is_empty() {
            return Ok(None);
        }
        Ok(Some(ShardState {
            steps: self.state.store.steps(&self.state.optimizer),
            schedule_step: self.state.optimizer.schedule_step(),
            loss_scale: self.state.update.scaler,
            pieces,
        }))
    }

    /// The frozen parameters of the held blocks, whole, as pieces without optimizer state (they
    /// have none): a checkpoint holds the whole model, and a block-wise reader (`export`) finds
    /// every element at its place among all the block's parameters.
    fn frozen_pieces(&self) -> Vec<Piece> {
        let held = (0..self.stage.blocks.len()).filter(|&i| self.stage.held_blocks[i]);
        held.flat_map(|block| {
            let frozen_descs = self.stage.desc.blocks[block]
                .param_descs
                .iter()
                .filter(|p| !p.trainable);
            let runs = self.stage.layouts[block].frozen_in_full();
            frozen_descs.zip(runs).filter_map(move |(p, (values, full))| {
                let values = &self.stage.frozen[block][values];
                self.piece(block, p, full.start, 0..p.len(), values, &[])
            })
        })
        .collect()
    }

    /// Loads the held parameters, this actor's optimizer state (into its store), the
    /// optimizer's step count and the schedule's position from `checkpoint`, whatever layout
    /// wrote it.
    pub fn restore(&mut self, checkpoint: &CheckpointReader) -> Result<(), String> {
        // Host buffers to restore into (the device state is rebuilt from them below).
        self.state.optimizer.ensure_state();
        let names = self.state.optimizer.spec().state_names();
        let segments: Vec<SegmentPlan> = self.state.sharding.segments.values().cloned().collect();
        for segment in &segments {
            let (values, _) = self.read_segment(checkpoint, segment, &segment.held, &[])?;
            let at = segment.in_held(&segment.held);
            if let Some(into) = self.state.store.held_mut(&mut self.state.held, at) {
                into.copy_from_slice(&values);
            }
            if !segment.updated.is_empty() {
                let (params, state) = self.read_segment(checkpoint, segment, &segment.updated, names)?;
                (self.state.store).restore_region(&mut self.state.optimizer, segment, params, state)?;
            }
        }
        self.restore_frozen(checkpoint)?;
        let steps = checkpoint.steps();
        self.state.store.set_steps(&mut self.state.optimizer, steps);
        self.state.optimizer.set_schedule_step(checkpoint.schedule_step());
        self.restore_loss_scale(checkpoint)?;
        self.reload_held()?;
        self.refresh_device_state();
        Ok(())
    }

    /// A dynamic loss scale goes on where the checkpoint left it (scale and clean-step count). A
    /// checkpoint of a job that did not scale dynamically, or a job that does not now (another
    /// precision, `--loss-scale static:S`), leaves the scaler as the program starts it.
    fn restore_loss_scale(&mut self, checkpoint: &CheckpointReader) -> Result<(), String> {
        let dynamic = |s: &crate::precision::LossScaler| s.growth_interval > 0;
        let saved = checkpoint.loss_scale()?.filter(dynamic);
        if let (Some(scaler), Some(saved)) = (self.state.update.scaler.as_mut().filter(|s| dynamic(s)), saved)
        {
            scaler.scale = saved.scale;
            scaler.clean_steps = saved.clean_steps;
        }
        Ok(())
    }

    /// The frozen parameters of the held blocks that `checkpoint` holds (one written by a run
    /// that trained them, say, before this one freezes them) take its values; the others keep
    /// theirs (a run that froze them wrote none: they are the model's initialisation).
    fn restore_frozen(&mut self, checkpoint: &CheckpointReader) -> Result<(), String> {
        let stored = checkpoint.params();
        for index in 0..self.stage.blocks.len() {
            let layout = self.stage.layouts[index].clone();
            if !self.stage.held_blocks[index] || !layout.has_frozen() {
                continue;
            }
            let mut values = self.stage.frozen[index].as_ref().clone();
            let frozen_descs = self.stage.desc.blocks[index]
                .param_descs
                .iter()
                .filter(|p| !p.trainable);
            let mut restored = false;
            for (desc, (at, _)) in frozen_descs.zip(layout.frozen_in_full()) {
                if stored.contains_key(&desc.name) {
                    let (read, _) = self.read_local(checkpoint, index, desc, 0..desc.len(), &[])?;
                    values[at].copy_from_slice(&read);
                    restored = true;
                }
            }
            if restored {
                if let Some(block) = self.stage.blocks[index].take() {
                    self.stage.blocks[index] = Some(block.load_frozen(&values));
                }
                self.stage.frozen[index] = std::sync::Arc::new(values);
            }
        }
        Ok(())
    }
}
