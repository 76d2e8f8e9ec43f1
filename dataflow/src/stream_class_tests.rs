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
use crate::tensor_id::TensorId;
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
            return Err(format!(
                "instruction {pc}: tags {ta} and {tb} pair inconsistently"
            ));
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

/// The sends, receives and collective starts of `stream` without their tags, sorted: who an
/// actor talks to and over which groups, whatever the order.
fn edges(stream: &[Instruction]) -> Vec<String> {
    let mut out: Vec<String> = (stream.iter())
        .filter_map(|i| match i {
            Instruction::Send { tensor, to, .. } => Some(format!("send {tensor} to {to}")),
            Instruction::Recv { tensor, from, .. } => Some(format!("recv {tensor} from {from}")),
            Instruction::StartCollective {
                kind, tensor, group, ..
            } => Some(format!("{kind:?} {tensor} over {group:?}")),
            _ => None,
        })
        .collect();
    out.sort();
    out
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
        (
            "gpt dp3 tp2 zero3".into(),
            program(
                GPT,
                ParallelPlan {
                    zero: 3,
                    ..base(3, 1, 2)
                },
            ),
        ),
        (
            "gpt dp2 pp2 zero1".into(),
            program(
                GPT,
                ParallelPlan {
                    zero: 1,
                    ..base(2, 2, 1)
                },
            ),
        ),
        (
            "gpt dp2 pp2 zero2".into(),
            program(
                GPT,
                ParallelPlan {
                    zero: 2,
                    ..base(2, 2, 1)
                },
            ),
        ),
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
            program(
                GPT,
                ParallelPlan {
                    schedule: Schedule::ZbH1,
                    ..base(2, 2, 2)
                },
            ),
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
            program(
                MLP,
                ParallelPlan {
                    zero: 2,
                    offload: Offload::Cpu,
                    ..base(2, 1, 1)
                },
            ),
        ),
        (
            "mlp dp2 pp2 device state".into(),
            program(
                MLP,
                ParallelPlan {
                    state: StatePlacement::Device,
                    ..base(2, 2, 1)
                },
            ),
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
    let mut islands = program(GPT, base(4, 2, 2));
    islands.islands = (0..16).map(|a| ["a", "b"][a / 4 % 2].to_string()).collect();
    out.push(("gpt dp4 pp2 tp2 on two islands".into(), islands));
    out
}

#[test]
fn translated_streams_equal_the_streams_built_for_each_actor() {
    for (name, program) in programs() {
        let program = if program.plan.sequence_parallel {
            program
                .sequence_parallel(&ModelSpec::parse(GPT).unwrap())
                .unwrap()
        } else {
            program
        };
        let shared = compile(&program).unwrap_or_else(|e| panic!("{name}: {e}"));
        let whole = compile_every_actor(&program).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(shared.actors.len(), whole.actors.len(), "{name}");
        let streams: Vec<Vec<Instruction>> = shared.every_stream().map(|s| s.instructions).collect();
        for (actor, s) in streams.iter().enumerate() {
            let w = &whole.stream(actor).instructions;
            if shared.mesh.coord(actor, "dp") == 0 {
                same_but_tags(w, s).unwrap_or_else(|e| panic!("{name}, actor {actor}: {e}"));
            }
            assert_eq!(computes(w), computes(s), "{name}, actor {actor}");
            assert_eq!(edges(w), edges(s), "{name}, actor {actor}: peers and collectives");
        }
        for actor in (0..streams.len()).step_by(3) {
            for (i, instruction) in streams[actor].iter().enumerate() {
                assert_eq!(
                    shared.streams.instruction(actor, i).as_ref(),
                    Some(instruction),
                    "{name}"
                );
            }
        }
        verify(&streams).unwrap_or_else(|e| panic!("{name}: the translated mesh: {e}"));
        assert_eq!(shared.fabric, whole.fabric, "{name}");
        assert_eq!(shared.memory, whole.memory, "{name}");
        assert_eq!(shared.offload_traffic, whole.offload_traffic, "{name}");
        assert_eq!(shared.prediction, whole.prediction, "{name}");
    }
}

