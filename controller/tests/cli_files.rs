//! The files a job reads and writes, checked before launch: `--init` weights and `--data`
//! batch files (missing, extra or misshapen tensors named), and `export` of what was trained
//! (its metadata and `config.json`), which `--init` accepts again.

mod common;

use common::{archipelago, refused};

/// `--init` and `--data FILE.safetensors` are checked before any actor starts, naming the
/// missing, extra or misshapen tensors; `train --init --data` then `export` writes the trained
/// model, which `--init` accepts again.
#[test]
fn weights_and_batch_files_are_checked_before_launch_and_export_writes_the_model() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../integration-tests/fixtures/torch");
    let gpt = "gpt:vocab=16,ctx=8,d=16,layers=2,heads=2";
    let file = |name: &str| format!("{fixture}/{name}");
    refused(
        &[
            "train",
            "--model",
            gpt,
            "--steps",
            "1",
            "--init",
            &file("mlp.init.safetensors"),
        ],
        &[
            "missing tok.weight",
            "not parameters of this model: layers.0.bias",
        ],
    );
    refused(
        &[
            "train",
            "--model",
            "gpt:vocab=16,ctx=8,d=8,layers=2,heads=2",
            "--steps",
            "1",
            "--init",
            &file("gpt.init.safetensors"),
        ],
        &["`tok.weight` is F32 [16, 16], expected F32 [16, 8]"],
    );
    refused(
        &[
            "train",
            "--model",
            gpt,
            "--steps",
            "1",
            "--data",
            &file("mlp.data.safetensors"),
        ],
        &["holds inputs, targets, which this model does not read; it reads only tokens"],
    );
    refused(
        &[
            "train",
            "--model",
            "gpt:vocab=16,ctx=4,d=16,layers=2,heads=2",
            "--steps",
            "1",
            "--data",
            &file("gpt.data.safetensors"),
        ],
        &["needs `tokens`: I64, I32 or U8 [n, 5]"],
    );
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = dir.path().join("model.safetensors");
    let (ckpt, out) = (ckpt.to_str().unwrap(), out.to_str().unwrap());
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        gpt,
        "--steps",
        "2",
        "--batch",
        "4",
        "--dp",
        "2",
        "--zero",
        "3",
        "--init",
        &file("gpt.init.safetensors"),
        "--data",
        &file("gpt.data.safetensors"),
        "--checkpoint-dir",
        ckpt,
    ]);
    assert!(ok, "{text}");
    let (ok, text) = archipelago(&["export", ckpt, "--out", out]);
    assert!(ok && text.contains("7232 parameters, step 2"), "{text}");
    // The export says what it holds: its metadata and a config.json beside it name the model
    // and the facts its weights cannot (heads, activation, LayerNorm ε).
    let file_meta = archipelago_actors::tensor_file::TensorFile::open(std::path::Path::new(out)).unwrap();
    assert_eq!(
        file_meta.meta().get("archipelago_model").map(String::as_str),
        Some(gpt)
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (config["n_head"].as_u64(), config["layer_norm_epsilon"].as_f64()),
        (Some(2), Some(1e-5))
    );
    let (ok, text) = archipelago(&["train", "--model", gpt, "--steps", "1", "--init", out]);
    assert!(ok, "{text}");
    // Weights of one gpt refused for another of the same shapes but other heads.
    let other = "gpt:vocab=16,ctx=8,d=16,layers=2,heads=4";
    refused(
        &["train", "--model", other, "--steps", "1", "--init", out],
        &["holds the weights of", "heads=2"],
    );
    refused(
        &["export", dir.path().to_str().unwrap(), "--out", out],
        &["no complete checkpoint"],
    );
}
