//! `archipelago eval`: `transformers`' GPT-2 fixture scored from its `model.safetensors` (the
//! model read from the `config.json` beside it) gives the loss `transformers` gives; a gpt
//! trained a few steps scores the same from its checkpoint and from the file `export` wrote of
//! it; a file for another model and a checkpoint of another model are refused with the fix.
//! int8 (LLM.int8, issue 41): a gpt-tiny trained on the README scores held-out text within 1%
//! of its f32 perplexity with its projection weights a quarter of the bytes.

mod common;

use common::{archipelago, eval_loss, fixture, refused};

#[test]
fn eval_scores_transformers_weights_and_checkpoints_alike() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("eval.json");
    let (init, text, tokenizer) = (
        fixture("gpt2/model.safetensors"),
        fixture("gpt2/eval.txt"),
        fixture("tokenizer/tokenizer.json"),
    );
    let report_arg = report.display().to_string();
    let args = [
        "eval",
        "--init",
        &init,
        "--data",
        &text,
        "--tokenizer",
        &tokenizer,
        "--report",
        &report_arg,
    ];
    let (ok, out) = archipelago(&args);
    assert!(ok, "{out}");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gpt2/expected.json")).unwrap()).unwrap();
    let want = expected["eval"]["loss"].as_f64().unwrap();
    assert!((eval_loss(&out) - want).abs() < 1e-5, "{out} against {want}");
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(written["predicted_tokens"], 70);
    assert!((written["loss"].as_f64().unwrap() - want).abs() < 1e-5);
    refused(
        &["eval", "--model", "gpt-tiny", "--init", &init, "--data", &text],
        &["does not hold this model's weights", "missing tok.weight"],
    );

    // A gpt trained a few steps: its checkpoint and its export score alike.
    let model = "gpt:vocab=256,ctx=8,d=16,layers=1,heads=2";
    let checkpoints = dir.path().join("ck").display().to_string();
    let (ok, out) = archipelago(&[
        "train",
        "--model",
        model,
        "--steps",
        "3",
        "--batch",
        "4",
        "--data",
        &text,
        "--checkpoint-dir",
        &checkpoints,
        "--checkpoint-every",
        "3",
    ]);
    assert!(ok, "{out}");
    let (ok, from_checkpoint) = archipelago(&["eval", "--checkpoint", &checkpoints, "--data", &text]);
    assert!(ok, "{from_checkpoint}");
    let exported = dir.path().join("export/model.safetensors");
    std::fs::create_dir_all(exported.parent().unwrap()).unwrap();
    let exported = exported.display().to_string();
    let (ok, out) = archipelago(&["export", &checkpoints, "--out", &exported]);
    assert!(ok, "{out}");
    let (ok, from_export) = archipelago(&["eval", "--init", &exported, "--data", &text]);
    assert!(ok, "{from_export}");
    assert_eq!(
        eval_loss(&from_checkpoint),
        eval_loss(&from_export),
        "{from_checkpoint}\n{from_export}"
    );
    assert!(from_export.contains(model), "{from_export}");
    refused(
        &[
            "eval",
            "--checkpoint",
            &checkpoints,
            "--model",
            "gpt-tiny",
            "--data",
            &text,
        ],
        &["holds `gpt:vocab=256", "drop --model"],
    );
}

/// `eval --report` of `args`: the report's JSON.
fn eval_report(args: &[&str], report: &std::path::Path) -> serde_json::Value {
    let report_arg = report.display().to_string();
    let (ok, out) = archipelago(&[args, &["--report", &report_arg]].concat());
    assert!(ok, "{out}");
    println!("{out}");
    serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap()
}

#[test]
fn int8_weights_keep_a_trained_gpt_tinys_perplexity_within_one_percent() {
    let dir = tempfile::tempdir().unwrap();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let train_text = format!("{root}/README.md");
    // Held out: the first 6,000 bytes of the guide (its start is prose, not README text).
    let guide = std::fs::read(format!("{root}/docs/GUIDE.md")).unwrap();
    let held_out = dir.path().join("held_out.txt");
    std::fs::write(&held_out, &guide[..guide.len().min(6000)]).unwrap();
    let held_out = held_out.display().to_string();
    let checkpoints = dir.path().join("ck").display().to_string();
    let (ok, out) = archipelago(&[
        "train",
        "--model",
        "gpt-tiny",
        "--steps",
        "120",
        "--batch",
        "8",
        "--lr",
        "3e-3",
        "--data",
        &train_text,
        "--checkpoint-dir",
        &checkpoints,
        "--checkpoint-every",
        "120",
    ]);
    assert!(ok, "{out}");
    let eval = ["eval", "--checkpoint", &checkpoints, "--data", &held_out];
    let f32_report = eval_report(&eval, &dir.path().join("f32.json"));
    let int8_args = [&eval[..], &["--quantize", "int8"]].concat();
    let int8_report = eval_report(&int8_args, &dir.path().join("int8.json"));
    let (f32_ppl, int8_ppl) = (
        f32_report["perplexity"].as_f64().unwrap(),
        int8_report["perplexity"].as_f64().unwrap(),
    );
    println!(
        "gpt-tiny on docs/GUIDE.md: perplexity f32 {f32_ppl:.4}, int8 {int8_ppl:.4} ({:+.3}%)",
        100.0 * (int8_ppl / f32_ppl - 1.0)
    );
    assert!(
        f32_ppl < 40.0,
        "the model is trained: perplexity {f32_ppl} over 256 byte values"
    );
    assert!(
        (int8_ppl / f32_ppl - 1.0).abs() < 0.01,
        "int8 {int8_ppl} against f32 {f32_ppl}"
    );
    let bytes = &int8_report["int8"];
    assert_eq!(bytes["layers"], 4 * 4, "{bytes}");
    assert_eq!(
        bytes["f32_bytes"].as_u64().unwrap(),
        4 * bytes["int8_bytes"].as_u64().unwrap()
    );
    // A lowered threshold sends many features through f32 (LLM.int8's decomposition) and a
    // threshold none reaches sends none: both within 1%, and they differ, so the outlier path ran.
    let perplexity_at = |threshold: &str, name: &str| {
        let args = [&int8_args[..], &["--outlier-threshold", threshold]].concat();
        eval_report(&args, &dir.path().join(name))["perplexity"]
            .as_f64()
            .unwrap()
    };
    let (lowered, forced) = (
        perplexity_at("2", "lowered.json"),
        perplexity_at("1e9", "forced.json"),
    );
    println!("outlier threshold 2: perplexity {lowered:.4}; none: {forced:.4}");
    for ppl in [lowered, forced] {
        assert!((ppl / f32_ppl - 1.0).abs() < 0.01, "{ppl} against f32 {f32_ppl}");
    }
    assert_ne!(lowered, forced);
}
