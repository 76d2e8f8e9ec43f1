//! `train --lora-rank`: fine-tuning adapters on `transformers`' GPT-2 fixture from the command
//! line — the fine-tuning text's loss falls, `--lora-out` writes a PEFT directory that
//! `eval --lora-init` scores lower on that text than the base alone, and `export --merge-lora`
//! writes a plain model with the same loss — and bad LoRA input is
//! refused before launch with the fix: a target that matches no module (the modules listed), a
//! rank above min(d, k), `--lora-rank` without `--init`, an adapter directory of another shape, a
//! resume on another base file than the checkpoint's (its SHA-256 recorded).

mod common;

use common::{archipelago, eval_loss, fixture, refused};

const MODEL: &str = "gpt2:vocab=320,ctx=16,d=16,layers=2,heads=4";

#[test]
fn adapters_train_write_peft_files_and_bad_lora_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("fine-tune.txt");
    let line = "The quick brown fox jumps over the lazy dog. A single controller compiles one program.\n";
    std::fs::write(&text, line.repeat(30)).unwrap();
    let (text, init, tokenizer) = (
        text.display().to_string(),
        fixture("gpt2/model.safetensors"),
        fixture("tokenizer/tokenizer.json"),
    );
    let out_dir = dir.path().join("adapter").display().to_string();
    let lora = ["--lora-rank", "8", "--lora-targets", "c_attn,c_proj,c_fc"];
    let mut args = vec![
        "train",
        "--model",
        MODEL,
        "--init",
        &init,
        "--data",
        &text,
        "--tokenizer",
        &tokenizer,
    ];
    args.extend([
        "--steps",
        "60",
        "--batch",
        "8",
        "--optimizer",
        "adamw",
        "--lr",
        "0.05",
        "--lora-out",
        &out_dir,
    ]);
    args.extend(lora);
    let (ok, out) = archipelago(&args);
    assert!(ok, "{out}");
    assert!(out.contains("adapters written to"), "{out}");
    let base_args = [
        "eval",
        "--init",
        &init,
        "--data",
        &text,
        "--tokenizer",
        &tokenizer,
    ];
    let (ok, base) = archipelago(&base_args);
    assert!(ok, "{base}");
    let mut adapted_args = base_args.to_vec();
    adapted_args.extend(["--lora-init", &out_dir]);
    let (ok, adapted) = archipelago(&adapted_args);
    assert!(ok, "{adapted}");
    let (before, after) = (eval_loss(&base), eval_loss(&adapted));
    assert!(
        after < before - 0.3,
        "the fine-tuning text's loss falls: {before} → {after}"
    );
    assert!(
        adapted.contains("/lora:r=8,alpha=8,targets=c_attn+c_proj+c_fc"),
        "{adapted}"
    );
    // Merged into the base, the adapters give the same loss with no LoRA code.
    let merged = dir.path().join("merged/model.safetensors");
    std::fs::create_dir_all(merged.parent().unwrap()).unwrap();
    let merged = merged.display().to_string();
    let (ok, out) = archipelago(&[
        "export",
        "--merge-lora",
        "--init",
        &init,
        "--lora-init",
        &out_dir,
        "--out",
        &merged,
    ]);
    assert!(ok, "{out}");
    let (ok, from_merged) = archipelago(&[
        "eval",
        "--init",
        &merged,
        "--data",
        &text,
        "--tokenizer",
        &tokenizer,
    ]);
    assert!(ok, "{from_merged}");
    assert!(
        (eval_loss(&from_merged) - after).abs() < 1e-5,
        "{from_merged} against {after}"
    );
    assert!(from_merged.contains(&format!("eval {MODEL} ")), "{from_merged}");

    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            MODEL,
            "--data",
            &text,
            "--tokenizer",
            &tokenizer,
        ];
        args.extend(extra);
        args.into_iter().map(str::to_string).collect::<Vec<_>>()
    };
    let refused_with = |extra: &[&str], needles: &[&str]| {
        let args = train(extra);
        refused(&args.iter().map(String::as_str).collect::<Vec<_>>(), needles);
    };
    refused_with(
        &["--init", &init, "--lora-rank", "4", "--lora-targets", "q_proj"],
        &["`q_proj` matches no module", "c_attn, c_fc, c_proj"],
    );
    refused_with(
        &["--init", &init, "--lora-rank", "17"],
        &["above min(d_in, d_out) = 16", "at most 16"],
    );
    refused_with(
        &["--lora-rank", "4"],
        &["no --init gives them", "--lora-random-base"],
    );
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(
        format!("{out_dir}/adapter_model.safetensors"),
        other.join("adapter_model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(format!("{out_dir}/adapter_config.json")).unwrap();
    std::fs::write(
        other.join("adapter_config.json"),
        config.replace("\"r\": 8", "\"r\": 2"),
    )
    .unwrap();
    let other = other.display().to_string();
    refused_with(
        &["--init", &init, "--lora-init", &other],
        &["expected F32 [2, 16]", "does not fit"],
    );
    // Checkpoints hold the adapters and the base file's hash: a resume on another base is
    // refused naming both hashes; on the same base it goes on.
    let checkpoints = dir.path().join("ck").display().to_string();
    let first = train(&[
        "--init",
        &init,
        "--lora-rank",
        "2",
        "--steps",
        "2",
        "--checkpoint-dir",
        &checkpoints,
        "--checkpoint-every",
        "2",
    ]);
    let (ok, out) = archipelago(&first.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{out}");
    let other_base = dir.path().join("other-base.safetensors");
    let mut bytes = std::fs::read(&init).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&other_base, bytes).unwrap();
    let other_base = other_base.display().to_string();
    refused_with(
        &[
            "--init",
            &other_base,
            "--lora-rank",
            "2",
            "--steps",
            "4",
            "--resume",
            &checkpoints,
        ],
        &["the checkpoint's frozen base was", "resume with --init"],
    );
    let again = train(&[
        "--init",
        &init,
        "--lora-rank",
        "2",
        "--steps",
        "4",
        "--resume",
        &checkpoints,
        "--resume-override",
        "steps",
    ]);
    let (ok, out) = archipelago(&again.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{out}");
    // The model from transformers' config.json (--model-config) instead of --model.
    let (ok, out) = archipelago(&[
        "train",
        "--model-config",
        &fixture("gpt2/config.json"),
        "--init",
        &init,
        "--lora-rank",
        "2",
        "--steps",
        "1",
        "--data",
        &text,
        "--tokenizer",
        &tokenizer,
    ]);
    assert!(ok && out.contains(&format!("training {MODEL}/lora:r=2")), "{out}");
    // A seeded random base trains when asked for.
    let (ok, out) = archipelago(
        &train(&["--lora-rank", "2", "--lora-random-base", "--steps", "1"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(ok, "{out}");
}
