//! The `archipelago` binary: `plan`, `train`, `controller` and `host` refuse bad input with a fix
//! (every refusal listed in issue 19 pinned), `plan` prints the streams without starting actors,
//! and `train` writes the report's stable keys.

mod common;

use common::{archipelago, refused};

#[test]
fn a_batch_that_dp_does_not_divide_is_refused_by_plan_and_train() {
    for command in ["plan", "train"] {
        let (ok, text) = archipelago(&[command, "--model", "mlp-8x1024", "--dp", "3", "--batch", "64"]);
        assert!(!ok, "{command} accepted an indivisible batch: {text}");
        assert!(
            text.contains("does not divide over dp=3") && text.contains("--batch 63 or --batch 66"),
            "{text}"
        );
    }
}

#[test]
fn plan_prints_mesh_streams_and_memory() {
    let (ok, text) = archipelago(&["plan", "--model", "mlp-8x1024", "--dp", "2", "--streams"]);
    assert!(ok, "{text}");
    for needle in [
        "rates: measured",
        "mesh dp=2",
        "actor 1 on cpu:1",
        "AllReduceSum(grad.",
        "OptimizerStep",
        "memory ≈",
    ] {
        assert!(text.contains(needle), "`{needle}` missing:\n{text}");
    }
    // `--json`: the plan alone on stdout; where its rates came from on stderr.
    let out = std::process::Command::new(common::BIN)
        .args(["plan", "--model", "gpt-tiny", "--dp", "2", "--json"])
        .output()
        .expect("run archipelago");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan JSON alone on stdout");
    assert_eq!(plan["actors"].as_array().unwrap().len(), 2);
    assert!(said.contains("rates: measured"), "{said}");
}

#[test]
fn bad_model_specs_are_refused_with_the_expected_forms() {
    let (ok, text) = archipelago(&["plan", "--model", "resnet"]);
    assert!(!ok && text.contains("mlp:in=I,hidden=H,layers=L,out=O"), "{text}");
}

#[test]
fn train_writes_the_report_keys() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let args = [
        "train",
        "--model",
        "gpt:vocab=256,ctx=8,d=16,layers=1,heads=2",
        "--dp",
        "2",
        "--batch",
        "4",
        "--steps",
        "3",
    ];
    let (ok, text) = archipelago(&[&args[..], &["--report", report.to_str().unwrap()]].concat());
    assert!(ok, "{text}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    for key in [
        "model",
        "plan",
        "params",
        "steps",
        "final_loss",
        "param_l2",
        "block_l2",
        "actors",
        "peak_rss_bytes",
        "samples_per_s",
        "tokens_per_s",
        "load_avg",
    ] {
        assert!(!r[key].is_null(), "report lacks `{key}`: {r}");
    }
    assert_eq!(r["steps"].as_array().unwrap().len(), 3);
    // embedding, attn.0, mlp.0, head: a gpt layer is two blocks.
    assert_eq!(r["block_l2"].as_array().unwrap().len(), 4);
    assert_eq!(r["plan"]["dp"], 2);
    assert!(r["actors"][1]["model_state_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn data_file_trains_a_gpt_on_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let text_file = dir.path().join("text.txt");
    std::fs::write(
        &text_file,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        "gpt:vocab=256,ctx=16,d=16,layers=1,heads=2",
        "--batch",
        "2",
        "--steps",
        "2",
        "--data",
        text_file.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        "mlp-8x1024",
        "--data",
        text_file.to_str().unwrap(),
        "--steps",
        "1",
    ]);
    assert!(!ok && text.contains("not a gpt"), "{text}");
}

