//! An actor's typed state layout, decided by the compiler: for each parameter slice it holds,
//! the elements it keeps and updates (its split or ZeRO shard), storage and compute dtype,
//! trainable or frozen, its gradient bucket and the tier its values and optimizer state live
//! in. The parameter is the contract between plan and trainer: the trainer builds its held
//! vector, frozen values and optimizer state from this and checks it at start (ZeRO:
//! Rajbhandari et al., SC 2020; ZeRO-Offload/Infinity for the tiers).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::actor_training::{ActorTraining, SegmentPlan};
use crate::dtype::DType;
use crate::model_spec::ModelDesc;
use crate::program::{Offload, StatePlacement};

/// Where a slice's values or optimizer state live between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    /// On the actor's device (`--state device`).
    Device,
    /// In the actor's host memory.
    Host,
    /// With the actor's offload actor, in host memory (`--offload cpu`).
    OffloadCpu,
    /// With the actor's offload actor, in files (`--offload nvme:DIR`).
    OffloadNvme,
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::OffloadCpu => "offload cpu",
            Tier::OffloadNvme => "offload nvme",
        })
    }
}

/// One parameter's slice of an actor's training state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceState {
    /// The block holding the parameter.
    pub block: usize,
    /// The parameter's name (unique in the model).
    pub param: String,
    /// The elements of the (flattened) parameter this actor keeps between steps: all of them,
    /// or its ZeRO-3 shard of them; frozen parameters are kept whole.
    pub held: Range<usize>,
    /// The elements it updates and keeps optimizer state for (empty when frozen).
    pub updated: Range<usize>,
    /// The dtype the values are stored in (the master copy).
    pub storage: DType,
    /// The dtype forward and backward compute in.
    pub compute: DType,
    /// Whether it trains.
    pub trainable: bool,
    /// The index of its gradient bucket among the actor's segments (`None` when frozen: no
    /// gradient, no optimizer state, no place in any bucket).
    pub bucket: Option<usize>,
    /// Where its values live between steps.
    pub values_tier: Tier,
    /// Where its optimizer state lives (`None` when frozen).
    pub state_tier: Option<Tier>,
}

/// `a ∩ b` (empty when they do not meet).
fn meet(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let (start, end) = (a.start.max(b.start), a.end.min(b.end));
    if start < end { start..end } else { 0..0 }
}

/// The tiers of an actor's values and optimizer state under its plan.
fn tiers(training: &ActorTraining) -> (Tier, Tier) {
    let offload = match training.offload {
        Offload::None => None,
        Offload::Cpu => Some(Tier::OffloadCpu),
        Offload::Nvme { .. } => Some(Tier::OffloadNvme),
    };
    // `Auto` is decided when the plan is compiled; an actor's plan never holds it.
    let resident = match training.state {
        StatePlacement::Device => Tier::Device,
        StatePlacement::Host | StatePlacement::Auto => Tier::Host,
    };
    match offload {
        Some(tier) if training.offload_params => (tier, tier),
        Some(tier) => (resident, tier),
        None => (resident, resident),
    }
}

/// The layout of an actor training `segments` (`training`'s) of `model`: one slice per
/// parameter of each block it holds, in model order. A block described only by its count is
/// one parameter named after the block. Every slice computes in `compute` (the program's
/// precision) whatever its storage.
pub fn state_layout(model: &ModelDesc, training: &ActorTraining, compute: DType) -> Vec<SliceState> {
    let (values_tier, state_tier) = tiers(training);
    let mut slices = Vec::new();
    for (bucket, segment) in training.segments.iter().enumerate() {
        let mut at = 0; // the parameter's first element in the segment's trained vector
        for block in segment.start..segment.end {
            for (param, shape, dtype, trainable) in params_of(model, block) {
                let len: usize = shape.iter().product();
                let slice = if trainable {
                    let span = at..at + len;
                    at += len;
                    trained_slice(segment, span, bucket, (dtype, state_tier))
                } else {
                    SliceState {
                        held: 0..len,
                        updated: 0..0,
                        trainable: false,
                        bucket: None,
                        state_tier: None,
                        ..SliceState::default_for(dtype)
                    }
                };
                slices.push(SliceState {
                    block,
                    param,
                    values_tier,
                    compute,
                    ..slice
                });
            }
        }
    }
    slices
}

impl SliceState {
    fn default_for(dtype: DType) -> SliceState {
        SliceState {
            block: 0,
            param: String::new(),
            held: 0..0,
            updated: 0..0,
            storage: dtype,
            // `state_layout` sets the program's compute dtype (mixed precision: a 16-bit compute
            // copy of an f32 master).
            compute: dtype,
            trainable: true,
            bucket: None,
            values_tier: Tier::Host,
            state_tier: None,
        }
    }
}

/// The trainable parameter at `span` of `segment`'s trained vector: the parts of it the actor
/// holds and updates, relative to the parameter.
fn trained_slice(
    segment: &SegmentPlan,
    span: Range<usize>,
    bucket: usize,
    (dtype, tier): (DType, Tier),
) -> SliceState {
    let relative = |part: &Range<usize>| {
        let m = meet(&span, part);
        if m.is_empty() {
            0..0
        } else {
            m.start - span.start..m.end - span.start
        }
    };
    SliceState {
        held: relative(&segment.held),
        updated: relative(&segment.updated),
        bucket: Some(bucket),
        state_tier: Some(tier),
        ..SliceState::default_for(dtype)
    }
}

