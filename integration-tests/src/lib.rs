//! Shared helpers for the integration tests: run a zoo model under a plan and compare reports.
//! Every run of these helpers keeps every actor's final parameters and checks that its
//! replicas agree element by element ([`replicas`]), and [`assert_equivalent`] checks both runs'.

pub mod closed_form;
pub mod precision;
pub mod replicas;
pub mod state_resume;
pub mod torch_fixture;

pub use replicas::{assert_replicas_agree, replica_params};

use archipelago_controller::{Controller, TrainOptions, TrainReport};
use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec, ParallelPlan, Program};

/// The small dp × pp plan of the ZeRO and checkpoint tests: global batch 24, 8 KiB gradient
/// buckets (several buckets: several reduce-scatters and all-gathers), 2 micro-batches when
/// pipelined.
pub fn small_plan(dp: usize, pp: usize, zero: u8) -> ParallelPlan {
    ParallelPlan {
        dp,
        pp,
        zero,
        microbatches: if pp > 1 { 2 } else { 1 },
        batch: 24,
        bucket_bytes: 8 << 10,
        ..ParallelPlan::default()
    }
}

/// Trains `model` under `plan` for `steps` steps on the embedded controller (one CPU actor per
/// mesh position), with seed 7 and Adam at lr 1e-2 (so that small deep models visibly learn in
/// a few steps).
pub fn train_plan(model: &str, plan: ParallelPlan, steps: u64) -> TrainReport {
    train_with_options(
        model,
        plan,
        TrainOptions {
            steps,
            ..TrainOptions::default()
        },
    )
}

/// [`train_plan`] with explicit options (a trace file, a job name).
pub fn train_with_options(model: &str, plan: ParallelPlan, options: TrainOptions) -> TrainReport {
    let what = format!(
        "{model} dp={} pp={} m={} {} v={}{}",
        plan.dp,
        plan.pp,
        plan.microbatches,
        plan.schedule,
        plan.virtual_stages,
        if plan.checkpoint_activations { " ckpt" } else { "" }
    );
    let actors = plan.actors();
    let program = Program::new(ModelSpec::parse(model).expect("model spec"))
        .with_seed(7)
        .with_optimizer(OptimizerSpec::adam(1e-2))
        .with_plan(plan);
    let options = TrainOptions {
        keep_params: true,
        ..options
    };
    let report = Controller::local(DeviceSpec::cpus(actors))
        .train(&program, &options)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_replicas_agree(&report, &program.model, &what);
    assert_fabric_bytes_as_planned(&report, &what);
    report
}

/// Trains `program` on the embedded controller, one CPU actor per mesh position of its plan,
/// and checks that its replicas agree ([`assert_replicas_agree`]).
pub fn train_program(program: &Program, options: &TrainOptions) -> TrainReport {
    let report = train_program_unchecked(program, options);
    let what = describe_program(program);
    assert_replicas_agree(&report, &program.model, &what);
    assert_fabric_bytes_as_planned(&report, &what);
    report
}

/// Every actor read from its peers, kind by kind, what the plan predicted it would
/// ([`archipelago_controller::fabric_check`]).
pub fn assert_fabric_bytes_as_planned(report: &TrainReport, what: &str) {
    if let Err(e) = archipelago_controller::fabric_check::check(report) {
        panic!("{what}: {e}");
    }
}

