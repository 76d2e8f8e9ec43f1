//! Equivalence for tensor parallelism (Megatron-LM, Shoeybi et al. 2019; 3-D meshes, Narayanan
//! et al. 2021): gpt at tp 2 and 4, a vocabulary tp does not divide (padded), the mlp at tp 2 and
//! 3 (a last layer row-parallel, whose output is g's sum, and column-parallel, whose logits take
//! the vocabulary-parallel loss), tp × dp, tp × pp (1F1B, m = 4), tp × dp × pp (8 actors),
//! tp × ZeRO-3 × dp, an mlp's stages cut where the activation is sharded, tp with activation
//! checkpointing, with clipping, with the state on the device (ZeRO-2 × dp) and offloaded to the
//! host (ZeRO-2 × dp), and ZeRO-R's partitioned (and offloaded) activation checkpoints: each trains to one device's losses, step by step, and its parameters,
//! element by element — gathered from every
//! tp rank's slices put back at their global places (the replica check also holds every
//! replicated parameter equal over each tp group) — under plain SGD and AdamW. Every run's
//! measured fabric bytes equal the plan's, kind by kind (tensor-parallel bytes included).
//!
//! The negative controls break one piece each and the same comparison must catch it by a wide
//! margin: Megatron's f left out (the backward all-reduce of a replicated input's gradient), g
//! left out (the forward all-reduce of a partial output), the vocabulary-parallel loss taking
//! each rank's own maximum, and the fused qkv cut contiguously instead of per head.

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{
    ModelSpec, Offload, OptimizerSpec, ParallelPlan, Program, StatePlacement, TestFault,
};
use std::ops::Range;

use archipelago_integration_tests::{MARGIN, assert_caught, train_program, train_program_unchecked};

const GPT: &str = "gpt:vocab=64,ctx=8,d=32,layers=2,heads=4";
/// 63 tokens: tp 2 and 4 pad the vocabulary (the last rank's slice has padding columns).
const GPT_PADDED: &str = "gpt:vocab=63,ctx=8,d=32,layers=2,heads=4";
/// 9 tokens at tp = 4: the last rank holds no token of the vocabulary.
const GPT_ALL_PADDING: &str = "gpt:vocab=9,ctx=8,d=32,layers=2,heads=4";
/// Three hidden layers and the output (four blocks, column- and row-parallel in turn): the last
/// is row-parallel, its output a partial sum (g before the loss).
const MLP_PARTIAL: &str = "mlp:in=12,hidden=24,layers=3,out=6";
/// Four hidden layers and the output (five blocks): the last is column-parallel, its logits
/// sharded (the vocabulary-parallel loss).
const MLP_SHARDED: &str = "mlp:in=12,hidden=24,layers=4,out=6";
const STEPS: u64 = 4;
/// Steps of the bf16 comparison, and its relative bound on each step's loss: a quarter of
/// bf16's last place (2⁻¹⁰; one step's loss is a mean over every token, whose roundings mostly
/// cancel: measured 2.0e-4 under SGD on 2026-11-28).
const BF16_STEPS: u64 = 12;
const BF16_RTOL: f64 = 1.0 / 1024.0;
const BATCH: usize = 8;
/// Relative tolerance of the losses and the parameters (f32 reduction order).
const RTOL: f64 = 1e-5;
/// Absolute tolerance of the parameters (elements near zero).
const ATOL: f64 = 1e-6;
/// Absolute tolerance of the parameters under Adam (see [`tolerance`]): 1/20 of one step of
/// its learning rate (1e-2). Measured on 2026-11-28 with ATOL instead, the worst excess was 7.2
/// for dp = 2 (no tp at all), 29 for tp = 2 and 114 for tp = 2 with the padded vocabulary, all
/// from elements whose gradients are small (a worst difference of 1.6e-4).
const ADAM_ATOL: f64 = 5e-4;

/// A finished run: its report and every parameter of the model, block by block.
struct Run {
    report: TrainReport,
    params: Vec<Vec<f32>>,
}

fn sgd() -> OptimizerSpec {
    OptimizerSpec::sgd(0.2)
}

fn adamw() -> OptimizerSpec {
    OptimizerSpec::adamw(1e-2).with_weight_decay(0.1)
}

