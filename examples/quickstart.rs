//! The smallest archipelago program: declare a model and a plan, train on the embedded
//! controller (this process, one CPU actor per device), print the losses.
//!
//! Run: `cargo run --example quickstart`

use archipelago_controller::{Controller, TrainOptions};
use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Program};

fn main() -> anyhow::Result<()> {
    let model = ModelSpec::parse("mlp:in=64,hidden=128,layers=4,out=10")?;
    let program = Program::new(model).with_plan(ParallelPlan {
        dp: 2,
        batch: 64,
        ..ParallelPlan::default()
    });
    let controller = Controller::local(DeviceSpec::cpus(2));
    print!("{}", controller.plan(&program)?.summary());
    let report = controller.train(
        &program,
        &TrainOptions {
            steps: 20,
            ..TrainOptions::default()
        },
    )?;
    for step in &report.steps {
        println!("step {:>2}  loss {:.4}", step.step, step.loss);
    }
    println!("final parameter L2 norm {:.6}", report.param_l2);
    Ok(())
}
