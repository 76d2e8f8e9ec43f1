//! The same run with each store of the training state ends with the same parameters, element by
//! element: host memory (`--state host`), the device (`--state device`), and the offload actor in
//! host memory and in a file (`--offload cpu`, `--offload nvme:DIR`; with ZeRO-3 the parameter
//! shards offloaded too), under plain SGD and Adam, at dp = 2 with ZeRO-1 and ZeRO-3 (issue 37:
//! the store is where the state lives, never what the update computes). Negative control: one
//! replica's gradient dropped under the offload store lands far outside the same comparison.

use archipelago_dataflow::{
    ModelSpec, Offload, OptimizerSpec, ParallelPlan, Program, StatePlacement, TestFault,
};
use archipelago_integration_tests::small_plan;

use super::{MARGIN, Run, param_difference, run_checked, run_program};

fn program(plan: ParallelPlan, optimizer: OptimizerSpec) -> Program {
    Program::new(ModelSpec::parse(super::MLP).expect("model spec"))
        .with_seed(7)
        .with_optimizer(optimizer)
        .with_plan(plan)
}

/// The stores other than host memory, for `plan`: on the device, offloaded to host memory, and
/// to files in `dir` (ZeRO-3 offloads its parameter shards too).
fn other_stores(plan: &ParallelPlan, dir: &std::path::Path) -> Vec<(&'static str, ParallelPlan)> {
    let offload = |tier: Offload| ParallelPlan {
        offload: tier,
        offload_params: plan.zero == 3,
        ..plan.clone()
    };
    vec![
        (
            "device",
            ParallelPlan {
                state: StatePlacement::Device,
                ..plan.clone()
            },
        ),
        ("offload cpu", offload(Offload::Cpu)),
        (
            "offload nvme",
            offload(Offload::Nvme {
                dir: dir.display().to_string(),
            }),
        ),
    ]
}

#[test]
fn every_store_ends_with_the_same_parameters() {
    let dir = tempfile::tempdir().expect("temp dir");
    for optimizer in [OptimizerSpec::sgd(super::LR), OptimizerSpec::adam(1e-2)] {
        for zero in [1, 3] {
            let host_plan = ParallelPlan {
                state: StatePlacement::Host,
                ..small_plan(2, 1, zero)
            };
            let host = run_program(program(host_plan.clone(), optimizer));
            for (store, plan) in other_stores(&host_plan, dir.path()) {
                let what = format!("{} zero {zero}: {store} against host memory", optimizer.name());
                let run = run_program(program(plan, optimizer));
                let (excess, abs) = param_difference(&host, &run);
                eprintln!("{what}: max |Δparam| {abs:e} (allclose excess {excess:.3})");
                assert!(excess <= 1.0, "{what}: parameters differ by {abs:e}");
            }
        }
    }
}

/// The control: under the offload store, one replica's gradient dropped ends `MARGIN`× past the
/// tolerance of the same comparison.
#[test]
fn a_dropped_gradient_under_the_offload_store_is_caught() {
    let sgd = OptimizerSpec::sgd(super::LR);
    let plan = ParallelPlan {
        offload: Offload::Cpu,
        ..small_plan(2, 1, 1)
    };
    let clean: Run = run_program(program(plan.clone(), sgd));
    let mut broken = program(plan, sgd);
    broken.test_fault = Some(TestFault::DropReplicaGrad);
    let (excess, abs) = param_difference(&clean, &run_checked(broken, false));
    eprintln!("control offload DropReplicaGrad: max |Δparam| {abs:e} (allclose excess {excess:.1})");
    assert!(
        excess > MARGIN,
        "a dropped gradient moved the parameters by only {abs:e}"
    );
}
