//! Sharded checkpoints: a job stopped after a checkpoint and resumed — with the same or another
//! layout (dp, pp, ZeRO stage) — trains to the same parameters and losses as a job that never
//! stopped; a checkpoint with a corrupted shard or without its manifest is passed over for the
//! previous complete one. A model with frozen parameters resumes the same way.

use std::path::Path;

use archipelago_actors::checkpoint::{
    CheckpointReader, Manifest, Piece, ShardState, Slice, step_dir, write_manifest, write_shard,
};
use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::{LrSchedule, ModelSpec, OptimizerSpec, ParallelPlan, Program};
use archipelago_integration_tests::closed_form::{excess, read_params};
use archipelago_integration_tests::{
    copy_dir, max_relative_difference, small_plan as plan, train_program, train_with_options,
};

const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";

fn options(steps: u64, dir: Option<&Path>, every: u64, resume: bool) -> TrainOptions {
    TrainOptions {
        keep_params: true,
        steps,
        checkpoint_dir: dir.map(Path::to_path_buf),
        checkpoint_every: every,
        resume,
        // The first runs here stand for jobs stopped early: they ran fewer steps than the
        // resumed run's total, which the resume must be told it may change.
        resume_override: if resume { vec!["steps".into()] } else { Vec::new() },
        ..TrainOptions::default()
    }
}

/// The resumed run's parameters equal the reference's, and so do its losses step for step.
fn assert_continues(reference: &TrainReport, resumed: &TrainReport, first_step: u64, what: &str) {
    assert_eq!(
        resumed.steps.first().map(|s| s.step),
        Some(first_step),
        "{what}: first step run"
    );
    let blocks = max_relative_difference(&reference.block_l2, &resumed.block_l2);
    assert!(blocks < 1e-5, "{what}: block norms differ by {blocks:e}");
    for s in &resumed.steps {
        let r = reference.steps[s.step as usize - 1].loss;
        assert!(
            ((r - s.loss) / r).abs() < 1e-5,
            "{what}: step {} loss {} vs {r}",
            s.step,
            s.loss
        );
    }
    assert_eq!(
        resumed.steps.last().map(|s| s.step),
        reference.steps.last().map(|s| s.step)
    );
}

#[test]
fn resuming_with_another_layout_equals_not_stopping() {
    let reference = train_with_options(MLP, plan(2, 1, 3), options(8, None, 0, false));
    let root = tempfile::tempdir().unwrap();
    let stopped = root.path().join("dp2-zero3");
    train_with_options(MLP, plan(2, 1, 3), options(4, Some(&stopped), 2, false));
    assert!(stopped.join("step-00000002/manifest.json").exists());
    assert!(stopped.join("step-00000004/manifest.json").exists());
    for (layout, what) in [
        (plan(2, 1, 3), "dp=2 zero 3 (same layout)"),
        (plan(1, 1, 0), "dp=1"),
        (plan(4, 1, 2), "dp=4 zero 2"),
        (plan(2, 2, 1), "dp=2 pp=2 zero 1"),
        (plan(1, 3, 0), "pp=3"),
    ] {
        let dir = root.path().join(what.replace([' ', '=', '(', ')'], "_"));
        copy_dir(&stopped, &dir);
        let resumed = train_with_options(MLP, layout, options(8, Some(&dir), 2, true));
        assert_continues(&reference, &resumed, 5, &format!("dp=2 zero 3 → {what}"));
        assert!(
            dir.join("step-00000008/manifest.json").exists(),
            "{what}: went on checkpointing"
        );
    }
}

