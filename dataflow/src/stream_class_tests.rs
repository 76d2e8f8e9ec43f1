//! The stream classes against the reference lowering: for plans across the parallelisms, the
//! actors of replica 0 run exactly the streams built for them alone (up to tag numbering, per
//! actor), every actor runs the same computes in the same order, and the translated mesh passes
//! the whole verifier. (The reference orders some collectives of replicas after the first
//! differently: it inserts a bucket's reductions after the last replica's run, so replica 0 starts
//! them later in its stream than the others; the classes run replica 0's order everywhere.)
//! Negative controls for the comparison, the symmetry check and the quotient's verification.

use std::collections::HashMap;

use super::*;
use crate::passes::schedule::Schedule;
use crate::verify::verify;
use crate::{
    DeviceSpec, ModelSpec, Offload, ParallelPlan, Program, StatePlacement, compile, compile_every_actor,
};

/// `a` and `b` agree instruction by instruction once `b`'s tags are renamed to `a`'s by one
/// one-to-one map.
fn same_but_tags(a: &[Instruction], b: &[Instruction]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{} instructions against {}", a.len(), b.len()));
    }
    let (mut to_a, mut to_b) = (HashMap::new(), HashMap::new());
    let tag = |i: &Instruction| match i {
        Instruction::Send { tag, .. }
        | Instruction::Recv { tag, .. }
        | Instruction::StartCollective { tag, .. }
        | Instruction::WaitCollective { tag, .. } => Some(*tag),
        Instruction::Compute { .. } => None,
    };
    let retag = |i: &Instruction, t: u64| {
        let mut i = i.clone();
        match &mut i {
            Instruction::Send { tag, .. }
            | Instruction::Recv { tag, .. }
            | Instruction::StartCollective { tag, .. }
            | Instruction::WaitCollective { tag, .. } => *tag = t,
            Instruction::Compute { .. } => {}
        }
        i
    };
    for (pc, (x, y)) in a.iter().zip(b).enumerate() {
        if let (Some(ta), Some(tb)) = (tag(x), tag(y))
            && (*to_a.entry(tb).or_insert(ta) != ta || *to_b.entry(ta).or_insert(tb) != tb)
        {
            return Err(format!("instruction {pc}: tags {ta} and {tb} pair inconsistently"));
        }
        let y = tag(y).map_or_else(|| y.clone(), |tb| retag(y, to_a[&tb]));
        if *x != y {
            return Err(format!("instruction {pc}: `{x}` against `{y}`"));
        }
    }
    Ok(())
}

/// The compute instructions of `stream`, in order.
fn computes(stream: &[Instruction]) -> Vec<&Instruction> {
    (stream.iter())
        .filter(|i| matches!(i, Instruction::Compute { .. }))
        .collect()
}

fn program(model: &str, plan: ParallelPlan) -> Program {
    let mut program = Program::new(ModelSpec::parse(model).unwrap()).with_plan(plan);
    program.devices = DeviceSpec::cpus(program.plan.dp * program.plan.pp * program.plan.tp);
    program
}

const GPT: &str = "gpt:vocab=32,ctx=8,d=16,layers=4,heads=4";
const MLP: &str = "mlp:in=8,hidden=16,layers=4,out=4";

/// Plans across the parallelisms and the passes that rewrite streams.
fn programs() -> Vec<(String, Program)> {
    let base = |dp, pp, tp| ParallelPlan {
        dp,
        pp,
        tp,
        microbatches: 4,
        batch: dp * 8,
        schedule: Schedule::OneFOneB,
        ..ParallelPlan::default()
    };
    let mut out = vec![
        ("gpt dp3".into(), program(GPT, base(3, 1, 1))),
        ("gpt dp2 pp2 tp2".into(), program(GPT, base(2, 2, 2))),
        ("gpt dp3 tp2 zero3".into(), program(GPT, ParallelPlan { zero: 3, ..base(3, 1, 2) })),
        ("gpt dp2 pp2 zero1".into(), program(GPT, ParallelPlan { zero: 1, ..base(2, 2, 1) })),
        ("gpt dp2 pp2 zero2".into(), program(GPT, ParallelPlan { zero: 2, ..base(2, 2, 1) })),
        ("mlp dp2 tp2 pp2".into(), program(MLP, base(2, 2, 2))),
        (
            "gpt dp2 pp2 interleaved".into(),
            program(
                GPT,
                ParallelPlan {
                    virtual_stages: 2,
                    schedule: Schedule::Interleaved,
                    ..base(2, 2, 1)
                },
            ),
        ),
        (
            "gpt dp2 pp2 tp2 zb-h1".into(),
            program(GPT, ParallelPlan { schedule: Schedule::ZbH1, ..base(2, 2, 2) }),
        ),
        (
            "gpt dp2 tp2 sp ckpt partitioned".into(),
            program(
                GPT,
                ParallelPlan {
                    sequence_parallel: true,
                    checkpoint_activations: true,
                    partition_activations: true,
                    ..base(2, 2, 2)
                },
            ),
        ),
        (
            "mlp dp2 offload zero2".into(),
            program(MLP, ParallelPlan { zero: 2, offload: Offload::Cpu, ..base(2, 1, 1) }),
        ),
        (
            "mlp dp2 pp2 device state".into(),
            program(MLP, ParallelPlan { state: StatePlacement::Device, ..base(2, 2, 1) }),
        ),
    ];
    let mut lamb = program(GPT, base(2, 2, 1)).with_clip_grad_norm(Some(1.0));
    lamb.optimizer = crate::OptimizerSpec::lamb(1e-3);
    out.push(("gpt dp2 pp2 clip lamb".into(), lamb));
    let clipped = program(GPT, base(2, 2, 2)).with_clip_grad_norm(Some(1.0));
    out.push(("gpt dp2 pp2 tp2 clip".into(), clipped));
    let mut bf16 = program(GPT, base(2, 2, 2));
    bf16.precision = crate::Precision::parse("bf16").unwrap();
    out.push(("gpt dp2 pp2 tp2 bf16".into(), bf16));
    let mut islands = program(MLP, base(4, 1, 1));
    islands.islands = vec!["a".into(), "b".into(), "a".into(), "b".into()];
    out.push(("mlp dp4 on two islands".into(), islands));
    out
}

#[test]
fn translated_streams_equal_the_streams_built_for_each_actor() {
    for (name, program) in programs() {
        let program = if program.plan.sequence_parallel {
            program.sequence_parallel(&ModelSpec::parse(GPT).unwrap()).unwrap()
        } else {
            program
        };
        let shared = compile(&program).unwrap_or_else(|e| panic!("{name}: {e}"));
        let whole = compile_every_actor(&program).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(shared.actors.len(), whole.actors.len(), "{name}");
        for (actor, (s, w)) in shared.actors.iter().zip(&whole.actors).enumerate() {
            let (s, w) = (&s.stream.instructions, &w.stream.instructions);
            if shared.mesh.coord(actor, "dp") == 0 {
                same_but_tags(w, s).unwrap_or_else(|e| panic!("{name}, actor {actor}: {e}"));
            }
            assert_eq!(computes(w), computes(s), "{name}, actor {actor}");
        }
        let streams: Vec<Vec<Instruction>> =
            shared.actors.iter().map(|a| a.stream.instructions.clone()).collect();
        verify(&streams).unwrap_or_else(|e| panic!("{name}: the translated mesh: {e}"));
        assert_eq!(shared.fabric, whole.fabric, "{name}");
        assert_eq!(shared.memory, whole.memory, "{name}");
    }
}