/// [`train_program`] without the replica check (the report keeps every actor's parameters): for
/// the control that shows the check catches what the other comparisons miss.
pub fn train_program_unchecked(program: &Program, options: &TrainOptions) -> TrainReport {
    let options = TrainOptions {
        keep_params: true,
        ..options.clone()
    };
    let what = describe_program(program);
    Controller::local(DeviceSpec::cpus(program.plan.actors()))
        .train(program, &options)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn describe_program(program: &Program) -> String {
    let plan = &program.plan;
    format!(
        "{} {} dp={} pp={} zero={}",
        program.model.name,
        program.optimizer.name(),
        plan.dp,
        plan.pp,
        plan.zero
    )
}

/// Trains `model` with `dp` replicas, global batch `batch`, `steps` steps and gradient buckets of
/// `bucket_bytes` (small buckets exercise the overlap path), on the embedded controller.
pub fn train(model: &str, dp: usize, batch: usize, steps: u64, bucket_bytes: u64) -> TrainReport {
    let program = Program::new(ModelSpec::parse(model).expect("model spec"))
        .with_seed(7)
        .with_plan(ParallelPlan {
            dp,
            batch,
            bucket_bytes,
            ..ParallelPlan::default()
        });
    let controller = Controller::local(DeviceSpec::cpus(dp));
    let options = TrainOptions {
        steps,
        keep_params: true,
        ..TrainOptions::default()
    };
    let what = format!("{model} dp={dp}");
    let report = (controller.train(&program, &options)).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_replicas_agree(&report, &program.model, &what);
    report
}

/// Asserts that `report`'s run of `model` (seed 7, as every helper here trains) moved each
/// block's parameters away from their initial values (the library's initialisation from
/// `(seed, name)`): a run that updated nothing would pass every equivalence trivially. (Whether a
/// few steps lower the loss is left to chance by the batches; the update rules themselves are
/// checked against closed forms and PyTorch in `optimizer_equivalence.rs`.)
pub fn assert_params_moved(model: &str, report: &TrainReport) {
    let desc = ModelSpec::parse(model).expect("model spec").desc();
    let initial: Vec<f64> = desc
        .blocks
        .iter()
        .map(|b| {
            let init = archipelago_actors::block::initial_params(&b.param_descs, 7);
            init.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt()
        })
        .collect();
    assert_eq!(initial.len(), report.block_l2.len(), "{model}: block counts");
    for (b, (before, after)) in initial.iter().zip(&report.block_l2).enumerate() {
        let moved = (before - after).abs() / before.max(1e-12);
        assert!(
            moved > 1e-6,
            "{model}: block {b}'s parameters did not move from their initialisation ({before} → {after})"
        );
    }
}

/// Largest relative difference between two non-negative figures lists.
pub fn max_relative_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "different block counts");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// Asserts that every replica of `run` (and of `reference`) holds the same parameters, element by
/// element ([`assert_replicas_agree`]), and that `run` trained to `reference`'s losses and
/// per-block and total L2 norms within `tolerance` relative. Both runs must have kept their
/// parameters (the helpers here do). Element-wise closeness to the reference is checked where the
/// update rule passes reduction-order noise on as it is (plain SGD: `sgd_matrix.rs`); Adam's normalised step turns the noise of a gradient near
/// zero into a step of up to its learning rate, so under Adam the norms are the figure.
pub fn assert_equivalent(reference: &TrainReport, run: &TrainReport, tolerance: f64, what: &str) {
    let model = ModelSpec::parse(&reference.model)
        .unwrap_or_else(|e| panic!("{what}: the report's model `{}`: {e}", reference.model))
        .desc();
    assert_replicas_agree(reference, &model, &format!("{what} (reference)"));
    assert_replicas_agree(run, &model, what);
    assert_same_losses_and_norms(reference, run, tolerance, what);
}

/// Asserts that `run` has `reference`'s losses, step by step, and its per-block and total
/// parameter norms (the norms answered by one replica per block) within `tolerance` relative:
/// what [`assert_equivalent`] checks beside every replica's parameters.
pub fn assert_same_losses_and_norms(reference: &TrainReport, run: &TrainReport, tolerance: f64, what: &str) {
    let blocks = max_relative_difference(&reference.block_l2, &run.block_l2);
    assert!(
        blocks < tolerance,
        "{what}: block norms differ by {blocks:e} (tolerance {tolerance:e})"
    );
    let total = max_relative_difference(&[reference.param_l2], &[run.param_l2]);
    assert!(total < tolerance, "{what}: parameter norms differ by {total:e}");
    for (a, b) in reference.steps.iter().zip(&run.steps) {
        let d = ((a.loss - b.loss) / a.loss).abs() as f64;
        assert!(
            d < tolerance,
            "{what}: step {} loss {} vs {} ({d:e})",
            a.step,
            a.loss,
            b.loss
        );
    }
    assert_eq!(
        reference.steps.len(),
        run.steps.len(),
        "{what}: step counts differ"
    );
}

/// How far past its tolerance every negative control's broken variant must land, at least.
pub const MARGIN: f64 = 10.0;

/// Asserts that a negative control's `difference` lands at least `margin` × `tolerance` away
/// (`margin` ≥ [`MARGIN`]), and prints the margin found.
pub fn assert_caught(what: &str, difference: f64, tolerance: f64, margin: f64) {
    assert!(margin >= MARGIN, "{what}: a control's bar is at least {MARGIN}×");
    let found = difference / tolerance;
    eprintln!("control {what}: {difference:e}, {found:.1}× the tolerance {tolerance:e} (bar {margin}×)");
    assert!(
        difference >= margin * tolerance,
        "{what}: the broken variant lands only {found:.1}× past the tolerance {tolerance:e} \
         ({margin}× needed): the comparison barely catches it"
    );
}

/// The stateful update rules a path of the optimizer must match the host loops under: AdamW with
/// weight decay (and its parameter groups) and SGD with Nesterov momentum and weight decay.
pub fn stateful_rules() -> [OptimizerSpec; 2] {
    [
        OptimizerSpec::adamw(1e-2).with_weight_decay(0.1),
        OptimizerSpec::sgd(0.1)
            .with_momentum(0.9, true)
            .expect("momentum")
            .with_weight_decay(0.05),
    ]
}

/// Copies the directory `from` (a checkpoint) to `to`, recursively.
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
