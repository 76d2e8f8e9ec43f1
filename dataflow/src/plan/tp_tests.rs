//! Tests of the plan's tensor-parallel checks (shapes the model cannot be cut by, groups that
//! would span islands, models without splits, each refused naming `--tp` and the fix) and of the
//! tensor-parallel step: Megatron's f and g as all-reduces in the streams, per-rank dp groups,
//! the local model's buckets.

use super::*;
use crate::{BlockInfo, CollectiveKind, InputKind, ModelDesc, ModelSpec, ParallelPlan, TensorId};

fn with_tp(spec: &str, dp: usize, tp: usize) -> Program {
    Program::new(ModelSpec::parse(spec).unwrap()).with_plan(ParallelPlan {
        dp,
        tp,
        batch: 4 * dp,
        ..ParallelPlan::default()
    })
}

fn refusal(program: &Program) -> String {
    compile(program).unwrap_err().to_string()
}

const GPT: &str = "gpt:vocab=64,ctx=16,d=32,layers=2,heads=4";

/// Heads (gpt) and the hidden width (mlp) must divide by tp; the refusal names the divisors.
#[test]
fn refuses_a_tp_the_heads_or_widths_do_not_divide() {
    let why = refusal(&with_tp(GPT, 1, 3));
    assert!(
        why.contains("--tp 3") && why.contains("4 attention heads"),
        "{why}"
    );
    assert!(why.contains("(2, 4)"), "{why}");
    let why = refusal(&with_tp("mlp:in=12,hidden=24,layers=3,out=6", 1, 5));
    assert!(why.contains("--tp 5") && why.contains("24 hidden width"), "{why}");
    assert!(
        matches!(
            compile(&with_tp(GPT, 1, 0)),
            Err(PlanError::Zero { what: "--tp" })
        ),
        "--tp 0"
    );
}

/// The vocabulary need not divide (it is padded): only the heads decide for gpt.
#[test]
fn a_vocabulary_tp_does_not_divide_is_not_refused_for_its_shape() {
    compile(&with_tp("gpt:vocab=65,ctx=16,d=32,layers=2,heads=4", 1, 2)).unwrap();
}

/// A tp group is consecutive actors and must share an island; dp may span islands.
#[test]
fn refuses_a_tp_group_across_islands() {
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut p = with_tp(GPT, 2, 2);
    p.islands = names(&["a", "b", "a", "b"]);
    let why = refusal(&p);
    assert!(why.contains("--tp 2") && why.contains("spans islands"), "{why}");
    assert!(why.contains("at most 1"), "{why}");
    p.islands = names(&["a", "a", "b", "b"]);
    compile(&p).unwrap();
}

/// A model given only by parameter counts has no splits for tp to follow.
#[test]
fn refuses_tp_for_a_model_without_described_parameters() {
    let model = ModelDesc {
        name: "counted".into(),
        input: InputKind::Dense {
            features: 4,
            classes: 2,
        },
        blocks: vec![BlockInfo {
            name: "dense".into(),
            params: 10,
            param_descs: Vec::new(),
            activation_floats_per_sample: 4,
            output_floats_per_sample: 2,
            tp: None,
        }],
    };
    let p = Program::custom(model, crate::data::DataSpec::Clusters { seed: 0 }).with_plan(ParallelPlan {
        tp: 2,
        ..ParallelPlan::default()
    });
    let why = refusal(&p);
    assert!(why.contains("--tp 2") && why.contains("`dense`"), "{why}");
}

/// A tp plan meshes `dp × tp`; tp=1 plans as before (a `dp × pp` mesh).
#[test]
fn a_tp_plan_meshes_dp_by_tp_and_tp_1_is_unchanged() {
    let plan = compile(&with_tp(GPT, 2, 2)).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=2 × tp=2");
    assert_eq!(plan.actors.len(), 4);
    let plan = compile(&with_tp(GPT, 2, 1)).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=2");
    assert_eq!(plan.actors.len(), 2);
}

/// Every all-reduce of `tensor`-kind in `actor`'s stream, with its group.
fn all_reduces(plan: &Plan, actor: usize, of: impl Fn(&TensorId) -> bool) -> Vec<Vec<usize>> {
    plan.stream(actor)
        .instructions
        .iter()
        .filter_map(|i| match i {
            Instruction::StartCollective {
                kind: CollectiveKind::AllReduceSum,
                group,
                tensor,
                ..
            } if of(tensor) => Some(group.clone()),
            _ => None,
        })
        .collect()
}

fn is_activation(t: &TensorId) -> bool {
    matches!(t, TensorId::Activation { .. })
}

