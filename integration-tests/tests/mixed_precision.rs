//! Mixed precision (issue 38; Micikevicius et al., "Mixed Precision Training", 2018): a bf16
//! compute copy of the weights over the f32 master trains a small gpt and an mlp to within 2% of
//! f32's loss (the mean of the last 20 steps, never one step's), under Adam and under SGD (which
//! passes the gradient's scale on as it is); the compute copy takes 2 bytes per parameter beside
//! the f32 master. The layouts and the fabric's bytes are `mixed_precision_layouts.rs`'s.
//!
//! Negative controls, each caught at least [`MARGIN`]× past its tolerance: bf16 compared with f32
//! at f32's tolerance (the run really computed in bf16); a compute copy never refreshed after the
//! update (`TestFault::StaleComputeCopy`); a master rounded to bf16 after each update, i.e. no
//! f32 master (`TestFault::RoundedMaster`), under SGD at a rate whose updates fall below half a
//! bf16 place.

use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Precision, TestFault};
use archipelago_integration_tests::precision::{LAST, bf16, loss_gap, mean_last, program, run, worst_step};
use archipelago_integration_tests::{MARGIN, assert_caught};

const GPT: &str = "gpt:vocab=64,ctx=16,d=32,layers=2,heads=2";
const MLP: &str = "mlp:in=16,hidden=64,layers=3,out=4";
/// Wide enough that SGD at 0.02 moves most weights by less than half a bf16 place per step.
const MLP_WIDE: &str = "mlp:in=16,hidden=512,layers=3,out=4";
/// Steps of the loss comparisons.
const STEPS: u64 = 60;
/// The bound of the issue: bf16's mean loss over the last steps within 2% of f32's.
const LOSS_BOUND: f64 = 0.02;

fn one_device(batch: usize) -> ParallelPlan {
    ParallelPlan {
        batch,
        ..ParallelPlan::default()
    }
}

