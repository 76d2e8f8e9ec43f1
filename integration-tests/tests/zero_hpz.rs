//! ZeRO++'s hpZ (Wang et al. 2023 §3.2) in one process, the islands named by the program: under
//! SGD (whose step carries any error in the gradient as it is) and Adam, dp=4 ZeRO-3 with
//! `--zero-hpz` over islands a, b, a, b and a, a, b, b, and dp=2 × pp=2 over a, a, b, b (each
//! stage's replicas on two islands of one: the secondary copy is the whole segment and the
//! backward's gather a group of one), and dp=4 with the parameter shards offloaded
//! (`--offload cpu --offload-params`), trains to the parameters of ZeRO-3 without it bit for bit
//! and to one device's within f32 reduction order; the parameter bytes read across islands halve
//! (one forward and one backward gather per segment and micro-batch). Control: a secondary copy
//! never refreshed after the first step (`TestFault::HpzStaleSecondary`) is caught.
//! (`controller/tests/multi_host_hpz.rs` runs it across two host processes.)

use archipelago_controller::TrainReport;
use archipelago_dataflow::{Offload, OptimizerSpec, ParallelPlan, Precision, Program, TestFault};
use archipelago_integration_tests::precision::{max_abs, params, program, run};
use archipelago_integration_tests::{MARGIN, assert_caught, assert_equivalent, small_plan};

const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const STEPS: u64 = 6;
const TOLERANCE: f64 = 1e-5;

fn on_islands(optimizer: &OptimizerSpec, plan: ParallelPlan, islands: &str, hpz: bool) -> Program {
    let mut p = program(
        MLP,
        *optimizer,
        Precision::default(),
        ParallelPlan {
            zero_hpz: hpz,
            ..plan
        },
    );
    p.islands = islands.split(',').map(str::to_string).collect();
    p
}

fn crossing_parameters(r: &TrainReport) -> u64 {
    r.steps.last().unwrap().fabric_crossing_islands.parameters
}

#[test]
fn hpz_equals_zero_three_and_one_device_and_halves_the_gathers_across_islands() {
    let rules = [OptimizerSpec::sgd(0.1), OptimizerSpec::adam(1e-2)];
    // ZeRO-Infinity's parameter offload beside it: the shards live with the offload actor, the
    // gathers (and the secondary copy) on the replica.
    let offloaded = ParallelPlan {
        offload: Offload::Cpu,
        offload_params: true,
        ..small_plan(4, 1, 3)
    };
    let layouts = [
        (small_plan(4, 1, 3), "a,b,a,b"),
        (small_plan(4, 1, 3), "a,a,b,b"),
        (small_plan(2, 2, 3), "a,a,b,b"),
        (offloaded, "a,a,b,b"),
    ];
    for optimizer in &rules {
        let one_device = run(
            &program(MLP, *optimizer, Precision::default(), small_plan(1, 1, 0)),
            STEPS,
        );
        for (plan, islands) in &layouts {
            let what = format!(
                "{} dp={} pp={} offload-params {} islands {islands}",
                optimizer.name(),
                plan.dp,
                plan.pp,
                plan.offload_params
            );
            let zero3 = run(&on_islands(optimizer, plan.clone(), islands, false), STEPS);
            let hpz = run(&on_islands(optimizer, plan.clone(), islands, true), STEPS);
            assert_eq!(
                max_abs(&params(&hpz), &params(&zero3)),
                0.0,
                "{what}: hpZ against ZeRO-3"
            );
            assert_equivalent(&one_device, &hpz, TOLERANCE, &what);
            if optimizer.name() == "sgd" {
                let gap = max_abs(&params(&hpz), &params(&one_device));
                assert!(gap < TOLERANCE, "{what}: {gap} from one device");
            }
            let (before, after) = (crossing_parameters(&zero3), crossing_parameters(&hpz));
            assert!(before > 0, "{what}: no parameter bytes crossed islands");
            assert_eq!(2 * after, before, "{what}: parameter bytes across islands");
            assert!(
                hpz.actors
                    .iter()
                    .all(|a| a.hpz_secondary_bytes == a.estimated_hpz_secondary_bytes)
            );
        }
    }
    // The control, under SGD at dp=4 over a, b, a, b.
    let sgd = OptimizerSpec::sgd(0.1);
    let one_device = run(
        &program(MLP, sgd, Precision::default(), small_plan(1, 1, 0)),
        STEPS,
    );
    let mut stale = on_islands(&sgd, small_plan(4, 1, 3), "a,b,a,b", true);
    stale.test_fault = Some(TestFault::HpzStaleSecondary);
    let stale = run(&stale, STEPS);
    let gap = max_abs(&params(&stale), &params(&one_device));
    assert_caught("hpZ with a stale secondary copy", gap, TOLERANCE, MARGIN);
}
