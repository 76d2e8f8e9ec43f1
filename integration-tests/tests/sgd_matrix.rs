//! Equivalence under plain SGD (no momentum), element by element: every layout — dp, each
//! pipeline schedule, ZeRO 1/2/3, offload with ZeRO, pp × dp — trains to the same losses, step by
//! step, and the same parameters, element by element (read back from a checkpoint written at the
//! end, which holds every parameter whatever the layout sharded), as one device with the same
//! global batch. SGD applies the gradient as it is, so a gradient summed where it should be
//! averaged (or the reverse) shows here, where Adam would hide it.
//!
//! The negative controls inject one fault each (`Program::test_fault`, a test-only hook) and
//! assert that the same element-wise comparison catches it by a wide margin: an all-reduce
//! skipped, one replica's gradient dropped, micro-batch gradients averaged instead of summed, a
//! ZeRO shard updated at the wrong offset. `state_on_device` runs the matrix with the training
//! state on the device and checks the host ⇄ device bytes each step reports; `offload_clipping`
//! checks the deferred offloaded update under clipping; `frozen` trains a model with frozen
//! parameters on dp, pp and ZeRO-3 against one device; `stores` runs one plan with the state in
//! host memory, on the device and offloaded to host memory and to files, element-wise alike.

#[path = "sgd_matrix/frozen.rs"]
mod frozen;
#[path = "sgd_matrix/offload_clipping.rs"]
mod offload_clipping;
#[path = "sgd_matrix/state_on_device.rs"]
mod state_on_device;
#[path = "sgd_matrix/stores.rs"]
mod stores;

use archipelago_actors::checkpoint::{CheckpointReader, step_dir};
use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{ModelSpec, Offload, OptimizerSpec, ParallelPlan, Program, TestFault};
use archipelago_integration_tests::{
    assert_equivalent, assert_replicas_agree, assert_same_losses_and_norms, replica_params, small_plan,
    train_program, train_program_unchecked,
};

const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const STEPS: u64 = 6;
const LR: f32 = 0.5;
/// Relative tolerance of the losses and the parameters (f32 reduction order).
const RTOL: f64 = 1e-5;
/// Absolute tolerance of the parameters (elements near zero).
const ATOL: f64 = 1e-6;
/// How far past the tolerance a fault must land for its control to count as caught.
const MARGIN: f64 = 100.0;

/// A finished run: its report and every parameter, block by block.
struct Run {
    report: TrainReport,
    params: Vec<Vec<f32>>,
}

/// Trains the mlp with plain SGD under `plan` (with `fault` injected), checkpointing after the
/// last step, and reads every parameter back from that checkpoint.
fn run(plan: ParallelPlan, fault: Option<TestFault>) -> Run {
    let mut program = Program::new(ModelSpec::parse(MLP).expect("model spec"))
        .with_seed(7)
        .with_optimizer(OptimizerSpec::sgd(LR))
        .with_plan(plan);
    // A fault may make the replicas disagree: its control measures how far, instead.
    let check_replicas = fault.is_none();
    program.test_fault = fault;
    run_checked(program, check_replicas)
}

/// Trains `program` for `STEPS`, checkpointing after the last step, checks that its replicas
/// agree, and reads every parameter back from that checkpoint.
fn run_program(program: Program) -> Run {
    run_checked(program, true)
}

/// [`run_program`], with or without the replica check.
fn run_checked(program: Program, check_replicas: bool) -> Run {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = TrainOptions {
        steps: STEPS,
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: STEPS,
        ..TrainOptions::default()
    };
    let report = if check_replicas {
        train_program(&program, &options)
    } else {
        train_program_unchecked(&program, &options)
    };
    let reader = CheckpointReader::open(&step_dir(dir.path(), STEPS)).expect("final checkpoint");
    let params = program
        .model
        .blocks
        .iter()
        .enumerate()
        .map(|(b, info)| {
            let [p, _, _] = reader
                .read_values(b, 0..info.params as usize, 0)
                .unwrap_or_else(|e| panic!("block {b}: {e}"));
            p
        })
        .collect();
    Run { report, params }
}

/// One device, the same global batch: what every layout must reproduce. (Six layers under
/// plain SGD barely lower the loss in six steps; the controls show the parameters move enough
/// for a wrong gradient to show.)
fn reference() -> Run {
    run(small_plan(1, 1, 0), None)
}

