//! Where every block and segment of a training step lives on the `dp × pp × tp` mesh: the chunks of
//! the pipeline partition, the segments (gradient buckets) cut from them, and the islands of
//! the actors. Every pass of the step ([`super::step`]) reads it; none changes it.

use crate::ActorId;
use crate::activation_checkpoints::{ActivationCheckpoints, KeptInput};
use crate::mesh::Mesh;
use crate::model_spec::ModelDesc;
use crate::passes::data_parallel::{Bucket, buckets_in};
use crate::passes::partition::Chunk;
use crate::passes::schedule::PipelineShape;
use crate::tensor_parallel::{BlockTp, replicated_trained};

/// Where every block and segment lives.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// The mesh (`dp`, then `pp` when there is more than one stage, then `tp` when there is more
    /// than one tensor-parallel rank).
    pub mesh: Mesh,
    /// Pipeline shape.
    pub shape: PipelineShape,
    /// Chunks in model order.
    pub chunks: Vec<Chunk>,
    /// Segments (gradient buckets) in model order, numbered globally.
    pub segments: Vec<Bucket>,
    /// The chunk of each segment.
    pub segment_chunk: Vec<usize>,
    /// The island of each actor (empty: one island).
    pub islands: Vec<usize>,
    /// ZeRO++'s hpZ (`--zero-hpz`): the backward gathers ZeRO-3's parameters inside each island
    /// from the secondary copy the forward's gather left there ([`super::zero`]).
    pub hpz: bool,
    /// How each segment's input (its first block's) and output (its last block's) are held
    /// across a tensor-parallel group (replicated for a block without a tensor-parallel form).
    pub segment_tp: Vec<BlockTp>,
    /// Whether each segment has trainable replicated parameters (whose gradients a
    /// tensor-parallel group sums).
    pub segment_replicated: Vec<bool>,
    /// What activation checkpointing keeps of segment inputs, and where (none by default).
    pub checkpoints: ActivationCheckpoints,
    /// Sequence parallelism: for each segment, the segment whose residual stream it reads as its
    /// second input (`TensorId::Residual`); `None` for all without it.
    pub residual_source: Vec<Option<usize>>,
    /// The actors the step graph is built for (every actor when `None`): a plan builds one
    /// representative per stream class ([`crate::stream_class`]).
    pub built: Option<Vec<bool>>,
}

impl Layout {
    /// Cuts every chunk into buckets of about `bucket_bytes`.
    pub fn new(
        model: &ModelDesc,
        mesh: Mesh,
        shape: PipelineShape,
        chunks: Vec<Chunk>,
        bucket_bytes: u64,
    ) -> Layout {
        // Under tensor parallelism every block is its own segment (even one without gradients),
        // so that the all-reduce after a block with a partial output (Megatron's g) falls
        // between segments.
        let per_block = mesh.axis_size("tp") > 1;
        let mut segments = Vec::new();
        let mut segment_chunk = Vec::new();
        for (c, &(start, end)) in chunks.iter().enumerate() {
            let b = if per_block {
                (start..end)
                    .map(|i| Bucket {
                        id: segments.len() + i - start,
                        start: i,
                        end: i + 1,
                        bytes: model.blocks[i].grad_bytes(),
                    })
                    .collect()
            } else {
                buckets_in(model, start..end, bucket_bytes, segments.len())
            };
            segment_chunk.extend(std::iter::repeat_n(c, b.len()));
            segments.extend(b);
        }
        let segment_tp = segments
            .iter()
            .map(|b| {
                let tp = |i: usize| model.blocks[i].tp.unwrap_or_default();
                let (first, last) = (tp(b.start), tp(b.end - 1));
                BlockTp::new(first.input, last.output).with_residual(first.residual_in, last.residual_out)
            })
            .collect();
        // A block reads the residual of the last block before it that passed one on (the plan
        // refused a model where that is not so); segments start at blocks.
        let by_block = crate::sequence_parallel::residual_sources(model).unwrap_or_default();
        let segment_at = |block: usize| {
            segments
                .iter()
                .position(|b: &Bucket| b.start <= block && block < b.end)
        };
        debug_assert!(
            by_block.iter().all(Option::is_none) || per_block,
            "a residual stream needs a segment per block (tensor parallelism)"
        );
        let residual_source = (segments.iter())
            .map(|b| by_block.get(b.start).copied().flatten().and_then(segment_at))
            .collect();
        let segment_replicated = (segments.iter())
            .map(|b| replicated_trained(&model.blocks[b.start..b.end]) > 0)
            .collect();
        Layout {
            mesh,
            shape,
            chunks,
            segments,
            segment_chunk,
            islands: Vec::new(),
            hpz: false,
            segment_tp,
            segment_replicated,
            checkpoints: ActivationCheckpoints::default(),
            residual_source,
            built: None,
        }
    }

    /// The segment reading segment `k`'s residual stream, when `k` passes one on.
    pub fn residual_reader(&self, k: usize) -> Option<usize> {
        self.residual_source.iter().position(|s| *s == Some(k))
    }