/// A model with frozen parameters (a whole matrix and a bias, in two pipeline stages): its
/// checkpoints hold the whole model (the frozen values without optimizer state), and a job stopped after one resumes — with the same
/// layout and with another — to the run that never stopped, the frozen values coming from the
/// model's initialisation as they did at the start.
#[test]
fn a_model_with_frozen_parameters_resumes_like_not_stopping() {
    let program = |layout: ParallelPlan| {
        let mut p = Program::new(ModelSpec::parse(MLP).unwrap())
            .with_seed(7)
            .with_optimizer(OptimizerSpec::adam(1e-2))
            .with_plan(layout);
        for d in p.model.blocks.iter_mut().flat_map(|b| b.param_descs.iter_mut()) {
            if d.name == "layers.1.weight" || d.name == "layers.5.bias" {
                d.trainable = false;
            }
        }
        p
    };
    let reference = train_program(&program(plan(2, 1, 3)), &options(8, None, 0, false));
    let root = tempfile::tempdir().unwrap();
    let stopped = root.path().join("stopped");
    let first = program(plan(2, 1, 3));
    let report = train_program(&first, &options(4, Some(&stopped), 2, false));
    // The checkpoint holds the whole model, frozen values too, each element at its place among
    // its block's parameters: read block by block (as `export` reads), it is the run's model.
    let params = archipelago_integration_tests::assert_replicas_agree(&report, &first.model, "frozen");
    let reader = CheckpointReader::open(&step_dir(&stopped, 4)).unwrap();
    for (b, block) in params.iter().enumerate() {
        let [read, _, _] = reader.read_values(b, 0..block.len(), 0).unwrap();
        let same = read.iter().zip(block).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same && read.len() == block.len(),
            "block {b} reads back otherwise"
        );
    }
    for (layout, what) in [(plan(2, 1, 3), "dp=2 zero 3"), (plan(1, 2, 0), "pp=2")] {
        let dir = root.path().join(what.replace([' ', '='], "_"));
        copy_dir(&stopped, &dir);
        let resumed = train_program(&program(layout), &options(8, Some(&dir), 2, true));
        assert_continues(&reference, &resumed, 5, &format!("frozen, dp=2 zero 3 → {what}"));
    }
}

/// Fine-tuning from a checkpoint of a run that trained everything, with one parameter now
/// frozen: the frozen parameter starts from the checkpoint's values (not the initialisation) and
/// keeps them, bit for bit, on dp=2 and ZeRO-3 × dp=2. Control: the checkpoint's values differ
/// from the initialisation (the first run moved them).
#[test]
fn fine_tuning_from_a_full_checkpoint_freezes_the_checkpointed_values() {
    let root = tempfile::tempdir().unwrap();
    let full = root.path().join("full");
    let trained = Program::new(ModelSpec::parse(MLP).unwrap())
        .with_seed(7)
        .with_optimizer(OptimizerSpec::adam(1e-2))
        .with_plan(plan(2, 1, 0));
    train_program(&trained, &options(4, Some(&full), 4, false));
    let reader = CheckpointReader::open(&step_dir(&full, 4)).unwrap();
    let name = "layers.1.weight";
    let desc = trained.model.blocks[1].param_descs[0].clone();
    assert_eq!(desc.name, name);
    let (saved, _) = reader.read_param(name, &desc.shape, 0..desc.len(), &[]).unwrap();
    let initial = archipelago_actors::block::init_param(&desc, 7);
    assert_ne!(saved, initial, "the first run moved the parameter");
    for (layout, what) in [(plan(2, 1, 0), "dp=2"), (plan(2, 1, 3), "dp=2 zero 3")] {
        let dir = root.path().join(what.replace([' ', '='], "_"));
        copy_dir(&full, &dir);
        let mut tuned = trained.clone().with_plan(layout);
        tuned.model.blocks[1].param_descs[0].trainable = false;
        let report = train_program(&tuned, &options(8, Some(&dir), 0, true));
        let params = archipelago_integration_tests::assert_replicas_agree(&report, &tuned.model, what);
        let held = &params[1][..desc.len()];
        let same = held.iter().zip(&saved).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: the frozen parameter is not the checkpoint's");
    }
}

#[test]
fn a_corrupt_or_partial_checkpoint_is_passed_over_for_the_previous_one() {
    let reference = train_with_options(MLP, plan(2, 1, 1), options(8, None, 0, false));
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ck");
    train_with_options(MLP, plan(2, 1, 1), options(6, Some(&dir), 2, false));
    // Flip a byte in the middle of a shard of the newest checkpoint (step 6).
    let shard = dir.join("step-00000006/actor-00001.shard");
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let corrupt = root.path().join("corrupt");
    copy_dir(&dir, &corrupt);
    let resumed = train_with_options(MLP, plan(2, 1, 1), options(8, Some(&corrupt), 0, true));
    assert_continues(&reference, &resumed, 5, "step 6 corrupt → step 4");
    // And step 4 written only in part (no manifest: the writer died before finishing it).
    std::fs::remove_file(dir.join("step-00000004/manifest.json")).unwrap();
    let resumed = train_with_options(MLP, plan(2, 1, 1), options(8, Some(&dir), 0, true));
    assert_continues(&reference, &resumed, 3, "step 6 corrupt, step 4 partial → step 2");
}

