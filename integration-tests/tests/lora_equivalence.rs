//! LoRA fine-tuning trains like one device (issue 40): the GPT-2 fixture's base (from
//! `transformers`, `--init`) with adapters of rank 4 on `c_attn` and `c_proj` trains at dp=2,
//! pp=2 and ZeRO-3 × dp=2 to one device's losses and adapters — element by element under plain
//! SGD, losses and norms under Adam — with every base parameter bit-identical to the file's
//! after, on every actor; the adapters alone carry gradients, optimizer state and gradient bytes
//! on the fabric (the plan's optimizer bytes are the adapters'). Negative control: a base weight
//! left trainable moves and is caught.

use std::path::{Path, PathBuf};

use archipelago_actors::inference::read_weights;
use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::family::{LoraSpec, gpt2_from_config};
use archipelago_dataflow::{FabricKind, ModelSpec, OptimizerSpec, ParallelPlan, Program, compile};
use archipelago_integration_tests::{
    assert_caught, assert_replicas_agree, assert_same_losses_and_norms, small_plan, train_program,
};

const STEPS: u64 = 5;
const RTOL: f64 = 1e-5;
const ATOL: f64 = 1e-6;
/// A base weight the control leaves trainable.
const LEFT_TRAINABLE: &str = "transformer.h.1.mlp.c_fc.weight";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/gpt2")
        .join(name)
}

/// The fixture's GPT-2 with adapters on `c_attn` and `c_proj`.
fn spec() -> ModelSpec {
    let text = std::fs::read_to_string(fixture("config.json")).unwrap();
    let base = gpt2_from_config(&serde_json::from_str(&text).unwrap()).unwrap();
    let lora = LoraSpec {
        rank: 4,
        alpha: 8.0,
        targets: vec!["c_attn".into(), "c_proj".into()],
    };
    base.with_lora(lora).unwrap()
}

fn program(plan: ParallelPlan, optimizer: OptimizerSpec, leave_trainable: bool) -> Program {
    let mut program = Program::new(spec())
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_plan(plan);
    program.init = Some(fixture("model.safetensors").display().to_string());
    if leave_trainable {
        let p = (program.model.blocks.iter_mut().flat_map(|b| &mut b.param_descs))
            .find(|p| p.name == LEFT_TRAINABLE)
            .unwrap();
        p.trainable = true;
    }
    program
}

fn train(program: &Program) -> (TrainReport, Vec<Vec<f32>>) {
    let options = TrainOptions {
        steps: STEPS,
        ..TrainOptions::default()
    };
    let report = train_program(program, &options);
    let params = assert_replicas_agree(&report, &program.model, "lora");
    (report, params)
}

/// Largest element-wise excess over `allclose(RTOL, ATOL)` (≤ 1 passes).
fn excess(reference: &[Vec<f32>], run: &[Vec<f32>]) -> f64 {
    let pairs = reference.iter().flatten().zip(run.iter().flatten());
    pairs
        .map(|(&x, &y)| (x as f64 - y as f64).abs() / (ATOL + RTOL * (x as f64).abs()))
        .fold(0.0, f64::max)
}

/// How many base (frozen) parameters of `program` differ in any bit from the `--init` file's (or,
/// for a base held in bf16, by more than bf16's rounding of them: 2⁻⁸ relative).
fn base_changed(program: &Program, params: &[Vec<f32>]) -> usize {
    let bf16 = program.precision.compute == archipelago_dataflow::DType::BF16;
    let moved = |(a, b): (&f32, &f32)| {
        a.to_bits() != b.to_bits() && (!bf16 || (a - b).abs() > b.abs() * 2f32.powi(-8))
    };
    let initial = read_weights(&spec(), &fixture("model.safetensors"), None).unwrap();
    let mut changed = 0;
    for ((block, held), start) in program.model.blocks.iter().zip(params).zip(&initial) {
        let mut at = 0;
        for p in &block.param_descs {
            let range = at..at + p.len();
            at += p.len();
            let is_base = !p.name.contains(".lora_");
            if is_base && held[range.clone()].iter().zip(&start[range]).any(moved) {
                changed += 1;
            }
        }
    }
    changed
}

#[test]
fn lora_trains_like_one_device_on_every_layout_and_the_base_stays_put() {
    for optimizer in [OptimizerSpec::sgd(0.5), OptimizerSpec::adam(1e-2)] {
        let reference_program = program(small_plan(1, 1, 0), optimizer, false);
        let (reference, reference_params) = train(&reference_program);
        assert_eq!(
            base_changed(&reference_program, &reference_params),
            0,
            "one device moved the base"
        );
        let losses: Vec<f32> = reference.steps.iter().map(|s| s.loss).collect();
        assert!(
            losses.last() < losses.first(),
            "{} does not learn: {losses:?}",
            optimizer.name()
        );
        for plan in [small_plan(2, 1, 0), small_plan(1, 2, 0), small_plan(2, 1, 3)] {
            let what = format!(
                "dp {} pp {} zero {} {}",
                plan.dp,
                plan.pp,
                plan.zero,
                optimizer.name()
            );
            let run_program = program(plan, optimizer, false);
            let (run, params) = train(&run_program);
            assert_eq!(base_changed(&run_program, &params), 0, "{what}: the base moved");
            assert_same_losses_and_norms(&reference, &run, RTOL, &what);
            assert_state_and_fabric_are_the_adapters(&run_program, &run, &what);
            if optimizer.name() == "sgd" {
                let excess = excess(&reference_params, &params);
                eprintln!("lora {what}: allclose excess {excess:.3}");
                assert!(
                    excess <= 1.0,
                    "{what}: adapters differ ({excess:.1}× the tolerance)"
                );
            }
        }
    }
}