/// The cases: (model, optimizer, batch).
fn cases() -> [(&'static str, OptimizerSpec, usize); 3] {
    [
        (GPT, OptimizerSpec::adam(1e-2), 8),
        (GPT, OptimizerSpec::sgd(0.5), 8),
        (MLP, OptimizerSpec::sgd(0.1), 32),
    ]
}

#[test]
fn bf16_ends_within_two_percent_of_f32() {
    for (model, optimizer, batch) in cases() {
        let what = format!("{model} {}", optimizer.name());
        let f32_run = run(
            &program(model, optimizer, Precision::default(), one_device(batch)),
            STEPS,
        );
        let bf16_run = run(&program(model, optimizer, bf16(), one_device(batch)), STEPS);
        let (first, last) = (f32_run.steps[0].loss as f64, mean_last(&f32_run));
        assert!(
            last < 0.9 * first,
            "{what}: f32 did not learn ({first} → {last}): the comparison would show nothing"
        );
        let gap = loss_gap(&f32_run, &bf16_run);
        eprintln!(
            "{what}: mean loss of the last {LAST} steps f32 {last:.5}, bf16 {:.5}: {gap:.2e} apart",
            mean_last(&bf16_run)
        );
        assert!(
            gap < LOSS_BOUND,
            "{what}: bf16 ends {gap:.3e} from f32 (bound {LOSS_BOUND})"
        );
        // Control: at f32's tolerance the two differ (the run did compute in bf16).
        assert_caught(
            &format!("{what}: bf16 against f32 at 1e-5"),
            worst_step(&f32_run, &bf16_run),
            1e-5,
            MARGIN,
        );
    }
}

#[test]
fn a_stale_compute_copy_is_caught() {
    let (model, optimizer, batch) = cases()[0];
    let f32_run = run(
        &program(model, optimizer, Precision::default(), one_device(batch)),
        STEPS,
    );
    let mut stale = program(model, optimizer, bf16(), one_device(batch));
    stale.test_fault = Some(TestFault::StaleComputeCopy);
    let gap = loss_gap(&f32_run, &run(&stale, STEPS));
    assert_caught("a compute copy never refreshed", gap, LOSS_BOUND, MARGIN);
}

/// SGD at a rate whose updates are below half a bf16 place of most weights: with the f32 master
/// they add up (bf16 within 2% of f32); rounded into a 16-bit master each one vanishes.
#[test]
fn without_the_f32_master_small_updates_vanish() {
    let (model, batch) = (MLP_WIDE, 32);
    let optimizer = OptimizerSpec::sgd(0.02);
    let f32_run = run(
        &program(model, optimizer, Precision::default(), one_device(batch)),
        STEPS,
    );
    let bf16_run = run(&program(model, optimizer, bf16(), one_device(batch)), STEPS);
    let gap = loss_gap(&f32_run, &bf16_run);
    eprintln!("small SGD steps: bf16 with its f32 master {gap:.2e} from f32");
    assert!(
        gap < LOSS_BOUND,
        "bf16 with its f32 master ends {gap:.3e} from f32"
    );
    let mut rounded = program(model, optimizer, bf16(), one_device(batch));
    rounded.test_fault = Some(TestFault::RoundedMaster);
    let gap = loss_gap(&f32_run, &run(&rounded, STEPS));
    assert_caught("a master rounded to bf16", gap, LOSS_BOUND, MARGIN);
}

/// The compute copy holds 2 bytes per parameter in bf16, 4 in f32, beside an f32 master of the
/// same size either way.
#[test]
fn the_compute_copy_is_two_bytes_per_parameter_in_bf16() {
    let params = ModelSpec::parse(GPT).unwrap().desc().params();
    let bytes = |precision: Precision| {
        let report = run(
            &program(GPT, OptimizerSpec::adam(1e-3), precision, one_device(8)),
            2,
        );
        let actor = &report.actors[0];
        (actor.compute_weight_bytes, actor.model_state_bytes)
    };
    let (f32_copy, f32_state) = bytes(Precision::default());
    let (bf16_copy, bf16_state) = bytes(bf16());
    assert_eq!(f32_copy, 4 * params, "f32 compute copy");
    assert_eq!(bf16_copy, 2 * params, "bf16 compute copy");
    assert_eq!(
        bf16_state, f32_state,
        "the master, gradients and Adam's state stay f32"
    );
}

/// Offload keeps the f32 master (and Adam's state) in its tier and sends the device the compute
/// copy: under bf16 the parameters' host-to-device bytes of a step are 2 per parameter on each
/// replica (the updated shard back from the tier, gathered and loaded into the modules), half of
/// f32's; the tier's share of the model state is the same f32 12 bytes per updated parameter.
#[test]
fn offload_sends_the_device_its_compute_copy() {
    let params = ModelSpec::parse(GPT).unwrap().desc().params();
    let plan = ParallelPlan {
        dp: 2,
        zero: 2,
        batch: 8,
        offload: archipelago_dataflow::Offload::Cpu,
        ..ParallelPlan::default()
    };
    let bytes = |precision: Precision| {
        let report = run(
            &program(GPT, OptimizerSpec::adam(1e-3), precision, plan.clone()),
            3,
        );
        let to_device: Vec<u64> = (report.steps.iter().skip(1))
            .map(|s| s.transfers.parameters.to_device)
            .collect();
        let tier: Vec<u64> = (report.actors.iter())
            .map(|a| a.offload.as_ref().map_or(0, |o| o.host_bytes))
            .collect();
        (to_device, tier)
    };
    let (wide, wide_tier) = bytes(Precision::default());
    let (narrow, narrow_tier) = bytes(bf16());
    assert!(
        wide.iter().all(|&b| b == 2 * 4 * params),
        "f32: {wide:?} for {params} parameters"
    );
    assert!(
        narrow.iter().all(|&b| b == 2 * 2 * params),
        "bf16: {narrow:?} for {params} parameters"
    );
    assert_eq!(
        narrow_tier, wide_tier,
        "the tier keeps the f32 master and state either way"
    );
}
