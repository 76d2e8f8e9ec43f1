//! The optimizers of issue 17 on real plans: gradient clipping by the global norm (Pascanu et
//! al. 2013, as `clip_grad_norm_`; reduced over every actor: dp, pp and ZeRO shards), LAMB's
//! per-parameter trust ratios (You et al. 2020; norms reduced over the ZeRO shards of each
//! parameter) and AdamW (Loshchilov & Hutter 2019) with parameter groups and a learning-rate
//! schedule each train to the same parameters and losses as one device, step for step; each
//! test also shows its feature changes the run (a negative control the comparison catches).

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{LrSchedule, ModelSpec, OptimizerSpec, ParallelPlan, ParamGroups, Program};
use archipelago_integration_tests::{
    assert_equivalent, max_relative_difference, small_plan as plan, train_program,
};

const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const GPT: &str = "gpt:vocab=256,ctx=8,d=16,layers=2,heads=2";
const STEPS: u64 = 4;

fn program(model: &str, layout: ParallelPlan, optimizer: OptimizerSpec) -> Program {
    Program::new(ModelSpec::parse(model).expect("model spec"))
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_plan(layout)
}

fn run(program: &Program) -> TrainReport {
    train_program(
        program,
        &TrainOptions {
            steps: STEPS,
            ..TrainOptions::default()
        },
    )
}

/// Every step's reported figure (`grad_norm` or `lr`) agrees within `tolerance` relative.
fn assert_same_figures(
    a: &TrainReport,
    b: &TrainReport,
    figure: fn(&archipelago_controller::StepRecord) -> Option<f32>,
    what: &str,
) {
    for (x, y) in a.steps.iter().zip(&b.steps) {
        let (x, y) = (figure(x).expect("reported"), figure(y).expect("reported"));
        assert!(((x - y) / x).abs() < 1e-4, "{what}: step figures {x} vs {y}");
    }
}

/// SGD with momentum (scale-sensitive, unlike Adam) clipped to a bound below every step's
/// gradient norm: dp=2, dp=2 under ZeRO-3, pp=2 and dp=2 × pp=2 under ZeRO-1 report the same
/// global norms and train to the same parameters as one device. Unclipped, the run differs.
#[test]
fn clipping_by_the_global_norm_equals_one_device_on_every_layout() {
    let sgd = OptimizerSpec::sgd(0.2).with_momentum(0.9, false).unwrap();
    let clipped = |layout| program(MLP, layout, sgd).with_clip_grad_norm(Some(0.05));
    let reference = run(&clipped(plan(1, 1, 0)));
    for s in &reference.steps {
        let norm = s.grad_norm.expect("a clipped step reports its norm");
        assert!(
            norm > 0.05,
            "step {}: norm {norm} must exceed the bound for clipping to engage",
            s.step
        );
    }
    for (layout, what) in [
        (plan(2, 1, 0), "dp=2"),
        (plan(2, 1, 3), "dp=2 zero 3"),
        (plan(1, 2, 0), "pp=2"),
        (plan(2, 2, 1), "dp=2 pp=2 zero 1"),
    ] {
        let run = run(&clipped(layout));
        assert_same_figures(&reference, &run, |s| s.grad_norm, what);
        assert_equivalent(&reference, &run, 1e-5, what);
    }
    let unclipped = run(&program(MLP, plan(1, 1, 0), sgd));
    assert!(unclipped.steps.iter().all(|s| s.grad_norm.is_none()));
    let differs = max_relative_difference(&reference.block_l2, &unclipped.block_l2);
    assert!(
        differs > 1e-3,
        "clipping must change the run (block norms differ by {differs:e})"
    );
}

