//! The GPU path's host ⇄ device transfers — a gradient bucket concatenated on the device and read
//! in one transfer, a block's parameters written in one transfer and sliced on the device — run
//! here on CPU devices (forced on with `Builders::with_batched_transfers`) and train to the same
//! parameters and losses as the tensor-by-tensor path, alone and under ZeRO-3 (which loads the
//! parameters of every segment each step) and pipeline stages. Likewise the GPU's update of a
//! training state kept on the device (`--state device`): tensor ops instead of the flat loops
//! the CPU backend runs in place (`Builders::with_tensor_op_update`), under AdamW with parameter
//! groups and SGD with Nesterov momentum and weight decay.

use archipelago_actors::Builders;
use archipelago_controller::{Controller, TrainOptions, TrainReport};
use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec, ParallelPlan, Program, StatePlacement};
use archipelago_integration_tests::{assert_equivalent, assert_params_moved, small_plan, stateful_rules};

const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const GPT: &str = "gpt:vocab=256,ctx=16,d=32,layers=2,heads=4";

fn train(model: &str, plan: ParallelPlan, batched: bool) -> TrainReport {
    let actors = plan.actors();
    let spec = ModelSpec::parse(model).unwrap();
    let program = Program::new(spec.clone())
        .with_seed(7)
        .with_optimizer(OptimizerSpec::adam(1e-2))
        .with_plan(plan);
    let options = TrainOptions {
        keep_params: true,
        steps: 5,
        ..TrainOptions::default()
    };
    Controller::local(DeviceSpec::cpus(actors))
        .train_blocks(
            &program,
            Builders::zoo(spec).with_batched_transfers(batched),
            &options,
        )
        .unwrap()
}

#[test]
fn batched_transfers_train_like_tensor_by_tensor_ones() {
    for model in [MLP, GPT] {
        let batch = if model == GPT { 8 } else { 24 };
        let reference = train(
            model,
            ParallelPlan {
                batch,
                ..small_plan(1, 1, 0)
            },
            false,
        );
        assert_params_moved(model, &reference);
        for (dp, pp, zero) in [(1, 1, 0), (2, 1, 3), (2, 2, 1)] {
            let plan = ParallelPlan {
                batch,
                ..small_plan(dp, pp, zero)
            };
            let run = train(model, plan, true);
            assert_equivalent(
                &reference,
                &run,
                1e-5,
                &format!("{model} dp={dp} pp={pp} zero={zero} batched"),
            );
        }
    }
}

#[test]
fn the_tensor_op_update_of_a_device_state_trains_like_the_host_loops() {
    for model in [MLP, GPT] {
        let spec = ModelSpec::parse(model).unwrap();
        let batch = if model == GPT { 8 } else { 24 };
        let lamb = archipelago_dataflow::OptimizerSpec::lamb(1e-2).with_weight_decay(0.01);
        for optimizer in stateful_rules().into_iter().chain([lamb]) {
            // With clipping (a bound every step's norm exceeds) on one device: the bucket's sum
            // of squares is taken on the device.
            let cases = [
                (1, 1, 0, None),
                (2, 1, 0, None),
                (1, 2, 0, None),
                (1, 1, 0, Some(0.05)),
                (2, 1, 1, None),
                (2, 1, 2, Some(0.05)),
                (2, 1, 3, None),
            ];
            for (dp, pp, zero, clip) in cases {
                let train = |state, tensor_ops| {
                    let plan = ParallelPlan {
                        batch,
                        state,
                        ..small_plan(dp, pp, zero)
                    };
                    let program = Program::new(spec.clone())
                        .with_seed(7)
                        .with_optimizer(optimizer)
                        .with_clip_grad_norm(clip)
                        .with_plan(plan);
                    let options = TrainOptions {
                        keep_params: true,
                        steps: 4,
                        ..TrainOptions::default()
                    };
                    let builders = Builders::zoo(spec.clone())
                        .with_batched_transfers(tensor_ops)
                        .with_tensor_op_update(tensor_ops);
                    Controller::local(DeviceSpec::cpus(dp * pp))
                        .train_blocks(&program, builders, &options)
                        .unwrap()
                };
                let host = train(StatePlacement::Host, false);
                let device = train(StatePlacement::Device, true);
                let what = format!(
                    "{model} {optimizer:?} dp={dp} pp={pp} zero={zero} clip={clip:?} tensor-op update"
                );
                assert_params_moved(model, &host);
                // LAMB's norms are summed in f32 on the device (f64 in the host loops).
                let tolerance = if optimizer.needs_param_norms() { 1e-5 } else { 1e-6 };
                assert_equivalent(&host, &device, tolerance, &what);
                if let Some(bound) = clip {
                    let engaged = device
                        .steps
                        .iter()
                        .all(|s| s.grad_norm.is_some_and(|n| n > bound));
                    assert!(engaged, "{what}: clipping did not engage every step");
                }
                let optimizer_bytes: u64 = device.steps.iter().map(|s| s.transfers.optimizer_path()).sum();
                // dp = 2: each replica's buckets leave for the all-reduce and come back, 4 steps;
                // ZeRO-1/2 add the updated shards down and the gathered model up, and ZeRO-2's
                // reduced gradient comes back as a shard (until collectives run on the device).
                let model_bytes = 4 * device.params;
                let per_step = match (dp, zero) {
                    (1, _) => 0,
                    (_, 0) => 2 * dp as u64 * model_bytes,
                    (_, 1) => 2 * dp as u64 * model_bytes + model_bytes + dp as u64 * model_bytes,
                    (_, 2) => dp as u64 * model_bytes + model_bytes + model_bytes + dp as u64 * model_bytes,
                    // ZeRO-3: the bucket down and its shard back; for the forward and the
                    // backward, each shard down for the all-gather and the gathered model up
                    // into every replica's modules.
                    _ => dp as u64 * model_bytes + model_bytes + 2 * (model_bytes + dp as u64 * model_bytes),
                };
                let expected = 4 * per_step;
                assert_eq!(
                    optimizer_bytes, expected,
                    "{what}: optimizer-path bytes over 4 steps"
                );
            }
        }
    }
}
