//! What `train` and `plan` tell a user, as a user sees it (the binary, stdout piped): the banner
//! confirms every setting the run resolved, progress lines carry the learning rate and the
//! gradient norm at `--log-every`, nothing carries colour codes into a file, the report holds
//! resolved values; `plan` prints a summary (streams on request), accepts `train`'s flags and puts
//! layouts side by side; bad paths are refused before any actor starts.

use std::process::Command;

fn archipelago(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_archipelago"))
        .args(args)
        .output()
        .expect("run archipelago");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const GPT: &str = "gpt:vocab=256,ctx=8,d=16,layers=1,heads=2";

#[test]
fn the_banner_progress_and_report_confirm_what_runs() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let (ok, out, err) = archipelago(&[
        "train",
        "--model",
        GPT,
        "--batch",
        "4",
        "--steps",
        "4",
        "--optimizer",
        "adamw",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "1",
        "--clip-grad-norm",
        "1",
        "--log-every",
        "1",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(ok, "{out}{err}");
    for needle in [
        "on 1 actor [dp=1]",
        "optimizer adamw lr 0.001 betas (0.9, 0.999) eps 1e-8 weight decay 0.01 (none on biases and LayerNorm)",
        "lr schedule cosine to 0.1×lr at step 4, warmup 1",
        "clip grad norm 1",
        "zero 0, state host, precision f32",
        "data: synthetic byte stream (seed 0)",
        "start: seeded initialisation (seed 0)",
        "(step 4's batch, before its update)",
    ] {
        assert!(out.contains(needle), "`{needle}` missing:\n{out}");
    }
    let progress: Vec<&str> = out.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(progress.len(), 4, "--log-every 1 prints every step:\n{out}");
    assert!(
        progress
            .iter()
            .all(|l| l.contains(" lr ") && l.contains("grad norm")),
        "{out}"
    );
    // Warmup's first update runs at lr/1 = the peak; the cosine ends at a tenth of it.
    assert!(
        progress[0].contains("lr 1.000e-3") && progress[3].contains("lr 1.000e-4"),
        "{out}"
    );
    assert!(
        !out.contains('\u{1b}') && !err.contains('\u{1b}'),
        "colour codes in a pipe:\n{out}{err}"
    );
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    // The report's flags hold what the defaults resolved to, not null.
    assert_eq!(r["plan"]["batch"], 4);
    assert_eq!(r["plan"]["weight_decay"].as_f64(), Some(0.009999999776482582));
    assert_eq!(r["plan"]["devices"], "cpu:0");
}

#[test]
fn plan_prints_a_summary_takes_trains_flags_and_streams_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let base = [
        "plan",
        "--model",
        "mlp:in=8,hidden=16,layers=4,out=3",
        "--dp",
        "2",
        "--rate",
        "default",
    ];
    // Flags that only matter while running are accepted (and ignored).
    let run_flags = [
        "--report",
        "r.json",
        "--checkpoint-dir",
        d,
        "--checkpoint-every",
        "5",
        "--patience-s",
        "9",
    ];
    let (ok, out, err) = archipelago(&[&base[..], &run_flags[..]].concat());
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("predicted step") && out.contains("memory ≈"),
        "{out}"
    );
    assert!(
        !out.contains("OptimizerStep"),
        "the summary holds no streams:\n{out}"
    );
    assert!(
        out.contains("--streams prints every actor's instructions"),
        "{out}"
    );
    let (ok, out, _) = archipelago(&[&base[..], &["--streams"]].concat());
    assert!(
        ok && out.contains("OptimizerStep") && out.contains("AllReduceSum(grad."),
        "{out}"
    );
}

#[test]
fn plan_compare_puts_layouts_side_by_side_and_names_a_refused_one() {
    let (ok, out, err) = archipelago(&[
        "plan",
        "--model",
        "gpt-tiny",
        "--rate",
        "default",
        "--compare",
        "--dp 2",
        "--dp 2 --pp 2 --microbatches 4",
        "--dp 2 --zero 3",
        "--dp 3",
    ]);
    assert!(ok, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("layout") && lines[0].contains("predicted step"),
        "{out}"
    );
    assert!(
        lines[1].starts_with("--dp 2 ") && lines[1].contains(" ms"),
        "{out}"
    );
    assert!(lines[2].contains("dp=2 × pp=2"), "{out}");
    assert!(
        lines[3].starts_with("--dp 2 --zero 3") && lines[3].contains("MiB"),
        "{out}"
    );
    assert!(lines[4].contains("refused"), "{out}");
    assert!(
        out.contains("--dp 3: global batch 16 does not divide over dp=3"),
        "{out}"
    );
}

