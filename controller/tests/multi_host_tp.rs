//! Tensor parallelism across real processes on 127.0.0.1 (an `archipelago controller` and two
//! `archipelago host`s of two devices each): placement keeps each tp group on one host's devices
//! (Megatron-LM's tp inside a node) and puts the dp replicas or pp stages across the hosts; the
//! job trains to the parameters of the same job in one process, element by element, each actor
//! reading the fabric bytes its plan predicted. A `--tp` larger than any host's devices is
//! refused before any actor starts, naming the largest host.

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{ModelSpec, ParallelPlan};

mod common;

use common::{Cluster, local, plan, program};

/// The runs' parameters (every actor's slices at their global places, replicas agreeing) and
/// losses agree within `tolerance` relative, and each run read the fabric bytes it planned.
fn assert_same(reference: &TrainReport, run: &TrainReport, tolerance: f64, what: &str) {
    let model = ModelSpec::parse(common::MLP).unwrap().desc();
    let params = |which: &str, report: &TrainReport| {
        if let Err(e) = archipelago_controller::fabric_check::check(report) {
            panic!("{what} ({which}): {e}");
        }
        archipelago_controller::replica_check::assemble_params(report, &model)
            .unwrap_or_else(|e| panic!("{what} ({which}): {e}"))
    };
    let (a, b) = (params("reference", reference), params("run", run));
    for (block, (x, y)) in a.iter().zip(&b).enumerate() {
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            let d = (p - q).abs() as f64;
            assert!(
                d <= tolerance * (1e-3 + p.abs() as f64),
                "{what}: block {block} element {i}: {p} vs {q}"
            );
        }
    }
    assert_eq!(reference.steps.len(), run.steps.len(), "{what}: steps");
    for (x, y) in reference.steps.iter().zip(&run.steps) {
        let d = ((x.loss - y.loss) / x.loss).abs() as f64;
        assert!(
            d < tolerance,
            "{what}: step {} loss {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
    }
}

#[test]
fn tp_groups_stay_on_one_host_and_train_as_in_one_process() {
    let mut cluster = Cluster::start(5.0, 30.0);
    cluster.add_host("h1", "cpu:0,cpu:1");
    cluster.add_host("h2", "cpu:0,cpu:1");
    let remote = cluster.controller();
    let tp2 = |layout: ParallelPlan| ParallelPlan { tp: 2, ..layout };
    for (layout, what) in [
        (tp2(plan(2, 1, 0)), "tp=2 dp=2"),
        (tp2(plan(1, 2, 0)), "tp=2 pp=2"),
    ] {
        let reference = local(layout.clone(), 4);
        let options = TrainOptions {
            steps: 4,
            job: format!("tp-across-{}", what.replace(' ', "-")),
            keep_params: true,
            ..TrainOptions::default()
        };
        let run = remote
            .train(&program(layout), &options)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(run.actors.len(), 4, "{what}: every actor reported");
        assert_same(&reference, &run, 1e-5, what);
    }
    // Four ranks cannot sit on a two-device host.
    let error = remote
        .train(
            &program(ParallelPlan {
                tp: 4,
                ..plan(1, 1, 0)
            }),
            &TrainOptions {
                steps: 1,
                ..TrainOptions::default()
            },
        )
        .expect_err("tp=4 on two-device hosts");
    let message = error.to_string();
    assert!(
        message.contains("--tp 4") && message.contains("lower --tp to 2"),
        "{message}"
    );
}
