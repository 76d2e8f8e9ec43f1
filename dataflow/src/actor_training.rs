//! What one actor's plan says about its training state, decided once by the compiler: its
//! segments (gradient buckets) with the shard of each it owns, its data-parallel group, the ZeRO
//! stage in force (an enum: a one-member group shards nothing), the offload tier, activation
//! checkpointing (implied by ZeRO-3) and where the state lives. The trainer is built from this
//! and re-derives none of it (ZeRO: Rajbhandari et al., SC 2020).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::instruction::UpdateScope;
use crate::passes::data_parallel::Bucket;
use crate::state_layout::{SliceState, state_layout};
use crate::tensor_parallel::TpPlace;
use crate::{ModelDesc, Offload, Program, StatePlacement};

/// The ZeRO stage in force on an actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ZeroStage {
    /// Every replica holds everything (stage 0, or any stage with one replica).
    Replicated,
    /// Stage 1: the optimizer state is sharded over the dp group.
    ShardedOptimizer,
    /// Stage 2: also the gradients (a reduce-scatter, not an all-reduce).
    ShardedGradients,
    /// Stage 3: also the parameters, gathered per segment when needed.
    ShardedParameters,
}

impl ZeroStage {
    /// The stage in force for `--zero requested` over a dp group of `replicas`.
    ///
    /// # Panics
    /// When `requested` is above 3 (the plan refuses it first).
    pub fn in_force(requested: u8, replicas: usize) -> ZeroStage {
        if replicas < 2 {
            return ZeroStage::Replicated;
        }
        match requested {
            0 => ZeroStage::Replicated,
            1 => ZeroStage::ShardedOptimizer,
            2 => ZeroStage::ShardedGradients,
            3 => ZeroStage::ShardedParameters,
            n => panic!("ZeRO stage {n} does not exist (0..=3)"),
        }
    }

    /// The stage's number (0..=3).
    pub fn level(self) -> u8 {
        self as u8
    }

    /// Each replica updates only its shard of the optimizer state (stages 1–3).
    pub fn shards_optimizer(self) -> bool {
        self >= ZeroStage::ShardedOptimizer
    }

    /// Each replica keeps only its shard of the gradients (stages 2–3): a reduced bucket reaches
    /// the update as this replica's shard (the reduce-scatter), not whole — decided here, never
    /// guessed from a length.
    pub fn shards_gradients(self) -> bool {
        self >= ZeroStage::ShardedGradients
    }

    /// Each replica keeps only its shard of the parameters (stage 3).
    pub fn shards_parameters(self) -> bool {
        self >= ZeroStage::ShardedParameters
    }
}

impl ActorTraining {
    /// The optimizer step this actor's plan calls for: the offload actor's update, ZeRO-3's kept
    /// shard, ZeRO-1/2's shard then gather, or the whole bucket (what the compiled stream's
    /// `OptimizerStep` says; the trainer refuses a stream that says otherwise).
    pub fn update_scope(&self) -> UpdateScope {
        if self.offload.is_some() {
            UpdateScope::CollectOffloaded
        } else {
            self.after_update()
        }
    }

    /// What follows the update of a segment, wherever it ran (here or on the offload actor): the
    /// modules take the whole updated segment (`Whole`), the updated shard goes to the
    /// all-gather (`ShardThenGather`, ZeRO-1/2), or it stays until the next gather
    /// (`ShardKept`, ZeRO-3).
    pub fn after_update(&self) -> UpdateScope {
        if self.zero.shards_parameters() {
            UpdateScope::ShardKept
        } else if self.zero.shards_optimizer() {
            UpdateScope::ShardThenGather
        } else {
            UpdateScope::Whole
        }
    }
}

/// Shard `s` of `n` of `len` elements: contiguous, sizes differing by at most one. Collectives
/// (reduce-scatter, all-gather) and ZeRO's shards use this one function.
pub fn shard_range(len: usize, n: usize, s: usize) -> Range<usize> {
    s * len / n..(s + 1) * len / n
}

