//! GPT-2's tied head trained whole (issue 40): the token table is one parameter used by the first
//! and the last block, and every layout trains it as PyTorch does — the fixture of
//! `scripts/gpt2_fixture.py` (`training.json`: `torch_fixture.py`'s five SGD steps and five
//! AdamW steps with clipping, warmup and cosine decay, on `GPT2LMHeadModel` from the fixture's
//! weights, PyTorch summing the table's two gradients itself) is met on one device, under
//! pipeline parallelism (the head on the last stage, the table on the first), data parallelism,
//! ZeRO-1 and -3 and tensor parallelism (each rank's vocabulary rows), element by element.
//! Negative controls: the gradient sum skipped (the table updated with the embedding's gradient
//! alone) and the mirror left stale (the head computing with the initial table) are caught; a
//! vocabulary that tp does not divide pads the tie as it pads the table.

use std::path::{Path, PathBuf};

use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program, TestFault};
use archipelago_integration_tests::{
    MARGIN, assert_caught, assert_equivalent, small_plan as plan, torch_fixture,
};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/gpt2")
}

fn training() -> serde_json::Value {
    let path = fixture_dir().join("training.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("training.json")
}

fn tp(size: usize, layout: ParallelPlan) -> ParallelPlan {
    ParallelPlan { tp: size, ..layout }
}

/// The fixture's run `run` laid out as `layout`, from the fixture's `save_pretrained` weights.
fn program(run: &str, layout: ParallelPlan) -> Program {
    let dir = fixture_dir();
    let init = dir.join("model.safetensors");
    torch_fixture::fixture_program_in(&dir, &training(), "gpt2", run, &init, layout)
}

fn compare(program: &Program, run: &str) -> torch_fixture::TorchComparison {
    let training = training();
    let torch = &training["models"]["gpt2"]["runs"][run];
    torch_fixture::compare_with_torch_in(&fixture_dir(), program, "gpt2", run, torch)
}

/// Every layout (sequence parallelism's too), SGD and AdamW, ends at PyTorch's parameters (SGD 1e-5 relative, AdamW
/// allclose(1e-4, 1e-3·lr)) with its losses, rates and gradient norms (the norm counts the
/// table once, with both uses' gradient in it).
#[test]
fn full_fine_tuning_of_the_tied_gpt2_matches_transformers() {
    for run in ["sgd", "adamw"] {
        for (layout, what) in [
            (plan(1, 1, 0), "one device"),
            (plan(1, 2, 0), "pp=2"),
            (plan(2, 1, 3), "dp=2 zero 3"),
            (plan(2, 2, 1), "dp=2 pp=2 zero 1"),
            (tp(2, plan(1, 1, 0)), "tp=2"),
            (tp(2, plan(1, 2, 0)), "tp=2 pp=2"),
        ] {
            let what = format!("gpt2 {run} {what}");
            check(&program(run, layout), run, &what);
        }
        // Sequence parallelism cuts the same parameters into other blocks: `--init` reads them
        // by name.
        let spec = ModelSpec::parse(training()["models"]["gpt2"]["spec"].as_str().unwrap()).unwrap();
        let sequence_parallel = program(run, tp(2, plan(1, 2, 0)))
            .sequence_parallel(&spec)
            .expect("the sequence-parallel form");
        check(
            &sequence_parallel,
            run,
            &format!("gpt2 {run} tp=2 pp=2 sequence-parallel"),
        );
    }
}

/// Trains `program` as the fixture's `run` and holds it to PyTorch's.
fn check(program: &Program, run: &str, what: &str) {
    let c = compare(program, run);
    eprintln!(
        "torch {what}: max |Δparam| {:e} (excess {:.3}), figures excess {:.3}",
        c.param_abs, c.param_excess, c.figures_excess
    );
    assert!(
        c.figures_excess <= 1.0 && c.param_excess <= 1.0,
        "{what}: differs from PyTorch: {c:?}"
    );
}

/// The same comparison catches a tie half built: its gradient sum skipped (on one device and
/// across two stages) or the mirror never refreshed from the table.
#[test]
fn a_tie_without_its_gradient_sum_or_its_values_is_caught() {
    for (layout, fault, what) in [
        (
            plan(1, 1, 0),
            TestFault::SkipTiedGrads,
            "one device, the sum skipped",
        ),
        (plan(1, 2, 0), TestFault::SkipTiedGrads, "pp=2, the sum skipped"),
        (
            plan(1, 2, 0),
            TestFault::StaleTiedValues,
            "pp=2, the mirror stale",
        ),
    ] {
        let mut broken = program("sgd", layout);
        broken.test_fault = Some(fault);
        let c = compare(&broken, "sgd");
        assert_caught(&format!("{what}, parameters"), c.param_excess, 1.0, MARGIN);
    }
}

/// A vocabulary that tensor parallelism does not divide (37 rows over 2 ranks): the table and its
/// mirror are padded alike, and tp=2 and tp=2 × pp=2 train to one device's losses and
/// parameters (from the seeded initialisation).
#[test]
fn a_vocabulary_tp_does_not_divide_pads_the_tie_alike() {
    let spec = ModelSpec::parse("gpt2:vocab=37,ctx=8,d=16,layers=1,heads=2").expect("spec");
    let seeded = |layout: ParallelPlan| {
        Program::new(spec.clone())
            .with_seed(5)
            .with_optimizer(OptimizerSpec::sgd(0.5))
            .with_plan(ParallelPlan { batch: 8, ..layout })
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |layout: ParallelPlan, name: &str| {
        let file = dir.path().join(name);
        let report = torch_fixture::train_and_export(&seeded(layout), 3, &file);
        (report, torch_fixture::read_weights(&file))
    };
    let (reference, reference_weights) = run(plan(1, 1, 0), "one.safetensors");
    for (layout, what) in [
        (tp(2, plan(1, 1, 0)), "tp=2"),
        (tp(2, plan(1, 2, 0)), "tp=2 pp=2"),
    ] {
        let (report, weights) = run(layout, "run.safetensors");
        let (excess, abs) = torch_fixture::weights_excess(&reference_weights, &weights, |_, _| (1e-5, 1e-6));
        eprintln!("vocab 37 {what}: max |Δparam| {abs:e} (excess {excess:.3})");
        assert!(excess <= 1.0, "{what}: parameters differ by {abs:e}");
        assert_equivalent(&reference, &report, 1e-5, what);
    }
}
