//! Tests of sequence parallelism in the plan: the model's sequence-parallel form (the same
//! parameters, cut into LayerNorm and mixing blocks), Megatron's reduce-scatters and all-gathers
//! in place of the all-reduces (the same bytes per step as plain tp), the residual stream as a
//! second tensor between segments, and the refusals.

use super::*;
use crate::plan::compile;
use crate::{CollectiveKind, Instruction, ParallelPlan, TensorId};

const GPT: &str = "gpt:vocab=64,ctx=16,d=32,layers=2,heads=4";

fn program(spec: &str, dp: usize, tp: usize, sp: bool) -> Program {
    let spec = ModelSpec::parse(spec).unwrap();
    let p = Program::new(spec.clone()).with_plan(ParallelPlan {
        dp,
        tp,
        batch: 4 * dp,
        microbatches: 2,
        ..ParallelPlan::default()
    });
    if sp {
        p.sequence_parallel(&spec).unwrap()
    } else {
        p
    }
}

fn refusal(program: &Program) -> String {
    compile(program).unwrap_err().to_string()
}

/// The sequence-parallel form holds exactly the parameters of the plain one, in the same order,
/// and every LayerNorm block but the first reads the residual the one before passed on.
#[test]
fn the_sequence_parallel_form_cuts_the_same_parameters() {
    let spec = ModelSpec::parse(GPT).unwrap();
    let (plain, sp) = (spec.desc(), desc(&spec).unwrap());
    let names = |m: &ModelDesc| -> Vec<String> {
        m.blocks
            .iter()
            .flat_map(|b| b.param_descs.iter().map(|p| p.name.clone()))
            .collect()
    };
    assert_eq!(names(&plain), names(&sp));
    assert_eq!(sp.blocks.len(), 1 + 4 * 2 + 2);
    let blocks: Vec<&str> = sp.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(
        blocks[..5],
        ["embedding", "attn.0.ln", "attn.0", "mlp.0.ln", "mlp.0"]
    );
    let sources = residual_sources(&sp).unwrap();
    assert_eq!(sources[..6], [None, None, None, Some(1), None, Some(3)]);
    assert_eq!(
        sources[9],
        Some(7),
        "the final LayerNorm adds the last MLP's residual"
    );
    assert!(is_sequence_parallel(&sp) && !is_sequence_parallel(&plain));
    let mlp = ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=2").unwrap();
    assert!(
        desc(&mlp)
            .unwrap_err()
            .to_string()
            .contains("drop --sequence-parallel")
    );
}

/// The collectives of `actor`'s stream on activations and their gradients, in order.
fn tp_edges(plan: &crate::Plan, actor: usize) -> Vec<(CollectiveKind, TensorId)> {
    (plan.stream(actor).instructions.iter())
        .filter_map(|i| match i {
            Instruction::StartCollective { kind, tensor, .. }
                if matches!(
                    tensor,
                    TensorId::Activation { .. } | TensorId::ActivationGrad { .. }
                ) =>
            {
                Some((*kind, tensor.clone()))
            }
            _ => None,
        })
        .collect()
}

/// Per micro-batch: the embedding's partial output reduce-scattered; per half-layer an
/// all-gather before the mixing block and a reduce-scatter after it, and in the backward their
/// adjoints; the final LayerNorm's output all-gathered for the head. No all-reduce of an
/// activation is left, and the residual stream never leaves the actor.
#[test]
fn all_reduces_become_reduce_scatters_and_all_gathers() {
    let plan = compile(&program(GPT, 1, 2, true)).unwrap();
    for actor in 0..2 {
        let edges = tp_edges(&plan, actor);
        let count = |kind, grad: bool| {
            let is = |t: &TensorId| matches!(t, TensorId::ActivationGrad { .. }) == grad;
            edges.iter().filter(|(k, t)| *k == kind && is(t)).count()
        };
        use CollectiveKind::{AllGather, AllReduceSum, ReduceScatterSum};
        // 2 micro-batches × (4 half-layers + the embedding or the head).
        assert_eq!(count(ReduceScatterSum, false), 2 * 5, "actor {actor}");
        assert_eq!(count(AllGather, false), 2 * 5);
        assert_eq!(count(AllGather, true), 2 * 5);
        assert_eq!(count(ReduceScatterSum, true), 2 * 5);
        assert_eq!(count(AllReduceSum, false) + count(AllReduceSum, true), 0);
        let moved = |i: &Instruction| match i {
            Instruction::StartCollective { tensor, .. }
            | Instruction::Send { tensor, .. }
            | Instruction::Recv { tensor, .. } => {
                matches!(tensor, TensorId::Residual { .. } | TensorId::ResidualGrad { .. })
            }
            _ => false,
        };
        assert!(!plan.stream(actor).instructions.iter().any(moved));
    }
}

