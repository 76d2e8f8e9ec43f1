//! Tests of ZeRO-R's partitioned activation checkpoints in the plan (Rajbhandari et al. 2019
//! §6): an all-gather of each checkpointed input the tp group holds whole before its backward,
//! counted in the tensor-parallel bytes; offloaded checkpoints moved to the host estimate; and
//! the refusals of `--partition-activations` and `--offload-activations` without what they need.

use super::*;
use crate::{CollectiveKind, ComputeOp, Instruction, ModelSpec, ParallelPlan, TensorId};

const GPT: &str = "gpt:vocab=64,ctx=16,d=32,layers=2,heads=4";

fn checkpointed(tp: usize, partition: bool, offload: bool) -> Program {
    Program::new(ModelSpec::parse(GPT).unwrap()).with_plan(ParallelPlan {
        tp,
        batch: 4,
        microbatches: 2,
        checkpoint_activations: true,
        partition_activations: partition,
        offload_activations: offload,
        ..ParallelPlan::default()
    })
}

/// The checkpoints each actor gathers, in stream order, and the computes that read them.
fn gathers(plan: &Plan, actor: usize) -> Vec<TensorId> {
    (plan.stream(actor).instructions.iter())
        .filter_map(|i| match i {
            Instruction::StartCollective {
                kind: CollectiveKind::AllGather,
                tensor: t @ TensorId::Checkpoint { .. },
                ..
            } => Some(t.clone()),
            _ => None,
        })
        .collect()
}

/// Every segment but the first keeps its input; partitioned, each one is gathered over the tp
/// group once per micro-batch before its backward (started while the backward of the segment
/// after it runs), and the gathers read (tp − 1)/tp of it.
#[test]
fn each_partitioned_checkpoint_is_gathered_before_its_backward() {
    let whole = compile(&checkpointed(2, false, false)).unwrap();
    let plan = compile(&checkpointed(2, true, false)).unwrap();
    assert!(gathers(&whole, 0).is_empty(), "no gathers unpartitioned");
    let segments = plan.buckets.len();
    for actor in 0..2 {
        let found = gathers(&plan, actor);
        assert_eq!(found.len(), 2 * (segments - 1), "{found:?}");
        let stream = &plan.stream(actor).instructions;
        let mut ahead = 0;
        for tensor in &found {
            let start = (stream.iter())
                .position(|i| matches!(i, Instruction::StartCollective { tensor: t, .. } if t == tensor));
            let wait = (stream.iter())
                .position(|i| matches!(i, Instruction::WaitCollective { tensor: t, .. } if t == tensor));
            let read = (stream.iter())
                .position(|i| matches!(i, Instruction::Compute { inputs, .. } if inputs.contains(tensor)));
            assert!(
                wait.unwrap() < read.unwrap(),
                "{tensor} read before its gather ends"
            );
            let between = &stream[start.unwrap()..wait.unwrap()];
            let backward = |i: &Instruction| {
                matches!(
                    i,
                    Instruction::Compute {
                        op: ComputeOp::Backward { .. },
                        ..
                    }
                )
            };
            ahead += usize::from(between.iter().any(backward));
        }
        // All but each slot's first run one segment ahead: another backward runs meanwhile.
        assert_eq!(ahead, 2 * (segments - 2), "gathers started a backward ahead");
        let (rows, ctx, d) = (2u64, 16u64, 32u64);
        let gathered = 2 * (segments as u64 - 1) * rows * ctx * d / 2 * 4;
        let more = plan.fabric[actor].tensor_parallel - whole.fabric[actor].tensor_parallel;
        assert_eq!(more, gathered);
    }
}

/// The estimate keeps half of the unpartitioned checkpoints per actor, and none on the device
/// when they are offloaded (the same bytes in host memory instead).
#[test]
fn checkpoints_are_estimated_partitioned_and_offloaded() {
    let estimate = |p: &Program| compile(p).unwrap().memory[0].clone();
    let whole = estimate(&checkpointed(2, false, false));
    let half = estimate(&checkpointed(2, true, false));
    let host = estimate(&checkpointed(2, true, true));
    assert!(whole.activation_checkpoints > 0);
    assert_eq!(2 * half.activation_checkpoints, whole.activation_checkpoints);
    // Partitioned, two whole inputs are gathered at a time (2 rows × 16 tokens × 32 wide, f32).
    let gathered = 2 * (2 * 16 * 32 * 4);
    assert_eq!(
        whole.activations + gathered - half.activations,
        half.activation_checkpoints
    );
    // On CPU devices host memory is the device's: offloading moves nothing out of the total.
    assert_eq!(host.activations, half.activations);
    assert_eq!(
        (host.activation_checkpoints, host.activation_checkpoints_host),
        (0, half.activation_checkpoints)
    );
}

/// Partitioning needs checkpointing and a tp group; offloading needs checkpointing (ZeRO-3
/// implies it); each refusal names the flag to add or drop.
#[test]
fn refuses_partitions_and_offloads_without_checkpoints_or_tp() {
    let mut unchecked = checkpointed(2, true, false);
    unchecked.plan.checkpoint_activations = false;
    let why = compile(&unchecked).unwrap_err().to_string();
    assert!(
        why.contains("--partition-activations") && why.contains("add --checkpoint-activations"),
        "{why}"
    );
    let why = compile(&checkpointed(1, true, false)).unwrap_err().to_string();
    assert!(
        why.contains("--tp is 1") && why.contains("--tp 2 or more"),
        "{why}"
    );
    let mut offloaded = checkpointed(1, false, true);
    offloaded.plan.checkpoint_activations = false;
    let why = compile(&offloaded).unwrap_err().to_string();
    assert!(why.contains("--offload-activations cpu"), "{why}");
    offloaded.plan.zero = 3;
    offloaded.plan.dp = 2;
    offloaded.plan.batch = 8;
    assert!(compile(&offloaded).is_ok(), "ZeRO-3 implies checkpointing");
}