fn plan(tp: usize, dp: usize, pp: usize, microbatches: usize) -> ParallelPlan {
    ParallelPlan {
        tp,
        dp,
        pp,
        microbatches,
        schedule: Schedule::OneFOneB,
        batch: BATCH,
        bucket_bytes: 8 << 10,
        ..ParallelPlan::default()
    }
}

fn program(model: &str, optimizer: OptimizerSpec, plan: ParallelPlan) -> Program {
    Program::new(ModelSpec::parse(model).expect("model spec"))
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_plan(plan)
}

/// Trains `program` for `STEPS` and gathers every parameter from the actors' reports (checking
/// that replicas, tp ranks' replicated parameters included, agree, unless a fault is injected).
fn run(program: &Program) -> Run {
    let options = TrainOptions {
        steps: STEPS,
        ..TrainOptions::default()
    };
    let report = match program.test_fault {
        None => train_program(program, &options),
        Some(_) => train_program_unchecked(program, &options),
    };
    let params = archipelago_controller::replica_check::assemble_params(&report, &program.model)
        .unwrap_or_else(|e| panic!("{}: {e}", program.model.name));
    Run { report, params }
}

/// Largest element-wise excess over `allclose(rtol = RTOL, atol)` over all parameters (but the
/// `skipped` ranges, by block) and every step's loss: an excess ≤ 1 passes.
fn excess(reference: &Run, run: &Run, atol: f64, skipped: &[(usize, Range<usize>)]) -> f64 {
    let close = |x: f64, y: f64| (x - y).abs() / (atol + RTOL * x.abs());
    let mut worst = 0.0f64;
    assert_eq!(reference.params.len(), run.params.len(), "block counts");
    for (block, (a, b)) in reference.params.iter().zip(&run.params).enumerate() {
        assert_eq!(a.len(), b.len(), "block sizes");
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            if skipped.iter().any(|(s, r)| *s == block && r.contains(&i)) {
                continue;
            }
            if std::env::var("TP_DEBUG").is_ok() && close(x as f64, y as f64) > 1.0 {
                eprintln!("  block {block} element {i} of {}: {x} vs {y}", a.len());
            }
            worst = worst.max(close(x as f64, y as f64));
        }
    }
    assert_eq!(
        reference.report.steps.len(),
        run.report.steps.len(),
        "step counts"
    );
    for (a, b) in reference.report.steps.iter().zip(&run.report.steps) {
        worst = worst.max(close(a.loss as f64, b.loss as f64));
    }
    worst
}

/// The key biases of a gpt (the middle third of each `qkv.bias`), by block: their gradient is
/// zero in exact arithmetic (a key bias adds `q·b` to every score of a query's row, which the
/// softmax does not see), so what reaches them is reduction-order noise, which Adam's
/// normalised step turns into steps of up to its learning rate on any two layouts (dp = 2
/// against one device shows it as much as tp does). SGD compares them with the rest.
fn key_biases(model: &str) -> Vec<(usize, Range<usize>)> {
    let desc = ModelSpec::parse(model).expect("model spec").desc();
    let mut found = Vec::new();
    for (block, info) in desc.blocks.iter().enumerate() {
        let mut at = 0;
        for p in &info.param_descs {
            if p.name.ends_with("qkv.bias") {
                let third = p.len() / 3;
                found.push((block, at + third..at + 2 * third));
            }
            at += p.len();
        }
    }
    found
}

/// The absolute tolerance of the parameters under `optimizer`, and what it leaves out: SGD
/// applies the gradient as it is (f32's reduction order, element by element, everywhere);
/// Adam divides by its root mean square, which turns a difference in the last places of a small
/// gradient into a larger one of the step ([`ADAM_ATOL`]), and noise alone into steps of up to
/// its learning rate (the key biases, [`key_biases`]).
fn tolerance(model: &str, optimizer: &OptimizerSpec) -> (f64, Vec<(usize, Range<usize>)>) {
    match optimizer.name() {
        "sgd" => (ATOL, Vec::new()),
        _ => (ADAM_ATOL, key_biases(model)),
    }
}

/// `plans` of `model` under `optimizer` each train to one device's losses and parameters.
fn check(model: &str, optimizer: OptimizerSpec, plans: &[ParallelPlan]) {
    check_with(model, optimizer, plans, |_| {});
}