/// Largest element-wise excess over `allclose(rtol = RTOL, atol = ATOL)` over all parameters,
/// and the largest absolute difference: an excess ≤ 1 passes.
fn param_difference(reference: &Run, run: &Run) -> (f64, f64) {
    assert_eq!(reference.params.len(), run.params.len(), "block counts");
    let (mut excess, mut abs) = (0.0f64, 0.0f64);
    for (a, b) in reference.params.iter().zip(&run.params) {
        assert_eq!(a.len(), b.len(), "block sizes");
        for (&x, &y) in a.iter().zip(b) {
            let d = (x as f64 - y as f64).abs();
            abs = abs.max(d);
            excess = excess.max(d / (ATOL + RTOL * (x as f64).abs()));
        }
    }
    (excess, abs)
}

fn describe(plan: &ParallelPlan) -> String {
    format!(
        "dp={} pp={} m={} {} v={} zero={} offload={}{} state={}",
        plan.dp,
        plan.pp,
        plan.microbatches,
        plan.schedule,
        plan.virtual_stages,
        plan.zero,
        plan.offload,
        if plan.offload_params { " params" } else { "" },
        plan.state
    )
}

/// `plan` trains to the reference's losses (every step), block norms and parameters; returns
/// the run.
fn check(reference: &Run, plan: ParallelPlan) -> Run {
    let what = describe(&plan);
    let r = run(plan, None);
    assert_equivalent(&reference.report, &r.report, RTOL, &what);
    let (excess, abs) = param_difference(reference, &r);
    eprintln!("sgd {what}: max |Δparam| {abs:e} (allclose excess {excess:.3})");
    assert!(
        excess <= 1.0,
        "{what}: parameters differ by {abs:e} ({excess:.1}× the tolerance)"
    );
    r
}

/// The replica check's control: replica 1 of dp=2 applies a zero gradient in the last step only,
/// so that its parameters alone stay one SGD step behind. The losses (computed before the
/// update), the block norms and the checkpoint (both written by replica 0) match one device as
/// before — the comparison of earlier sessions passes it — while the replica check fails it,
/// naming replica 1, which lies `MARGIN`× past the tolerance.
#[test]
fn the_replica_check_catches_a_fault_in_another_replicas_last_update() {
    let reference = reference();
    let mut program = Program::new(ModelSpec::parse(MLP).expect("model spec"))
        .with_seed(7)
        .with_optimizer(OptimizerSpec::sgd(LR))
        .with_plan(small_plan(2, 1, 0));
    program.test_fault = Some(TestFault::SkipReplicaUpdate {
        replica: 1,
        step: STEPS,
    });
    let model = program.model.clone();
    let broken = run_checked(program, false);
    // The old comparison: losses, norms and the checkpoint's parameters all pass.
    assert_same_losses_and_norms(
        &reference.report,
        &broken.report,
        RTOL,
        "control (old comparison)",
    );
    let (excess, abs) = param_difference(&reference, &broken);
    assert!(
        excess <= 1.0,
        "the checkpoint shows the fault ({abs:e}): not the control intended"
    );
    // The new one fails it, naming the replica.
    let caught = std::panic::catch_unwind(|| assert_replicas_agree(&broken.report, &model, "control"));
    let message = match caught {
        Ok(_) => panic!("the replica check passed a run whose replica 1 skipped its last update"),
        Err(panic) => (panic.downcast_ref::<String>().cloned()).unwrap_or_default(),
    };
    eprintln!("control SkipReplicaUpdate: {message}");
    assert!(
        message.contains("replica 1"),
        "the report must name replica 1: {message}"
    );
    let strayed = Run {
        report: broken.report.clone(),
        params: replica_params(&broken.report, &model, 1),
    };
    let (excess, abs) = param_difference(&reference, &strayed);
    eprintln!("control SkipReplicaUpdate: replica 1 max |Δparam| {abs:e} (allclose excess {excess:.1})");
    assert!(
        excess > MARGIN,
        "replica 1 strayed by only {abs:e} ({excess:.1}× the tolerance)"
    );
}

/// With `fault` injected, `plan` ends `MARGIN`× past the tolerance; without it, it passes.
fn caught(reference: &Run, plan: ParallelPlan, fault: TestFault) {
    let what = format!("{} {fault:?}", describe(&plan));
    check(reference, plan.clone());
    let r = run(plan, Some(fault));
    let (excess, abs) = param_difference(reference, &r);
    eprintln!("control {what}: max |Δparam| {abs:e} (allclose excess {excess:.1})");
    assert!(
        excess > MARGIN,
        "{what}: the fault moved the parameters by only {abs:e} ({excess:.1}× the tolerance)"
    );
}