fn is_activation_grad(t: &TensorId) -> bool {
    matches!(t, TensorId::ActivationGrad { .. })
}

/// gpt at tp=2 (2 layers, 2 micro-batches): per micro-batch, g after the embedding and after
/// each half-layer (1 + 2·2), f after the backward of each half-layer and of the head (2·2 + 1),
/// all over the actor's tp group: the four all-reduces per layer of Megatron-LM plus the
/// embedding's and the head's input. Every block is its own segment.
#[test]
fn a_gpt_layer_has_two_g_and_two_f_all_reduces_per_microbatch() {
    let mut p = with_tp(GPT, 1, 2);
    p.plan.microbatches = 2;
    let plan = compile(&p).unwrap();
    assert_eq!(plan.buckets.len(), p.model.blocks.len());
    for actor in 0..2 {
        let g = all_reduces(&plan, actor, is_activation);
        let f = all_reduces(&plan, actor, is_activation_grad);
        assert_eq!((g.len(), f.len()), (2 * 5, 2 * 5), "actor {actor}");
        assert!(g.iter().chain(&f).all(|group| group == &vec![0, 1]));
    }
    let one = compile(&with_tp(GPT, 1, 1)).unwrap();
    assert!(all_reduces(&one, 0, |t| is_activation(t) || is_activation_grad(t)).is_empty());
}

/// mlp at tp=2: g after each row-parallel (odd) layer, f after the backward of each
/// column-parallel (even) layer past the first; nothing after the others.
#[test]
fn mlp_alternates_column_and_row_layers() {
    let plan = compile(&with_tp("mlp:in=12,hidden=24,layers=3,out=6", 1, 2)).unwrap();
    let segments = |of: fn(&TensorId) -> bool| -> Vec<usize> {
        (plan.stream(0).instructions.iter())
            .filter_map(|i| match i {
                Instruction::StartCollective {
                    tensor:
                        t @ (TensorId::Activation { segment, .. } | TensorId::ActivationGrad { segment, .. }),
                    ..
                } if of(t) => Some(*segment),
                _ => None,
            })
            .collect()
    };
    assert_eq!(segments(is_activation), [1, 3]);
    assert_eq!(segments(is_activation_grad), [2]);
}

/// tp=2 × dp=2 × pp=2 (8 actors, 1F1B, 4 micro-batches): tp groups are consecutive actors,
/// gradients are reduced over the replicas holding the same slice, stages exchange activations
/// rank to rank, and the whole step verifies (compile runs the verifier).
#[test]
fn three_axes_keep_every_collective_in_its_group() {
    let mut p = with_tp(GPT, 2, 2);
    p.plan.pp = 2;
    p.plan.microbatches = 4;
    p.plan.batch = 8;
    let plan = compile(&p).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=2 × pp=2 × tp=2");
    for actor in 0..8 {
        let tp_group = vec![actor / 2 * 2, actor / 2 * 2 + 1];
        let g = all_reduces(&plan, actor, is_activation);
        assert!(
            !g.is_empty() && g.iter().all(|group| *group == tp_group),
            "actor {actor}"
        );
        let dp_group = vec![actor % 4, actor % 4 + 4];
        let grads = all_reduces(&plan, actor, |t| matches!(t, TensorId::GradBucket { .. }));
        assert!(
            !grads.is_empty() && grads.iter().all(|group| *group == dp_group),
            "actor {actor}"
        );
        for i in &plan.stream(actor).instructions {
            if let Instruction::Send { to, .. } = i {
                assert_eq!(to % 2, actor % 2, "actor {actor} sends to another tp rank");
            }
        }
    }
    let mut zero3 = with_tp(GPT, 2, 2);
    zero3.plan.zero = 3;
    compile(&zero3).unwrap();
}

/// Each rank's buckets hold its slice: at tp=2 the split parameters' bytes halve (the vocabulary
/// and the replicated LayerNorms and biases keep theirs).
#[test]
fn buckets_count_the_local_slice() {
    let bytes = |tp| -> u64 {
        (compile(&with_tp(GPT, 1, tp)).unwrap().buckets.iter())
            .map(|b| b.bytes)
            .sum()
    };
    let (one, two) = (bytes(1), bytes(2));
    assert!(two * 2 > one && two * 10 < one * 6, "tp=1 {one} B, tp=2 {two} B");
}

