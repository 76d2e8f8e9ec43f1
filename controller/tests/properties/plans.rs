//! "Every model spec `plan` accepts trains": model specs (mlp and gpt shapes, small, invalid
//! combinations included: zero sizes, heads that do not divide d, more stages than blocks) and
//! layouts (dp, pp, ZeRO stage, micro-batches, batch, schedule, activation checkpointing) are
//! drawn as `archipelago train` flags; what `plan` accepts must run one training step here and
//! give a finite loss, and what it refuses must be refused with an error, never a panic. A
//! `--data` text file is checked against the vocabulary when the job starts (not by `plan`,
//! which does not read data): a file that does not fit is refused then, before any actor runs,
//! with the fix.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use archipelago_controller::cli::{Cli, Command};
use archipelago_controller::{Controller, TrainOptions};
use clap::Parser;
use proptest::prelude::*;

/// What became of one drawn job.
#[derive(Debug)]
enum Outcome {
    /// Refused before training (flags, program or plan), with this error.
    Refused(String),
    /// Planned, then refused before any actor started because the `--data` file does not fit
    /// the model (bytes outside the vocabulary, shorter than a context): the data is read at
    /// launch, not by `plan`.
    DataRefused(String),
    /// Planned and trained one step to this loss.
    Trained(f32),
}

/// Text files a gpt may be given with `--data`: ASCII prose (bytes below 128), every byte
/// value (needs vocab=256), and two bytes (shorter than any context of 2 or more).
fn data_file(which: usize) -> String {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let prose = "the quick brown fox jumps over the lazy dog; ".repeat(40);
        std::fs::write(dir.path().join("prose.txt"), prose).unwrap();
        let all: Vec<u8> = (0..=255u8).cycle().take(2048).collect();
        std::fs::write(dir.path().join("bytes.txt"), all).unwrap();
        std::fs::write(dir.path().join("short.txt"), "hi").unwrap();
        dir
    });
    let name = ["prose.txt", "bytes.txt", "short.txt"][which % 3];
    dir.path().join(name).display().to_string()
}

/// Runs `archipelago train <flags> --steps 1` in this process as `train` does: the flags, the
/// program, the plan, then one step. A panic anywhere is returned as `Err`; so is an accepted
/// plan that fails to train.
fn attempt(flags: &[String]) -> Result<Outcome, String> {
    let run = || -> Result<Outcome, String> {
        let mut argv = vec![
            "archipelago".to_string(),
            "train".into(),
            "--steps".into(),
            "1".into(),
        ];
        argv.extend_from_slice(flags);
        let cli = match Cli::try_parse_from(&argv) {
            Ok(cli) => cli,
            Err(e) => return Ok(Outcome::Refused(e.to_string())),
        };
        let Command::Train(args) = cli.command else {
            unreachable!("parsed as train")
        };
        let data = args.job.data.as_ref().map(|p| p.display().to_string());
        let program = match args.job.program() {
            Ok(p) => p,
            Err(e) => return Ok(Outcome::Refused(e.to_string())),
        };
        let controller = Controller::local(program.devices.clone());
        if let Err(e) = controller.plan(&program) {
            return Ok(Outcome::Refused(e.to_string()));
        }
        let options = TrainOptions {
            steps: 1,
            job: "property".into(),
            ..TrainOptions::default()
        };
        match controller.train(&program, &options) {
            Ok(report) => Ok(Outcome::Trained(report.final_loss)),
            // Allowed only as the data check's refusal before launch, which names the file.
            Err(e)
                if data
                    .as_deref()
                    .is_some_and(|path| e.to_string().contains(&format!("--data {path} "))) =>
            {
                Ok(Outcome::DataRefused(e.to_string()))
            }
            Err(e) => Err(format!("`plan` accepted {flags:?} but the step failed: {e}")),
        }
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(result) => result,
        Err(panic) => Err(format!(
            "{flags:?} panicked: {}",
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        )),
    }
}

fn check(flags: &[String]) -> Result<Outcome, TestCaseError> {
    let outcome = attempt(flags).map_err(TestCaseError::fail)?;
    eprintln!("{flags:?}: {outcome:?}");
    match &outcome {
        Outcome::Refused(why) | Outcome::DataRefused(why) => {
            prop_assert!(!why.trim().is_empty(), "{flags:?} refused without a reason")
        }
        Outcome::Trained(loss) => prop_assert!(loss.is_finite(), "{flags:?} trained to loss {loss}"),
    }
    Ok(outcome)
}

/// Mostly `1..n`, sometimes 0 (refused: every size must be at least 1).
fn size(n: usize) -> impl Strategy<Value = usize> {
    prop_oneof![12 => 1..n, 1 => Just(0usize)]
}

fn model() -> impl Strategy<Value = String> {
    let mlp = (size(24), size(40), size(5), size(9))
        .prop_map(|(i, h, l, o)| format!("mlp:in={i},hidden={h},layers={l},out={o}"));
    // vocab 2..300 mostly (a vocabulary under 256 must train on tokens it can represent), with
    // the edges 0 and 1; d a multiple of heads mostly, any d up to 32 otherwise (often refused).
    let vocab = prop_oneof![8 => 2usize..300, 1 => 0usize..2];
    let d = (
        size(5),
        1usize..8,
        prop_oneof![6 => Just(None), 1 => (0usize..33).prop_map(Some)],
    )
        .prop_map(|(heads, k, any_d)| (any_d.unwrap_or(heads.max(1) * k), heads));
    let gpt = (vocab, size(12), d, size(4))
        .prop_map(|(v, c, (d, h), l)| format!("gpt:vocab={v},ctx={c},d={d},layers={l},heads={h}"));
    prop_oneof![mlp, gpt]
}

