//! Helpers of the mixed-precision tests (`tests/mixed_precision*.rs`): programs in a given
//! precision, every parameter of a run, element-wise distances, and the loss comparisons of
//! runs that are not meant to be equal (mixed precision, loss scaling, compression).

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Precision, Program};

use crate::{assert_replicas_agree, train_program};

/// bf16 compute over f32 masters, gradients reduced in bf16.
pub fn bf16() -> Precision {
    Precision::parse("bf16").expect("bf16")
}

/// `model` with seed 7, `optimizer`, `precision` and `plan`.
pub fn program(model: &str, optimizer: OptimizerSpec, precision: Precision, plan: ParallelPlan) -> Program {
    Program::new(ModelSpec::parse(model).expect("model spec"))
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_precision(precision)
        .with_plan(plan)
}

/// `program` for `steps` steps on the embedded controller (replicas checked, fabric bytes as
/// planned: [`train_program`]).
pub fn run(program: &Program, steps: u64) -> TrainReport {
    train_program(
        program,
        &TrainOptions {
            steps,
            ..TrainOptions::default()
        },
    )
}

/// Every parameter of a run (each block's, concatenated; every replica agreeing).
pub fn params(report: &TrainReport) -> Vec<f32> {
    let model = ModelSpec::parse(&report.model).expect("model spec").desc();
    assert_replicas_agree(report, &model, &report.model).concat()
}

/// The largest element-wise difference.
pub fn max_abs(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "parameter counts");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
}

/// Steps at the end of a run whose mean loss is compared.
pub const LAST: usize = 20;

/// The mean loss of the last [`LAST`] steps.
pub fn mean_last(report: &TrainReport) -> f64 {
    let tail = &report.steps[report.steps.len() - LAST..];
    tail.iter().map(|s| s.loss as f64).sum::<f64>() / LAST as f64
}

/// |mean_last(b) − mean_last(a)| / mean_last(a).
pub fn loss_gap(a: &TrainReport, b: &TrainReport) -> f64 {
    let (a, b) = (mean_last(a), mean_last(b));
    (b - a).abs() / a
}

/// The largest relative difference of one step's loss between two runs.
pub fn worst_step(a: &TrainReport, b: &TrainReport) -> f64 {
    (a.steps.iter().zip(&b.steps))
        .map(|(x, y)| ((x.loss - y.loss) / x.loss).abs() as f64)
        .fold(0.0, f64::max)
}
