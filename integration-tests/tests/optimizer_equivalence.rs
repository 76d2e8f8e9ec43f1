//! The optimizers of issue 17 on real plans: gradient clipping by the global norm (Pascanu et
//! al. 2013, as `clip_grad_norm_`; reduced over every actor: dp, pp and ZeRO shards), LAMB's
//! per-parameter trust ratios (You et al. 2020; norms reduced over the ZeRO shards of each
//! parameter) and AdamW (Loshchilov & Hutter 2019) with parameter groups and a learning-rate
//! schedule each train to the same parameters and losses as one device, step for step; each
//! test also shows its feature changes the run (a negative control the comparison catches).
//!
//! And against an independent reference: PyTorch's own training of the same tiny mlp and gpt
//! (`integration-tests/fixtures/torch`, from `scripts/torch_reference.py --fixture`), started
//! from the same weights (`--init`) on the same batches (`--data`), parameter by parameter, with
//! its negative controls; `--init` on every layout and `export` → `--init` → `export`.

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{
    LrSchedule, ModelSpec, Offload, OptimizerSpec, ParallelPlan, ParamGroups, Program,
};
use archipelago_integration_tests::{
    MARGIN, assert_caught, assert_equivalent, max_relative_difference, small_plan as plan, torch_fixture,
    train_program,
};