/// One segment of an actor: a gradient bucket and the blocks it covers, with the shard of it
/// this replica owns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentPlan {
    /// First block.
    pub start: usize,
    /// One past the last block.
    pub end: usize,
    /// Parameters (f32 elements) of its blocks.
    pub params: usize,
    /// This replica's shard of the segment, relative to its first parameter: what its
    /// optimizer updates under ZeRO ≥ 1, and the part it answers for in norms summed over the
    /// group (clipping, LAMB, the model's parameter norms) at every stage.
    pub own: Range<usize>,
    /// The part whose parameters it keeps between steps: the whole segment, or its shard
    /// under ZeRO-3 (gathered whole only around the segment's forward and backward).
    pub held: Range<usize>,
    /// The part its optimizer updates and keeps state for: the whole segment, or its shard under
    /// ZeRO ≥ 1.
    pub updated: Range<usize>,
    /// The part of the reduced gradient bucket that reaches it: the whole bucket (all-reduce),
    /// or its shard under ZeRO ≥ 2 (reduce-scatter). A bucket of another length is an error.
    pub grads: Range<usize>,
    /// The part it writes in checkpoints (parameters with their optimizer state): its updated
    /// shard under ZeRO ≥ 1; under ZeRO-0 the whole segment at the group's first replica and
    /// nothing at the others (which hold the same).
    pub saved: Range<usize>,
    /// The part whose parameters it answers for in the model's norms (the report's): its held
    /// shard where the parameters are sharded (ZeRO-3) or gathered in 16 bits (ZeRO-1/2 under
    /// mixed precision: the rest it holds are rounded copies); the whole segment at the group's
    /// first replica and nothing at the others where every replica holds them — one replica's
    /// parameters, as the checkpoint of ZeRO-0 holds one replica's.
    pub reported: Range<usize>,
    /// Where `held` starts among the actor's held parameters (its segments' held parts,
    /// concatenated in order).
    pub held_at: usize,
    /// Where `updated` starts in its optimizer state (its segments' updated parts, concatenated
    /// in order).
    pub state_at: usize,
}

impl SegmentPlan {
    /// Where elements `range` of the segment (within its held part) lie among the actor's held
    /// parameters.
    pub fn in_held(&self, range: &Range<usize>) -> Range<usize> {
        let at = self.held_at + range.start - self.held.start;
        at..at + range.len()
    }

    /// The segment's parts under ZeRO stage `zero`, for replica `replica` whose shard is `own`
    /// (of `params` elements), its held part starting at `held_at` and its state at `state_at`.
    ///
    /// With `rounded_gathers` (16-bit parameter gathers, mixed precision) a replica reports its
    /// own shard under ZeRO-1/2 too: the rest of what it holds are rounded copies.
    fn parts(
        (zero, rounded_gathers): (ZeroStage, bool),
        replica: usize,
        (start, end, params): (usize, usize, usize),
        own: Range<usize>,
        (held_at, state_at): (usize, usize),
    ) -> SegmentPlan {
        let whole = 0..params;
        let pick = |sharded: bool| if sharded { own.clone() } else { whole.clone() };
        let first_or = |sharded: bool| match (sharded, replica) {
            (true, _) => own.clone(),
            (false, 0) => whole.clone(),
            (false, _) => 0..0,
        };
        SegmentPlan {
            start,
            end,
            params,
            held: pick(zero.shards_parameters()),
            updated: pick(zero.shards_optimizer()),
            grads: pick(zero.shards_gradients()),
            saved: first_or(zero.shards_optimizer()),
            reported: first_or(zero.shards_parameters() || (rounded_gathers && zero.shards_optimizer())),
            own,
            held_at,
            state_at,
        }
    }
}

/// The training side of one actor's plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActorTraining {
    /// Its segments (gradient buckets), in model order.
    pub segments: Vec<SegmentPlan>,
    /// Its position in its data-parallel group.
    pub replica: usize,
    /// Members of that group.
    pub replicas: usize,
    /// The ZeRO stage in force.
    pub zero: ZeroStage,
    /// Where the master shard and optimizer state are offloaded to, if anywhere.
    pub offload: Offload,
    /// ZeRO-3 with offload: the parameter shards live in the offload tier too.
    pub offload_params: bool,
    /// Keep only segment inputs in forward, recompute in backward (implied by ZeRO-3).
    pub checkpoint_activations: bool,
    /// Where the state lives when not offloaded.
    pub state: StatePlacement,
    /// Its typed state layout: each parameter slice it holds, with the elements it keeps and
    /// updates, dtypes, trainable or frozen, bucket and tiers (see [`crate::state_layout`]).
    pub slices: Vec<SliceState>,
    /// Its place in its tensor-parallel group (rank 0 of 1 without tensor parallelism); its
    /// segments and slices are of its slice of the model ([`crate::tensor_parallel::local_model`]).
    #[serde(default)]
    pub tp: TpPlace,
    /// What activation checkpointing keeps of segment inputs, and where (partitioned over the
    /// tp group, offloaded to host memory).
    #[serde(default)]
    pub checkpoints: crate::ActivationCheckpoints,
    /// ZeRO++ hpZ: its place among its dp group's members on its island, as (position,
    /// members): it keeps `shard_range(params, members, position)` of each segment the forward
    /// gathers as its secondary copy, and brings that slice to the backward's gather inside the
    /// island. `None` without hpZ.
    #[serde(default)]
    pub secondary: Option<(usize, usize)>,
}

