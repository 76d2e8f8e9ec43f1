//! A resume that cannot silently change the run. A checkpoint's manifest records what decided
//! the run's next steps beside its model and seed ([`RunRecord`]: optimizer and hyper-parameters,
//! learning-rate schedule, clipping, total steps, data source, precision); a resume whose program
//! differs in any of them is refused, naming each difference and the flag that allows it
//! (`--resume-override`), and one that starts at or past the job's last step is refused with the
//! fix. (DeepSpeed and torchtitan keep the optimizer and scheduler state in the checkpoint and
//! load them over whatever the new run says; here the new run must say the same, or say that it
//! changes it.)

use archipelago_actors::checkpoint::{BaseWeights, Manifest, RunRecord};
use archipelago_dataflow::{LrDecay, LrSchedule, Program};

/// The names `--resume-override` takes, one per recorded setting.
pub const OVERRIDABLE: [&str; 7] = [
    "optimizer",
    "lr-schedule",
    "clip",
    "steps",
    "data",
    "precision",
    "compress",
];

/// What `program`, run to step `total_steps`, records in its checkpoints.
pub fn record(program: &Program, total_steps: u64) -> RunRecord {
    RunRecord {
        optimizer: program.optimizer,
        lr_schedule: program.lr_schedule,
        clip_grad_norm: program.clip_grad_norm,
        total_steps,
        data: program.data.clone(),
        // The compute dtype; the checkpoint's master and optimizer state are f32 whatever it is.
        precision: program.precision.compute,
        base: base_weights(program),
        compression: program.compression,
    }
}

/// The `--init` file of a run with frozen parameters (which its checkpoints do not hold), with
/// its SHA-256 (computed once per file and size per process). The path is recorded whole
/// (canonical), so that `serve --checkpoint` finds the base from any working directory.
fn base_weights(program: &Program) -> Option<BaseWeights> {
    use sha2::Digest;
    static HASHES: std::sync::Mutex<Vec<(String, u64, String)>> = std::sync::Mutex::new(Vec::new());
    let frozen = program.model.blocks.iter().any(|b| b.has_frozen());
    let given = program.init.as_ref().filter(|_| frozen)?;
    let canonical = std::fs::canonicalize(given).ok()?;
    let path = &canonical.to_str().map_or_else(|| given.clone(), str::to_string);
    let size = std::fs::metadata(path).ok()?.len();
    let mut hashes = HASHES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, hash)) = hashes.iter().find(|(p, s, _)| p == path && *s == size) {
        return Some(BaseWeights {
            path: path.clone(),
            sha256: hash.clone(),
        });
    }
    let mut hasher = sha2::Sha256::new();
    let mut file = std::fs::File::open(path).ok()?;
    std::io::copy(&mut file, &mut hasher).ok()?;
    let hash: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    hashes.push((path.clone(), size, hash.clone()));
    Some(BaseWeights {
        path: path.clone(),
        sha256: hash,
    })
}

/// Refuses a resume whose frozen base is not the checkpoint's: the checkpoint holds the trained
/// parameters (a LoRA run's adapters) and none of the base, so another base file would pair the
/// adapters with weights they were not trained on.
pub fn check_base(was: &RunRecord, now: &RunRecord) -> Result<(), String> {
    match (&was.base, &now.base) {
        (Some(was), Some(now)) if was.sha256 != now.sha256 => Err(format!(
            "the checkpoint's frozen base was {} (SHA-256 {}), and --init {} has SHA-256 {}: resume with \
             --init {} (the checkpoint holds the adapters, not the base)",
            was.path, was.sha256, now.path, now.sha256, was.path
        )),
        (Some(was), None) => Err(format!(
            "the checkpoint's frozen base was {} (SHA-256 {}) and this run gives no --init: resume with \
             --init {}",
            was.path, was.sha256, was.path
        )),
        _ => Ok(()),
    }
}

/// Refuses a resume that would move SGD's momentum between the optimizer and top-k's exchange
/// (Deep Gradient Compression's momentum correction keeps it as each replica's velocity beside
/// its residual, and the checkpoint's optimizer state then has none): the momentum one side
/// wrote is not where the other reads it. Not overridable: the state is missing, not changed.
fn check_momentum_home(was: &RunRecord, now: &RunRecord) -> Result<(), String> {
    let home = |r: &RunRecord| r.compression.moved_momentum(r.optimizer).is_some();
    let (then, after) = (home(was), home(now));
    let sgd_momentum = |r: &RunRecord| matches!(r.optimizer, archipelago_dataflow::OptimizerSpec::Sgd { momentum, .. } if momentum != 0.0);
    if then == after || !(sgd_momentum(was) && sgd_momentum(now)) {
        return Ok(());
    }
    Err(if then {
        format!(
            "the checkpoint's run kept SGD's momentum in top-k's exchange (--compress {}: each replica's velocity, beside its residuals), and this run keeps it in the optimizer, which would start without it: resume with --compress {}",
            was.compression, was.compression
        )
    } else {
        format!(
            "the checkpoint's run kept SGD's momentum in the optimizer, and --compress {} keeps it in the exchange (each replica's velocity, Deep Gradient Compression's momentum correction), which would start without it: resume with the checkpoint's --compress {}",
            now.compression, was.compression
        )
    })
}