fn pipeline(m: usize, schedule: Schedule, virtual_stages: usize) -> ParallelPlan {
    ParallelPlan {
        microbatches: m,
        schedule,
        virtual_stages,
        ..small_plan(1, 2, 0)
    }
}

#[test]
fn sgd_data_parallel_and_zero_match_one_device() {
    let reference = reference();
    for zero in 0..=3 {
        check(&reference, small_plan(2, 1, zero));
    }
}

#[test]
fn sgd_pipeline_schedules_match_one_device() {
    let reference = reference();
    check(&reference, pipeline(2, Schedule::GPipe, 1));
    check(&reference, pipeline(2, Schedule::OneFOneB, 1));
    check(&reference, pipeline(4, Schedule::Interleaved, 2));
    check(&reference, pipeline(4, Schedule::ZbH1, 1));
}

#[test]
fn sgd_offload_with_zero_matches_one_device() {
    let reference = reference();
    for zero in 1..=3 {
        let plan = ParallelPlan {
            offload: Offload::Cpu,
            ..small_plan(2, 1, zero)
        };
        check(&reference, plan.clone());
        if zero == 3 {
            check(
                &reference,
                ParallelPlan {
                    offload_params: true,
                    ..plan
                },
            );
        }
    }
}

#[test]
fn sgd_pipeline_times_data_parallel_matches_one_device() {
    let reference = reference();
    for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
        check(
            &reference,
            ParallelPlan {
                schedule,
                ..small_plan(2, 2, 0)
            },
        );
    }
    check(&reference, small_plan(2, 2, 1));
}

#[test]
fn a_skipped_all_reduce_is_caught() {
    caught(&reference(), small_plan(2, 1, 0), TestFault::SkipAllReduce);
}

#[test]
fn a_dropped_replica_gradient_is_caught() {
    caught(&reference(), small_plan(2, 1, 0), TestFault::DropReplicaGrad);
}

#[test]
fn averaged_microbatch_gradients_are_caught() {
    caught(&reference(), small_plan(1, 2, 0), TestFault::AverageMicrobatches);
}

#[test]
fn a_zero_shard_updated_at_the_wrong_offset_is_caught() {
    let reference = reference();
    for zero in [1, 3] {
        caught(&reference, small_plan(2, 1, zero), TestFault::ShiftZeroShard);
    }
}

/// The gpt (embedding, attention, LayerNorm, tied shapes) under plain SGD: data parallelism with
/// ZeRO 0 and 3, a pipeline and pp × dp with ZeRO-1 train to one device's losses and parameters,
/// element by element; dropping one replica's gradient is caught.
#[test]
fn sgd_gpt_layouts_match_one_device() {
    const GPT: &str = "gpt:vocab=64,ctx=8,d=16,layers=2,heads=2";
    let program = |plan: ParallelPlan| {
        Program::new(ModelSpec::parse(GPT).expect("model spec"))
            .with_seed(7)
            .with_optimizer(OptimizerSpec::sgd(LR))
            .with_plan(ParallelPlan { batch: 8, ..plan })
    };
    let reference = run_program(program(small_plan(1, 1, 0)));
    let first = reference.report.steps.first().expect("steps").loss;
    let last = reference.report.steps.last().expect("steps").loss;
    assert!(last < first, "the gpt does not learn under SGD: {first} → {last}");
    for plan in [
        small_plan(2, 1, 0),
        small_plan(2, 1, 3),
        small_plan(1, 2, 0),
        small_plan(2, 2, 1),
    ] {
        let what = format!("gpt {}", describe(&plan));
        let r = run_program(program(plan));
        assert_equivalent(&reference.report, &r.report, RTOL, &what);
        let (excess, abs) = param_difference(&reference, &r);
        eprintln!("sgd {what}: max |Δparam| {abs:e} (allclose excess {excess:.3})");
        assert!(excess <= 1.0, "{what}: parameters differ by {abs:e}");
    }
    // The control: one replica's gradient dropped must land far outside the tolerance.
    let mut broken = program(small_plan(2, 1, 0));
    broken.test_fault = Some(TestFault::DropReplicaGrad);
    let (excess, abs) = param_difference(&reference, &run_checked(broken, false));
    eprintln!("control gpt DropReplicaGrad: max |Δparam| {abs:e} (allclose excess {excess:.1})");
    assert!(
        excess > MARGIN,
        "a dropped replica gradient moved the gpt by only {abs:e}"
    );
}
