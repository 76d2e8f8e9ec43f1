//! The GPU path's host ⇄ device transfers — a gradient bucket concatenated on the device and read
//! in one transfer, a block's parameters written in one transfer and sliced on the device — run
//! here on CPU devices (forced on with `Builders::with_batched_transfers`) and train to the same
//! parameters and losses as the tensor-by-tensor path, alone and under ZeRO-3 (which loads the
//! parameters of every segment each step) and pipeline stages.

use archipelago_actors::Builders;
use archipelago_controller::{Controller, TrainOptions, TrainReport};
use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec, ParallelPlan, Program};
use archipelago_integration_tests::{assert_equivalent, assert_params_moved, small_plan};

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