/// Every actor's measured optimizer state is the plan's (within 10%), which holds the adapters'
/// moments alone (Adam: two f32 per adapter element it updates; none under plain SGD); a dp=2
/// replica's gradient reduction reads the adapters' gradients and nothing of the base.
fn assert_state_and_fabric_are_the_adapters(program: &Program, run: &TrainReport, what: &str) {
    let adapters: u64 = (program.model.blocks.iter()).map(|b| b.trained_params()).sum();
    assert_eq!(
        run.trainable_params, adapters,
        "{what}: the report's trainable parameters"
    );
    for (a, actor) in run.actors.iter().enumerate() {
        let (measured, planned) = (actor.optimizer_state_bytes, actor.estimated_optimizer_state_bytes);
        eprintln!(
            "{what}: actor {a} optimizer bytes {measured} (plan {planned}), gradient reads {}",
            actor.fabric_bytes_per_step.of_kind(FabricKind::Gradients)
        );
        assert!(
            measured.abs_diff(planned) * 10 <= planned.max(1),
            "{what}: actor {a} optimizer bytes {measured}, plan {planned}"
        );
        if program.plan.dp == 2 && program.plan.zero == 0 {
            // A two-member ring all-reduce reads (n−1)/n of the bucket twice: its bytes, once.
            let reads = actor.fabric_bytes_per_step.of_kind(FabricKind::Gradients);
            assert_eq!(
                reads,
                4 * adapters,
                "{what}: actor {a} reads {reads} gradient bytes"
            );
        }
    }
}

/// The plan keeps optimizer state and gradients for the adapters alone, and the gradient
/// reduction of dp=2 carries their bytes only.
#[test]
fn optimizer_state_and_gradient_bytes_are_the_adapters() {
    let program = program(small_plan(2, 1, 0), OptimizerSpec::adam(1e-2), false);
    let adapters: u64 = (program.model.blocks.iter().flat_map(|b| &b.param_descs))
        .filter(|p| p.trainable)
        .map(|p| p.len() as u64)
        .sum();
    assert!(
        adapters > 0 && adapters < program.model.params() / 10,
        "{adapters} of {}",
        program.model.params()
    );
    let plan = compile(&program).unwrap();
    for memory in &plan.memory {
        assert_eq!(
            memory.optimizer,
            8 * adapters,
            "Adam's two f32 moments per adapter element"
        );
        assert_eq!(memory.grads, 4 * adapters);
    }
}

/// The control: a base weight left trainable moves and ends far from the frozen reference.
#[test]
fn a_base_weight_left_trainable_is_caught() {
    let sgd = OptimizerSpec::sgd(0.5);
    let (_, reference) = train(&program(small_plan(1, 1, 0), sgd, false));
    let broken_program = program(small_plan(2, 1, 0), sgd, true);
    let (_, broken) = train(&broken_program);
    assert_eq!(
        base_changed(&broken_program, &broken),
        1,
        "the weight left trainable moved"
    );
    assert_caught("base left trainable", excess(&reference, &broken), 1.0, 100.0);
}

/// LoRA composes with tensor parallelism (A or B cut so the low-rank product follows the base
/// weight's split: `c_attn`'s B by heads, `c_proj`'s A by rows) — tp=2 and tp=2 × dp=2 train the
/// adapters like one device under plain SGD, element by element — and with bf16 mixed precision
/// (the base computing in bf16, the adapters' master in f32): dp=2 equals one device in bf16, and
/// the base stays bit-identical.
#[test]
fn lora_composes_with_tensor_parallelism_and_bf16() {
    let sgd = OptimizerSpec::sgd(0.5);
    let (_, reference) = train(&program(small_plan(1, 1, 0), sgd, false));
    for (tp, dp) in [(2, 1), (2, 2)] {
        let plan = ParallelPlan {
            tp,
            ..small_plan(dp, 1, 0)
        };
        let run_program = program(plan, sgd, false);
        let (_, params) = train(&run_program);
        assert_eq!(
            base_changed(&run_program, &params),
            0,
            "tp {tp} dp {dp}: the base moved"
        );
        let excess = excess(&reference, &params);
        eprintln!("lora tp {tp} dp {dp} sgd: allclose excess {excess:.3}");
        assert!(
            excess <= 1.0,
            "tp {tp} dp {dp}: adapters differ ({excess:.1}× the tolerance)"
        );
    }
    let bf16 = |dp: usize| {
        let mut p = program(small_plan(dp, 1, 0), OptimizerSpec::adam(1e-2), false);
        p.precision = archipelago_dataflow::Precision::parse("bf16").unwrap();
        p
    };
    let (one, one_params) = train(&bf16(1));
    let losses: Vec<f32> = one.steps.iter().map(|s| s.loss).collect();
    assert!(
        losses.last() < losses.first(),
        "bf16 LoRA does not learn: {losses:?}"
    );
    let two_program = bf16(2);
    let (two, two_params) = train(&two_program);
    assert_eq!(base_changed(&two_program, &two_params), 0, "bf16: the base moved");
    assert_eq!(
        base_changed(&bf16(1), &one_params),
        0,
        "bf16 one device: the base moved"
    );
    assert_same_losses_and_norms(&one, &two, 1e-2, "bf16 dp 2");
}