#[test]
fn a_small_vocabulary_gpt_trains_on_what_it_can_represent_and_refuses_data_it_cannot() {
    // The synthetic stream is generated within the vocabulary.
    let small = "gpt:vocab=64,ctx=16,d=32,layers=1,heads=4";
    let (ok, text) = archipelago(&["train", "--model", small, "--steps", "2"]);
    assert!(ok, "{text}");
    // Text whose bytes are below the vocabulary trains (lowercase ASCII < 128) ...
    let dir = tempfile::tempdir().unwrap();
    let text_file = dir.path().join("text.txt");
    std::fs::write(
        &text_file,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let fits = "gpt:vocab=128,ctx=16,d=32,layers=1,heads=4";
    let data = text_file.to_str().unwrap();
    let (ok, text) = archipelago(&["train", "--model", fits, "--steps", "2", "--data", data]);
    assert!(ok, "{text}");
    // ... and text that does not fit is refused before any actor starts, with the fix.
    let (ok, text) = archipelago(&["train", "--model", small, "--steps", "2", "--data", data]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("byte values up to 122") && text.contains("use vocab=123"),
        "{text}"
    );
    assert!(
        !text.contains("actor 0"),
        "refused after an actor started: {text}"
    );
}

#[test]
fn plan_refuses_bad_pipeline_input_naming_the_fix() {
    let cases: [(&[&str], &str); 5] = [
        (&["--pp", "12", "--microbatches", "4"], "use --pp 9 or less"),
        (&["--pp", "2", "--microbatches", "5"], "use --microbatches 4"),
        (&["--pp", "2", "--stages", "0-4,3-8"], "overlap"),
        (&["--pp", "2", "--stages", "0-3,5-8"], "no chunk holds block 4"),
        (
            &["--pp", "2", "--schedule", "pipedream"],
            "use gpipe, 1f1b, interleaved or zb-h1",
        ),
    ];
    for (flags, needle) in cases {
        let mut args = vec!["plan", "--model", "mlp-8x1024"];
        args.extend_from_slice(flags);
        let (ok, text) = archipelago(&args);
        assert!(
            !ok && text.contains(needle),
            "{flags:?}: `{needle}` missing:\n{text}"
        );
    }
}

#[test]
fn plan_prints_each_stage_schedule_bubble_and_peak() {
    let (ok, text) = archipelago(&[
        "plan",
        "--model",
        "mlp-8x1024",
        "--pp",
        "2",
        "--dp",
        "2",
        "--microbatches",
        "8",
        "--schedule",
        "gpipe",
        "--streams",
    ]);
    assert!(ok, "{text}");
    for needle in [
        "mesh dp=2 × pp=2",
        "schedule gpipe",
        "stage 0: bubble 0.",
        "peak micro-batches held 8: F0 F1 F2 F3 F4 F5 F6 F7 B0",
        "Send(act.0.7 → actor 1",
        "Recv(dact.1.0 ← actor 1",
    ] {
        assert!(text.contains(needle), "`{needle}` missing:\n{text}");
    }
}

#[test]
fn train_with_pipeline_flags_writes_trace_and_bubble() {
    let dir = tempfile::tempdir().unwrap();
    let (report, trace) = (dir.path().join("r.json"), dir.path().join("t.json"));
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        "mlp:in=16,hidden=32,layers=3,out=4",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--batch",
        "16",
        "--steps",
        "3",
        "--checkpoint-activations",
        "--report",
        report.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(ok && text.contains("stage 1: bubble"), "{text}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    for key in [
        "bubble",
        "predicted_bubble",
        "replayed_bubble",
        "peak_microbatches_held",
        "stage",
    ] {
        assert!(r["actors"][1].get(key).is_some(), "report lacks actors[].{key}");
    }
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert!(t["traceEvents"].as_array().unwrap().len() > 20);
}

/// `--devices` places the actors; a GPU this build or host cannot run is refused at start, before
/// any actor, naming what is missing; `devices` lists what the host offers.
#[test]
fn devices_are_listed_and_a_missing_gpu_is_refused_at_start() {
    let (ok, json) = archipelago(&["devices", "--json"]);
    assert!(ok, "{json}");
    let found: serde_json::Value = serde_json::from_str(&json).expect("devices JSON");
    let cores = found["cpu_cores"].as_u64().unwrap();
    assert!(cores >= 1, "{json}");
    assert_eq!(found["specs"][0], "cpu:0", "{json}");
    assert!(found["memory_bytes"].as_u64().unwrap() > 0, "{json}");
    if found["gpus"].as_array().unwrap().is_empty() {
        // CI: no GPU, or a build without `cuda`: the reason is given.
        assert!(
            found["gpus_unavailable"].as_str().is_some_and(|w| !w.is_empty()),
            "{json}"
        );
        let (ok, text) = archipelago(&[
            "train",
            "--model",
            "gpt-tiny",
            "--devices",
            "cuda:0",
            "--steps",
            "1",
        ]);
        assert!(!ok, "cuda:0 accepted without a GPU: {text}");
        assert!(text.contains("cuda:0 was asked for"), "{text}");
        assert!(
            text.contains("--features cuda") || text.contains("NVIDIA driver"),
            "the error does not say what is missing: {text}"
        );
        assert!(
            !text.contains("training gpt-tiny"),
            "refused only after starting: {text}"
        );
    }
    // Explicit CPU devices train as the default ones do.
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        "mlp:in=8,hidden=8,layers=2,out=2",
        "--dp",
        "2",
        "--devices",
        "cpu:1,cpu:0",
        "--steps",
        "2",
        "--quiet",
    ]);
    assert!(ok, "{text}");
    let (ok, text) = archipelago(&["plan", "--model", "mlp-8x1024", "--dp", "2", "--devices", "cpu:0"]);
    assert!(
        !ok && text.contains("devices"),
        "too few devices accepted: {text}"
    );
}

