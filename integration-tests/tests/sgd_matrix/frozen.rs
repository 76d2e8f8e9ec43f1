//! Frozen parameters (issue 37): a model with two frozen parameters (`layers.1.weight`, a whole
//! matrix, and `layers.5.bias`, in the other pipeline stage) trains on dp=2, pp=2 and ZeRO-3 ×
//! dp=2 to one device's losses and parameters — element by element under plain SGD, norms under
//! Adam — with each frozen parameter bit-identical to its initialisation on every actor after,
//! and no gradient or optimizer bytes for it: the plan's estimate and the measured model state
//! are the same run's without them, byte for byte, and the gradient reduction carries only the
//! trained elements. With the state on the device too, and with a whole block frozen (its bucket
//! empty). Negative control: the same plan with the parameters left trainable moves
//! them and ends far from the frozen reference.

use archipelago_actors::block::init_param;
use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{
    FabricKind, ModelSpec, OptimizerSpec, ParallelPlan, Program, StatePlacement, compile,
};
use archipelago_integration_tests::{
    assert_caught, assert_replicas_agree, assert_same_losses_and_norms, small_plan, train_program,
};

use super::{ATOL, MLP, RTOL, STEPS};

const FROZEN: [&str; 2] = ["layers.1.weight", "layers.5.bias"];

/// The mlp with `FROZEN` frozen (or not, for the control), seed 7, under `plan`.
fn program(plan: ParallelPlan, optimizer: OptimizerSpec, freeze: bool) -> Program {
    let mut program = Program::new(ModelSpec::parse(MLP).expect("model spec"))
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_plan(plan);
    for block in &mut program.model.blocks {
        for p in &mut block.param_descs {
            if FROZEN.contains(&p.name.as_str()) {
                p.trainable = !freeze;
            }
        }
    }
    program
}

/// A finished run: its report and every parameter (put together from every actor, replicas
/// agreeing bit for bit), block by block.
struct Run {
    report: TrainReport,
    params: Vec<Vec<f32>>,
}

fn train(program: &Program) -> Run {
    let options = TrainOptions {
        steps: STEPS,
        ..TrainOptions::default()
    };
    let report = train_program(program, &options);
    let params = assert_replicas_agree(&report, &program.model, "frozen");
    Run { report, params }
}

/// Largest element-wise excess over `allclose(RTOL, ATOL)` (≤ 1 passes).
fn excess(reference: &[Vec<f32>], run: &[Vec<f32>]) -> f64 {
    let pairs = reference.iter().flatten().zip(run.iter().flatten());
    pairs
        .map(|(&x, &y)| (x as f64 - y as f64).abs() / (ATOL + RTOL * (x as f64).abs()))
        .fold(0.0, f64::max)
}

/// Each frozen parameter of `program`'s model, where it lies in its block's full vector, and its
/// initial values.
fn frozen_params(program: &Program) -> Vec<(usize, std::ops::Range<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    for (b, block) in program.model.blocks.iter().enumerate() {
        let mut at = 0;
        for p in &block.param_descs {
            if !p.trainable {
                out.push((b, at..at + p.len(), init_param(p, program.seed)));
            }
            at += p.len();
        }
    }
    out
}

/// How many of the frozen parameters differ, in any bit, from their initialisation.
fn frozen_changed(program: &Program, run: &Run) -> usize {
    let frozen = frozen_params(program);
    assert_eq!(frozen.len(), FROZEN.len(), "the model has its frozen parameters");
    (frozen.iter())
        .filter(|(block, range, initial)| {
            let held = &run.params[*block][range.clone()];
            held.iter().zip(initial).any(|(a, b)| a.to_bits() != b.to_bits())
        })
        .count()
}

/// Every frozen parameter is bit-identical to its initialisation on every actor that holds it
/// (the replica check has held every copy to agree bit for bit).
fn assert_frozen_untouched(program: &Program, run: &Run, what: &str) {
    let changed = frozen_changed(program, run);
    assert_eq!(changed, 0, "{what}: {changed} frozen parameter(s) changed");
}

/// Bytes of the frozen parameters each actor holds (its stage's blocks).
fn frozen_bytes_of(program: &Program, blocks: &[(usize, usize)]) -> u64 {
    let held = |b: usize| blocks.iter().any(|&(s, e)| (s..e).contains(&b));
    (frozen_params(program).iter())
        .filter(|(b, _, _)| held(*b))
        .map(|(_, r, _)| 4 * r.len() as u64)
        .sum()
}