/// Offloaded state (host memory or NVMe files, optimizer state and under ZeRO-3 the parameters)
/// is checkpointed from the offload actors and restored into them, across layouts and tiers.
#[test]
fn offloaded_state_checkpoints_and_resumes_across_tiers_and_layouts() {
    use archipelago_dataflow::Offload;
    let reference = train_with_options(MLP, plan(2, 1, 3), options(8, None, 0, false));
    let root = tempfile::tempdir().unwrap();
    let nvme = root.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let offloaded = |dp: usize, zero: u8, tier: Offload, params: bool| ParallelPlan {
        offload: tier,
        offload_params: params,
        ..plan(dp, 1, zero)
    };
    let nvme_tier = Offload::Nvme {
        dir: nvme.display().to_string(),
    };
    for (writer, what) in [
        (offloaded(2, 3, Offload::Cpu, false), "zero 3 + cpu"),
        (offloaded(2, 3, nvme_tier.clone(), true), "zero 3 + nvme + params"),
    ] {
        let stopped = root.path().join(what.replace([' ', '+'], "_"));
        train_with_options(MLP, writer, options(4, Some(&stopped), 4, false));
        for (reader, to) in [
            (plan(1, 1, 0), "dp=1"),
            (offloaded(2, 1, nvme_tier.clone(), false), "dp=2 zero 1 + nvme"),
            (offloaded(2, 3, Offload::Cpu, true), "dp=2 zero 3 + cpu + params"),
            (offloaded(1, 0, Offload::Cpu, false), "dp=1 + cpu"),
        ] {
            let dir = root
                .path()
                .join(format!("{what}-{to}").replace([' ', '+', '='], "_"));
            copy_dir(&stopped, &dir);
            let resumed = train_with_options(MLP, reader, options(8, Some(&dir), 0, true));
            assert_continues(&reference, &resumed, 5, &format!("{what} → {to}"));
        }
    }
}

/// Reads the checkpoint in `from` and writes it, piece by piece through the library's writer,
/// into `to` after `edit` (a negative control's damage).
fn rewrite_checkpoint(from: &Path, to: &Path, edit: &dyn Fn(&mut ShardState)) {
    let reader = CheckpointReader::open(from).unwrap();
    let manifest = reader.manifest().clone();
    let mut files = Vec::new();
    for f in &manifest.files {
        let mut state = ShardState {
            steps: f.header.steps,
            schedule_step: f.header.schedule_step,
            loss_scale: f.header.loss_scale,
            pieces: Vec::new(),
        };
        for p in &f.header.pieces {
            let Slice::Flat { start, end } = p.slice else {
                panic!("the trainer writes flat pieces")
            };
            let names: Vec<&str> = p.state.iter().map(String::as_str).collect();
            let (values, tensors) = reader.read_param(&p.param, &p.shape, start..end, &names).unwrap();
            state.pieces.push(Piece {
                block: p.block,
                block_offset: p.block_offset,
                param: p.param.clone(),
                shape: p.shape.clone(),
                slice: p.slice.clone(),
                values,
                state: p.state.iter().cloned().zip(tensors).collect(),
            });
        }
        edit(&mut state);
        files.push(write_shard(to, f.header.actor, &state).unwrap());
    }
    write_manifest(to, &Manifest { files, ..manifest }).unwrap();
}