impl ActorTraining {
    /// The training plan of the actor at `replica` holding `buckets` of `program`'s model (the
    /// program as compiled: ZeRO-3's implied activation checkpointing already set).
    pub fn of(program: &Program, buckets: &[&Bucket], replica: usize) -> ActorTraining {
        let plan = &program.plan;
        let replicas = plan.dp;
        let zero = plan.zero_stage();
        let rounded_gathers = (zero, program.precision.compute != crate::DType::F32);
        let (mut held_at, mut state_at) = (0, 0);
        let mut segments = Vec::with_capacity(buckets.len());
        for b in buckets {
            let params = block_params(&program.model, b.start..b.end);
            let own = shard_range(params, replicas, replica);
            let segment = SegmentPlan::parts(
                rounded_gathers,
                replica,
                (b.start, b.end, params),
                own,
                (held_at, state_at),
            );
            held_at += segment.held.len();
            state_at += segment.updated.len();
            segments.push(segment);
        }
        let mut training = ActorTraining {
            segments,
            replica,
            replicas,
            zero,
            offload: plan.offload.clone(),
            offload_params: plan.offload_params && zero.shards_parameters(),
            checkpoint_activations: plan.checkpoint_activations,
            state: plan.state,
            slices: Vec::new(),
            tp: TpPlace::new(0, plan.tp),
            checkpoints: crate::ActivationCheckpoints::of(plan),
            secondary: None,
        };
        training.slices = state_layout(&program.model, &training, program.precision.compute);
        training
    }
}

/// Elements of the trained vectors of `blocks` (frozen parameters have no place in a segment).
fn block_params(model: &ModelDesc, blocks: Range<usize>) -> usize {
    model.blocks[blocks]
        .iter()
        .map(|b| b.trained_params() as usize)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelSpec, ParallelPlan, compile};

    #[test]
    fn a_one_member_group_shards_nothing_and_the_stages_nest() {
        assert_eq!(ZeroStage::in_force(3, 1), ZeroStage::Replicated);
        assert_eq!(ZeroStage::in_force(2, 4).level(), 2);
        let three = ZeroStage::in_force(3, 2);
        assert!(three.shards_optimizer() && three.shards_gradients() && three.shards_parameters());
        let one = ZeroStage::in_force(1, 2);
        assert!(one.shards_optimizer() && !one.shards_gradients());
        assert!(!ZeroStage::Replicated.shards_optimizer());
    }

    #[test]
    fn shards_cover_each_segment_once_and_the_plan_carries_them() {
        let model = ModelSpec::parse("mlp:in=24,hidden=48,layers=6,out=5").unwrap();
        for (dp, zero) in [(1, 3), (2, 0), (3, 1), (2, 3)] {
            let program = Program::new(model.clone()).with_plan(ParallelPlan {
                dp,
                batch: 12,
                zero,
                bucket_bytes: 4096,
                ..ParallelPlan::default()
            });
            let plan = compile(&program).unwrap();
            let first = &plan.actors[0].training;
            assert!(first.segments.len() > 1, "small buckets make several segments");
            assert_eq!(first.zero, ZeroStage::in_force(zero, dp));
            assert_eq!(first.checkpoint_activations, dp > 1 && zero == 3);
            for (k, segment) in first.segments.iter().enumerate() {
                let mut owned = vec![0; segment.params];
                let (mut saved, mut reported) = (owned.clone(), owned.clone());
                for actor in &plan.actors {
                    let s = &actor.training.segments[k];
                    owned[s.own.clone()].iter_mut().for_each(|n| *n += 1);
                    saved[s.saved.clone()].iter_mut().for_each(|n| *n += 1);
                    reported[s.reported.clone()].iter_mut().for_each(|n| *n += 1);
                    // What is updated is held; what arrives covers what is updated.
                    let within = |a: &Range<usize>, b: &Range<usize>| b.start <= a.start && a.end <= b.end;
                    assert!(within(&s.updated, &s.held) && within(&s.updated, &s.grads));
                    assert!(s.saved.is_empty() || s.saved == s.updated);
                }
                assert!(owned.iter().all(|&n| n == 1), "dp={dp} zero={zero} segment {k}");
                assert!(
                    saved.iter().all(|&n| n == 1),
                    "dp={dp} zero={zero} segment {k} saved"
                );
            }
            // Held parts and state parts are concatenated in segment order.
            for actor in &plan.actors {
                let (mut held, mut state) = (0, 0);
                for s in &actor.training.segments {
                    assert_eq!((s.held_at, s.state_at), (held, state));
                    held += s.held.len();
                    state += s.updated.len();
                }
            }
        }
    }
}