/// Whether two schedules give every step the same rate: a constant rate without warmup does not
/// depend on the total steps.
fn same_schedule(a: &LrSchedule, b: &LrSchedule) -> bool {
    let flat = |s: &LrSchedule| s.warmup_steps == 0 && s.decay == LrDecay::Constant;
    if flat(a) && flat(b) {
        return true;
    }
    a == b
}

/// The recorded settings that `now` changes: (name, the checkpoint's, this run's).
pub fn differences(was: &RunRecord, now: &RunRecord) -> Vec<(&'static str, String, String)> {
    let shown = |v: &dyn std::fmt::Debug| format!("{v:?}");
    let settings = [
        (
            "optimizer",
            was.optimizer == now.optimizer,
            was.optimizer.to_string(),
            now.optimizer.to_string(),
        ),
        (
            "lr-schedule",
            same_schedule(&was.lr_schedule, &now.lr_schedule),
            was.lr_schedule.to_string(),
            now.lr_schedule.to_string(),
        ),
        (
            "clip",
            was.clip_grad_norm == now.clip_grad_norm,
            shown(&was.clip_grad_norm),
            shown(&now.clip_grad_norm),
        ),
        (
            "steps",
            was.total_steps == now.total_steps,
            shown(&was.total_steps),
            shown(&now.total_steps),
        ),
        ("data", was.data == now.data, shown(&was.data), shown(&now.data)),
        (
            "precision",
            was.precision == now.precision,
            shown(&was.precision),
            shown(&now.precision),
        ),
        (
            "compress",
            was.compression == now.compression,
            was.compression.to_string(),
            now.compression.to_string(),
        ),
    ];
    (settings.into_iter())
        .filter(|(_, same, _, _)| !same)
        .map(|(name, _, a, b)| (name, a, b))
        .collect()
}

/// Checks a resume of `program` to step `total_steps` from the checkpoint `manifest` (in
/// `dir`), letting the settings named in `overrides` differ. A checkpoint written before runs
/// were recorded is checked for its step only.
pub fn check(
    manifest: &Manifest,
    dir: &std::path::Path,
    program: &Program,
    total_steps: u64,
    overrides: &[String],
) -> Result<(), String> {
    if let Some(unknown) = overrides.iter().find(|o| !OVERRIDABLE.contains(&o.as_str())) {
        return Err(format!(
            "--resume-override `{unknown}` is not a recorded setting; the settings are {}",
            OVERRIDABLE.join(", ")
        ));
    }
    if manifest.next_step > total_steps {
        return Err(format!(
            "the checkpoint in {} holds step {} and this job runs to step {total_steps} (--steps is the \
             total, not the steps to add): pass --steps {} or more to go on, with --resume-override steps \
             if the schedule may change",
            dir.display(),
            manifest.step,
            manifest.next_step
        ));
    }
    let Some(was) = &manifest.run else {
        return Ok(());
    };
    let now = record(program, total_steps);
    check_base(was, &now)?;
    check_momentum_home(was, &now)?;
    let refused: Vec<(&str, String, String)> = differences(was, &now)
        .into_iter()
        .filter(|(name, _, _)| !overrides.iter().any(|o| o == name))
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    let said: Vec<String> = (refused.iter())
        .map(|(name, a, b)| format!("{name}: the checkpoint's run had {a}, this run has {b}"))
        .collect();
    let names: Vec<&str> = refused.iter().map(|d| d.0).collect();
    Err(format!(
        "resuming from {} would change the run — {}; run with the checkpoint's settings, or pass \
         --resume-override {} to change them knowingly",
        dir.display(),
        said.join("; "),
        names.join(",")
    ))
}

