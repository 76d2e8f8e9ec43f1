//! Equivalence for sequence parallelism (Korthikanti et al. 2022): gpt at tp 2 and 4 with its
//! LayerNorm and residual regions cut along the tokens, with dp = 2, with activation
//! checkpointing (ZeRO-R's partitioned and offloaded checkpoints), ZeRO-3 × dp, ZB-H1, and
//! pp = 2 (1F1B, interleaved, × dp = 2: 8 actors, with partitioned checkpoints), and with only
//! the mixing blocks' inputs partitioned (those blocks recomputed; with pp and offload), trains
//! to one device's losses, step by step, and its parameters, element by element (the model's
//! sequence-parallel form holds the same parameters in the same order, cut into more blocks),
//! under SGD and AdamW; in bf16 within bf16's tolerance. Every run's measured fabric bytes equal
//! the plan's, and its tensor-parallel bytes equal plain tp's measured in the same run.
//!
//! The negative controls: the LayerNorms' gradients left unsummed over the group (each rank's
//! own tokens' share), and the residual stream's gradient dropped.

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program, TestFault};
use std::ops::Range;

use archipelago_integration_tests::{MARGIN, assert_caught, train_program, train_program_unchecked};

const GPT: &str = "gpt:vocab=64,ctx=8,d=32,layers=2,heads=4";
const STEPS: u64 = 4;
const BATCH: usize = 8;
/// Relative and absolute tolerances of the parameters and losses (f32 reduction order), and
/// Adam's absolute one with the key biases left out (as `tensor_parallel.rs` says why).
const RTOL: f64 = 1e-5;
const ATOL: f64 = 1e-6;
const ADAM_ATOL: f64 = 5e-4;
/// bf16: each step's loss within 2⁻¹⁰ of one device's in bf16 (an eighth of bf16's spacing
/// near 1).
const BF16_RTOL: f64 = 1.0 / 1024.0;

struct Run {
    report: TrainReport,
    /// Every parameter of the model in its order, flat (`None` for a broken run whose tp ranks
    /// no longer agree on their replicated parameters: its losses are compared).
    params: Option<Vec<f32>>,
}

fn plan(tp: usize, dp: usize, microbatches: usize) -> ParallelPlan {
    ParallelPlan {
        tp,
        dp,
        microbatches,
        batch: BATCH,
        bucket_bytes: 8 << 10,
        ..ParallelPlan::default()
    }
}

/// `plan` of gpt under `optimizer`, in the sequence-parallel form when `plan` asks for it.
fn program(optimizer: OptimizerSpec, plan: ParallelPlan) -> Program {
    let spec = ModelSpec::parse(GPT).expect("model spec");
    let sp = plan.sequence_parallel;
    let p = Program::new(spec.clone())
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_plan(plan);
    if sp {
        p.sequence_parallel(&spec).expect("the sequence-parallel form")
    } else {
        p
    }
}

fn sp(p: ParallelPlan) -> ParallelPlan {
    ParallelPlan {
        sequence_parallel: true,
        ..p
    }
}

fn run(program: &Program, steps: u64) -> Run {
    let options = TrainOptions {
        steps,
        ..TrainOptions::default()
    };
    let report = match program.test_fault {
        None => train_program(program, &options),
        Some(_) => train_program_unchecked(program, &options),
    };
    let params = archipelago_controller::replica_check::assemble_params(&report, &program.model);
    let params = match (params, program.test_fault) {
        (Ok(params), _) => Some(params.concat()),
        (Err(e), Some(fault)) => {
            eprintln!("{fault:?}: the tp ranks disagree ({e}); its losses are compared");
            None
        }
        (Err(e), None) => panic!("{}: {e}", program.model.name),
    };
    Run { report, params }
}

/// The key biases' flat places (their gradient is zero in exact arithmetic: Adam turns the
/// noise into steps of its learning rate on any two layouts).
fn key_biases() -> Vec<Range<usize>> {
    let desc = ModelSpec::parse(GPT).expect("model spec").desc();
    let mut at = 0;
    let mut found = Vec::new();
    for p in desc.blocks.iter().flat_map(|b| &b.param_descs) {
        if p.name.ends_with("qkv.bias") {
            found.push(at + p.len() / 3..at + 2 * p.len() / 3);
        }
        at += p.len();
    }
    found
}

/// Largest element-wise excess over `allclose(RTOL, atol)` over the parameters (but `skipped`)
/// and every step's loss.
fn excess(reference: &Run, run: &Run, atol: f64, skipped: &[Range<usize>]) -> f64 {
    let close = |x: f64, y: f64| (x - y).abs() / (atol + RTOL * x.abs());
    let (reference_params, params) = (
        reference.params.as_deref().unwrap_or(&[]),
        run.params.as_deref().unwrap_or(&[]),
    );
    if run.params.is_some() {
        assert_eq!(reference_params.len(), params.len(), "parameter counts");
    }
    let params = (reference_params.iter().zip(params).enumerate())
        .filter(|(i, _)| !skipped.iter().any(|r| r.contains(i)))
        .map(|(_, (&x, &y))| close(x as f64, y as f64));
    let losses = (reference.report.steps.iter().zip(&run.report.steps))
        .map(|(a, b)| close(a.loss as f64, b.loss as f64));
    assert_eq!(reference.report.steps.len(), run.report.steps.len());
    params.chain(losses).fold(0.0, f64::max)
}

fn tolerance(optimizer: &OptimizerSpec) -> (f64, Vec<Range<usize>>) {
    match optimizer.name() {
        "sgd" => (ATOL, Vec::new()),
        _ => (ADAM_ATOL, key_biases()),
    }
}