/// A described model whose blocks give no tensor-parallel form, or forms that do not meet, is
/// refused naming the block and `BlockInfo::with_tp`.
#[test]
fn refuses_blocks_without_or_with_mismatched_tp_forms() {
    let mut p = with_tp(GPT, 1, 2);
    p.model.blocks[2].tp = None;
    let why = refusal(&p);
    assert!(why.contains("`mlp.0`") && why.contains("with_tp"), "{why}");
    let mut p = with_tp(GPT, 1, 2);
    p.model.blocks[2].tp = Some(crate::tensor_parallel::BlockTp::new(
        crate::tensor_parallel::TpHeld::Sharded,
        crate::tensor_parallel::TpHeld::Partial,
    ));
    let why = refusal(&p);
    assert!(why.contains("`attn.0`") && why.contains("`mlp.0`"), "{why}");
}

/// The predicted tensor-parallel bytes of a gpt at tp=2: per micro-batch, 2 + 4·layers
/// all-reduces of `rows·ctx·d` f32 values (4 per layer, the embedding's g and the head's f), each
/// read as a two-member all-reduce reads, and the vocabulary-parallel loss's two statistics (a
/// maximum per token, two sums per token); once a step, the sums of the replicated parameters'
/// gradients (positions, LayerNorms, row-parallel biases); nothing counted as pipeline
/// activations.
#[test]
fn tensor_parallel_bytes_are_four_all_reduces_per_layer() {
    let mut p = with_tp(GPT, 1, 2);
    p.plan.microbatches = 2;
    let plan = compile(&p).unwrap();
    let (rows, ctx, d, layers) = (2, 16, 32, 2);
    let read = |kind, len| crate::fabric_bytes::collective_read_elems(kind, &[0, 1], 0, len) * 4;
    let per_layer_edge = read(CollectiveKind::AllReduceSum, rows * ctx * d);
    let loss =
        read(CollectiveKind::AllReduceMax, rows * ctx) + read(CollectiveKind::AllReduceSum, 2 * rows * ctx);
    let replicated = ctx * d + layers * 2 * (2 * d + d) + 2 * d;
    let grads = read(CollectiveKind::AllReduceSum, replicated);
    for bytes in &plan.fabric {
        let per_mb = (2 + 4 * layers as u64) * per_layer_edge + loss;
        assert_eq!(bytes.tensor_parallel, 2 * per_mb + grads);
        assert_eq!(bytes.activations + bytes.activation_grads, 0);
    }
}