/// [`check`] with `edit` made to every program (the reference's too).
fn check_with(model: &str, optimizer: OptimizerSpec, plans: &[ParallelPlan], edit: impl Fn(&mut Program)) {
    let programme = |p: ParallelPlan| {
        let mut program = program(model, optimizer, p);
        edit(&mut program);
        program
    };
    let reference = run(&programme(plan(1, 1, 1, 1)));
    let first = &reference.report.steps[0].loss;
    let last = &reference.report.steps.last().unwrap().loss;
    assert!(
        first.is_finite() && last.is_finite(),
        "{model}: losses {first} → {last}"
    );
    for p in plans {
        let what = format!(
            "{model} {} tp={} dp={} pp={} m={} zero={} ckpt={} partitioned={} offloaded={} {:?}",
            optimizer.name(),
            p.tp,
            p.dp,
            p.pp,
            p.microbatches,
            p.zero,
            p.checkpoint_activations,
            p.partition_activations,
            p.offload_activations,
            p.schedule
        );
        let run = run(&programme(p.clone()));
        let (atol, skipped) = tolerance(model, &optimizer);
        let found = excess(&reference, &run, atol, &skipped);
        eprintln!("{what}: worst excess over allclose {found:.3}");
        assert!(
            found <= 1.0,
            "{what}: {found:.2}× past allclose(rtol {RTOL}, atol {ATOL})"
        );
    }
}

#[test]
fn gpt_at_tp_2_and_4_matches_one_device() {
    check(GPT, sgd(), &[plan(2, 1, 1, 1), plan(4, 1, 1, 1)]);
    // dp = 2 beside them: Adam's tolerance is what any second layout needs.
    check(
        GPT,
        adamw(),
        &[plan(1, 2, 1, 1), plan(2, 1, 1, 1), plan(4, 1, 1, 1)],
    );
}

#[test]
fn a_vocabulary_tp_does_not_divide_is_padded() {
    for optimizer in [sgd(), adamw()] {
        check(GPT_PADDED, optimizer, &[plan(2, 1, 1, 1), plan(4, 1, 1, 1)]);
    }
    // 9 tokens over 4 ranks of 3: the last rank's slice is padding only.
    check(GPT_ALL_PADDING, sgd(), &[plan(4, 1, 1, 1)]);
}

#[test]
fn mlp_at_tp_2_and_3_matches_one_device() {
    for model in [MLP_PARTIAL, MLP_SHARDED] {
        for optimizer in [sgd(), adamw()] {
            check(model, optimizer, &[plan(2, 1, 1, 1), plan(3, 1, 1, 1)]);
        }
    }
}

#[test]
fn tp_composes_with_dp_pp_zero_checkpointing_and_clipping() {
    let zero3 = ParallelPlan {
        zero: 3,
        ..plan(2, 2, 1, 1)
    };
    let checkpointed = ParallelPlan {
        checkpoint_activations: true,
        ..plan(2, 1, 2, 4)
    };
    // The state on the device: the replicated gradients are read from and written into the
    // device's buckets.
    let on_device = ParallelPlan {
        zero: 2,
        state: StatePlacement::Device,
        ..plan(2, 2, 1, 1)
    };
    // ZeRO-Offload: each rank's shard of its slices updated by its offload actor.
    let offloaded = ParallelPlan {
        zero: 2,
        offload: Offload::Cpu,
        ..plan(2, 2, 1, 1)
    };
    // ZB-H1 (the weight gradients in their own pass) and interleaved stages (two chunks each).
    let zero_bubble = ParallelPlan {
        schedule: Schedule::ZbH1,
        ..plan(2, 1, 2, 4)
    };
    let interleaved = ParallelPlan {
        schedule: Schedule::Interleaved,
        virtual_stages: 2,
        ..plan(2, 1, 2, 4)
    };
    let plans = [
        zero_bubble,
        interleaved,
        offloaded,
        plan(2, 2, 1, 1),
        plan(2, 1, 2, 4),
        plan(2, 2, 2, 2),
        zero3,
        checkpointed,
        on_device,
    ];
    check(GPT, sgd(), &plans);
    // An mlp's stages cut after a column-parallel layer: the activation crosses as each rank's
    // shard (and its gradient back).
    let sharded_boundary = ParallelPlan {
        stages: Some(vec![(0, 1), (1, 5)]),
        ..plan(2, 1, 2, 2)
    };
    check(MLP_SHARDED, sgd(), &[sharded_boundary]);
    // Clipping's global norm counts each replicated parameter once over the tp group.
    let offloaded_clipped = ParallelPlan {
        zero: 1,
        offload: Offload::Cpu,
        ..plan(2, 2, 1, 1)
    };
    for optimizer in [sgd(), adamw()] {
        let plans = [plan(2, 2, 1, 1), offloaded_clipped.clone()];
        check_with(GPT, optimizer, &plans, |p| p.clip_grad_norm = Some(0.05));
    }
}

