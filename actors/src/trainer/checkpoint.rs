//! The trainer's part of a checkpoint: the pieces of state it owns, and loading any layout's
//! checkpoint into its own blocks and shards (see [`crate::checkpoint`]).
//!
//! Ownership follows ZeRO: under ZeRO ≥ 1 each replica saves its shard of every block (parameters
//! and optimizer state); unsharded replicas hold the same state, so only replica 0 saves it.

use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use crate::checkpoint::{CheckpointReader, Piece, ShardState};

impl<B: AutodiffBackend> Trainer<B> {
    /// The part of block `index` this actor owns in a checkpoint: (range in the block, where its
    /// optimizer state lives); `None` when another actor owns it all.
    fn checkpoint_part(&self, index: usize) -> Option<(Range<usize>, Range<usize>)> {
        if !self.held_blocks[index] {
            return None;
        }
        if self.sharding.zero >= 1 {
            self.sharding.owned_part(index, &self.offsets)
        } else if self.sharding.rank == 0 {
            let len = self.offsets[index + 1] - self.offsets[index];
            Some((0..len, self.offsets[index]..self.offsets[index + 1]))
        } else {
            None
        }
    }

    fn refuse_offload(&self) -> Result<(), String> {
        if self.offload.is_some() {
            return Err(
                "checkpoints of offloaded state (--offload) are not supported yet; train without \
                 --offload or without --checkpoint-dir"
                    .into(),
            );
        }
        Ok(())
    }

    /// This actor's pieces of the model and optimizer state.
    pub(super) fn checkpoint_state(&self) -> Result<Option<ShardState>, String> {
        self.refuse_offload()?;
        let mut pieces = Vec::new();
        for index in 0..self.blocks.len() {
            let Some((in_block, at)) = self.checkpoint_part(index) else {
                continue;
            };
            let params = if self.sharding.zero >= 3 {
                self.shard_master[at.clone()].to_vec()
            } else {
                let base = self.offsets[index];
                self.master[base + in_block.start..base + in_block.end].to_vec()
            };
            let (m, v) = self.optimizer.state(at);
            pieces.push(Piece {
                block: index,
                range: in_block,
                params,
                m: m.to_vec(),
                v: v.to_vec(),
            });
        }
        if pieces.is_empty() {
            return Ok(None);
        }
        Ok(Some(ShardState {
            steps: self.optimizer.steps(),
            pieces,
        }))
    }

    /// Loads the held blocks' parameters and this actor's optimizer state from `checkpoint`,
    /// whatever layout wrote it.
    pub fn restore(&mut self, checkpoint: &CheckpointReader) -> Result<(), String> {
        self.refuse_offload()?;
        let state = self.optimizer.has_state();
        for index in 0..self.blocks.len() {
            if !self.held_blocks[index] {
                continue;
            }
            let len = self.offsets[index + 1] - self.offsets[index];
            if self.sharding.zero < 3 {
                let [params, ..] = checkpoint.read(index, 0..len, false)?;
                self.master[self.offsets[index]..self.offsets[index + 1]].copy_from_slice(&params);
            }
            let part = if self.sharding.zero >= 1 {
                self.sharding.owned_part(index, &self.offsets)
            } else {
                Some((0..len, self.offsets[index]..self.offsets[index + 1]))
            };
            if let Some((in_block, at)) = part {
                let [params, m, v] = checkpoint.read(index, in_block, state)?;
                if self.sharding.zero >= 3 {
                    self.shard_master[at.clone()].copy_from_slice(&params);
                }
                self.optimizer.set_state(at.start, &m, &v);
            }
            if self.sharding.zero < 3 {
                self.reload(index..index + 1)?;
            }
        }
        self.optimizer.set_steps(checkpoint.steps());
        self.steps_done = checkpoint.steps();
        Ok(())
    }
}