const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const GPT: &str = "gpt:vocab=256,ctx=8,d=16,layers=2,heads=2";
const STEPS: u64 = 4;
/// The relative tolerance of the equivalences by norms and losses.
const TOLERANCE: f64 = 1e-5;
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
            keep_params: true,
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
        assert_equivalent(&reference, &run, TOLERANCE, what);
    }
    let unclipped = run(&program(MLP, plan(1, 1, 0), sgd));
    assert!(unclipped.steps.iter().all(|s| s.grad_norm.is_none()));
    let differs = max_relative_difference(&reference.block_l2, &unclipped.block_l2);
    assert_caught("unclipped (block norms)", differs, TOLERANCE, 100.0);
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
        assert_equivalent(&reference, &run(&program(MLP, layout, lamb)), TOLERANCE, what);
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
    assert_equivalent(
        &clipped_reference,
        &sharded,
        TOLERANCE,
        "LAMB clipped, dp=2 zero 3",
    );
    let adamw = run(&program(MLP, plan(1, 1, 0), OptimizerSpec::adamw(0.02)));
    let differs = max_relative_difference(&reference.block_l2, &adamw.block_l2);
    assert_caught("AdamW instead of LAMB (block norms)", differs, TOLERANCE, 100.0);
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
        assert_equivalent(&reference, &run, TOLERANCE, what);
    }
    let all = run(&with(plan(1, 1, 0), ParamGroups::DecayAll));
    let differs = max_relative_difference(&reference.block_l2, &all.block_l2);
    assert_caught(
        "decay on every parameter (block norms)",
        differs,
        TOLERANCE,
        MARGIN,
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

/// `layout` with `size` tensor-parallel ranks.
fn tp(size: usize, layout: ParallelPlan) -> ParallelPlan {
    ParallelPlan { tp: size, ..layout }
}

/// Against PyTorch (`integration-tests/fixtures/torch`, written by `scripts/torch_reference.py
/// --fixture`): the same tiny mlp and gpt, from the same initial weights (`--init`) on the same
/// batches (`--data`), trained 5 steps by plain SGD and by AdamW with clipping, warmup and cosine
/// decay, on one device and on parallel layouts (tensor-parallel ones included), end at PyTorch's parameters (exported and read
/// back with the safetensors crate, element by element) and losses, with PyTorch's learning
/// rates and gradient norms. SGD: within 1e-5 relative (with an absolute floor of 1e-5 of the
/// model's largest element, for elements near zero); AdamW: allclose(rtol 1e-4, atol 1e-3·lr).
#[test]
fn training_from_the_torch_fixture_matches_pytorch() {
    let expected = torch_fixture::expected();
    for model in ["mlp", "gpt"] {
        let init = torch_fixture::fixture_file(&format!("{model}.init.safetensors"));
        for run in ["sgd", "adamw"] {
            let torch = &expected["models"][model]["runs"][run];
            for (layout, what) in [
                (plan(1, 1, 0), "dp=1"),
                (plan(2, 1, 3), "dp=2 zero 3"),
                (plan(2, 2, 1), "dp=2 pp=2 zero 1"),
                (tp(2, plan(1, 1, 0)), "tp=2"),
                (tp(2, plan(2, 1, 1)), "tp=2 dp=2 zero 1"),
            ] {
                let what = format!("{model} {run} {what}");
                let program = torch_fixture::fixture_program(model, run, &init, layout);
                let c = torch_fixture::compare_with_torch(&program, model, run, torch);
                eprintln!(
                    "torch {what}: max |Δparam| {:e} (excess {:.3}), figures excess {:.3}",
                    c.param_abs, c.param_excess, c.figures_excess
                );
                assert!(
                    c.figures_excess <= 1.0 && c.param_excess <= 1.0,
                    "{what}: differs from PyTorch: {c:?}"
                );
            }
        }
    }
}

/// Negative controls of the PyTorch comparison: the same run with the learning rate 2% off, and
/// one started from weights with one matrix transposed (what a missing transpose at the PyTorch
/// boundary does) each end far outside the tolerance.
#[test]
fn the_torch_comparison_catches_a_wrong_rate_and_a_transposed_weight() {
    let expected = torch_fixture::expected();
    let torch = &expected["models"]["mlp"]["runs"]["sgd"];
    let init = torch_fixture::fixture_file("mlp.init.safetensors");
    let mut wrong_rate = torch_fixture::fixture_program("mlp", "sgd", &init, plan(1, 1, 0));
    wrong_rate.optimizer = OptimizerSpec::sgd(0.1 * 1.02);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut weights = torch_fixture::read_weights(&init);
    let (shape, values) = weights
        .get_mut("layers.1.weight")
        .expect("a square hidden matrix");
    assert_eq!(shape[0], shape[1]);
    let n = shape[0];
    *values = (0..n * n).map(|i| values[(i % n) * n + i / n]).collect();
    let transposed = dir.path().join("transposed.safetensors");
    torch_fixture::write_weights(&transposed, &weights);
    let wrong_layout = torch_fixture::fixture_program("mlp", "sgd", &transposed, plan(1, 1, 0));
    for (program, what) in [(wrong_rate, "lr 2% off"), (wrong_layout, "a transposed weight")] {
        let c = torch_fixture::compare_with_torch(&program, "mlp", "sgd", torch);
        eprintln!("control {what}: {c:?}");
        // Both in units of their tolerances (an excess of 1 is the edge of passing).
        assert_caught(&format!("{what}, parameters"), c.param_excess, 1.0, MARGIN);
        assert_caught(
            &format!("{what}, per-step figures"),
            c.figures_excess,
            1.0,
            MARGIN,
        );
    }
}

/// `--init` starts every layout from the same weights: from the fixture's gpt weights, dp=2 under
/// ZeRO-3, pp=2, dp=2 under ZeRO-3 with the parameters offloaded, tp=2 (each rank its slice of
/// the file's weights) and tp=2 × pp=2 train (2 SGD steps) to
/// dp=1's losses and parameters, element by element; the seeded initialisation is elsewhere
/// (its first loss differs), so the file was read.
#[test]
fn an_init_file_starts_every_layout_from_the_same_weights() {
    let init = torch_fixture::fixture_file("gpt.init.safetensors");
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |layout: ParallelPlan, name: &str| {
        let program = torch_fixture::fixture_program("gpt", "sgd", &init, layout);
        let file = dir.path().join(name);
        let report = torch_fixture::train_and_export(&program, 2, &file);
        (report, torch_fixture::read_weights(&file))
    };
    let (reference, reference_weights) = run(plan(1, 1, 0), "dp1.safetensors");
    let offloaded = ParallelPlan {
        offload: Offload::Cpu,
        offload_params: true,
        ..plan(2, 1, 3)
    };
    for (layout, what) in [
        (plan(2, 1, 3), "dp=2 zero 3"),
        (plan(1, 2, 0), "pp=2"),
        (offloaded, "dp=2 zero 3 offload cpu, parameters too"),
        (tp(2, plan(1, 1, 0)), "tp=2"),
        (tp(2, plan(1, 2, 0)), "tp=2 pp=2"),
    ] {
        let (report, weights) = run(layout, "run.safetensors");
        let (excess, abs) = torch_fixture::weights_excess(&reference_weights, &weights, |_, _| (1e-6, 1e-7));
        eprintln!("--init {what}: max |Δparam| {abs:e} (excess {excess:.3})");
        assert!(excess <= 1.0, "{what}: parameters differ by {abs:e}");
        assert_equivalent(&reference, &report, 1e-6, what);
    }
    let mut seeded = torch_fixture::fixture_program("gpt", "sgd", &init, plan(1, 1, 0));
    seeded.init = None;
    let seeded = train_program(
        &seeded,
        &TrainOptions {
            keep_params: true,
            steps: 1,
            ..TrainOptions::default()
        },
    );
    let (a, b) = (reference.steps[0].loss, seeded.steps[0].loss);
    // The control: the seeded weights are caught by the same loss comparison (1e-6), 1000×.
    assert_caught(
        "seeded weights instead of the file's (first loss)",
        ((a - b) / a).abs() as f64,
        1e-6,
        1000.0,
    );
}

/// `archipelago export` of a dp=2 ZeRO-3 checkpoint holds every parameter under its PyTorch name
/// and shape (read back with the safetensors crate); a run started from it (`--init`) and
/// exported again without moving (SGD at rate 0) gives the same file, byte for byte.
#[test]
fn export_of_a_zero3_checkpoint_round_trips_through_init() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fixture_init = torch_fixture::fixture_file("mlp.init.safetensors");
    let first = dir.path().join("first.safetensors");
    let trained = torch_fixture::fixture_program("mlp", "adamw", &fixture_init, plan(2, 1, 3));
    torch_fixture::train_and_export(&trained, 3, &first);
    let weights = torch_fixture::read_weights(&first);
    let spec = ModelSpec::parse(
        torch_fixture::expected()["models"]["mlp"]["spec"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let names: Vec<(String, Vec<usize>)> = archipelago_dataflow::param_names::block_params(&spec)
        .into_iter()
        .flatten()
        .map(|p| (p.name.clone(), p.torch_shape()))
        .collect();
    assert_eq!(weights.len(), names.len());
    for (name, shape) in &names {
        assert_eq!(&weights[name].0, shape, "{name}");
    }
    let initial = torch_fixture::read_weights(&fixture_init);
    // The control: the initial weights in place of the trained ones are caught element by
    // element (an absolute 1e-6: the round trip itself is compared byte for byte below).
    let (moved, _) = torch_fixture::weights_excess(&initial, &weights, |_, _| (0.0, 1e-6));
    assert_caught(
        "the initial weights exported instead of the trained ones",
        moved,
        1.0,
        MARGIN,
    );
    let mut still = torch_fixture::fixture_program("mlp", "sgd", &first, plan(2, 1, 3));
    still.optimizer = OptimizerSpec::sgd(0.0);
    let second = dir.path().join("second.safetensors");
    torch_fixture::train_and_export(&still, 1, &second);
    let (a, b) = (std::fs::read(&first).unwrap(), std::fs::read(&second).unwrap());
    assert!(
        a == b,
        "export → --init → export changed the file ({} vs {} bytes)",
        a.len(),
        b.len()
    );
}

/// SGD with Nesterov momentum and clipping (engaged at every step: factor < 1), AdamW with
/// warmup then cosine decay, and LAMB, each over 5 steps on one device and on dp=2 × ZeRO-3
/// (where a shard boundary cuts `layers.0.weight`, so LAMB's norm of it spans two shards), end
/// element by element at the parameters of a closed form written out in the test
/// (`closed_form.rs`: the mlp's backward by hand and each rule from its paper, no library
/// optimizer code), with its losses, gradient norms and rates. Each rule's deliberate mistake
/// (momentum dropped, clipping left out, coupled decay, no trust ratio, norms over half a
/// parameter) lands far outside the tolerance.
#[test]
fn momentum_adamw_and_lamb_match_their_closed_form_over_five_steps() {
    use archipelago_integration_tests::closed_form::{self, Mistake, Reference, Rule};
    const SMALL: &str = "mlp:in=6,hidden=8,layers=1,out=3";
    const FIVE: u64 = 5;
    const CLIP: f64 = 0.1;
    let betas = |spec: OptimizerSpec| match spec {
        OptimizerSpec::AdamW {
            beta1, beta2, eps, ..
        }
        | OptimizerSpec::Lamb {
            beta1, beta2, eps, ..
        } => (beta1 as f64, beta2 as f64, eps as f64),
        _ => unreachable!(),
    };
    let momentum = OptimizerSpec::sgd(0.2)
        .with_weight_decay(0.01)
        .with_momentum(0.9, true)
        .unwrap();
    let adamw = OptimizerSpec::adamw(1e-2).with_weight_decay(0.1);
    let lamb = OptimizerSpec::lamb(2e-2).with_weight_decay(0.1);
    let cases = [
        (
            momentum,
            Rule::Sgd {
                lr: 0.2,
                momentum: 0.9,
                nesterov: true,
                wd: 0.01,
            },
            Some(CLIP),
            None,
            vec![Mistake::NoMomentum, Mistake::Unclipped],
        ),
        (
            adamw,
            Rule::AdamW {
                lr: 1e-2,
                betas: betas(adamw),
                wd: 0.1,
            },
            None,
            Some((2, FIVE)),
            vec![Mistake::CoupledDecay],
        ),
        (
            lamb,
            Rule::Lamb {
                lr: 2e-2,
                betas: betas(lamb),
                wd: 0.1,
            },
            None,
            None,
            vec![Mistake::NoTrustRatio, Mistake::HalfParameterNorms],
        ),
    ];
    for (spec, rule, clip, schedule, mistakes) in cases {
        let program = |layout| {
            let p = program(SMALL, layout, spec).with_clip_grad_norm(clip.map(|c| c as f32));
            match schedule {
                Some((warmup, total)) => p.with_lr_schedule(LrSchedule::cosine(warmup, total)),
                None => p,
            }
        };
        let reference = Reference {
            rule,
            clip,
            schedule,
            mistake: None,
        };
        let expected = closed_form::train(&program(plan(1, 1, 0)), &reference, FIVE);
        if clip.is_some() {
            assert!(
                expected.clip_factors.iter().all(|&c| c < 1.0),
                "clipping must engage at every step: {:?}",
                expected.clip_factors
            );
        }
        for (layout, what) in [(plan(1, 1, 0), "dp=1"), (plan(2, 1, 3), "dp=2 zero 3")] {
            let what = format!("{} {what}", spec.name());
            let (report, params) = closed_form::train_and_read(&program(layout), FIVE);
            for (s, step) in report.steps.iter().enumerate() {
                let loss = (step.loss as f64 - expected.losses[s]).abs() / expected.losses[s];
                assert!(
                    loss < 1e-5,
                    "{what}: step {} loss {} vs {}",
                    step.step,
                    step.loss,
                    expected.losses[s]
                );
                if clip.is_some() {
                    let norm = step.grad_norm.expect("a clipped step reports its norm") as f64;
                    assert!(
                        (norm - expected.norms[s]).abs() / expected.norms[s] < 1e-5,
                        "{what}: step {} norm {norm} vs {}",
                        step.step,
                        expected.norms[s]
                    );
                }
                let lr = step.lr.expect("reported") as f64;
                let peak = spec.lr() as f64;
                let expected_lr = match schedule {
                    Some((w, _)) if step.step <= w => peak * step.step as f64 / w as f64,
                    Some((w, total)) => {
                        let progress = (step.step - w) as f64 / (total - w) as f64;
                        peak * (0.1 + 0.45 * (1.0 + (std::f64::consts::PI * progress).cos()))
                    }
                    None => peak,
                };
                assert!(
                    (lr - expected_lr).abs() < 1e-7 * peak.max(1.0),
                    "{what}: rate {lr} vs {expected_lr}"
                );
            }
            let (worst, abs) = closed_form::excess(&expected.params, &params, 1e-4, 1e-6);
            eprintln!("closed form {what}: max |Δparam| {abs:e} (allclose excess {worst:.3})");
            assert!(
                worst <= 1.0,
                "{what}: parameters differ from the closed form by {abs:e}"
            );
            for &mistake in &mistakes {
                let wrong = closed_form::train(
                    &program(plan(1, 1, 0)),
                    &Reference {
                        mistake: Some(mistake),
                        ..reference.clone()
                    },
                    FIVE,
                );
                let (caught, by) = closed_form::excess(&wrong.params, &params, 1e-4, 1e-6);
                eprintln!("control {what} {mistake:?}: |Δparam| {by:e}");
                assert_caught(&format!("{what} {mistake:?}"), caught, 1.0, 100.0);
            }
        }
    }
}