/// Block `block`'s parameters: (name, shape, dtype, trainable), in flattening order.
fn params_of(model: &ModelDesc, block: usize) -> Vec<(String, Vec<usize>, DType, bool)> {
    let info = &model.blocks[block];
    if info.param_descs.is_empty() {
        return vec![(info.name.clone(), vec![info.params as usize], DType::F32, true)];
    }
    (info.param_descs.iter())
        .map(|p| (p.name.clone(), p.shape.clone(), p.dtype, p.trainable))
        .collect()
}

/// One line on an actor's layout: its slices, trained and frozen elements held, and tiers.
pub fn layout_line(slices: &[SliceState]) -> String {
    let held = |trainable: bool| -> usize {
        (slices.iter())
            .filter(|s| s.trainable == trainable)
            .map(|s| s.held.len())
            .sum()
    };
    let updated: usize = slices.iter().map(|s| s.updated.len()).sum();
    let frozen = slices.iter().filter(|s| !s.trainable).count();
    let values = slices
        .first()
        .map_or("-".to_string(), |s| s.values_tier.to_string());
    let state = (slices.iter().find_map(|s| s.state_tier)).map_or("-".to_string(), |t| t.to_string());
    format!(
        "{} parameter slices ({frozen} frozen): holds {} trained + {} frozen elements, updates {updated}; values {values}, optimizer state {state}",
        slices.len(),
        held(true),
        held(false),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelSpec, ParallelPlan, Program, compile};

    const FROZEN: &str = "layers.1.weight";

    fn layouts(plan: ParallelPlan) -> Vec<Vec<SliceState>> {
        let mut program = Program::new(ModelSpec::parse("mlp:in=24,hidden=48,layers=6,out=5").unwrap())
            .with_plan(ParallelPlan {
                batch: 12,
                bucket_bytes: 4096,
                ..plan
            });
        for p in program
            .model
            .blocks
            .iter_mut()
            .flat_map(|b| b.param_descs.iter_mut())
        {
            p.trainable = p.name != FROZEN;
        }
        let plan = compile(&program).unwrap();
        plan.actors.iter().map(|a| a.training.slices.clone()).collect()
    }

    /// Over a dp group every trainable element is updated by one replica under ZeRO ≥ 1 (by every
    /// replica alike under ZeRO-0), in one bucket; a frozen
    /// parameter is held whole by every replica with no bucket, no update and no state.
    #[test]
    fn trained_elements_have_their_updaters_and_frozen_ones_none() {
        for (dp, zero) in [(1, 0), (2, 0), (2, 1), (2, 3), (3, 2)] {
            let actors = layouts(ParallelPlan {
                dp,
                zero,
                ..ParallelPlan::default()
            });
            let what = format!("dp={dp} zero={zero}");
            let mut updates = std::collections::HashMap::<&str, Vec<u32>>::new();
            for slices in &actors {
                for s in slices {
                    let len = s.held.len().max(s.updated.end);
                    if !s.trainable {
                        assert_eq!(s.param, FROZEN);
                        assert!(
                            s.bucket.is_none() && s.updated.is_empty() && s.state_tier.is_none(),
                            "{what}"
                        );
                        assert_eq!(s.held, 0..48 * 48, "{what}: a frozen parameter is held whole");
                        continue;
                    }
                    assert!(s.bucket.is_some() && s.state_tier.is_some(), "{what}");
                    let counts = updates.entry(&s.param).or_default();
                    counts.resize(counts.len().max(len), 0);
                    s.updated.clone().for_each(|i| counts[i] += 1);
                    // ZeRO-3 holds what it updates; below it every replica holds the parameter.
                    let holds = if zero == 3 && dp > 1 {
                        &s.updated
                    } else {
                        &(0..s.held.end)
                    };
                    assert_eq!(&s.held, holds, "{what} {}", s.param);
                }
            }
            // ZeRO ≥ 1 shards the update; replicated state is updated by every replica alike.
            let updaters = if zero >= 1 { 1 } else { dp as u32 };
            for (param, counts) in updates {
                let wrong = counts.iter().filter(|&&n| n != updaters).count();
                assert_eq!(
                    wrong, 0,
                    "{what}: {param} has {wrong} elements not updated {updaters}×"
                );
            }
        }
    }

    /// The tiers follow the plan's state placement and offload.
    #[test]
    fn tiers_follow_the_state_placement_and_offload() {
        let tiers_of = |plan: ParallelPlan| {
            let first = &layouts(plan)[0];
            let trained = first.iter().find(|s| s.trainable).unwrap();
            (trained.values_tier, trained.state_tier.unwrap())
        };
        let device = ParallelPlan {
            state: StatePlacement::Device,
            ..ParallelPlan::default()
        };
        assert_eq!(tiers_of(device), (Tier::Device, Tier::Device));
        let host = ParallelPlan {
            state: StatePlacement::Host,
            ..ParallelPlan::default()
        };
        assert_eq!(tiers_of(host), (Tier::Host, Tier::Host));
        let cpu = ParallelPlan {
            offload: Offload::Cpu,
            ..ParallelPlan::default()
        };
        assert_eq!(tiers_of(cpu), (Tier::Host, Tier::OffloadCpu));
        let nvme = ParallelPlan {
            dp: 2,
            zero: 3,
            offload: Offload::Nvme { dir: "/tmp".into() },
            offload_params: true,
            ..ParallelPlan::default()
        };
        assert_eq!(tiers_of(nvme), (Tier::OffloadNvme, Tier::OffloadNvme));
    }
}
