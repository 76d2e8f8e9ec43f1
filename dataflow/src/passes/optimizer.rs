//! The end of a training step: the optimizer update of every actor, with the reductions some
//! updates need before anything changes, and ZeRO's all-gather of the updated parameters.
//!
//! Gradient clipping by the global norm (as `torch.nn.utils.clip_grad_norm_`; Pascanu et al.,
//! ICML 2013) needs one number over every gradient of the model: each actor sums the squares of
//! its share of its reduced buckets (`GradNorm`: its ZeRO shard of each bucket, so that replicas
//! holding the same values count them once), and a one-value all-reduce over *every* actor
//! (dp × pp) gives the total before any update. LAMB (You et al., ICLR 2020) needs per-parameter
//! norms of the parameters and of their update directions: a parameter lives on one pipeline
//! stage but may be split over that stage's dp group by ZeRO, so each actor writes its partial
//! sums (`TrustNorms`) and an all-reduce over the dp group completes them. On one actor neither
//! reduction exists (the identity) and the tensors go straight to `OptimizerStep`.
//!
//! Loss scaling (f16, Micikevicius et al. 2018) needs the same one number, as a vote: the
//! partial sums cover every element of every reduced bucket exactly once over the mesh, so the
//! total is finite on every actor exactly when no actor's gradients overflowed, and every actor
//! skips or takes the step on the same value.
//!
//! Offload (ZeRO-Offload) hands buckets to the offload actor as soon as they are reduced, before
//! any global norm could be known: with clipping the runtime stages them there and the update
//! waits for the norm (the deferred update, [`super::offload`]); LAMB, whose trust ratios need
//! per-parameter norms over every shard in the middle of the update, is refused with offload.

use crate::PlanError;
use crate::graph::Graph;
use crate::instruction::{CollectiveKind, ComputeOp, UpdateScope};
use crate::passes::data_parallel::Bucket;
use crate::passes::pipeline::Layout;
use crate::program::Program;
use crate::tensor_id::TensorId;

/// The tensor holding the squared global gradient norm (one value), read by the update.
pub const GRAD_SQUARES: TensorId = TensorId::GradSquares;
/// The tensor holding LAMB's per-parameter sums of squares (`‖p‖², ‖u‖²` per parameter of the
/// stage, in the stage's parameter order), read by the update.
pub const TRUST_SQUARES: TensorId = TensorId::TrustSquares;

/// The reductions a step needs before its update.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepNorms {
    /// Gradient clipping: the global gradient norm over every actor.
    pub clip: bool,
    /// LAMB: per-parameter norms over each stage's dp group.
    pub trust: bool,
    /// Loss scaling: the overflow vote over every actor (the same sum of squares as clipping).
    pub vote: bool,
}

impl StepNorms {
    /// What `program`'s optimizer needs.
    pub fn of(program: &Program) -> StepNorms {
        StepNorms {
            clip: program.clip_grad_norm.is_some(),
            trust: program.optimizer.needs_param_norms(),
            vote: program.precision.loss_scaling().is_some(),
        }
    }

    /// True when no reduction precedes the update.
    pub fn none(&self) -> bool {
        !self.global() && !self.trust
    }

    /// Whether the update waits for the sum of squares of every gradient over every actor
    /// (clipping's norm, loss scaling's overflow vote).
    pub fn global(&self) -> bool {
        self.clip || self.vote
    }
}

/// Refuses an optimizer PyTorch would refuse, a schedule without an end, a clipping bound that is
/// no bound, and LAMB together with offload (its offloaded update runs segment by segment).
pub fn check(program: &Program) -> Result<(), PlanError> {
    program.optimizer.check().map_err(PlanError::Conflict)?;
    program.lr_schedule.check().map_err(PlanError::Conflict)?;
    if let Some(max) = program.clip_grad_norm
        && !(max > 0.0 && max.is_finite())
    {
        return Err(PlanError::Conflict(format!(
            "--clip-grad-norm {max}: the bound must be a finite number > 0"
        )));
    }
    if program.plan.offload.is_some() && program.optimizer.needs_param_norms() {
        return Err(PlanError::Conflict(format!(
            "--optimizer lamb needs each parameter's norm over all its shards before its trust ratio, but \
             --offload {} updates each segment alone on the host; use --optimizer adamw, or drop --offload",
            program.plan.offload
        )));
    }
    Ok(())
}

