//! The trainer's part of a checkpoint: the pieces of state it owns, and loading any layout's
//! checkpoint into its own blocks and shards (see [`crate::checkpoint`]).
//!
//! Ownership follows ZeRO: under ZeRO ≥ 1 each replica saves its shard of every block (parameters
//! and optimizer state); unsharded replicas hold the same state, so only replica 0 saves it.
//! With offload the owned state is read from (and restored into) the offload actor's regions.
//! Whatever an actor owns of a block is cut at its parameters' boundaries: each piece is one
//! named parameter or a flat range of one, with the optimizer state of those elements under the
//! names of [`archipelago_dataflow::OptimizerSpec::state_names`]; restoring reads each parameter
//! by name, its shape checked against this model's description.

use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use crate::checkpoint::{CheckpointReader, Piece, ShardState, Slice};

/// Where one block's part of a segment's offload region lies.
struct RegionPart {
    block: usize,
    /// Elements of the block's parameters.
    in_block: Range<usize>,
    /// The same elements in the region's parameter third.
    in_region: Range<usize>,
}

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
            .map(|s| {
                let p = &self.stage.param_descs[block][s.param];
                Piece {
                    block,
                    block_offset: s.block_offset,
                    param: p.name.clone(),
                    shape: p.shape.clone(),
                    slice: Slice::flat(s.in_param),
                    values: values[s.in_range.clone()].to_vec(),
                    state: state
                        .iter()
                        .map(|(name, v)| (name.to_string(), v[s.in_range.clone()].to_vec()))
                        .collect(),
                }
            })
            .collect()
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
            let (v, st) = checkpoint.read_param(&p.name, &p.shape, s.in_param, state)?;
            values[s.in_range.clone()].copy_from_slice(&v);
            for (into, from) in tensors.iter_mut().zip(st) {
                into[s.in_range.clone()].copy_from_slice(&from);
            }
        }
        Ok((values, tensors))
    }

    /// The part of block `index` this actor owns in a checkpoint: (range in the block, where its
    /// optimizer state lives); `None` when another actor owns it all.
    fn checkpoint_part(&self, index: usize) -> Option<(Range<usize>, Range<usize>)> {
        if !self.stage.held_blocks[index] {
            return None;
        }
        if self.state.sharding.zero.shards_optimizer() {
            self.state.sharding.owned_part(index, &self.stage.offsets)
        } else if self.state.sharding.rank == 0 {
            let len = self.stage.offsets[index + 1] - self.stage.offsets[index];
            Some((0..len, self.stage.offsets[index]..self.stage.offsets[index + 1]))
        } else {
            None
        }
    }

    /// The segments handed to the offload actor, each with its region's parameter count and the
    /// parts of its blocks in the region (the region covers the segment's optimizer range: the
    /// shard under ZeRO ≥ 1, the whole segment otherwise).
    fn offload_regions(&self) -> Result<Vec<(usize, usize, Vec<RegionPart>)>, String> {
        let mut starts: Vec<usize> = self.state.sharding.segments.keys().copied().collect();
        starts.sort_unstable();
        let mut out = Vec::new();
        for start in starts {
            let end = self.state.sharding.segment(start)?.end;
            let base = self.stage.offsets[start];
            let range = self
                .state
                .sharding
                .optimizer_range(start, self.stage.offsets[end] - base)?;
            let parts = (start..end)
                .filter_map(|block| {
                    let from = (self.stage.offsets[block] - base).max(range.start);
                    let to = (self.stage.offsets[block + 1] - base).min(range.end);
                    (from < to).then(|| RegionPart {
                        block,
                        in_block: from + base - self.stage.offsets[block]
                            ..to + base - self.stage.offsets[block],
                        in_region: from - range.start..to - range.start,
                    })
                })
                .collect();
            out.push((start, range.len(), parts));
        }
        Ok(out)
    }

    /// This actor's pieces of the model and optimizer state.
    pub(super) fn checkpoint_state(&self) -> Result<Option<ShardState>, String> {
        let mut pieces = match &self.state.offload {
            Some(offload) => {
                if !self.state.sharding.zero.shards_optimizer() && self.state.sharding.rank != 0 {
                    return Ok(None);
                }
                let names = self.state.optimizer.spec().state_names();
                let mut pieces = Vec::new();
                for (start, len, parts) in self.offload_regions()? {
                    if len == 0 {
                        continue; // this replica's shard of the segment is empty
                    }
                    let region = offload.read_state(start)?;
                    // `[params | state 1 | state 2]`, as many parts as the rule keeps tensors + 1.
                    let kept = (region.len() / len.max(1)).saturating_sub(1);
                    if kept != names.len() {
                        return Err(format!(
                            "the offload actor keeps {kept} state tensors per parameter, {} keeps {names:?}",
                            self.state.optimizer.spec().name()
                        ));
                    }
                    for p in parts {
                        let part = |k: usize| &region[k * len + p.in_region.start..k * len + p.in_region.end];
                        let state: Vec<(&str, &[f32])> =
                            names.iter().enumerate().map(|(k, n)| (*n, part(k + 1))).collect();
                        pieces.extend(self.pieces_of(p.block, &p.in_block, part(0), &state));
                    }
                }
                pieces
            }
            None => self.resident_pieces(),
        };
        // Frozen values are whole on every replica: the first one writes them.
        if self.state.sharding.rank == 0 {
            pieces.extend(self.frozen_pieces());
        }
        if pieces.is_empty() {
            return Ok(None);
        }
        // The offload actor counts the steps it took; the device optimizer its own.
        let steps = if self.state.offload.is_some() {
            self.state.steps_done
        } else {
            self.state.optimizer.steps()
        };
        Ok(Some(ShardState {
            steps,
            schedule_step: self.state.optimizer.schedule_step(),
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
            frozen_descs.zip(runs).map(move |(p, (values, full))| Piece {
                block,
                block_offset: full.start,
                param: p.name.clone(),
                shape: p.shape.clone(),
                slice: Slice::flat(0..p.len()),
                values: self.stage.frozen[block][values].to_vec(),
                state: Vec::new(),
            })
        })
        .collect()
    }

    /// The owned pieces of state held by this actor itself (no offload).
    fn resident_pieces(&self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        for index in 0..self.stage.blocks.len() {
            let Some((in_block, at)) = self.checkpoint_part(index) else {
                continue;
            };
            let params = if self.state.sharding.zero.shards_parameters() {
                self.state.shard_master[at.clone()].to_vec()
            } else {
                let base = self.stage.offsets[index];
                self.state.master[base + in_block.start..base + in_block.end].to_vec()
            };
            let (m, v) = self.state.optimizer.state(at);
            let state: Vec<(&str, &[f32])> = self
                .state
                .optimizer
                .spec()
                .state_names()
                .iter()
                .copied()
                .zip([m, v])
                .collect();
            pieces.extend(self.pieces_of(index, &in_block, &params, &state));
        }
        pieces
    }

    /// Loads the held blocks' parameters, this actor's optimizer state, the optimizer's step
    /// count and the schedule's position from `checkpoint`, whatever layout wrote it.
    pub fn restore(&mut self, checkpoint: &CheckpointReader) -> Result<(), String> {
        // Host buffers to restore into (the device state is rebuilt from them below).
        self.state.optimizer.ensure_state();
        let names = self.state.optimizer.spec().state_names();
        // Offloaded state is restored below, into the offload actor's regions.
        let resident: &[&str] = if self.state.offload.is_some() { &[] } else { names };
        for index in 0..self.stage.blocks.len() {
            if !self.stage.held_blocks[index] {
                continue;
            }
            let len = self.stage.offsets[index + 1] - self.stage.offsets[index];
            if !self.state.sharding.zero.shards_parameters() {
                let (params, _) = self.read_range(checkpoint, index, &(0..len), &[])?;
                self.state.master[self.stage.offsets[index]..self.stage.offsets[index + 1]]
                    .copy_from_slice(&params);
            }
            let part = if self.state.sharding.zero.shards_optimizer() {
                self.state.sharding.owned_part(index, &self.stage.offsets)
            } else {
                Some((0..len, self.stage.offsets[index]..self.stage.offsets[index + 1]))
            };
            if let Some((in_block, at)) = part {
                let (params, state) = self.read_range(checkpoint, index, &in_block, resident)?;
                if self.state.sharding.zero.shards_parameters() && !self.state.offload_params {
                    self.state.shard_master[at.clone()].copy_from_slice(&params);
                }
                let empty = Vec::new();
                let (m, v) = (state.first().unwrap_or(&empty), state.get(1).unwrap_or(&empty));
                self.state.optimizer.set_state(at.start, m, v);
            }
            if !self.state.sharding.zero.shards_parameters() {
                self.reload(index..index + 1)?;
            }
        }
        if let Some(offload) = &self.state.offload {
            let tensors = 1 + names.len();
            for (start, len, parts) in self.offload_regions()? {
                let mut region = vec![0.0f32; tensors * len];
                for p in parts {
                    let (params, state) = self.read_range(checkpoint, p.block, &p.in_block, names)?;
                    for (k, v) in std::iter::once(params).chain(state).enumerate() {
                        region[k * len + p.in_region.start..k * len + p.in_region.end].copy_from_slice(&v);
                    }
                }
                offload.write_state(start, region)?;
            }
        }
        self.restore_frozen(checkpoint)?;
        self.state.optimizer.set_steps(checkpoint.steps());
        self.state.optimizer.set_schedule_step(checkpoint.schedule_step());
        self.state.steps_done = checkpoint.steps();
        if self.state.device_state.is_some() {
            self.upload_state();
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
                    let (read, _) = checkpoint.read_param(&desc.name, &desc.shape, 0..desc.len(), &[])?;
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
