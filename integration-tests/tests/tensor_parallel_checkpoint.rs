//! Checkpoints under tensor parallelism: each tp rank writes its slices at their global places
//! (`Slice::Tp`: the per-head qkv split, padding left out, a ZeRO shard inside a rank's slice),
//! the replicated parameters once; so a checkpoint of tp = 2 × dp = 2 × ZeRO-1 resumes at
//! tp = 2, tp = 1, tp = 4, pp = 2 × dp = 2 and tp = 2 × pp = 2, and one of tp = 1 resumes at
//! tp = 2 and tp = 4, each training on to the parameters (element by element) and losses of a
//! job that never stopped. The block-wise reader `export` uses reads the whole model from a tp
//! checkpoint, equal to the one device's checkpoint of the same step. The control: a resume
//! that cuts qkv contiguously (`TestFault::ContiguousQkv`) is caught by the same comparison.

use std::path::Path;

use archipelago_actors::checkpoint::{CheckpointReader, step_dir};
use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program, TestFault};
use archipelago_integration_tests::{MARGIN, assert_caught, copy_dir, train_program};

/// A vocabulary tp = 4 pads (63 tokens), heads tp = 4 divides.
const GPT: &str = "gpt:vocab=63,ctx=8,d=32,layers=2,heads=4";
const STEPS: u64 = 6;
const STOP: u64 = 3;
const RTOL: f64 = 1e-5;
const ATOL: f64 = 1e-6;

fn plan(tp: usize, dp: usize, pp: usize, zero: u8) -> ParallelPlan {
    ParallelPlan {
        tp,
        dp,
        pp,
        zero,
        microbatches: if pp > 1 { 2 } else { 1 },
        batch: 8,
        bucket_bytes: 8 << 10,
        ..ParallelPlan::default()
    }
}

/// SGD with momentum: optimizer state to carry over, and the gradient's scale passed on.
fn program(plan: ParallelPlan) -> Program {
    let sgd = OptimizerSpec::sgd(0.2)
        .with_momentum(0.9, false)
        .expect("momentum");
    Program::new(ModelSpec::parse(GPT).expect("model spec"))
        .with_seed(7)
        .with_optimizer(sgd)
        .with_plan(plan)
}

fn train(plan: ParallelPlan, steps: u64, dir: Option<&Path>, resume: bool) -> (TrainReport, Vec<Vec<f32>>) {
    train_with_fault(plan, steps, dir, resume, None)
}

fn train_with_fault(
    plan: ParallelPlan,
    steps: u64,
    dir: Option<&Path>,
    resume: bool,
    fault: Option<TestFault>,
) -> (TrainReport, Vec<Vec<f32>>) {
    let mut program = program(plan);
    program.test_fault = fault;
    let options = TrainOptions {
        steps,
        checkpoint_dir: dir.map(Path::to_path_buf),
        checkpoint_every: STOP,
        resume,
        resume_override: if resume { vec!["steps".into()] } else { Vec::new() },
        ..TrainOptions::default()
    };
    let report = train_program(&program, &options);
    let params = archipelago_controller::replica_check::assemble_params(&report, &program.model)
        .unwrap_or_else(|e| panic!("{e}"));
    (report, params)
}

/// Worst element-wise excess over `allclose(RTOL, ATOL)` of `run`'s parameters and losses
/// against the reference's (the losses from the resumed run's first step on).
fn excess(reference: &(TrainReport, Vec<Vec<f32>>), run: &(TrainReport, Vec<Vec<f32>>)) -> f64 {
    let close = |x: f64, y: f64| (x - y).abs() / (ATOL + RTOL * x.abs());
    let mut worst = 0.0f64;
    for (a, b) in reference.1.iter().zip(&run.1) {
        assert_eq!(a.len(), b.len(), "block sizes");
        for (&x, &y) in a.iter().zip(b) {
            worst = worst.max(close(x as f64, y as f64));
        }
    }
    for s in &run.0.steps {
        let r = reference.0.steps[s.step as usize - 1].loss;
        worst = worst.max(close(r as f64, s.loss as f64));
    }
    assert_eq!(
        run.0.steps.last().map(|s| s.step),
        Some(STEPS),
        "the resumed run's last step"
    );
    worst
}