/// LAMB, whose trust ratio takes each parameter's norms over the shards ZeRO cut it into:
/// dp=2 under ZeRO-3 and ZeRO-2, unsharded dp=2 and pp=2 equal one device; so does LAMB with
/// clipping under ZeRO-3 (the global norm first, then the parameter norms). AdamW at the same
/// rate and decay trains elsewhere.
#[test]
fn lamb_with_norms_over_zero_shards_equals_one_device() {
    let lamb = OptimizerSpec::lamb(0.02);
    let reference = run(&program(MLP, plan(1, 1, 0), lamb));
    for (layout, what) in [
        (plan(2, 1, 3), "dp=2 zero 3"),
        (plan(2, 1, 2), "dp=2 zero 2"),
        (plan(2, 1, 0), "dp=2"),
        (plan(1, 2, 0), "pp=2"),
    ] {
        assert_equivalent(&reference, &run(&program(MLP, layout, lamb)), 1e-5, what);
    }
    let clipped = |layout| program(MLP, layout, lamb).with_clip_grad_norm(Some(0.05));
    let clipped_reference = run(&clipped(plan(1, 1, 0)));
    let sharded = run(&clipped(plan(2, 1, 3)));
    assert_same_figures(
        &clipped_reference,
        &sharded,
        |s| s.grad_norm,
        "LAMB clipped, dp=2 zero 3",
    );
    assert_equivalent(&clipped_reference, &sharded, 1e-5, "LAMB clipped, dp=2 zero 3");
    let adamw = run(&program(MLP, plan(1, 1, 0), OptimizerSpec::adamw(0.02)));
    let differs = max_relative_difference(&reference.block_l2, &adamw.block_l2);
    assert!(
        differs > 1e-3,
        "the trust ratio must change the run ({differs:e})"
    );
}

/// AdamW with its parameter groups (no decay for biases and LayerNorm) and warmup then cosine
/// decay, on a gpt: ZeRO-3 × dp=2 and ZeRO-1 × dp=2 × pp=2 equal one device, and every step
/// reports the schedule's rate. Decaying every parameter instead trains elsewhere.
#[test]
fn adamw_with_groups_and_a_schedule_equals_one_device_under_zero() {
    let adamw = OptimizerSpec::adamw(1e-2).with_weight_decay(0.1);
    let schedule = LrSchedule::cosine(2, STEPS);
    let with = |layout, groups| {
        program(GPT, layout, adamw)
            .with_lr_schedule(schedule)
            .with_param_groups(groups)
    };
    let reference = run(&with(plan(1, 1, 0), ParamGroups::NoDecayForVectors));
    let rates: Vec<f32> = reference.steps.iter().map(|s| s.lr.expect("reported")).collect();
    let expected: Vec<f32> = (1..=STEPS).map(|t| 1e-2 * schedule.factor(t)).collect();
    assert_eq!(rates, expected);
    assert!(
        (rates[0] - 5e-3).abs() < 1e-9 && (rates[3] - 1e-3).abs() < 1e-9,
        "{rates:?}"
    );
    for (layout, what) in [
        (plan(2, 1, 3), "dp=2 zero 3"),
        (plan(2, 2, 1), "dp=2 pp=2 zero 1"),
    ] {
        let run = run(&with(layout, ParamGroups::NoDecayForVectors));
        assert_same_figures(&reference, &run, |s| s.lr, what);
        assert_equivalent(&reference, &run, 1e-5, what);
    }
    let all = run(&with(plan(1, 1, 0), ParamGroups::DecayAll));
    let differs = max_relative_difference(&reference.block_l2, &all.block_l2);
    assert!(
        differs > 1e-5,
        "decaying vectors must change the run ({differs:e})"
    );
}

/// The plan's memory estimate counts each rule's state (`state_floats_per_param`): none for
/// plain SGD, the momentum buffer for SGD with momentum, `m` and `v` for AdamW and LAMB; under
/// ZeRO-1 × dp=2 every actor holds what the plan says.
#[test]
fn the_memory_estimate_counts_each_rules_state() {
    let mut held = Vec::new();
    for spec in [
        OptimizerSpec::sgd(0.1),
        OptimizerSpec::sgd(0.1).with_momentum(0.9, false).unwrap(),
        OptimizerSpec::adamw(1e-2),
        OptimizerSpec::lamb(1e-2),
    ] {
        let run = run(&program(MLP, plan(2, 1, 1), spec));
        for a in &run.actors {
            let (measured, estimate) = (a.model_state_bytes as f64, a.estimated_model_state_bytes as f64);
            assert!(
                (estimate - measured).abs() / measured < 0.10,
                "{} actor {}: plan {estimate} vs {measured}",
                spec.name(),
                a.actor
            );
        }
        held.push(run.actors[0].model_state_bytes);
    }
    assert!(
        held[0] < held[1] && held[1] < held[2] && held[2] == held[3],
        "{held:?}"
    );
}
