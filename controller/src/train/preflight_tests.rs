//! Tests of the preflight that need a real job's checkpoint (a module of their own: the
//! job path's modules may not import the controller that runs them, `tests/import_graph.rs`).

use archipelago_dataflow::{Compression, DeviceSpec, ModelSpec, ParallelPlan, Program};

use super::options::TrainOptions;
use super::preflight::preflight;

/// A top-k job resumed on the layout that wrote its checkpoint takes its residuals back in
/// silence; on another layout (dp=2 → dp=4), or under another `--compress` (whose state is not
/// this one's: `launch::same_exchange`), the notes warn that they start at zero. Control:
/// the same resume without `--compress` says nothing of residuals.
#[test]
fn a_topk_resume_on_another_layout_warns_that_the_residuals_start_at_zero() {
    let dir = tempfile::tempdir().unwrap();
    let program = |dp: usize, compression: Compression| {
        Program::new(ModelSpec::parse("mlp:in=8,hidden=16,layers=2,out=3").unwrap())
            .with_plan(ParallelPlan {
                dp,
                batch: 8,
                ..ParallelPlan::default()
            })
            .with_compression(compression)
    };
    let topk = Compression::TopK { ratio: 0.1 };
    let options = |resume: bool| TrainOptions {
        steps: if resume { 4 } else { 2 },
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: 2,
        resume,
        resume_override: vec!["steps".into(), "compress".into()],
        ..TrainOptions::default()
    };
    crate::Controller::local(DeviceSpec::cpus(2))
        .train(&program(2, topk), &options(false))
        .unwrap();
    // As the job runs it: the plan's program, its state placement resolved.
    let warns = |p: &Program| {
        let notes = preflight(&p.with_state_resolved(), &options(true))
            .unwrap_or_else(|e| panic!("{e}"))
            .notes;
        notes.iter().any(|n| n.contains("residuals start at zero"))
    };
    assert!(!warns(&program(2, topk)), "same layout: the residuals come back");
    assert!(warns(&program(4, topk)), "another layout: the warning");
    assert!(
        !warns(&program(4, Compression::None)),
        "no top-k: nothing to warn of"
    );
    // Same layout, another ratio: the residuals were another compression's and start at zero.
    assert!(
        warns(&program(2, Compression::TopK { ratio: 0.2 })),
        "another --compress: the warning"
    );
}
