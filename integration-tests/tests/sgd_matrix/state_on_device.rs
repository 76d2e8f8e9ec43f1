//! Training state on the device (`--state device`, `ParallelPlan::state`): the same element-wise
//! equivalence with one device as the rest of the matrix, under plain SGD and under the
//! scale-insensitive and stateful rules (AdamW with parameter groups, SGD with momentum,
//! Nesterov and weight decay, LAMB), and the host ⇄ device bytes each step reports: zero on the
//! optimizer path (gradients, parameters) with the state on the device; with the state in host
//! memory (today's round trip: the negative control) exactly the model's bytes each way per
//! step; at dp = 2 on the device, exactly each replica's gradient bucket each way (the
//! all-reduce runs in host memory until collectives run on the device); under ZeRO-1/2 on the
//! device, the reduced gradient (ZeRO-2: the shard), the updated shard down and the gathered
//! parameters up; under ZeRO-3, the shards down and the gathered model up for each pass.

use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program, StatePlacement};

use super::{Run, check, param_difference, reference, run_program};
use archipelago_integration_tests::{small_plan, stateful_rules};

fn on_device(plan: ParallelPlan) -> ParallelPlan {
    ParallelPlan {
        state: StatePlacement::Device,
        ..plan
    }
}

/// The model's parameter bytes (f32).
fn model_bytes() -> u64 {
    let desc = ModelSpec::parse(super::MLP).expect("model spec").desc();
    4 * desc.blocks.iter().map(|b| b.params).sum::<u64>()
}

/// Every step's (gradient, parameter) bytes each way, summed over actors.
fn optimizer_path(run: &Run) -> Vec<([u64; 2], [u64; 2])> {
    run.report
        .steps
        .iter()
        .map(|s| {
            let t = &s.transfers;
            (
                [t.gradients.to_host, t.gradients.to_device],
                [t.parameters.to_host, t.parameters.to_device],
            )
        })
        .collect()
}

#[test]
fn sgd_with_the_state_on_the_device_matches_one_device_and_moves_no_optimizer_bytes() {
    let reference = reference();
    let bytes = model_bytes();
    // The negative control: the host path reads every gradient off the device and writes
    // every parameter back, each step.
    for (step, path) in optimizer_path(&reference).into_iter().enumerate() {
        assert_eq!(path, ([bytes, 0], [0, bytes]), "host path, step {}", step + 1);
    }
    let pipeline = ParallelPlan {
        microbatches: 2,
        schedule: Schedule::OneFOneB,
        ..small_plan(1, 2, 0)
    };
    for plan in [
        small_plan(1, 1, 0),
        pipeline,
        small_plan(2, 1, 0),
        small_plan(2, 2, 0),
    ] {
        let plan = on_device(plan);
        let dp = plan.dp as u64;
        let run = check(&reference, plan);
        // Each replica's bucket leaves for the all-reduce and comes back once it is reduced.
        let expected = if dp > 1 {
            ([dp * bytes, dp * bytes], [0, 0])
        } else {
            ([0, 0], [0, 0])
        };
        for (step, path) in optimizer_path(&run).into_iter().enumerate() {
            assert_eq!(path, expected, "device state dp={dp}, step {}", step + 1);
        }
    }
    // ZeRO-1/2 on the device: each replica updates its shard there. Until collectives run on
    // the device, ZeRO-1's bucket leaves whole for the all-reduce and comes back whole; ZeRO-2's
    // comes back as the replica's shard; the updated shards leave for the all-gather (the
    // model's bytes over the group) and every replica takes the whole gathered model back.
    for zero in [1u8, 2] {
        let run = check(&reference, on_device(small_plan(2, 1, zero)));
        let back = if zero == 1 { 2 * bytes } else { bytes };
        for (step, path) in optimizer_path(&run).into_iter().enumerate() {
            assert_eq!(
                path,
                ([2 * bytes, back], [bytes, 2 * bytes]),
                "device state zero={zero}, step {}",
                step + 1
            );
        }
    }
    // ZeRO-3 on the device: the device keeps only its shard; for the forward and the backward
    // each shard goes down for the all-gather and every replica's modules take the gathered
    // model up; the reduce-scattered gradient comes back as the shard.
    let run = check(&reference, on_device(small_plan(2, 1, 3)));
    for (step, path) in optimizer_path(&run).into_iter().enumerate() {
        assert_eq!(
            path,
            ([2 * bytes, bytes], [2 * bytes, 4 * bytes]),
            "device state zero=3, step {}",
            step + 1
        );
    }
}

#[test]
fn stateful_rules_on_the_device_match_the_host_loops() {
    // Clipping to a bound below every step's norm, so that it engages each step.
    const CLIP: f32 = 0.05;
    // LAMB too: its per-parameter norms are summed on the device over each replica's share and
    // all-reduced (ZeRO-3 × dp = 2: a parameter's norm spans shards).
    let lamb = OptimizerSpec::lamb(1e-2).with_weight_decay(0.01);
    for optimizer in stateful_rules().into_iter().chain([lamb]) {
        for (dp, pp, zero, clip) in [
            (1, 1, 0, None),
            (2, 1, 0, None),
            (1, 2, 0, None),
            (1, 1, 0, Some(CLIP)),
            (2, 2, 0, Some(CLIP)),
            (2, 1, 1, None),
            (2, 1, 2, Some(CLIP)),
            (2, 1, 3, Some(CLIP)),
        ] {
            let program = |state| {
                Program::new(ModelSpec::parse(super::MLP).expect("model spec"))
                    .with_seed(7)
                    .with_optimizer(optimizer)
                    .with_clip_grad_norm(clip)
                    .with_plan(ParallelPlan {
                        state,
                        ..small_plan(dp, pp, zero)
                    })
            };
            let host = run_program(program(StatePlacement::Host));
            let device = run_program(program(StatePlacement::Device));
            let (excess, abs) = param_difference(&host, &device);
            eprintln!(
                "{optimizer:?} dp={dp} pp={pp} zero={zero} clip={clip:?}: device vs host max |Δparam| {abs:e}"
            );
            assert!(
                excess <= 1.0,
                "{optimizer:?} dp={dp} pp={pp} zero={zero}: {abs:e} apart"
            );
            if clip.is_some() {
                let norms: Vec<Option<f32>> = device.report.steps.iter().map(|s| s.grad_norm).collect();
                assert!(
                    norms.iter().all(|n| n.is_some_and(|n| n > CLIP)),
                    "clipping did not engage every step: {norms:?}"
                );
                let host_norms: Vec<Option<f32>> = host.report.steps.iter().map(|s| s.grad_norm).collect();
                assert_eq!(norms, host_norms, "the global norms");
            }
            let losses = |r: &Run| r.report.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
            assert_eq!(
                losses(&host),
                losses(&device),
                "{optimizer:?} dp={dp} pp={pp}: losses"
            );
        }
    }
}
