//! `archipelago eval`: `transformers`' GPT-2 fixture scored from its `model.safetensors` (the
//! model read from the `config.json` beside it) gives the loss `transformers` gives; a gpt
//! trained a few steps scores the same from its checkpoint and from the file `export` wrote of
//! it; a file for another model and a checkpoint of another model are refused with the fix.

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
