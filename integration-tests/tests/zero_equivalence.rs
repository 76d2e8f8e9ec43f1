//! ZeRO-1, -2 and -3 (Rajbhandari et al., SC 2020) train to the same parameters and losses as one
//! device, alone and under pipeline stages, and each actor's measured model state matches the
//! ZeRO formulas (f32 + Adam, Ψ parameters per stage, N = dp): zero 0 16Ψ; zero 1 8Ψ + 8Ψ/N;
//! zero 2 4Ψ + 12Ψ/N; zero 3 16Ψ/N — and the plan's estimate. Under ZeRO-3 no actor keeps a
//! compute copy of the weights between steps.

use archipelago_integration_tests::{assert_equivalent, assert_params_moved, small_plan as plan, train_plan};

const MLP7: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const PARAMS: f64 = 13_205.0;

fn formula(zero: u8, psi: f64, n: f64) -> f64 {
    match zero {
        0 => 16.0 * psi,
        1 => 8.0 * psi + 8.0 * psi / n,
        2 => 4.0 * psi + 12.0 * psi / n,
        _ => 16.0 * psi / n,
    }
}

#[test]
fn every_zero_stage_matches_one_device_and_the_memory_formulas() {
    let reference = train_plan(MLP7, plan(1, 1, 0), 6);
    assert_params_moved(MLP7, &reference);
    for zero in [0, 1, 2, 3] {
        for dp in [2, 4] {
            let run = train_plan(MLP7, plan(dp, 1, zero), 6);
            let what = format!("zero {zero} dp={dp}");
            assert_equivalent(&reference, &run, 1e-5, &what);
            for a in &run.actors {
                let expected = formula(zero, PARAMS, dp as f64);
                let measured = a.model_state_bytes as f64;
                assert!(
                    (measured - expected).abs() / expected < 0.10,
                    "{what}: actor {} holds {measured} bytes of model state, the formula says {expected}",
                    a.actor
                );
                if zero == 3 {
                    assert_eq!(a.compute_weight_bytes, 0, "{what}: weights kept between steps");
                }
                let estimate = a.estimated_model_state_bytes as f64;
                assert!(
                    (estimate - measured).abs() / measured < 0.10,
                    "{what}: plan {estimate} vs {measured}"
                );
            }
        }
    }
}

#[test]
fn zero_composes_with_pipeline_stages() {
    let reference = train_plan(MLP7, plan(1, 1, 0), 6);
    for zero in [1, 2, 3] {
        let run = train_plan(MLP7, plan(2, 2, zero), 6);
        assert_equivalent(&reference, &run, 1e-5, &format!("zero {zero} dp=2 pp=2"));
        let sharded: u64 = run
            .actors
            .iter()
            .filter(|a| a.replica == 0)
            .map(|a| a.model_state_bytes)
            .sum();
        let expected = formula(zero, PARAMS, 2.0);
        assert!(
            (sharded as f64 - expected).abs() / expected < 0.10,
            "zero {zero} pp=2: the two stages of a replica hold {sharded}, the formula says {expected}"
        );
    }
}