/// `plans` under `optimizer` each train to one device's losses and parameters.
fn check(optimizer: OptimizerSpec, plans: &[ParallelPlan]) {
    let reference = run(&program(optimizer, plan(1, 1, 1)), STEPS);
    let (atol, skipped) = tolerance(&optimizer);
    for p in plans {
        let what = format!(
            "{} tp={} dp={} pp={} m={} zero={} ckpt={} partitioned={} offloaded={} {:?}",
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
        let found = excess(
            &reference,
            &run(&program(optimizer, p.clone()), STEPS),
            atol,
            &skipped,
        );
        eprintln!("sequence-parallel {what}: worst excess over allclose {found:.3}");
        assert!(
            found <= 1.0,
            "{what}: {found:.2}× past allclose(rtol {RTOL}, atol {atol})"
        );
    }
}

#[test]
fn gpt_with_sequence_parallelism_matches_one_device() {
    let checkpointed = |partition: bool, offload: bool| ParallelPlan {
        checkpoint_activations: true,
        partition_activations: partition,
        offload_activations: offload,
        ..sp(plan(2, 1, 2))
    };
    let plans = [
        sp(plan(2, 1, 1)),
        sp(plan(4, 1, 1)),
        sp(plan(2, 2, 1)),
        checkpointed(true, false),
        checkpointed(true, true),
        ParallelPlan {
            zero: 3,
            ..sp(plan(2, 2, 1))
        },
        ParallelPlan {
            schedule: Schedule::ZbH1,
            ..sp(plan(2, 1, 2))
        },
        // Stages cut before LayerNorm blocks: the rank's tokens and the residual stream cross.
        ParallelPlan {
            pp: 2,
            ..sp(plan(2, 1, 4))
        },
        ParallelPlan {
            pp: 2,
            ..sp(plan(2, 2, 2))
        },
        ParallelPlan {
            pp: 2,
            schedule: Schedule::Interleaved,
            virtual_stages: 2,
            ..sp(plan(2, 1, 4))
        },
        ParallelPlan {
            pp: 2,
            checkpoint_activations: true,
            partition_activations: true,
            ..sp(plan(2, 1, 4))
        },
        // Only the mixing blocks' inputs kept as the rank's tokens, the blocks recomputed.
        ParallelPlan {
            partition_activations: true,
            ..sp(plan(2, 1, 2))
        },
        ParallelPlan {
            pp: 2,
            partition_activations: true,
            offload_activations: true,
            ..sp(plan(2, 2, 2))
        },
        // ZB-H1's split backward across stages, and with the mixing blocks recomputed.
        ParallelPlan {
            pp: 2,
            schedule: Schedule::ZbH1,
            ..sp(plan(2, 1, 4))
        },
        ParallelPlan {
            pp: 2,
            schedule: Schedule::ZbH1,
            partition_activations: true,
            ..sp(plan(2, 1, 4))
        },
    ];
    check(OptimizerSpec::sgd(0.2), &plans);
    let adamw = OptimizerSpec::adamw(1e-2).with_weight_decay(0.1);
    check(adamw, &plans[..3]);
    check(adamw, &plans[7..8]);
    check(adamw, &plans[11..12]);
}

/// The same bytes as plain tp: a reduce-scatter and an all-gather move what one all-reduce
/// does (measured in both runs, actor by actor).
#[test]
fn sequence_parallel_moves_plain_tps_bytes() {
    let sgd = OptimizerSpec::sgd(0.2);
    let bytes = |p: ParallelPlan| -> Vec<u64> {
        let run = run(&program(sgd, p), 2);
        (run.report.actors.iter())
            .map(|a| a.fabric_bytes_per_step.tensor_parallel)
            .collect()
    };
    let (plain, cut) = (bytes(plan(2, 1, 2)), bytes(sp(plan(2, 1, 2))));
    eprintln!("tensor-parallel bytes per step per actor: plain {plain:?}, sequence-parallel {cut:?}");
    assert!(plain.iter().all(|b| *b > 0));
    assert_eq!(plain, cut);
}

/// bf16: tp = 2 with sequence parallelism trains to one device's bf16 losses within bf16's
/// tolerance.
#[test]
fn sequence_parallel_in_bf16_matches_one_device_in_bf16() {
    let bf16 = archipelago_integration_tests::precision::bf16();
    let sgd = OptimizerSpec::sgd(0.2);
    let losses = |p: ParallelPlan| -> Vec<f64> {
        let run = run(&program(sgd, p).with_precision(bf16), 12);
        run.report.steps.iter().map(|s| s.loss as f64).collect()
    };
    let (one, cut) = (losses(plan(1, 1, 1)), losses(sp(plan(2, 1, 1))));
    let worst = (one.iter().zip(&cut))
        .map(|(a, b)| (a - b).abs() / a.abs())
        .fold(0.0, f64::max);
    eprintln!("bf16 sequence-parallel tp=2: worst relative loss difference {worst:.2e}");
    assert!(worst <= BF16_RTOL, "{worst:.2e} past {BF16_RTOL:.2e}");
}

#[test]
fn the_comparison_catches_a_broken_sequence_parallelism() {
    let sgd = OptimizerSpec::sgd(0.2);
    let reference = run(&program(sgd, plan(1, 1, 1)), STEPS);
    for (fault, what) in [
        (
            TestFault::SkipTpGradsReduce,
            "the LayerNorms' gradients unsummed over the group",
        ),
        (
            TestFault::DropResidualGrad,
            "the residual stream's gradient dropped",
        ),
    ] {
        let mut broken = program(sgd, sp(plan(2, 1, 1)));
        broken.test_fault = Some(fault);
        let found = excess(&reference, &run(&broken, STEPS), ATOL, &[]);
        eprintln!("{what}: {found:.3e}× past allclose");
        assert_caught(what, found, 1.0, MARGIN);
    }
}
