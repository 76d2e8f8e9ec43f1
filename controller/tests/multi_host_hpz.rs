//! ZeRO++'s hierarchical partitioning (hpZ, Wang et al. 2023 §3.2) across real processes: a
//! controller and two `archipelago host`s of two CPU devices each, each host its own island. At
//! dp=4 under ZeRO-3, `--zero-hpz` trains to the parameters of one device (and of ZeRO-3 without
//! it, bit for bit), while the bytes read across islands drop by exactly the backward's share of
//! the parameter gathers (its gathers stay inside each host); every actor holds the secondary
//! copy the plan said it would. Control: a secondary copy never refreshed after the first step
//! (`TestFault::HpzStaleSecondary`) is caught by the comparison with one device.

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{ModelSpec, TestFault};

mod common;

use common::{Cluster, local, plan, program};

/// The largest element-wise difference between two runs' parameters.
fn max_param_gap(a: &TrainReport, b: &TrainReport) -> f32 {
    let model = ModelSpec::parse(common::MLP).unwrap().desc();
    let assemble =
        |r: &TrainReport| archipelago_controller::replica_check::assemble_params(r, &model).unwrap();
    (assemble(a).iter().flatten())
        .zip(assemble(b).iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn hpz_keeps_the_backward_gathers_inside_each_host_and_equals_one_device() {
    let mut cluster = Cluster::start(5.0, 30.0);
    cluster.add_host("h1", "cpu:0,cpu:1");
    cluster.add_host("h2", "cpu:0,cpu:1");
    let remote = cluster.controller();
    let steps = 5;
    let one_device = local(plan(1, 1, 0), steps);
    let run = |hpz: bool, fault: Option<TestFault>| {
        let mut program = program(archipelago_dataflow::ParallelPlan {
            zero_hpz: hpz,
            ..plan(4, 1, 3)
        });
        program.test_fault = fault;
        let options = TrainOptions {
            steps,
            job: format!("hpz-{hpz}-{}", fault.is_some()),
            keep_params: true,
            ..TrainOptions::default()
        };
        remote
            .train(&program, &options)
            .unwrap_or_else(|e| panic!("hpz {hpz}: {e}"))
    };
    let zero3 = run(false, None);
    let hpz = run(true, None);
    for report in [&zero3, &hpz] {
        archipelago_controller::fabric_check::check(report).unwrap();
    }
    // Equivalence: with hpZ as without it (the same values gathered from elsewhere), and as one
    // device within f32 reduction order.
    assert_eq!(
        max_param_gap(&hpz, &zero3),
        0.0,
        "hpZ changed what the backward computes with"
    );
    let gap = max_param_gap(&hpz, &one_device);
    assert!(gap < 1e-5, "hpZ is {gap} from one device");
    for (a, b) in one_device.steps.iter().zip(&hpz.steps) {
        assert!(
            ((a.loss - b.loss) / a.loss).abs() < 1e-5,
            "step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    // Bytes across islands: the gradients' reduce-scatter and the forward's gathers cross as
    // before; the backward's gathers (as many bytes as the forward's: one micro-batch, one
    // forward and one backward per segment) no longer do.
    let crossing = |r: &TrainReport| r.steps.last().unwrap().fabric_crossing_islands;
    let (before, after) = (crossing(&zero3), crossing(&hpz));
    assert!(
        before.parameters > 0 && before.gradients > 0,
        "nothing crossed islands: {before:?}"
    );
    assert_eq!(after.gradients, before.gradients);
    assert_eq!(after.parameters * 2, before.parameters, "{before:?} → {after:?}");
    assert_eq!(before.total() - after.total(), before.parameters / 2);
    let total = |r: &TrainReport| r.steps.last().unwrap().fabric.total();
    assert!(total(&hpz) < total(&zero3));
    eprintln!(
        "bytes crossing islands per step: {} without hpZ, {} with (fabric {} → {})",
        before.total(),
        after.total(),
        total(&zero3),
        total(&hpz)
    );
    // Memory: every actor holds the secondary copy the plan estimated (its half of each
    // segment, an island being two replicas).
    for actor in &hpz.actors {
        assert!(
            actor.hpz_secondary_bytes > 0,
            "actor {} kept no secondary copy",
            actor.actor
        );
        assert_eq!(actor.hpz_secondary_bytes, actor.estimated_hpz_secondary_bytes);
    }
    assert!(zero3.actors.iter().all(|a| a.hpz_secondary_bytes == 0));
    // Control: a secondary copy kept from the first step only recomputes later backwards with
    // stale parameters, and the comparison with one device catches it.
    let stale = run(true, Some(TestFault::HpzStaleSecondary));
    let stale_gap = max_param_gap(&stale, &one_device);
    assert!(
        stale_gap > 100.0 * 1e-5,
        "the stale secondary copy went unnoticed ({stale_gap})"
    );
}
