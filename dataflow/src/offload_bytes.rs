//! The bytes each actor moves to and from its offload tier per step (ZeRO-Offload, Ren et al.,
//! USENIX ATC 2021), predicted from its plan: the line beside its fabric bytes that is not a
//! read from a peer.
//!
//! Per segment it owns an update for, an actor hands the offload actor its gradients (its
//! shard under ZeRO ≥ 1, the whole bucket without) and takes the updated parameters back; with
//! ZeRO-3's `--offload-params` the parameters stay in the tier, nothing comes back after the
//! update, and every gather of a segment (each `ShardParams` of its stream) reads this replica's
//! shard from the tier first. Elements are f32.

use serde::{Deserialize, Serialize};

use crate::instruction::{ComputeOp, Instruction};
use crate::plan::Plan;

/// Bytes one actor moved between itself and its offload tier in a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadTraffic {
    /// Gradients handed to the tier.
    pub to_tier: u64,
    /// Parameters taken back from it (updated shards, and `--offload-params` gathers' shards).
    pub from_tier: u64,
}

impl OffloadTraffic {
    /// Both directions together.
    pub fn total(&self) -> u64 {
        self.to_tier + self.from_tier
    }
}

impl std::fmt::Display for OffloadTraffic {
    /// `to the tier 51.6 KiB, back 103.2 KiB`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let human = crate::fabric_bytes::human;
        write!(
            f,
            "to the tier {}, back {}",
            human(self.to_tier),
            human(self.from_tier)
        )
    }
}

/// Each actor's offload traffic per step (zero for an actor without offload), indexed by actor.
pub fn predict(plan: &Plan) -> Vec<OffloadTraffic> {
    plan.actors
        .iter()
        .map(|actor| {
            let training = &actor.training;
            let mut traffic = OffloadTraffic::default();
            if matches!(training.offload, crate::Offload::None) {
                return traffic;
            }
            for segment in &training.segments {
                let updated = if training.zero.shards_optimizer() {
                    segment.own.len()
                } else {
                    segment.params
                } as u64;
                traffic.to_tier += 4 * updated;
                if !training.offload_params {
                    traffic.from_tier += 4 * updated;
                }
            }
            if training.offload_params {
                for instruction in plan.class_stream(actor.actor) {
                    if let Instruction::Compute {
                        op: ComputeOp::ShardParams { start, .. },
                        ..
                    } = instruction
                    {
                        let own = (training.segments.iter())
                            .find(|s| s.start == *start)
                            .map_or(0, |s| s.own.len());
                        traffic.from_tier += 4 * own as u64;
                    }
                }
            }
            traffic
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelSpec, Offload, ParallelPlan, Program, compile};

    fn plan(dp: usize, zero: u8, offload: Offload, offload_params: bool) -> Plan {
        let model = ModelSpec::parse("mlp:in=24,hidden=48,layers=6,out=5").unwrap();
        compile(&Program::new(model).with_plan(ParallelPlan {
            dp,
            zero,
            batch: 12,
            bucket_bytes: 4096,
            offload,
            offload_params,
            ..ParallelPlan::default()
        }))
        .unwrap()
    }

    /// Without offload nothing moves; with it, whole buckets without ZeRO, the shard with it
    /// (both ways), and under `--offload-params` the gathers' shards come back instead of the
    /// updated ones.
    #[test]
    fn offload_traffic_follows_the_shards_and_the_gathers() {
        assert!(
            predict(&plan(2, 1, Offload::None, false))
                .iter()
                .all(|t| t.total() == 0)
        );
        let params = 4 * 13_205;
        let whole = predict(&plan(1, 0, Offload::Cpu, false));
        assert_eq!((whole[0].to_tier, whole[0].from_tier), (params, params));
        let sharded = predict(&plan(2, 1, Offload::Cpu, false));
        let both: u64 = sharded.iter().map(|t| t.to_tier).sum();
        assert_eq!(both, params, "the two shards make the model");
        assert!(sharded.iter().all(|t| t.to_tier == t.from_tier));
        let kept = plan(2, 3, Offload::Cpu, true);
        let traffic = predict(&kept);
        let gathers = (kept.stream(0).instructions.iter())
            .filter(|i| {
                matches!(
                    i,
                    Instruction::Compute {
                        op: ComputeOp::ShardParams { .. },
                        ..
                    }
                )
            })
            .count();
        assert!(
            gathers >= 2 * kept.actors[0].training.segments.len(),
            "forward and backward gathers"
        );
        assert!(
            traffic[0].from_tier > traffic[0].to_tier,
            "every gather reads the shard back"
        );
    }
}
