//! Equivalence (the correctness contract): data parallelism trains to the same parameters as one
//! device with the same global batch, step for step, for an mlp and a small gpt.

use archipelago_integration_tests::{assert_equivalent, assert_params_moved, train};

const MLP: &str = "mlp:in=48,hidden=64,layers=4,out=6";
const GPT: &str = "gpt:vocab=256,ctx=16,d=32,layers=2,heads=2";

#[test]
fn mlp_data_parallel_matches_one_device() {
    let reference = train(MLP, 1, 24, 8, 25 << 20);
    assert!(
        reference.final_loss < reference.steps[0].loss,
        "the mlp does not learn"
    );
    for dp in [1, 2, 3, 4] {
        // Small buckets: several all-reduces per step, overlapping the backward.
        let run = train(MLP, dp, 24, 8, 8 << 10);
        assert_equivalent(&reference, &run, 1e-5, &format!("mlp dp={dp}"));
    }
}

#[test]
fn gpt_data_parallel_matches_one_device() {
    let reference = train(GPT, 1, 12, 5, 25 << 20);
    assert_params_moved(GPT, &reference);
    for dp in [2, 3, 4] {
        let run = train(GPT, dp, 12, 5, 32 << 10);
        assert_equivalent(&reference, &run, 1e-4, &format!("gpt dp={dp}"));
    }
}

/// Both ways devices of one process reduce — through each other's buffers (the default) and
/// as rings of messages (what groups across hosts run) — train to the one-device parameters,
/// at dp=4 where their summation orders differ (member order against ring order).
#[test]
fn shared_buffer_and_ring_collectives_train_alike() {
    use archipelago_actors::collectives::Collectives;
    use archipelago_controller::{Controller, TrainOptions};
    use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Program};
    let reference = train(MLP, 1, 24, 6, 25 << 20);
    for zero in [0, 2] {
        let program = Program::new(ModelSpec::parse(MLP).unwrap())
            .with_seed(7)
            .with_plan(ParallelPlan {
                dp: 4,
                batch: 24,
                zero,
                bucket_bytes: 8 << 10,
                ..ParallelPlan::default()
            });
        for collectives in [Collectives::Shared, Collectives::Ring] {
            let options = TrainOptions {
                keep_params: true,
                steps: 6,
                collectives,
                ..TrainOptions::default()
            };
            let run = Controller::local(DeviceSpec::cpus(4))
                .train(&program, &options)
                .unwrap();
            assert_equivalent(
                &reference,
                &run,
                1e-5,
                &format!("mlp dp=4 zero={zero} {collectives}"),
            );
        }
    }
}

#[test]
fn a_different_seed_changes_the_result() {
    // The equivalence check can fail: a run from other weights is far from the reference.
    let a = train(MLP, 1, 24, 3, 25 << 20);
    let program_b = archipelago_dataflow::Program::new(archipelago_dataflow::ModelSpec::parse(MLP).unwrap())
        .with_seed(8)
        .with_plan(archipelago_dataflow::ParallelPlan {
            batch: 24,
            ..Default::default()
        });
    let b = archipelago_controller::Controller::local(archipelago_dataflow::DeviceSpec::cpus(1))
        .train(
            &program_b,
            &archipelago_controller::TrainOptions {
                keep_params: true,
                steps: 3,
                ..Default::default()
            },
        )
        .unwrap();
    // The control lands at least 100× past the mlp's tolerance (1e-5).
    let d = archipelago_integration_tests::max_relative_difference(&a.block_l2, &b.block_l2);
    eprintln!(
        "control: another seed, block norms {d:e} ({:.0}× the tolerance 1e-5)",
        d / 1e-5
    );
    assert!(
        d >= 100.0 * 1e-5,
        "another seed lands only {:.1}× past the tolerance 1e-5 (100× needed)",
        d / 1e-5
    );
}

/// Data parallelism across islands (a dp group of 4 in two islands of 2, and of 6 in three):
/// the hierarchical all-reduce trains to the same parameters as one device; so does dp × pp
/// with each stage's replicas spread over two islands.
#[test]
fn hierarchical_all_reduce_across_islands_matches_one_device() {
    use archipelago_controller::{Controller, TrainOptions};
    use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec, ParallelPlan, Program};
    let run = |dp: usize, pp: usize, islands: Vec<String>| {
        let program = Program {
            islands,
            ..Program::new(ModelSpec::parse(MLP).unwrap())
                .with_seed(7)
                .with_optimizer(OptimizerSpec::adam(1e-2))
                .with_plan(ParallelPlan {
                    dp,
                    pp,
                    microbatches: pp,
                    batch: 24,
                    bucket_bytes: 8 << 10,
                    ..ParallelPlan::default()
                })
        };
        let options = TrainOptions {
            keep_params: true,
            steps: 6,
            ..TrainOptions::default()
        };
        Controller::local(DeviceSpec::cpus(dp * pp))
            .train(&program, &options)
            .unwrap()
    };
    let reference = run(1, 1, Vec::new());
    // Actor r·pp + s: replica r of stage s.
    let island = |dp: usize, pp: usize, per: usize| {
        (0..dp * pp)
            .map(|a| format!("stage{}-group{}", a % pp, (a / pp) / per))
            .collect::<Vec<_>>()
    };
    for (dp, pp) in [(4, 1), (6, 1), (4, 2)] {
        let report = run(dp, pp, island(dp, pp, 2));
        let hierarchical = report
            .actors
            .iter()
            .flat_map(|a| &a.instructions)
            .any(|i| i.instruction.contains("HierarchicalAllReduceSum"));
        assert!(
            hierarchical,
            "dp={dp} pp={pp}: no hierarchical all-reduce in the plan"
        );
        assert_equivalent(&reference, &report, 1e-5, &format!("islands dp={dp} pp={pp}"));
    }
}
