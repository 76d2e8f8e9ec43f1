//! The trainer's part of a checkpoint: the pieces of state it owns, and loading any layout's
//! checkpoint into its own blocks and shards (see [`crate::checkpoint`]).
//!
//! Ownership follows ZeRO: under ZeRO ≥ 1 each replica saves its shard of every block (parameters
//! and optimizer state); unsharded replicas hold the same state, so only replica 0 saves it.
//! With offload the owned state is read from (and restored into) the offload actor's regions.

use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;

use super::Trainer;
use crate::checkpoint::{CheckpointReader, Piece, ShardState};

/// Where one block's part of a segment's offload region lies.
struct RegionPart {
    block: usize,
    /// Elements of the block's parameters.
    in_block: Range<usize>,
    /// The same elements in the region's parameter third.
    in_region: Range<usize>,
}

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

    /// The segments handed to the offload actor, each with its region's parameter count and the
    /// parts of its blocks in the region (the region covers the segment's optimizer range: the
    /// shard under ZeRO ≥ 1, the whole segment otherwise).
    fn offload_regions(&self) -> Result<Vec<(usize, usize, Vec<RegionPart>)>, String> {
        let mut starts: Vec<usize> = self.sharding.segments.keys().copied().collect();
        starts.sort_unstable();
        let mut out = Vec::new();
        for start in starts {
            let end = self.sharding.segment(start)?.end;
            let base = self.offsets[start];
            let range = self.sharding.optimizer_range(start, self.offsets[end] - base)?;
            let parts = (start..end)
                .filter_map(|block| {
                    let from = (self.offsets[block] - base).max(range.start);
                    let to = (self.offsets[block + 1] - base).min(range.end);
                    (from < to).then(|| RegionPart {
                        block,
                        in_block: from + base - self.offsets[block]..to + base - self.offsets[block],
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
        let pieces = match &self.offload {
            Some(offload) => {
                if self.sharding.zero == 0 && self.sharding.rank != 0 {
                    return Ok(None);
                }
                let mut pieces = Vec::new();
                for (start, len, parts) in self.offload_regions()? {
                    let region = offload.read_state(start)?;
                    // `[params | m | v]`, as many parts as the rule keeps state values + 1.
                    let values = (region.len() / len.max(1)).saturating_sub(1);
                    for p in parts {
                        let part = |k: usize| {
                            if k > values {
                                return Vec::new();
                            }
                            region[k * len + p.in_region.start..k * len + p.in_region.end].to_vec()
                        };
                        pieces.push(Piece {
                            block: p.block,
                            range: p.in_block,
                            params: part(0),
                            m: part(1),
                            v: part(2),
                        });
                    }
                }
                pieces
            }
            None => self.resident_pieces(),
        };
        if pieces.is_empty() {
            return Ok(None);
        }
        // The offload actor counts the steps it took; the device optimizer its own.
        let steps = if self.offload.is_some() {
            self.steps_done
        } else {
            self.optimizer.steps()
        };
        Ok(Some(ShardState { steps, pieces }))
    }

    /// The owned pieces of state held by this actor itself (no offload).
    fn resident_pieces(&self) -> Vec<Piece> {
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
        pieces
    }

    /// Loads the held blocks' parameters and this actor's optimizer state from `checkpoint`,
    /// whatever layout wrote it.
    pub fn restore(&mut self, checkpoint: &CheckpointReader) -> Result<(), String> {
        // State values per parameter of the rule (offloaded state is restored below).
        let floats = self.optimizer.spec().state_floats_per_param() as usize;
        let values = if self.offload.is_some() { 0 } else { floats };
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
                let [params, m, v] = checkpoint.read_values(index, in_block, values)?;
                if self.sharding.zero >= 3 && !self.offload_params {
                    self.shard_master[at.clone()].copy_from_slice(&params);
                }
                self.optimizer.set_state(at.start, &m, &v);
            }
            if self.sharding.zero < 3 {
                self.reload(index..index + 1)?;
            }
        }
        if let Some(offload) = &self.offload {
            let thirds = 1 + floats;
            for (start, len, parts) in self.offload_regions()? {
                let mut region = vec![0.0f32; thirds * len];
                for p in parts {
                    let values = checkpoint.read_values(p.block, p.in_block, floats)?;
                    for (k, v) in values.iter().take(thirds).enumerate() {
                        region[k * len + p.in_region.start..k * len + p.in_region.end].copy_from_slice(v);
                    }
                }
                offload.write_state(start, region)?;
            }
        }
        self.optimizer.set_steps(checkpoint.steps());
        self.steps_done = checkpoint.steps();
        Ok(())
    }
}