#[test]
fn bad_paths_are_refused_before_any_actor_starts() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.txt");
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let train = ["train", "--model", GPT, "--batch", "2", "--steps", "1"];
    let cases: [(&[&str], &str); 3] = [
        (&["--data", missing.to_str().unwrap()], "--data"),
        (&["--resume", missing.to_str().unwrap()], "no such directory"),
        (
            &["--resume", empty.to_str().unwrap()],
            "holds no `step-N` directory",
        ),
    ];
    for (flags, needle) in cases {
        let (ok, out, err) = archipelago(&[&train[..], flags].concat());
        assert!(!ok, "{flags:?} accepted:\n{out}{err}");
        assert!(err.contains(needle), "`{needle}` missing for {flags:?}:\n{err}");
        if needle == "--data" {
            assert!(
                err.contains("no such file") && !out.contains("training "),
                "{out}{err}"
            );
        }
    }
}

/// `ps --model sparse-lr` with its defaults learns: its own rate (0.03) takes the held-out
/// objective most of the way from ln 2 to the true weights' in the default 30 clocks (at
/// `train`'s 1e-3 it moved 0.693 → 0.683); a given `--lr` still wins.
#[test]
fn ps_sparse_lr_learns_with_its_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("ps.json");
    let objective = |extra: &[&str]| {
        let args = ["ps", "--model", "sparse-lr", "--report", report.to_str().unwrap()];
        let (ok, out, err) = archipelago(&[&args[..], extra].concat());
        assert!(ok, "{out}{err}");
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let s = &r["sparse"];
        let (start, end, truth) = (
            s["objective_start"].as_f64(),
            s["objective_end"].as_f64(),
            s["objective_true"].as_f64(),
        );
        (start.unwrap(), end.unwrap(), truth.unwrap(), out)
    };
    let (start, end, truth, out) = objective(&[]);
    assert!(out.contains("(lr 0.03,"), "{out}");
    assert!(
        end < start - 0.5 * (start - truth),
        "{start} → {end} (true {truth})"
    );
    // Control: at 1e-3 the same run barely moves.
    let (start, end, _, out) = objective(&["--lr", "0.001"]);
    assert!(
        out.contains("(lr 0.001,") && end > start - 0.05,
        "{start} → {end}:\n{out}"
    );
}

/// f16: the banner names the loss scale, each progress line the step's scale, and the report
/// holds it; `--loss-scale` with bf16 and a scale that is no scale are refused by `plan`, naming
/// the fix.
#[test]
fn f16_shows_its_loss_scale_and_bad_scales_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let (ok, out, err) = archipelago(&[
        "train",
        "--model",
        GPT,
        "--batch",
        "4",
        "--steps",
        "2",
        "--precision",
        "f16",
        "--loss-scale",
        "dynamic:1024",
        "--log-every",
        "1",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("precision f16 (f32 master and optimizer state; loss scale dynamic from 1024"),
        "{out}"
    );
    let progress: Vec<&str> = out.lines().filter(|l| l.starts_with("step ")).collect();
    assert!(progress.iter().all(|l| l.contains("loss scale 1024")), "{out}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["steps"][0]["loss_scale"], 1024.0);
    for (args, needle) in [
        (
            &["--precision", "bf16", "--loss-scale", "dynamic"][..],
            "drop --loss-scale, or use --precision f16",
        ),
        (
            &["--precision", "f16", "--loss-scale", "static:0"][..],
            "not a finite number ≥ 1",
        ),
    ] {
        let mut all = vec!["plan", "--model", GPT, "--batch", "4"];
        all.extend_from_slice(args);
        let (ok, out, err) = archipelago(&all);
        assert!(!ok && err.contains(needle), "{args:?}: {out}{err}");
    }
}