    /// How segment `k`'s input is kept for its backward, when the plan names it
    /// ([`crate::TensorId::Checkpoint`]; see [`ActivationCheckpoints::kept_input`]).
    pub fn kept_input(&self, k: usize) -> Option<KeptInput> {
        (self.checkpoints).kept_input(self.tp(), self.segments[k].start, self.segment_tp[k].input)
    }

    /// The pipeline device (coordinate on `pp`) holding chunk `c`.
    pub fn device_of_chunk(&self, c: usize) -> usize {
        c % self.shape.pp
    }

    /// The pipeline device holding segment `k`.
    pub fn device_of_segment(&self, k: usize) -> usize {
        self.device_of_chunk(self.segment_chunk[k])
    }

    /// The actor of replica `r`, pipeline device `s` (tensor-parallel rank 0).
    pub fn actor(&self, r: usize, s: usize) -> usize {
        self.actor_at(r, s, 0)
    }

    /// The actor of replica `r`, pipeline device `s`, tensor-parallel rank `t`.
    pub fn actor_at(&self, r: usize, s: usize, t: usize) -> usize {
        self.mesh.rank_of(&[("dp", r), ("pp", s), ("tp", t)])
    }

    /// Tensor-parallel ranks per replica and stage.
    pub fn tp(&self) -> usize {
        self.mesh.axis_size("tp")
    }

    /// Every actor of pipeline device `s` (each replica's tensor-parallel ranks), in rank order.
    pub fn stage_actors(&self, s: usize) -> Vec<ActorId> {
        let (dp, tp) = (self.mesh.axis_size("dp"), self.tp());
        (0..dp)
            .flat_map(|r| (0..tp).map(move |t| (r, t)))
            .map(|(r, t)| self.actor_at(r, s, t))
            .collect()
    }

    /// The dp groups of pipeline device `s`, one per tensor-parallel rank (the replicas' actors
    /// holding the same slice), in rank order.
    pub fn dp_groups(&self, s: usize) -> Vec<Vec<ActorId>> {
        (0..self.tp())
            .map(|t| self.mesh.group(self.actor_at(0, s, t), "dp"))
            .collect()
    }

    /// `group` cut by island: the members of each island in group order, islands in the order
    /// their first member appears (the whole group, once, without islands).
    pub fn island_subgroups(&self, group: &[ActorId]) -> Vec<Vec<ActorId>> {
        let island = |a: ActorId| self.islands.get(a).copied().unwrap_or(0);
        let mut out: Vec<Vec<ActorId>> = Vec::new();
        for &a in group {
            match out.iter_mut().find(|g| island(g[0]) == island(a)) {
                Some(g) => g.push(a),
                None => out.push(vec![a]),
            }
        }
        out
    }

    /// hpZ: `actor`'s place in the members of its dp group on its island, as (position,
    /// members): its slice of the secondary copy is `shard_range(params, members, position)`.
    pub fn island_place(&self, actor: ActorId, s: usize) -> Option<(usize, usize)> {
        let group = self.dp_groups(s).into_iter().find(|g| g.contains(&actor))?;
        let mine = self
            .island_subgroups(&group)
            .into_iter()
            .find(|g| g.contains(&actor))?;
        Some((mine.iter().position(|&a| a == actor)?, mine.len()))
    }

    /// The tensor-parallel group of replica `r` on pipeline device `s`, in rank order.
    pub fn tp_group(&self, r: usize, s: usize) -> Vec<ActorId> {
        self.mesh.group(self.actor(r, s), "tp")
    }

    /// The chunks on pipeline device `s`, in model order.
    pub fn chunks_on(&self, s: usize) -> Vec<Chunk> {
        (0..self.chunks.len())
            .filter(|&c| self.device_of_chunk(c) == s)
            .map(|c| self.chunks[c])
            .collect()
    }

    /// Segments of chunk `c`, in model order.
    pub fn segments_of(&self, c: usize) -> Vec<&Bucket> {
        self.segments
            .iter()
            .zip(&self.segment_chunk)
            .filter(|(_, sc)| **sc == c)
            .map(|(b, _)| b)
            .collect()
    }

    /// The (replica, pipeline device) coordinates of `actor`.
    pub fn coords_of(&self, actor: ActorId) -> (usize, usize) {
        (self.mesh.coord(actor, "dp"), self.mesh.coord(actor, "pp"))
    }

    /// The dp group of pipeline device `s` at tensor-parallel rank 0 (every replica's actor), in
    /// replica order; [`Layout::dp_groups`] gives every rank's.
    pub fn dp_group(&self, s: usize) -> Vec<ActorId> {
        self.mesh.group(self.actor(0, s), "dp")
    }

    /// The segment whose blocks are exactly `start..end`.
    pub fn segment_of_blocks(&self, start: usize, end: usize) -> Option<usize> {
        self.segments
            .iter()
            .position(|b| b.start == start && b.end == end)
    }
}