/// Appends every actor's optimizer step to `graph`: the norms and their reductions (all actors'
/// `GradNorm` before the one all-reduce over every actor, so no actor updates before the norm is
/// known), then per pipeline device `TrustNorms` and its dp all-reduce, and the update reading
/// the device's gradient buckets. What ZeRO and offload change about the update is theirs
/// ([`super::zero`], [`super::offload`]).
pub fn append_updates(graph: &mut Graph, layout: &Layout, norms: StepNorms) {
    let pp = layout.shape.pp;
    let dp = layout.mesh.axis_size("dp");
    let held = |s: usize| -> Vec<&Bucket> {
        layout
            .segments
            .iter()
            .filter(|b| layout.device_of_segment(b.id) == s)
            .collect()
    };
    let span = |buckets: &[&Bucket]| {
        (
            buckets.first().map_or(0, |b| b.start),
            buckets.last().map_or(0, |b| b.end),
        )
    };
    let grads = |buckets: &[&Bucket]| -> Vec<TensorId> {
        buckets
            .iter()
            .map(|b| TensorId::GradBucket { segment: b.id })
            .collect()
    };
    if norms.global() {
        for s in 0..pp {
            let buckets = held(s);
            let (start, end) = span(&buckets);
            for actor in layout.stage_actors(s) {
                let op = ComputeOp::GradNorm { start, end };
                graph.compute(actor, op, &grads(&buckets), &[GRAD_SQUARES]);
            }
        }
        if layout.mesh.size() > 1 {
            let everyone = (0..layout.mesh.size()).collect();
            graph.collective(CollectiveKind::AllReduceSum, everyone, &GRAD_SQUARES);
        }
    }
    for s in 0..pp {
        let buckets = held(s);
        let (start, end) = span(&buckets);
        let mut inputs = grads(&buckets);
        if norms.trust {
            let mut trust_inputs = inputs.clone();
            if norms.global() {
                trust_inputs.push(GRAD_SQUARES);
            }
            for actor in layout.stage_actors(s) {
                let op = ComputeOp::TrustNorms { start, end };
                graph.compute(actor, op, &trust_inputs, &[TRUST_SQUARES]);
            }
            if dp > 1 {
                for group in layout.dp_groups(s) {
                    graph.collective(CollectiveKind::AllReduceSum, group, &TRUST_SQUARES);
                }
            }
            inputs.push(TRUST_SQUARES);
        } else if norms.global() {
            inputs.push(GRAD_SQUARES);
        }
        let op = ComputeOp::OptimizerStep {
            start,
            end,
            scope: UpdateScope::Whole,
        };
        for actor in layout.stage_actors(s) {
            graph.compute(actor, op.clone(), &inputs, &[]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instruction::Instruction;
    use crate::{ModelSpec, ParallelPlan, compile};

    fn streams(plan: ParallelPlan, clip: bool, lamb: bool) -> Vec<Vec<Instruction>> {
        let mut program = Program::new(ModelSpec::parse("mlp:in=8,hidden=16,layers=4,out=3").unwrap())
            .with_plan(plan)
            .with_clip_grad_norm(clip.then_some(1.0));
        if lamb {
            program.optimizer = crate::OptimizerSpec::lamb(1e-3);
        }
        compile(&program)
            .unwrap()
            .every_stream()
            .map(|a| a.instructions)
            .collect()
    }

    fn position(stream: &[Instruction], what: &dyn Fn(&Instruction) -> bool) -> Option<usize> {
        stream.iter().position(what)
    }

    fn is_compute(name: &'static str) -> impl Fn(&Instruction) -> bool {
        move |i| matches!(i, Instruction::Compute { op, .. } if op.to_string().starts_with(name))
    }

    /// dp = 2 × pp = 2 with clipping: every actor sums its squares, joins one all-reduce over all
    /// four actors, and updates only after waiting for it.
    #[test]
    fn clipping_reduces_the_norm_over_every_actor_before_any_update() {
        let plan = ParallelPlan {
            dp: 2,
            pp: 2,
            microbatches: 2,
            batch: 8,
            bucket_bytes: 256,
            ..ParallelPlan::default()
        };
        for stream in streams(plan, true, false) {
            let norm = position(&stream, &is_compute("GradNorm")).expect("GradNorm");
            let reduce = position(&stream, &|i| {
                matches!(i, Instruction::StartCollective { tensor, group, .. }
                    if *tensor == GRAD_SQUARES && group == &vec![0, 1, 2, 3])
            })
            .expect("the all-actor all-reduce");
            let wait = position(
                &stream,
                &|i| matches!(i, Instruction::WaitCollective { tensor, .. } if *tensor == GRAD_SQUARES),
            )
            .expect("its wait");
            let update = position(&stream, &is_compute("OptimizerStep")).expect("OptimizerStep");
            assert!(norm < reduce && reduce < wait && wait < update, "{stream:#?}");
            let Instruction::Compute { inputs, .. } = &stream[update] else {
                unreachable!()
            };
            assert_eq!(inputs.last(), Some(&GRAD_SQUARES));
            assert!(position(&stream, &is_compute("TrustNorms")).is_none());
        }
    }

    /// LAMB under ZeRO-3 × dp = 2: the per-parameter sums are all-reduced over the dp group
    /// (where the shards of a parameter live) before the update; with clipping the global norm
    /// comes first. On one actor there is no collective at all.
    #[test]
    fn lamb_reduces_its_norms_over_the_dp_group() {
        let plan = ParallelPlan {
            dp: 2,
            zero: 3,
            batch: 8,
            bucket_bytes: 256,
            ..ParallelPlan::default()
        };
        for stream in streams(plan, true, true) {
            let clip = position(
                &stream,
                &|i| matches!(i, Instruction::WaitCollective { tensor, .. } if *tensor == GRAD_SQUARES),
            )
            .unwrap();
            let trust = position(&stream, &is_compute("TrustNorms")).unwrap();
            let reduce = position(&stream, &|i| {
                matches!(i, Instruction::StartCollective { tensor, group, .. }
                    if *tensor == TRUST_SQUARES && group.len() == 2)
            })
            .unwrap();
            let update = position(&stream, &is_compute("OptimizerStep")).unwrap();
            assert!(clip < trust && trust < reduce && reduce < update);
        }
        let single = streams(ParallelPlan::default(), true, true);
        let stream = &single[0];
        assert!(
            !stream
                .iter()
                .any(|i| matches!(i, Instruction::StartCollective { .. }))
        );
        let norm = position(stream, &is_compute("GradNorm")).unwrap();
        let trust = position(stream, &is_compute("TrustNorms")).unwrap();
        assert!(norm < trust && trust < position(stream, &is_compute("OptimizerStep")).unwrap());
    }

    /// f16's loss scaling without clipping: the same all-actor all-reduce of the sum of squares
    /// precedes every update (the overflow vote), at dp = 2 × pp = 2 and with ZeRO-2.
    #[test]
    fn loss_scaling_votes_over_every_actor_before_any_update() {
        for zero in [0, 2] {
            let plan = ParallelPlan {
                dp: 2,
                pp: 2,
                zero,
                microbatches: 2,
                batch: 8,
                bucket_bytes: 256,
                ..ParallelPlan::default()
            };
            let program = Program::new(ModelSpec::parse("mlp:in=8,hidden=16,layers=4,out=3").unwrap())
                .with_plan(plan)
                .with_precision(crate::Precision::parse("f16").unwrap());
            for actor in compile(&program).unwrap().every_stream() {
                let stream = actor.instructions;
                let reduce = position(&stream, &|i| {
                    matches!(i, Instruction::StartCollective { tensor, group, .. }
                        if *tensor == GRAD_SQUARES && group == &vec![0, 1, 2, 3])
                })
                .expect("the all-actor vote");
                let wait = position(
                    &stream,
                    &|i| matches!(i, Instruction::WaitCollective { tensor, .. } if *tensor == GRAD_SQUARES),
                )
                .expect("its wait");
                let update = position(&stream, &is_compute("OptimizerStep")).expect("OptimizerStep");
                assert!(reduce < wait && wait < update, "{stream:#?}");
            }
        }
    }

    /// Negative control: without clipping or LAMB the step has no norm instructions and no
    /// extra collective (the streams the equivalence suite has always run).
    #[test]
    fn plain_updates_need_no_reduction() {
        let plan = ParallelPlan {
            dp: 2,
            batch: 8,
            ..ParallelPlan::default()
        };
        for stream in streams(plan, false, false) {
            assert!(position(&stream, &is_compute("GradNorm")).is_none());
            assert!(!stream.iter().any(
                |i| matches!(i, Instruction::StartCollective { tensor, .. } if *tensor == GRAD_SQUARES)
            ));
        }
    }

    /// With offload, clipping compiles (the deferred update waits for the norm: every GradNorm
    /// reads no bucket, the update reads the reduced norm); LAMB is refused naming the flags.
    #[test]
    fn clipping_defers_the_offloaded_update_and_lamb_is_refused_with_offload() {
        let model = ModelSpec::parse("mlp:in=8,hidden=16,layers=4,out=3").unwrap();
        let offloaded = ParallelPlan {
            offload: crate::Offload::Cpu,
            dp: 2,
            batch: 8,
            ..ParallelPlan::default()
        };
        let clip = Program::new(model.clone())
            .with_plan(offloaded.clone())
            .with_clip_grad_norm(Some(1.0));
        for stream in compile(&clip).unwrap().every_stream().map(|a| a.instructions) {
            let norm = position(&stream, &is_compute("GradNorm")).expect("GradNorm");
            let last_hand_off = stream
                .iter()
                .rposition(|i| {
                    matches!(
                        i,
                        Instruction::Compute {
                            op: ComputeOp::OffloadGrads { .. },
                            ..
                        }
                    )
                })
                .expect("hand-offs");
            assert!(
                last_hand_off < norm,
                "every bucket is staged before the norm is summed"
            );
            let Instruction::Compute { inputs, .. } = &stream[norm] else {
                unreachable!()
            };
            assert!(inputs.is_empty(), "{inputs:?}");
            let update = position(&stream, &is_compute("OptimizerStep")).unwrap();
            let Instruction::Compute { inputs, .. } = &stream[update] else {
                unreachable!()
            };
            assert_eq!(inputs, &[GRAD_SQUARES]);
        }
        let lamb = Program::new(model.clone())
            .with_plan(offloaded)
            .with_optimizer(crate::OptimizerSpec::lamb(1e-3));
        let err = compile(&lamb).unwrap_err().to_string();
        assert!(
            err.contains("--optimizer lamb needs") && err.contains("drop --offload"),
            "{err}"
        );
        let bad = Program::new(model).with_clip_grad_norm(Some(0.0));
        assert!(
            compile(&bad)
                .unwrap_err()
                .to_string()
                .contains("must be a finite number > 0")
        );
    }
}