/// The optimizer flags: SGD with Nesterov momentum, weight decay, warmup then cosine decay and
/// clipping trains on dp=2 and reports every step's rate and gradient norm; conflicting or
/// unknown settings are refused before anything starts, naming the flag.
#[test]
fn optimizer_flags_train_and_refuse_conflicts() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let args = [
        "train",
        "--model",
        "mlp:in=8,hidden=16,layers=2,out=3",
        "--dp",
        "2",
        "--batch",
        "8",
        "--steps",
        "4",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
        "--nesterov",
        "--weight-decay",
        "0.01",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--clip-grad-norm",
        "0.5",
        "--quiet",
    ];
    let (ok, text) = archipelago(&[&args[..], &["--report", report.to_str().unwrap()]].concat());
    assert!(ok, "{text}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let steps = r["steps"].as_array().unwrap();
    let lr: Vec<f64> = steps.iter().map(|s| s["lr"].as_f64().unwrap()).collect();
    assert!(
        (lr[0] - 0.05).abs() < 1e-6 && (lr[1] - 0.1).abs() < 1e-6,
        "{lr:?}"
    );
    assert!(
        (lr[3] - 0.01).abs() < 1e-6,
        "cosine to a tenth at the last step: {lr:?}"
    );
    assert!(steps.iter().all(|s| s["grad_norm"].as_f64().unwrap() > 0.0));
    for (flags, needle) in [
        (
            &["--optimizer", "lamb", "--offload", "cpu"][..],
            "--optimizer lamb needs each parameter's norm",
        ),
        (
            &["--optimizer", "sgd", "--nesterov"][..],
            "--nesterov needs --momentum > 0",
        ),
        (
            &["--optimizer", "adamw", "--momentum", "0.9"][..],
            "apply to --optimizer sgd",
        ),
        (
            &["--optimizer", "adagrad"][..],
            "use adam, adamw, sgd, lamb or (on the command line) onebit-adam",
        ),
        // 1-bit Adam: what it needs and what it does not combine with.
        (&["--freeze-step", "5"][..], "use it with --optimizer onebit-adam"),
        (
            &["--optimizer", "onebit-adam", "--dp", "2"][..],
            "needs --freeze-step W",
        ),
        (
            &["--optimizer", "onebit-adam", "--freeze-step", "30", "--dp", "2"][..],
            "is not below --steps 30",
        ),
        (
            &[
                "--optimizer",
                "onebit-adam",
                "--freeze-step",
                "5",
                "--dp",
                "2",
                "--compress",
                "int8",
            ][..],
            "drop --compress int8",
        ),
        (
            &["--optimizer", "onebit-adam", "--freeze-step", "5"][..],
            "dp=1 has none",
        ),
        (
            &[
                "--optimizer",
                "onebit-adam",
                "--freeze-step",
                "5",
                "--dp",
                "2",
                "--zero",
                "1",
            ][..],
            "use --zero 0",
        ),
        (
            &[
                "--optimizer",
                "onebit-adam",
                "--freeze-step",
                "5",
                "--dp",
                "2",
                "--clip-grad-norm",
                "1",
            ][..],
            "drop --clip-grad-norm",
        ),
        (
            &[
                "--optimizer",
                "onebit-adam",
                "--freeze-step",
                "5",
                "--dp",
                "2",
                "--weight-decay",
                "0.1",
            ][..],
            "drop --weight-decay",
        ),
        (&["--lr-schedule", "step"][..], "use constant, cosine or linear"),
    ] {
        let (ok, text) = archipelago(
            &[
                &["plan", "--model", "mlp:in=8,hidden=16,layers=2,out=3"][..],
                flags,
            ]
            .concat(),
        );
        assert!(!ok && text.contains(needle), "{flags:?}: {text}");
    }
}

