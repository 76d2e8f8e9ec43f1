//! Checkpoints under mixed precision (issue 38): the shards hold the f32 master and optimizer
//! state whatever the compute dtype, so a bf16 run resumes bit for bit as one that never stopped,
//! and resumes in f32 (and an f32 run in bf16) on any layout — each resumed layout equal to the
//! same resume on one device. A resume in another precision is refused unless
//! `--resume-override precision` says so (the run record names the precision).

use std::path::Path;

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{DType, OptimizerSpec, ParallelPlan, Precision};
use archipelago_integration_tests::precision::{bf16, max_abs, params, program};
use archipelago_integration_tests::{MARGIN, assert_caught, copy_dir, small_plan as plan, train_program};

const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";

fn options(steps: u64, dir: &Path, overrides: &[&str], resume: bool) -> TrainOptions {
    TrainOptions {
        keep_params: true,
        steps,
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every: 2,
        resume,
        resume_override: overrides.iter().map(|s| s.to_string()).collect(),
        ..TrainOptions::default()
    }
}

/// `precision` with f32 reduction: layouts then differ from one device by f32 order only.
fn exact(precision: Precision) -> Precision {
    precision.with_grad_reduce(DType::F32)
}

fn run(precision: Precision, layout: ParallelPlan, options: &TrainOptions) -> Result<TrainReport, String> {
    let optimizer = OptimizerSpec::sgd(0.1)
        .with_momentum(0.9, false)
        .expect("momentum");
    let program = program(MLP, optimizer, exact(precision), layout);
    // `train_program` panics on a refused job; a refusal is what one case here looks for.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| train_program(&program, options))).map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// Micro-batches of four rows: the small plan's batch of 24 over its replicas and micro-batches.
fn same_shape(dp: usize, pp: usize, zero: u8) -> ParallelPlan {
    let mut layout = plan(dp, pp, zero);
    layout.microbatches = 24 / 4 / dp;
    layout
}

#[test]
fn bf16_checkpoints_resume_in_either_precision_on_any_layout() {
    let root = tempfile::tempdir().unwrap();
    let (f32_precision, bf16_precision) = (Precision::default(), bf16());
    let mut on_one_device = Vec::new();
    for (first, then) in [
        (bf16_precision, bf16_precision),
        (bf16_precision, f32_precision),
        (f32_precision, bf16_precision),
    ] {
        let what = format!("{} → {}", first.compute, then.compute);
        let stopped = root.path().join(format!("{}-{}", first.compute, then.compute));
        run(first, same_shape(2, 1, 3), &options(4, &stopped, &[], false)).unwrap();
        let resume = |layout: ParallelPlan, name: &str| {
            let dir = root
                .path()
                .join(format!("{}-{}-{name}", first.compute, then.compute));
            copy_dir(&stopped, &dir);
            let overrides: &[&str] = if first == then {
                &["steps"]
            } else {
                &["steps", "precision"]
            };
            run(then, layout, &options(8, &dir, overrides, true)).unwrap()
        };
        let one = resume(same_shape(1, 1, 0), "one-device");
        assert_eq!(
            one.steps.first().map(|s| s.step),
            Some(5),
            "{what}: resumed at step 5"
        );
        for (layout, name) in [
            (same_shape(2, 1, 1), "dp=2 zero 1"),
            (same_shape(1, 2, 0), "pp=2"),
        ] {
            let resumed = resume(layout, &name.replace([' ', '='], "_"));
            let apart = max_abs(&params(&one), &params(&resumed));
            assert!(apart <= 1e-6, "{what} on {name}: {apart:e} from one device");
        }
        on_one_device.push(params(&one));
        if first == then {
            // Bit for bit as the bf16 run that never stopped.
            let never = root.path().join("never");
            let whole = run(first, same_shape(2, 1, 3), &options(8, &never, &[], false)).unwrap();
            let apart = max_abs(&params(&whole), &params(&one));
            assert!(apart <= 1e-6, "{what}: {apart:e} from the run that never stopped");
        }
    }
    // Control: the resume in f32 is caught by the same comparison against the resume in bf16
    // (the precision after a resume is the resumed run's).
    let apart = max_abs(&on_one_device[0], &on_one_device[1]);
    assert_caught("bf16 → f32 against bf16 → bf16", apart, 1e-6, MARGIN);
}

#[test]
fn another_precision_needs_the_override() {
    let root = tempfile::tempdir().unwrap();
    let stopped = root.path().join("bf16");
    run(bf16(), plan(1, 1, 0), &options(2, &stopped, &[], false)).unwrap();
    let refused = run(
        Precision::default(),
        plan(1, 1, 0),
        &options(4, &stopped, &["steps"], true),
    )
    .unwrap_err();
    assert!(
        refused.contains("precision: the checkpoint's run had BF16, this run has F32")
            && refused.contains("--resume-override precision"),
        "{refused}"
    );
}