/// The controls of the comparison: a peer moved wrongly and a class's stream run untranslated
/// by another replica (its `LoadBatch` rows are replica 0's) are both caught.
#[test]
fn the_comparison_catches_a_wrong_peer_and_untranslated_rows() {
    let (_, program) = programs().swap_remove(1);
    let plan = compile(&program).unwrap();
    let whole = compile_every_actor(&program).unwrap();
    let mut wrong = plan.stream(2).instructions;
    let send = wrong
        .iter()
        .position(|i| matches!(i, Instruction::Send { .. }))
        .unwrap();
    if let Instruction::Send { to, .. } = &mut wrong[send] {
        *to += 1;
    }
    assert!(same_but_tags(&whole.stream(2).instructions, &wrong).is_err());
    let replica_1 = plan.mesh.rank_of(&[("dp", 1)]);
    assert_ne!(
        computes(&whole.stream(replica_1).instructions),
        computes(plan.class_stream(replica_1)),
        "replica 1 running replica 0's rows"
    );
}

/// The symmetry check refuses a peer off the representatives and a group that spans dp only in
/// part; the quotient's verification still finds a deadlock between classes.
#[test]
fn the_symmetry_check_and_the_quotient_refuse_what_they_must() {
    let mesh = crate::Mesh::new(&[("dp", 4), ("pp", 2)]).unwrap();
    let symmetry = Symmetry::of(&mesh, 8);
    let x = TensorId::named("x");
    let mut streams = vec![Vec::new(); 8];
    streams[0] = vec![Instruction::Send {
        tensor: x.clone(),
        to: 3,
        tag: 0,
    }];
    let refused = symmetry.check(&streams).unwrap_err().to_string();
    assert!(refused.contains("peer 3 is not at replica 0"), "{refused}");
    let start = |group: Vec<usize>| Instruction::StartCollective {
        kind: crate::CollectiveKind::AllReduceSum,
        tensor: x.clone(),
        group,
        tag: 1,
        dtype: crate::DType::F32,
        codec: crate::Codec::None,
    };
    streams[0] = vec![start(vec![0, 2])];
    let refused = symmetry.check(&streams).unwrap_err().to_string();
    assert!(refused.contains("not all of it"), "{refused}");
    streams[0] = vec![start(vec![0, 2, 4, 6])];
    symmetry.check(&streams).unwrap();
    // Whole along dp on each member's line: an L over dp and pp, a diagonal, a repeat.
    for group in [vec![0, 2, 4, 6, 1], vec![0, 3, 4, 6], vec![0, 2, 4, 6, 0]] {
        streams[0] = vec![start(group.clone())];
        let refused = symmetry.check(&streams).unwrap_err().to_string();
        assert!(
            refused.contains("not whole") || refused.contains("not all of it"),
            "{group:?}: {refused}"
        );
    }
    streams[0] = vec![Instruction::WaitCollective {
        tensor: x.clone(),
        tag: 9,
    }];
    let refused = symmetry.check(&streams).unwrap_err().to_string();
    assert!(refused.contains("before starting it"), "{refused}");
    let mut many_tags = symmetry.clone();
    many_tags.tags = 1 << 31;
    streams[0] = Vec::new();
    assert!(many_tags.check(&streams).unwrap_err().to_string().contains("2³²"));
    // Stage 0 and stage 1 each wait for the other first.
    let y = TensorId::named("y");
    let make = Instruction::Compute {
        op: ComputeOp::User { name: "make".into() },
        inputs: vec![],
        outputs: vec![x.clone()],
    };
    let recv = |from, tag| Instruction::Recv {
        tensor: y.clone(),
        from,
        tag,
    };
    let send = |to, tag| Instruction::Send {
        tensor: x.clone(),
        to,
        tag,
    };
    streams[0] = vec![make.clone(), recv(1, 3), send(1, 2)];
    streams[1] = vec![make.clone(), recv(0, 2), send(0, 3)];
    symmetry.check(&streams).unwrap();
    let deadlock = verify(&symmetry.quotient(&streams)).unwrap_err().to_string();
    assert!(deadlock.contains("waits for actor"), "{deadlock}");
    streams[1] = vec![make, send(0, 3), recv(0, 2)];
    verify(&symmetry.quotient(&streams)).unwrap();
}