/// A vocabulary-parallel head ends the forward in the two loss statistics' all-reduces (the
/// maximum first) before the loss, on every tp rank; a row-parallel output (mlp with an odd
/// layer count) is all-reduced by g and takes the plain loss.
#[test]
fn sharded_logits_take_the_vocabulary_parallel_loss() {
    let kinds = |spec: &str| -> Vec<(CollectiveKind, TensorId)> {
        let plan = compile(&with_tp(spec, 1, 2)).unwrap();
        (plan.stream(1).instructions.iter())
            .filter_map(|i| match i {
                Instruction::StartCollective { kind, tensor, .. }
                    if matches!(tensor, TensorId::LossMax { .. } | TensorId::LossSums { .. }) =>
                {
                    Some((*kind, tensor.clone()))
                }
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        kinds(GPT),
        [
            (CollectiveKind::AllReduceMax, TensorId::LossMax { mb: 0 }),
            (CollectiveKind::AllReduceSum, TensorId::LossSums { mb: 0 }),
        ]
    );
    assert_eq!(
        kinds("mlp:in=12,hidden=24,layers=2,out=6").len(),
        2,
        "even layers: sharded classes"
    );
    assert!(
        kinds("mlp:in=12,hidden=24,layers=3,out=6").is_empty(),
        "odd layers: g, then the plain loss"
    );
}

/// The replicated gradients of a bucket are summed over its tp group after the bucket's last
/// backward (which alone copies them out) and written back before its dp reduction; a bucket
/// without replicated parameters (mlp's column layers) has none.
#[test]
fn replicated_gradients_are_summed_over_tp_before_dp() {
    let mut p = with_tp("mlp:in=12,hidden=24,layers=3,out=6", 2, 2);
    p.plan.microbatches = 2;
    let plan = compile(&p).unwrap();
    let stream = &plan.stream(3).instructions;
    let position = |want: &dyn Fn(&Instruction) -> bool| stream.iter().position(want);
    for segment in 0..4 {
        let tp_sum = position(&|i| {
            matches!(i, Instruction::StartCollective { tensor: TensorId::TpGrads { segment: s }, group, .. }
                if *s == segment && *group == vec![2, 3])
        });
        let dp_sum = position(&|i| {
            matches!(i, Instruction::StartCollective { tensor: TensorId::GradBucket { segment: s }, group, .. }
                if *s == segment && *group == vec![1, 3])
        })
        .expect("every bucket is reduced over dp");
        // Row-parallel layers (1, 3) have a replicated bias; column layers (0, 2) none.
        match tp_sum {
            Some(at) => {
                assert!(segment % 2 == 1 && at < dp_sum, "segment {segment}");
                let write_back = position(&|i| {
                    matches!(i, Instruction::Compute { op: ComputeOp::ReplicatedGrads { start, .. }, .. }
                        if *start == segment)
                });
                assert!(
                    write_back.is_some_and(|w| at < w && w < dp_sum),
                    "segment {segment}"
                );
                // Only the bucket's last backward (of two micro-batches) copies them out.
                let copies = (stream.iter())
                    .filter(|i| {
                        matches!(i, Instruction::Compute { outputs, .. }
                        if outputs.contains(&TensorId::TpGrads { segment }))
                    })
                    .count();
                assert_eq!(copies, 1, "segment {segment}");
            }
            None => assert_eq!(segment % 2, 0, "segment {segment}"),
        }
    }
}

/// What the tensor-parallel step does not run yet is refused naming the fix: LAMB (its trust
/// ratios need norms over the group) and a block computed whole on every rank (its gradients
/// would be summed over the group).
#[test]
fn refuses_lamb_and_whole_blocks_under_tp() {
    let p = with_tp(GPT, 1, 2).with_optimizer(crate::OptimizerSpec::lamb(1e-3));
    let why = refusal(&p);
    assert!(why.contains("lamb") && why.contains("adamw"), "{why}");
    let mut p = with_tp(GPT, 1, 2);
    p.model.blocks[3].tp = Some(crate::tensor_parallel::BlockTp::new(
        crate::tensor_parallel::TpHeld::Replicated,
        crate::tensor_parallel::TpHeld::Replicated,
    ));
    let why = refusal(&p);
    assert!(
        why.contains("`attn.1`") && why.contains("whole on every rank"),
        "{why}"
    );
}

/// In bf16, g and f move the activations in bf16 (as the trainer holds them); the loss's
/// statistics and the replicated gradients' sums stay f32.
#[test]
fn tp_all_reduces_of_activations_take_the_compute_dtype() {
    let p = with_tp(GPT, 1, 2).with_precision(crate::precision::Precision::parse("bf16").unwrap());
    let plan = compile(&p).unwrap();
    for i in &plan.stream(0).instructions {
        if let Instruction::StartCollective { tensor, dtype, .. } = i {
            let want = match tensor {
                TensorId::Activation { .. } | TensorId::ActivationGrad { .. } => crate::DType::BF16,
                TensorId::LossMax { .. } | TensorId::LossSums { .. } | TensorId::TpGrads { .. } => {
                    crate::DType::F32
                }
                _ => continue,
            };
            assert_eq!(*dtype, want, "{tensor}");
        }
    }
}

/// Each rank's memory: its slices of the parameters (about 1/tp of them: the replicated ones
/// stay whole) and of the activations Korthikanti et al. count as cut by tp (12d of a layer's
/// 17d, and the scores), the rest (5d a layer) whole.
#[test]
fn memory_per_rank_holds_its_slices_of_parameters_and_activations() {
    let (one, two) = (
        compile(&with_tp(GPT, 1, 1)).unwrap(),
        compile(&with_tp(GPT, 1, 2)).unwrap(),
    );
    let (a, b) = (&one.memory[0], &two.memory[0]);
    let ratio = b.params as f64 / a.params as f64;
    assert!(
        ratio > 0.5 && ratio < 0.52,
        "params {} → {} ({ratio})",
        a.params,
        b.params
    );
    let (ctx, d, heads, vocab, rows) = (16u64, 32u64, 4u64, 64u64, 4u64);
    // Per sample: embedding ctx·d; per layer ctx·(17d + 3·heads·ctx); head ctx·(2d + 3·vocab).
    let layer_whole = ctx * (17 * d + 3 * heads * ctx);
    let layer_tp2 = ctx * (5 * d + (12 * d + 3 * heads * ctx) / 2);
    let whole = ctx * d + 2 * layer_whole + ctx * (2 * d + 3 * vocab);
    let tp2 = ctx * d + 2 * layer_tp2 + ctx * (2 * d + 3 * vocab / 2);
    assert_eq!(a.activations, 4 * rows * whole, "{a:?}");
    assert_eq!(b.activations, 4 * rows * tp2, "{b:?}");
}