/// Each fault lands far past the tolerance the plans above meet: under SGD, element-wise at
/// f32's tolerance; one under AdamW at Adam's.
#[test]
fn the_comparison_catches_a_broken_tensor_parallelism() {
    let faults = [
        (GPT, sgd(), TestFault::SkipTpInputGradReduce, "f skipped"),
        (GPT, sgd(), TestFault::SkipTpOutputReduce, "g skipped"),
        (
            GPT,
            sgd(),
            TestFault::LocalLossMax,
            "the loss with each rank's own maximum",
        ),
        (GPT, sgd(), TestFault::ContiguousQkv, "qkv cut contiguously"),
        (
            MLP_PARTIAL,
            sgd(),
            TestFault::SkipTpOutputReduce,
            "g skipped before the loss",
        ),
        (
            MLP_SHARDED,
            sgd(),
            TestFault::SkipTpInputGradReduce,
            "the mlp with f skipped",
        ),
        (
            MLP_SHARDED,
            sgd(),
            TestFault::LocalLossMax,
            "the mlp's loss with each rank's own maximum",
        ),
        (
            GPT,
            adamw(),
            TestFault::SkipTpInputGradReduce,
            "f skipped, under AdamW",
        ),
    ];
    for (model, optimizer, fault, what) in faults {
        let reference = run(&program(model, optimizer, plan(1, 1, 1, 1)));
        let mut broken = program(model, optimizer, plan(2, 1, 1, 1));
        broken.test_fault = Some(fault);
        let (atol, skipped) = tolerance(model, &optimizer);
        let found = excess(&reference, &run(&broken), atol, &skipped);
        assert_caught(what, found, 1.0, MARGIN);
    }
}

/// Mixed precision: tp = 2 in bf16 trains to one device's bf16 losses, step by step, within
/// bf16's tolerance ([`BF16_RTOL`]); f left out lands far past it.
#[test]
fn tp_2_in_bf16_matches_one_device_in_bf16() {
    let bf16 = archipelago_integration_tests::precision::bf16();
    for optimizer in [sgd(), adamw()] {
        let programme = |tp: usize, fault: Option<TestFault>| {
            let mut p = program(GPT, optimizer, plan(tp, 1, 1, 1)).with_precision(bf16);
            p.test_fault = fault;
            p
        };
        let losses = |p: &Program| -> Vec<f64> {
            let options = TrainOptions {
                steps: BF16_STEPS,
                ..TrainOptions::default()
            };
            let report = match p.test_fault {
                None => train_program(p, &options),
                Some(_) => train_program_unchecked(p, &options),
            };
            report.steps.iter().map(|s| s.loss as f64).collect()
        };
        let reference = losses(&programme(1, None));
        let worst = |run: &[f64]| {
            (reference.iter().zip(run))
                .map(|(a, b)| ((a - b) / a).abs())
                .fold(0.0, f64::max)
        };
        let what = format!("gpt {} bf16", optimizer.name());
        let tp2 = worst(&losses(&programme(2, None)));
        eprintln!("{what}: tp=2 against one device, worst step's loss {tp2:.2e} apart");
        assert!(
            tp2 < BF16_RTOL,
            "{what}: tp=2 {tp2:.2e} from one device (bound {BF16_RTOL})"
        );
        let broken = worst(&losses(&programme(2, Some(TestFault::SkipTpInputGradReduce))));
        assert_caught(&format!("{what}: f skipped"), broken, BF16_RTOL, MARGIN);
    }
}