/// A layout recorded as the parallel plan's JSON, in the words of the flags (`dp=2 pp=1 tp=1 zero=3`).
pub fn layout_words(layout: &serde_json::Value) -> String {
    let field = |k: &str| layout.get(k).map_or("?".to_string(), |v| v.to_string());
    // Checkpoints written before tensor parallelism existed hold no `tp`: theirs was 1.
    let tp = layout.get("tp").map_or("1".to_string(), |v| v.to_string());
    format!(
        "dp={} pp={} tp={tp} zero={}",
        field("dp"),
        field("pp"),
        field("zero")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use archipelago_dataflow::{ModelSpec, OptimizerSpec};

    fn manifest(run: Option<RunRecord>, step: u64) -> Manifest {
        Manifest {
            job: "t".into(),
            step,
            next_step: step + 1,
            model: "mlp".into(),
            seed: 0,
            layout: serde_json::Value::Null,
            run,
            files: Vec::new(),
        }
    }

    fn program(optimizer: OptimizerSpec, schedule: LrSchedule) -> Program {
        let mut p = Program::new(ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap())
            .with_optimizer(optimizer);
        p.lr_schedule = schedule;
        p
    }

    /// The same run resumes; another optimizer, schedule or total is refused naming each, and
    /// passes when overridden; a constant rate does not depend on the total; a checkpoint past
    /// the last step is refused with the fix.
    #[test]
    fn a_resume_that_changes_the_run_is_refused_naming_what() {
        let dir = std::path::Path::new("/ck");
        let cosine = |total| LrSchedule {
            warmup_steps: 2,
            decay: LrDecay::Cosine,
            total_steps: total,
            final_fraction: 0.1,
        };
        let adamw = OptimizerSpec::adamw(1e-3);
        let written = manifest(Some(record(&program(adamw, cosine(30)), 30)), 10);
        check(&written, dir, &program(adamw, cosine(30)), 30, &[]).unwrap();
        let sgd = program(OptimizerSpec::sgd(1e-3), cosine(20));
        let refused = check(&written, dir, &sgd, 20, &[]).unwrap_err();
        for name in [
            "optimizer:",
            "lr-schedule:",
            "steps:",
            "--resume-override optimizer,lr-schedule,steps",
        ] {
            assert!(refused.contains(name), "{name} not in: {refused}");
        }
        let overrides: Vec<String> = ["optimizer", "lr-schedule", "steps"].map(String::from).to_vec();
        check(&written, dir, &sgd, 20, &overrides).unwrap();
        let unknown = check(&written, dir, &sgd, 20, &["lr".into()]).unwrap_err();
        assert!(unknown.contains("not a recorded setting"), "{unknown}");
        // A constant rate: a longer run changes nothing but the total, which must be said.
        let constant = |total| LrSchedule {
            total_steps: total,
            ..LrSchedule::constant()
        };
        let flat = manifest(Some(record(&program(adamw, constant(30)), 30)), 10);
        let longer = check(&flat, dir, &program(adamw, constant(60)), 60, &[]).unwrap_err();
        assert!(
            longer.contains("steps:") && !longer.contains("lr-schedule"),
            "{longer}"
        );
        check(&flat, dir, &program(adamw, constant(60)), 60, &["steps".into()]).unwrap();
        // At or past the last step.
        let past = check(&written, dir, &program(adamw, cosine(30)), 10, &[]).unwrap_err();
        assert!(past.contains("--steps 11 or more"), "{past}");
        // Written before runs were recorded: the step only.
        check(&manifest(None, 10), dir, &sgd, 20, &[]).unwrap();
        // Another --compress (a top-k run's residuals would go unused) is said, and overridable.
        let topk = program(adamw, cosine(30))
            .with_compression(archipelago_dataflow::Compression::TopK { ratio: 0.01 });
        let dropped = check(&written, dir, &topk, 30, &[]).unwrap_err();
        assert!(
            dropped.contains("compress: ") && dropped.contains("topk:0.01"),
            "{dropped}"
        );
        check(&written, dir, &topk, 30, &["compress".into()]).unwrap();
        // Under SGD with momentum top-k keeps the momentum in the exchange: a resume that moves
        // it between there and the optimizer is refused, overrides or not.
        let momentum = OptimizerSpec::sgd(0.1).with_momentum(0.9, false).unwrap();
        let corrected = program(momentum, cosine(30))
            .with_compression(archipelago_dataflow::Compression::TopK { ratio: 0.01 });
        let plain = program(momentum, cosine(30));
        let all: Vec<String> = OVERRIDABLE.iter().map(|s| s.to_string()).collect();
        let from_topk = manifest(Some(record(&corrected, 30)), 10);
        let refused = check(&from_topk, dir, &plain, 30, &all).unwrap_err();
        assert!(refused.contains("resume with --compress topk:0.01"), "{refused}");
        let from_plain = manifest(Some(record(&plain, 30)), 10);
        let refused = check(&from_plain, dir, &corrected, 30, &all).unwrap_err();
        assert!(
            refused.contains("resume with the checkpoint's --compress none"),
            "{refused}"
        );
        check(&from_topk, dir, &corrected, 30, &[]).unwrap();
    }

    /// A LoRA run records its base file by its whole path, however `--init` named it; a run
    /// without frozen parameters records none.
    #[test]
    fn the_base_file_is_recorded_by_its_whole_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.safetensors"), b"base weights").unwrap();
        let lora = archipelago_dataflow::family::LoraSpec {
            rank: 2,
            alpha: 4.0,
            targets: vec!["c_attn".into()],
        };
        let model = ModelSpec::parse("gpt2:vocab=16,ctx=8,d=8,layers=1,heads=2").unwrap();
        let mut adapted = Program::new(model.with_lora(lora).unwrap());
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let roundabout = dir.path().join("sub/../base.safetensors");
        adapted.init = Some(roundabout.to_str().unwrap().to_string());
        let base = record(&adapted, 10).base.expect("a LoRA run records its base");
        let whole = std::fs::canonicalize(dir.path().join("base.safetensors")).unwrap();
        assert_eq!(base.path, whole.to_str().unwrap(), "not canonical: {}", base.path);
        assert_eq!(base.sha256.len(), 64);
        let mut full = Program::new(ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap());
        full.init = adapted.init.clone();
        assert!(record(&full, 10).base.is_none(), "no frozen parameters, no base");
    }
}
