//! Equivalence (the correctness contract) for pipeline parallelism: every schedule, stage count,
//! micro-batch count, pp × dp mesh and activation checkpointing trains to the same parameters and
//! losses as one device with the same global batch, step for step. Also: the measured peak of
//! micro-batches held per stage equals the schedule's bound, and `--trace` writes one track per
//! actor.

use archipelago_controller::TrainOptions;
use archipelago_dataflow::ParallelPlan;
use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_integration_tests::{assert_equivalent, assert_params_moved, train_plan, train_with_options};

/// Seven blocks: stage counts 3 and 4 do not divide them evenly.
const MLP7: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const GPT: &str = "gpt:vocab=256,ctx=16,d=32,layers=2,heads=2";
const BATCH: usize = 24;
const STEPS: u64 = 6;

fn plan(pp: usize, m: usize, schedule: Schedule) -> ParallelPlan {
    ParallelPlan {
        pp,
        microbatches: m,
        schedule,
        batch: BATCH,
        ..ParallelPlan::default()
    }
}

fn reference() -> archipelago_controller::TrainReport {
    let r = train_plan(MLP7, plan(1, 1, Schedule::OneFOneB), STEPS);
    assert_params_moved(MLP7, &r);
    r
}

fn check(reference: &archipelago_controller::TrainReport, plan: ParallelPlan) {
    let what = format!(
        "pp={} dp={} m={} {} v={} ckpt={}",
        plan.pp, plan.dp, plan.microbatches, plan.schedule, plan.virtual_stages, plan.checkpoint_activations
    );
    let run = train_plan(MLP7, plan, STEPS);
    assert_equivalent(reference, &run, 1e-5, &what);
    for a in &run.actors {
        assert_eq!(
            a.peak_microbatches_held, a.predicted_peak_microbatches_held,
            "{what}: actor {} held {} micro-batches, the schedule says {}",
            a.actor, a.peak_microbatches_held, a.predicted_peak_microbatches_held
        );
    }
}

#[test]
fn two_stages_gpipe_and_1f1b_match_one_device() {
    let reference = reference();
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for m in [1, 4, 8] {
            check(&reference, plan(2, m, schedule));
        }
    }
}

#[test]
fn three_and_four_uneven_stages_match_one_device() {
    let reference = reference();
    for pp in [3, 4] {
        check(&reference, plan(pp, 4, Schedule::OneFOneB));
        check(&reference, plan(pp, 6, Schedule::GPipe));
    }
    // A hand-pinned split.
    let mut pinned = plan(2, 4, Schedule::OneFOneB);
    pinned.stages = Some(vec![(0, 5), (5, 7)]);
    check(&reference, pinned);
}

#[test]
fn interleaved_and_zero_bubble_match_one_device() {
    let reference = reference();
    let mut interleaved = plan(2, 4, Schedule::Interleaved);
    interleaved.virtual_stages = 2;
    check(&reference, interleaved.clone());
    interleaved.virtual_stages = 3;
    interleaved.microbatches = 6;
    check(&reference, interleaved);
    check(&reference, plan(2, 4, Schedule::ZbH1));
    check(&reference, plan(3, 6, Schedule::ZbH1));
}

#[test]
fn pipeline_times_data_parallel_matches_one_device() {
    let reference = reference();
    for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
        let mut p = plan(2, 2, schedule);
        p.dp = 2;
        p.bucket_bytes = 4 << 10; // several buckets per stage
        check(&reference, p);
    }
    let mut p = plan(2, 3, Schedule::OneFOneB);
    p.dp = 2;
    p.pp = 3;
    p.microbatches = 4;
    check(&reference, p);
}

#[test]
fn activation_checkpointing_matches_one_device() {
    let reference = reference();
    let mut p = plan(1, 1, Schedule::OneFOneB);
    p.checkpoint_activations = true;
    check(&reference, p);
    for schedule in [Schedule::OneFOneB, Schedule::ZbH1] {
        let mut p = plan(2, 4, schedule);
        p.checkpoint_activations = true;
        check(&reference, p);
    }
    let mut p = plan(2, 2, Schedule::GPipe);
    p.dp = 2;
    p.checkpoint_activations = true;
    check(&reference, p);
}

#[test]
fn gpt_two_stages_match_one_device_with_and_without_checkpointing() {
    let gpt = |pp: usize, m: usize, ckpt: bool| {
        train_plan(
            GPT,
            ParallelPlan {
                pp,
                microbatches: m,
                batch: 8,
                checkpoint_activations: ckpt,
                ..ParallelPlan::default()
            },
            4,
        )
    };
    let reference = gpt(1, 1, false);
    assert!(
        reference.final_loss < reference.steps[0].loss,
        "the gpt does not learn"
    );
    assert_equivalent(&reference, &gpt(2, 4, false), 1e-4, "gpt pp=2 m=4");
    assert_equivalent(&reference, &gpt(2, 2, true), 1e-4, "gpt pp=2 m=2 checkpointed");
}

#[test]
fn trace_has_one_track_per_actor_with_micro_batch_spans() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let report = train_with_options(
        MLP7,
        plan(2, 4, Schedule::OneFOneB),
        TrainOptions {
            keep_params: true,
            steps: 2,
            trace: Some(path.clone()),
            ..TrainOptions::default()
        },
    );
    assert_eq!(report.actors.len(), 2);
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for actor in 0..2 {
        for cat in ["forward", "backward", "optimizer"] {
            assert!(
                spans.iter().any(|e| e["tid"] == actor && e["cat"] == cat),
                "no {cat} span on actor {actor}"
            );
        }
        let forwards = spans
            .iter()
            .filter(|e| e["tid"] == actor && e["cat"] == "forward" && e["args"]["step"] == 2)
            .count();
        assert_eq!(forwards, 4, "actor {actor}: one forward per micro-batch");
    }
    assert!(
        spans
            .iter()
            .any(|e| e["tid"] == 0 && e["cat"] == "send" && e["args"]["mb"] == 3)
    );
    assert!(spans.iter().any(|e| e["tid"] == 1 && e["cat"] == "recv"));
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "M" && e["args"]["name"].as_str().is_some_and(|n| n.contains("stage 1")))
    );
    // Spans of one actor do not overlap (one stream per actor).
    for actor in 0..2 {
        let mut mine: Vec<(f64, f64)> = spans
            .iter()
            .filter(|e| e["tid"] == actor)
            .map(|e| (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap()))
            .collect();
        mine.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(
            mine.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0 + 1.0),
            "actor {actor}: overlapping spans"
        );
    }
}