// Every refusal of bad input made before any actor starts (issue 19's list: `--zero 4`,
// `--offload-params` without `--zero 3`, `--dp 0`, a missing or empty token file, `--resume` with
// no checkpoint or another model's): each exits non-zero naming what to change.

#[test]
fn plan_flags_that_cannot_work_are_refused_naming_the_fix() {
    for command in ["plan", "train"] {
        refused(
            &[command, "--model", "mlp-8x1024", "--dp", "2", "--zero", "4"],
            &["--zero 4", "0, 1, 2 and 3"],
        );
        refused(
            &[command, "--model", "mlp-8x1024", "--dp", "2", "--offload-params"],
            &["--offload-params", "needs --zero 3", "--offload cpu or nvme:DIR"],
        );
        refused(
            &[command, "--model", "mlp-8x1024", "--dp", "0"],
            &["--dp must be at least 1"],
        );
        refused(
            &[
                command,
                "--model",
                "mlp-8x1024",
                "--dp",
                "2",
                "--offload",
                "cpu",
                "--state",
                "device",
            ],
            &["--state device", "--offload cpu", "--state host"],
        );
        refused(
            &[command, "--model", "mlp-8x1024", "--state", "gpu"],
            &["--state `gpu`", "use `auto`, `host` or `device`"],
        );
    }
}

#[test]
fn a_missing_or_empty_token_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "").unwrap();
    for (file, needle) in [(&missing, "cannot read the token file"), (&empty, "is empty")] {
        let file = file.to_str().unwrap();
        refused(
            &["controller", "--listen", "127.0.0.1:0", "--token-file", file],
            &[needle, file],
        );
        refused(
            &["host", "--controller", "127.0.0.1:9", "--token-file", file],
            &[needle],
        );
    }
}

#[test]
fn resuming_without_a_checkpoint_or_from_another_models_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    refused(
        &["train", "--model", "mlp-8x1024", "--steps", "1", "--resume", root],
        &["no complete checkpoint under", root],
    );
    // A checkpoint of one model, then a resume of another from it.
    let small = "mlp:in=8,hidden=16,layers=2,out=4";
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        small,
        "--steps",
        "2",
        "--checkpoint-dir",
        root,
    ]);
    assert!(ok, "{text}");
    refused(
        &[
            "train",
            "--model",
            "mlp:in=8,hidden=32,layers=2,out=4",
            "--steps",
            "3",
            "--resume",
            root,
        ],
        &["is of model", small],
    );
    // The same model resumed with another optimizer, or to a step it has passed, is refused
    // naming what; told to, it changes the optimizer and goes on, saying where it resumed.
    refused(
        &[
            "train",
            "--model",
            small,
            "--steps",
            "3",
            "--optimizer",
            "sgd",
            "--resume",
            root,
        ],
        &[
            "would change the run",
            "optimizer:",
            "--resume-override optimizer",
        ],
    );
    refused(
        &["train", "--model", small, "--steps", "1", "--resume", root],
        &["holds step 2", "--steps 3 or more"],
    );
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        small,
        "--steps",
        "3",
        "--resume",
        root,
        "--resume-override",
        "steps",
    ]);
    assert!(ok && text.contains("resuming from step 2"), "{text}");
}