/// The tensor-parallel bytes of a step are plain tp's: a reduce-scatter and an all-gather read
/// what one all-reduce does.
#[test]
fn tensor_parallel_bytes_are_plain_tps() {
    let (plain, sp) = (
        compile(&program(GPT, 1, 2, false)).unwrap(),
        compile(&program(GPT, 1, 2, true)).unwrap(),
    );
    for (a, b) in plain.fabric.iter().zip(&sp.fabric) {
        assert_eq!(a.tensor_parallel, b.tensor_parallel);
        assert_eq!(b.activations + b.activation_grads, 0);
    }
    assert!(sp.fabric[0].tensor_parallel > 0);
}

/// Per layer and token a rank keeps whole only the two gathered LayerNorm outputs (2d, which
/// burn's graph holds for the linear after each), where plain tp keeps the LayerNorm and residual
/// regions whole (5d); the rest is cut by tp. At tp = 4 the rank's estimate is then the smaller.
#[test]
fn the_estimate_keeps_the_layernorm_regions_per_rank() {
    let (ctx, d, layers) = (16u64, 32u64, 2u64);
    let layer_blocks =
        |m: &ModelDesc| m.blocks[1..m.blocks.len() - if is_sequence_parallel(m) { 2 } else { 1 }].to_vec();
    let whole = |p: &Program| -> u64 {
        let blocks = layer_blocks(&p.model);
        blocks
            .iter()
            .map(|b| b.activation_floats_per_sample - b.tp.unwrap().sharded_activations)
            .sum()
    };
    let (plain, sp) = (program(GPT, 1, 4, false), program(GPT, 1, 4, true));
    assert_eq!(whole(&sp), layers * ctx * 2 * d);
    assert_eq!(whole(&plain), layers * ctx * 5 * d);
    let acts = |p: &Program| compile(p).unwrap().memory[0].activations;
    assert!(acts(&sp) < acts(&plain), "{} vs {}", acts(&sp), acts(&plain));
}

/// `--sequence-parallel` without tp, with a model not in its form (or the form without the
/// flag), with stages cut where the tokens are whole, or with tokens tp does not divide:
/// refused, naming the fix.
#[test]
fn refusals_name_the_fix() {
    let why = refusal(&program(GPT, 1, 1, true));
    assert!(
        why.contains("--tp is 1") && why.contains("drop --sequence-parallel"),
        "{why}"
    );
    let mut flag_only = program(GPT, 1, 2, false);
    flag_only.plan.sequence_parallel = true;
    let why = refusal(&flag_only);
    assert!(why.contains("Program::sequence_parallel"), "{why}");
    let mut form_only = program(GPT, 1, 2, true);
    form_only.plan.sequence_parallel = false;
    assert!(refusal(&form_only).contains("add --sequence-parallel"));
    let mut pp = program(GPT, 1, 2, true);
    pp.plan.pp = 2;
    compile(&pp).unwrap();
    pp.plan.stages = Some(vec![(0, 2), (2, 11)]);
    let why = refusal(&pp);
    assert!(
        why.contains("not at block 2") && why.contains("[1, 3, 5, 7, 9]"),
        "{why}"
    );
    pp.plan.stages = None;
    pp.plan.pp = 7;
    assert!(refusal(&pp).contains("at most 6"));
    let odd = program("gpt:vocab=64,ctx=5,d=32,layers=1,heads=4", 1, 2, true);
    let mut odd = odd;
    odd.plan.batch = 2;
    let why = refusal(&odd);
    assert!(why.contains("5 tokens") && why.contains("--tp 2"), "{why}");
}

/// With `--partition-activations` alone, only the mixing blocks and the head (whose inputs an
/// all-gather brings) are checkpointed: each keeps the rank's share and the plan gathers it
/// again before the block's backward; the LayerNorm blocks keep their graphs.
#[test]
fn partitioned_mixing_inputs_are_the_only_checkpoints() {
    let mut p = program(GPT, 1, 2, true);
    p.plan.partition_activations = true;
    let plan = compile(&p).unwrap();
    let gathered: Vec<usize> = (plan.stream(0).instructions.iter())
        .filter_map(|i| match i {
            Instruction::StartCollective {
                kind: CollectiveKind::AllGather,
                tensor: TensorId::Checkpoint { segment, mb: 0 },
                ..
            } => Some(*segment),
            _ => None,
        })
        .collect();
    let mut sorted = gathered.clone();
    sorted.sort();
    assert_eq!(sorted, [2, 4, 6, 8, 10], "the mixing blocks and the head");
    let mut plain = program(GPT, 1, 2, false);
    plain.plan.partition_activations = true;
    assert!(refusal(&plain).contains("nothing is checkpointed"));
}