fn layout() -> impl Strategy<Value = Vec<String>> {
    (
        (
            size(4),
            size(4),
            prop_oneof![9 => 0u8..4, 1 => Just(4u8)],
            1usize..4,
        ),
        // The batch: a multiple of dp × micro-batches (mostly), any, or the model's default.
        (0u8..10, 1usize..4, 1usize..25),
        prop_oneof![Just("1f1b"), Just("gpipe"), Just("zb-h1")],
        any::<bool>(),
    )
        .prop_map(|((dp, pp, zero, micro), (mode, m, raw), schedule, ckpt)| {
            let mut flags = vec![
                "--dp".to_string(),
                dp.to_string(),
                "--pp".into(),
                pp.to_string(),
                "--zero".into(),
                zero.to_string(),
                "--microbatches".into(),
                micro.to_string(),
                "--schedule".into(),
                schedule.into(),
            ];
            match mode {
                0..7 => flags.extend(["--batch".into(), (dp.max(1) * micro * m).to_string()]),
                7..9 => flags.extend(["--batch".into(), raw.to_string()]),
                _ => {}
            }
            if ckpt {
                flags.push("--checkpoint-activations".into());
            }
            flags
        })
}

#[test]
fn every_plan_accepted_trains_a_step_and_every_refusal_is_an_error() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // 128 jobs (about 40% accepted): each accepted one trains a step on up to 9 actors. The seed
    // follows the workspace's rule (fixed under CI, random and printed elsewhere, replayed with
    // ARCHIPELAGO_PROPTEST_SEED); a failure prints the smallest failing flags.
    let config = ProptestConfig {
        cases: 128,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(archipelago_dataflow::property_seed::seed()),
        ..ProptestConfig::default()
    };
    let (trained, refused) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut runner = proptest::test_runner::TestRunner::new(config);
    // One job in five reads a text file instead of the synthetic stream.
    let data = prop_oneof![4 => Just(None), 1 => (0usize..3).prop_map(Some)];
    let result = runner.run(&(model(), layout(), data), |(model, layout, data)| {
        let mut flags = vec!["--model".to_string(), model];
        flags.extend(layout);
        if let Some(which) = data {
            flags.extend(["--data".to_string(), data_file(which)]);
        }
        match check(&flags)? {
            Outcome::Trained(_) => trained.fetch_add(1, Ordering::Relaxed),
            Outcome::Refused(_) | Outcome::DataRefused(_) => refused.fetch_add(1, Ordering::Relaxed),
        };
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (trained, refused) = (trained.into_inner(), refused.into_inner());
    eprintln!("{trained} jobs planned and trained a step, {refused} refused");
    // The draw must exercise both sides, or the property says little.
    assert!(
        trained >= 24 && refused >= 16,
        "{trained} trained, {refused} refused"
    );
}

fn flags(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

#[test]
fn known_jobs_land_on_the_expected_side() {
    // Accepted and trained: the small-vocabulary gpt of issue 19 (it used to pass `plan` and
    // then panic at the first forward), and a pipelined ZeRO-1 layout.
    for accepted in [
        "--model gpt:vocab=64,ctx=16,d=32,layers=2,heads=4",
        "--model gpt:vocab=2,ctx=4,d=8,layers=2,heads=2 --dp 2 --pp 2 --zero 1 --batch 4 --microbatches 2",
        "--model mlp:in=3,hidden=5,layers=3,out=2 --dp 3 --batch 6",
    ] {
        let outcome = check(&flags(accepted)).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(outcome, Outcome::Trained(_)), "{accepted}: {outcome:?}");
    }
    // Text of bytes up to 122 trains a gpt of vocab=123 and is refused (before launch, with
    // the fix) for vocab=64; a model spec `plan` accepts either way.
    let prose = data_file(0);
    let fits = check(&flags(&format!(
        "--model gpt:vocab=123,ctx=8,d=8,layers=1,heads=2 --data {prose}"
    )));
    assert!(matches!(fits, Ok(Outcome::Trained(_))), "{fits:?}");
    let small = check(&flags(&format!(
        "--model gpt:vocab=64,ctx=8,d=8,layers=1,heads=2 --data {prose}"
    )));
    let Ok(Outcome::DataRefused(message)) = small else {
        panic!("text with bytes over the vocabulary: {small:?}")
    };
    assert!(message.contains("vocab=123"), "{message}");
    // Negative controls: refused, with the reason.
    for (refused, why) in [
        (
            "--model gpt:vocab=64,ctx=16,d=30,layers=2,heads=4",
            "heads=4 must divide d=30",
        ),
        ("--model gpt:vocab=0,ctx=16,d=32,layers=2,heads=4", "at least 1"),
        ("--model mlp:in=3,hidden=5,layers=3,out=2 --dp 0", "dp"),
        ("--model mlp:in=3,hidden=5,layers=3,out=2 --zero 4", "zero"),
        ("--model mlp:in=3,hidden=5,layers=2,out=2 --pp 9", "pp"),
    ] {
        let outcome = check(&flags(refused)).unwrap_or_else(|e| panic!("{e}"));
        let Outcome::Refused(message) = outcome else {
            panic!("{refused}: expected a refusal, got {outcome:?}")
        };
        assert!(message.to_lowercase().contains(why), "{refused}: {message}");
    }
}