/// The whole model, block by block, as `export` reads it from the checkpoint of step `step`.
fn exported(dir: &Path, step: u64) -> Vec<Vec<f32>> {
    let reader = CheckpointReader::open(&step_dir(dir, step)).expect("checkpoint");
    let model = ModelSpec::parse(GPT).unwrap().desc();
    (model.blocks.iter().enumerate())
        .map(|(b, info)| {
            let [values, _, _] = reader
                .read_values(b, 0..info.params as usize, 0)
                .unwrap_or_else(|e| panic!("block {b}: {e}"));
            values
        })
        .collect()
}

fn resumes(from: &Path, layouts: &[(ParallelPlan, &str)], reference: &(TrainReport, Vec<Vec<f32>>)) {
    let root = tempfile::tempdir().unwrap();
    for (layout, what) in layouts {
        let dir = root.path().join(what.replace([' ', '=', '×'], "_"));
        copy_dir(from, &dir);
        let resumed = train(layout.clone(), STEPS, Some(&dir), true);
        assert_eq!(resumed.0.steps.first().map(|s| s.step), Some(STOP + 1), "{what}");
        let found = excess(reference, &resumed);
        eprintln!("resumed at {what}: worst excess over allclose {found:.3}");
        assert!(found <= 1.0, "{what}: {found:.2}× past allclose({RTOL}, {ATOL})");
    }
}

#[test]
fn a_tp_checkpoint_resumes_at_any_layout_and_back() {
    let root = tempfile::tempdir().unwrap();
    let one_dir = root.path().join("one");
    let reference = train(plan(1, 1, 1, 0), STEPS, Some(&one_dir), false);
    let tp_dir = root.path().join("tp2-dp2-zero1");
    train(plan(2, 2, 1, 1), STOP, Some(&tp_dir), false);
    // The whole model, read block-wise as `export` reads it, equals one device's.
    let (whole, reference_whole) = (exported(&tp_dir, STOP), exported(&one_dir, STOP));
    for (b, (x, y)) in whole.iter().zip(&reference_whole).enumerate() {
        let worst = (x.iter().zip(y))
            .map(|(a, b)| (a - b).abs() as f64)
            .fold(0.0, f64::max);
        assert!(
            worst < 1e-5,
            "block {b}: the tp checkpoint's whole model is {worst:e} off"
        );
    }
    resumes(
        &tp_dir,
        &[
            (plan(2, 2, 1, 1), "tp=2 × dp=2 zero 1 (the same)"),
            (plan(1, 1, 1, 0), "tp=1"),
            (plan(4, 1, 1, 0), "tp=4"),
            (plan(1, 2, 2, 0), "pp=2 × dp=2"),
            (plan(2, 1, 2, 0), "tp=2 × pp=2"),
        ],
        &reference,
    );
    // And back: a checkpoint of one device (ZeRO-2 at dp = 2) resumed under tp.
    let dp_dir = root.path().join("dp2-zero2");
    train(plan(1, 2, 1, 2), STOP, Some(&dp_dir), false);
    resumes(
        &dp_dir,
        &[
            (plan(2, 1, 1, 0), "tp=2"),
            (plan(4, 2, 1, 3), "tp=4 × dp=2 zero 3"),
        ],
        &reference,
    );
    // The control: a resume that takes each rank's qkv as a contiguous cut of the whole.
    let dir = root.path().join("control");
    copy_dir(&tp_dir, &dir);
    let fault = Some(TestFault::ContiguousQkv);
    let broken = train_with_fault(plan(2, 1, 1, 0), STEPS, Some(&dir), true, fault);
    assert_caught(
        "a resume with qkv cut contiguously",
        excess(&reference, &broken),
        1.0,
        MARGIN,
    );
}