/// SGD with Nesterov momentum and weight decay (its `momentum_buffer`), AdamW and LAMB
/// (`exp_avg`, `exp_avg_sq`), each under 3 steps of warmup then cosine decay over 8 steps:
/// stopped inside the warmup (after step 2) or right after it (after step 4) on one layout and
/// resumed on another — for the momentum buffer also from and into an offload actor's region —
/// they end at the parameters of the run that never stopped, element by element, with its
/// losses and its rate at every step. Negative controls: the same checkpoint with the schedule's
/// position reset to 0, or with the optimizer state dropped (zeroed), trains elsewhere.
#[test]
fn momentum_adamw_and_lamb_resume_with_their_state_and_schedule() {
    use archipelago_dataflow::Offload;
    const STEPS: u64 = 8;
    let momentum = OptimizerSpec::sgd(0.1)
        .with_weight_decay(0.01)
        .with_momentum(0.9, true)
        .unwrap();
    let cpu = |dp: usize, zero: u8| ParallelPlan {
        offload: Offload::Cpu,
        ..plan(dp, 1, zero)
    };
    // The training state on the device: written from it, and restored onto it.
    let device = |dp: usize, pp: usize, zero: u8| ParallelPlan {
        state: archipelago_dataflow::StatePlacement::Device,
        ..plan(dp, pp, zero)
    };
    for (optimizer, writer, reader, rtol) in [
        (momentum, cpu(2, 3), plan(1, 2, 0), 1e-5),
        (momentum, device(2, 1, 0), plan(1, 2, 0), 1e-5),
        (OptimizerSpec::adamw(1e-2), plan(2, 1, 3), device(1, 2, 0), 1e-4),
        (OptimizerSpec::adamw(1e-2), device(2, 1, 1), device(2, 1, 2), 1e-4),
        (momentum, device(2, 1, 3), device(1, 2, 0), 1e-5),
        (momentum, plan(2, 1, 3), cpu(2, 1), 1e-5),
        (OptimizerSpec::adamw(1e-2), plan(2, 1, 3), plan(2, 2, 1), 1e-4),
        (OptimizerSpec::lamb(1e-2), plan(1, 2, 0), plan(2, 1, 3), 1e-4),
        (OptimizerSpec::lamb(1e-2), device(2, 1, 3), device(1, 2, 0), 1e-4),
    ] {
        let name = optimizer.name();
        let program = |layout| {
            Program::new(ModelSpec::parse(MLP).unwrap())
                .with_seed(7)
                .with_optimizer(optimizer)
                .with_lr_schedule(LrSchedule::cosine(3, STEPS))
                .with_plan(layout)
        };
        let root = tempfile::tempdir().unwrap();
        let straight = root.path().join("straight");
        let reference = train_program(
            &program(plan(1, 1, 0)),
            &options(STEPS, Some(&straight), STEPS, false),
        );
        let reference_params = read_params(&step_dir(&straight, STEPS), &program(plan(1, 1, 0)));
        let expected: Vec<Vec<f64>> = reference_params
            .iter()
            .map(|p| p.iter().map(|&x| f64::from(x)).collect())
            .collect();
        let resume = |dir: &Path, what: &str| {
            let resumed = train_program(&program(reader.clone()), &options(STEPS, Some(dir), STEPS, true));
            let params = read_params(&step_dir(dir, STEPS), &program(reader.clone()));
            let (excess, abs) = excess(&expected, &params, rtol, 1e-6);
            eprintln!("{name} {what}: max |Δparam| {abs:e} (allclose excess {excess:.3})");
            (resumed, excess, abs)
        };
        for stop in [2, 4] {
            let what = format!("{} → {} after step {stop}", describe(&writer), describe(&reader));
            let stopped = root.path().join(format!("stopped-{stop}"));
            train_program(
                &program(writer.clone()),
                &options(stop, Some(&stopped), stop, false),
            );
            let dir = root.path().join(format!("resumed-{stop}"));
            copy_dir(&stopped, &dir);
            let (resumed, excess, abs) = resume(&dir, &what);
            assert_continues(&reference, &resumed, stop + 1, &format!("{name}: {what}"));
            assert!(excess <= 1.0, "{name} {what}: parameters differ by {abs:e}");
            for (s, r) in resumed.steps.iter().zip(&reference.steps[stop as usize..]) {
                assert_eq!(s.lr, r.lr, "{name} {what}: the rate of step {}", s.step);
            }
            // Negative controls: the schedule restarted, the optimizer state lost.
            let from = step_dir(&stopped, stop);
            for (control, edit) in [
                (
                    "schedule position reset",
                    &(|s: &mut ShardState| s.schedule_step = 0) as &dyn Fn(&mut ShardState),
                ),
                ("optimizer state dropped", &|s: &mut ShardState| {
                    for p in &mut s.pieces {
                        for (_, t) in &mut p.state {
                            t.iter_mut().for_each(|x| *x = 0.0);
                        }
                    }
                }),
            ] {
                let dir = root
                    .path()
                    .join(format!("control-{stop}-{}", control.replace(' ', "-")));
                rewrite_checkpoint(&from, &step_dir(&dir, stop), edit);
                // The excess is in units of the tolerance: the bar is 100× (at least 10×).
                let (_, excess, abs) = resume(&dir, &format!("{what} with the {control}"));
                eprintln!("control {name} {what}, the {control}: {excess:.1}× the tolerance (bar 100×)");
                assert!(
                    excess >= 100.0,
                    "{name} {what}: the {control} lands only {excess:.1}× past the tolerance \
                     ({abs:e}; 100× needed)"
                );
            }
        }
    }
}

fn describe(layout: &ParallelPlan) -> String {
    format!(
        "dp={} pp={} zero {}{} state {}",
        layout.dp,
        layout.pp,
        layout.zero,
        if layout.offload.is_some() { " + cpu" } else { "" },
        layout.state
    )
}