/// ZeRO-R (Rajbhandari et al. 2019 §6): under activation checkpointing at tp = 2, each rank keeps
/// half of every checkpointed input the group holds whole and the group all-gathers it before
/// the recompute; `--offload-activations cpu` keeps what is checkpointed in host memory. Each
/// variant — with 1F1B pipelines, ZB-H1, dp × pp (8 actors) and ZeRO-3 (which implies
/// checkpointing) — trains to one device's losses and parameters under SGD and AdamW; the
/// checkpoint bytes each actor held at the peak (measured by the trainer) are half of the
/// unpartitioned run's, none on the device when offloaded, and the plan's estimate. The control:
/// a recompute reading the rank's own part without the gather.
#[test]
fn partitioned_and_offloaded_activation_checkpoints_match_one_device() {
    let kept = |partition: bool, offload: bool, p: ParallelPlan| ParallelPlan {
        checkpoint_activations: true,
        partition_activations: partition,
        offload_activations: offload,
        ..p
    };
    let partitioned = kept(true, false, plan(2, 1, 1, 2));
    let plans = [
        partitioned.clone(),
        kept(true, true, plan(2, 1, 1, 2)),
        kept(false, true, plan(1, 1, 1, 2)),
        kept(true, false, plan(2, 1, 2, 4)),
        kept(true, true, plan(2, 2, 2, 2)),
        ParallelPlan {
            schedule: Schedule::ZbH1,
            ..kept(true, false, plan(2, 1, 2, 4))
        },
        ParallelPlan {
            schedule: Schedule::Interleaved,
            virtual_stages: 2,
            ..kept(true, false, plan(2, 1, 2, 4))
        },
        // ZeRO-3 implies the checkpointing the parts are kept for.
        ParallelPlan {
            zero: 3,
            checkpoint_activations: false,
            ..kept(true, false, plan(2, 2, 1, 1))
        },
    ];
    check(GPT, sgd(), &plans);
    check(GPT, adamw(), &plans[..2]);
    check(MLP_SHARDED, sgd(), std::slice::from_ref(&partitioned));

    let peaks = |model: &str, p: ParallelPlan| {
        let run = run(&program(model, sgd(), p));
        let actors = run.report.actors.iter();
        let measured: Vec<_> = actors.clone().map(|a| a.activation_checkpoint_bytes).collect();
        let estimated: Vec<_> = actors.map(|a| a.estimated_activation_checkpoint_bytes).collect();
        assert_eq!(measured, estimated, "the plan's estimate of the checkpoints");
        measured
    };
    let whole = peaks(GPT, kept(false, false, plan(2, 1, 1, 2)));
    let halves = peaks(GPT, partitioned.clone());
    let offloaded = peaks(GPT, kept(true, true, plan(2, 1, 1, 2)));
    eprintln!("checkpoint bytes per actor: whole {whole:?}, partitioned {halves:?}, offloaded {offloaded:?}");
    for ((w, h), o) in whole.iter().zip(&halves).zip(&offloaded) {
        assert!(w.device > 0 && w.host == 0, "{w:?}");
        assert_eq!(2 * h.device, w.device, "a rank keeps half of each input");
        assert_eq!(
            (o.device, o.host),
            (0, h.device),
            "offloaded: the same half, on the host"
        );
    }
    // The mlp: dense rows in (the batch is no checkpoint), inputs after a column-parallel layer
    // already a rank's slice (kept as they are), the others partitioned; as estimated.
    let mlp = peaks(MLP_SHARDED, partitioned.clone());
    assert!(mlp.iter().all(|b| b.device > 0), "{mlp:?}");
    // Partitioning only moves bytes: in bf16 the losses and parameters are those of the
    // unpartitioned run, bit for bit (the parts' byte offsets in 16 bits).
    let bf16 = archipelago_integration_tests::precision::bf16();
    let in_bf16 = |partition| {
        let p = kept(partition, false, plan(2, 1, 1, 2));
        run(&program(GPT, sgd(), p).with_precision(bf16))
    };
    let (plain, parted) = (in_bf16(false), in_bf16(true));
    assert_eq!(plain.params, parted.params, "bf16 parameters");
    let losses = |r: &Run| r.report.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
    assert_eq!(losses(&plain), losses(&parted), "bf16 losses");

    let reference = run(&program(GPT, sgd(), plan(1, 1, 1, 1)));
    let mut broken = program(GPT, sgd(), partitioned);
    broken.test_fault = Some(TestFault::SkipCheckpointGather);
    let found = excess(&reference, &run(&broken), ATOL, &[]);
    assert_caught(
        "the recompute without the checkpoint's gather",
        found,
        1.0,
        MARGIN,
    );
}
