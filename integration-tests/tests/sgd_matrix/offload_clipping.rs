//! Clipping with offload (the deferred offloaded update): every bucket is staged with the
//! offload actor as it is reduced and updated only once the global norm is known, so an
//! offloaded run clips exactly as one device does — under plain SGD (scale-sensitive), SGD with
//! momentum and AdamW, over ZeRO 0–3 with dp = 2 — element by element, with the same gradient
//! norm reported every step. Negative control: without clipping the same run ends far from the
//! clipped reference (clipping engaged: the reported norms exceed the bound).

use archipelago_dataflow::{ModelSpec, Offload, OptimizerSpec, ParallelPlan, Program};

use super::{RTOL, Run, describe, param_difference, run_program};
use archipelago_integration_tests::{assert_equivalent, small_plan};

/// Well under the gradient norms of the first steps, so every step is clipped.
const BOUND: f32 = 0.05;

fn clipped(plan: ParallelPlan, optimizer: OptimizerSpec, clip: Option<f32>) -> Run {
    let program = Program::new(ModelSpec::parse(super::MLP).expect("model spec"))
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_plan(plan)
        .with_clip_grad_norm(clip);
    run_program(program)
}

fn norms(run: &Run) -> Vec<f64> {
    run.report
        .steps
        .iter()
        .map(|s| s.grad_norm.expect("a clipped step reports its norm") as f64)
        .collect()
}

#[test]
fn offloaded_updates_wait_for_the_norm_and_clip_like_one_device() {
    let rules = [
        OptimizerSpec::sgd(super::LR),
        OptimizerSpec::sgd(0.1)
            .with_momentum(0.9, false)
            .expect("momentum"),
        OptimizerSpec::adamw(1e-2).with_weight_decay(0.1),
    ];
    for optimizer in rules {
        let reference = clipped(small_plan(1, 1, 0), optimizer, Some(BOUND));
        assert!(
            norms(&reference).iter().all(|&n| n > BOUND as f64),
            "every step must clip: {:?}",
            norms(&reference)
        );
        for zero in 0..=3 {
            let plan = ParallelPlan {
                offload: Offload::Cpu,
                ..small_plan(2, 1, zero)
            };
            let what = format!("{} {} clip {BOUND}", describe(&plan), optimizer.name());
            let run = clipped(plan.clone(), optimizer, Some(BOUND));
            assert_equivalent(&reference.report, &run.report, RTOL, &what);
            let (excess, abs) = param_difference(&reference, &run);
            eprintln!("{what}: max |Δparam| {abs:e} (allclose excess {excess:.3})");
            assert!(excess <= 1.0, "{what}: parameters differ by {abs:e}");
            for (a, b) in norms(&reference).iter().zip(norms(&run)) {
                assert!((a - b).abs() <= 1e-5 * a, "{what}: norms {a} vs {b}");
            }
            if zero == 2 {
                // The control: the same offloaded run, unclipped, is far from the clipped one.
                let unclipped = clipped(plan, optimizer, None);
                let (excess, abs) = param_difference(&reference, &unclipped);
                eprintln!("control {what} unclipped: max |Δparam| {abs:e} ({excess:.1}×)");
                assert!(
                    excess > super::MARGIN,
                    "{what}: clipping changed nothing ({abs:e})"
                );
            }
        }
    }
}