/// Without ZeRO sharding, each actor's model state — the plan's and the measured — is the
/// unfrozen run's less, per frozen element it holds, an f32 gradient and the optimizer's state
/// (12 bytes under Adam, 4 under plain SGD); and every actor's gradient reduction reads fewer
/// bytes than unfrozen.
fn assert_no_state_for_frozen(frozen: (&Program, &Run), trainable: (&Program, &Run), what: &str) {
    let plan = compile(frozen.0).expect("plan");
    let unfrozen_plan = compile(trainable.0).expect("plan");
    for (a, (f, t)) in frozen
        .1
        .report
        .actors
        .iter()
        .zip(&trainable.1.report.actors)
        .enumerate()
    {
        let floats = 1 + frozen.0.optimizer.state_floats_per_param();
        let gone = floats * frozen_bytes_of(frozen.0, &plan.actors[a].chunks);
        let (pf, pt) = (&plan.memory[a], &unfrozen_plan.memory[a]);
        assert_eq!(
            pf.grads + pf.optimizer + gone,
            pt.grads + pt.optimizer,
            "{what}: actor {a}'s plan"
        );
        assert_eq!(
            pf.params, pt.params,
            "{what}: actor {a}'s plan keeps the frozen values"
        );
        assert_eq!(
            f.model_state_bytes + gone,
            t.model_state_bytes,
            "{what}: actor {a} measured"
        );
        let reads = |r: &TrainReport| r.actors[a].fabric_bytes_per_step.of_kind(FabricKind::Gradients);
        if reads(&trainable.1.report) > 0 {
            assert!(
                reads(&frozen.1.report) < reads(&trainable.1.report),
                "{what}: actor {a} reduces frozen gradients"
            );
        }
    }
}

#[test]
fn frozen_parameters_stay_put_and_the_rest_trains_like_one_device() {
    let on_device = ParallelPlan {
        state: StatePlacement::Device,
        ..small_plan(2, 1, 0)
    };
    let layouts = [
        small_plan(2, 1, 0),
        small_plan(1, 2, 0),
        small_plan(2, 1, 3),
        on_device,
    ];
    for optimizer in [OptimizerSpec::sgd(super::LR), OptimizerSpec::adam(1e-2)] {
        let reference_program = program(small_plan(1, 1, 0), optimizer, true);
        let reference = train(&reference_program);
        assert_frozen_untouched(&reference_program, &reference, "one device");
        for plan in layouts.clone() {
            let what = format!("{} {}", super::describe(&plan), optimizer.name());
            let frozen_program = program(plan.clone(), optimizer, true);
            let run = train(&frozen_program);
            assert_frozen_untouched(&frozen_program, &run, &what);
            assert_same_losses_and_norms(&reference.report, &run.report, RTOL, &what);
            if optimizer.name() == "sgd" {
                let excess = excess(&reference.params, &run.params);
                eprintln!("frozen {what}: allclose excess {excess:.3}");
                assert!(
                    excess <= 1.0,
                    "{what}: parameters differ ({excess:.1}× the tolerance)"
                );
            }
            if plan.zero == 0 {
                let trainable_program = program(plan, optimizer, false);
                let trainable = train(&trainable_program);
                assert_no_state_for_frozen((&frozen_program, &run), (&trainable_program, &trainable), &what);
            }
        }
    }
}

/// The control: left trainable, the same parameters move, and the run ends far from the frozen
/// reference under the same element-wise comparison.
#[test]
fn a_frozen_parameter_left_trainable_is_caught() {
    let sgd = OptimizerSpec::sgd(super::LR);
    let reference = train(&program(small_plan(1, 1, 0), sgd, true));
    let plan = small_plan(2, 1, 0);
    let broken_program = program(plan, sgd, false);
    let broken = train(&broken_program);
    let mut frozen_view = broken_program.clone();
    for block in &mut frozen_view.model.blocks {
        for p in &mut block.param_descs {
            p.trainable = !FROZEN.contains(&p.name.as_str());
        }
    }
    let moved = frozen_changed(&frozen_view, &broken);
    assert_eq!(
        moved,
        FROZEN.len(),
        "left trainable, {moved} of the parameters moved"
    );
    assert_caught(
        "frozen left trainable",
        excess(&reference.params, &broken.params),
        1.0,
        100.0,
    );
}

/// A whole block frozen (fine-tuning's "freeze the bottom layers"): its gradient bucket has
/// nothing in it; dp=2, ZeRO-3 × dp=2 and pp=2 still train the rest like one device, and the
/// block stays bit-identical.
#[test]
fn a_wholly_frozen_block_trains_like_one_device() {
    let freeze_block = |plan: ParallelPlan| {
        let mut p = program(plan, OptimizerSpec::sgd(super::LR), false);
        for d in &mut p.model.blocks[1].param_descs {
            d.trainable = false;
        }
        p
    };
    let reference_program = freeze_block(small_plan(1, 1, 0));
    let reference = train(&reference_program);
    for plan in [small_plan(2, 1, 0), small_plan(2, 1, 3), small_plan(1, 2, 0)] {
        let what = super::describe(&plan);
        let frozen_program = freeze_block(plan);
        let run = train(&frozen_program);
        let initial = frozen_params(&frozen_program);
        assert_eq!(initial.len(), 2, "{what}: the block's weight and bias");
        for (block, range, values) in &initial {
            let held = &run.params[*block][range.clone()];
            let same = held.iter().zip(values).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: the frozen block changed");
        }
        let excess = excess(&reference.params, &run.params);
        assert!(
            excess <= 1.0,
            "{what}: parameters differ ({excess:.1}x the tolerance)"
        );
    }
}
