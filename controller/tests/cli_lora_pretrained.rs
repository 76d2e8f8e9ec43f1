//! The fine-tuning workflow from the command line on a model pretrained here: a gpt trains on
//! one text and is exported; LoRA adapters fine-tune it on another text (`--init` the export,
//! `--lora-out`); the new text's loss falls under `eval`, and `export --merge-lora` writes a plain
//! gpt whose loss is the adapted one's (1e-5), from the adapter directory or from the run's
//! checkpoint (whose plain export, lacking the base, is refused naming that merge).

mod common;

use common::{archipelago, eval_loss, refused};

#[test]
fn a_pretrained_gpt_fine_tunes_with_adapters_and_merges() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).display().to_string();
    let first = "A single controller compiles one program into a stream per device and checks it. ";
    let second = "Low-rank adapters learn B times A while the frozen base stays exactly as it was. ";
    std::fs::write(path("first.txt"), first.repeat(40)).unwrap();
    std::fs::write(path("second.txt"), second.repeat(40)).unwrap();
    let model = "gpt:vocab=256,ctx=16,d=32,layers=2,heads=2";
    let (ok, out) = archipelago(&[
        "train",
        "--model",
        model,
        "--data",
        &path("first.txt"),
        "--steps",
        "60",
        "--batch",
        "8",
        "--lr",
        "0.01",
        "--checkpoint-dir",
        &path("ck"),
        "--checkpoint-every",
        "60",
    ]);
    assert!(ok, "{out}");
    std::fs::create_dir_all(path("base")).unwrap();
    let base = path("base/model.safetensors");
    let (ok, out) = archipelago(&["export", &path("ck"), "--out", &base]);
    assert!(ok, "{out}");
    let (ok, out) = archipelago(&[
        "train",
        "--model",
        model,
        "--init",
        &base,
        "--data",
        &path("second.txt"),
        "--steps",
        "60",
        "--batch",
        "8",
        "--lr",
        "0.01",
        "--lora-rank",
        "8",
        "--lora-targets",
        "qkv,proj,fc1,fc2",
        "--lora-out",
        &path("adapter"),
    ]);
    assert!(ok, "{out}");
    let second_text = path("second.txt");
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", "--data", second_text.as_str()];
        args.extend(extra);
        let (ok, out) = archipelago(&args);
        assert!(ok, "{out}");
        eval_loss(&out)
    };
    let before = eval(&["--init", &base]);
    let after = eval(&["--init", &base, "--lora-init", &path("adapter")]);
    assert!(
        after < before - 0.5,
        "the second text's loss falls: {before} → {after}"
    );
    std::fs::create_dir_all(path("merged")).unwrap();
    let merged = path("merged/model.safetensors");
    let (ok, out) = archipelago(&[
        "export",
        "--merge-lora",
        "--init",
        &base,
        "--lora-init",
        &path("adapter"),
        "--out",
        &merged,
    ]);
    assert!(ok, "{out}");
    let from_merged = eval(&["--init", &merged]);
    assert!(
        (from_merged - after).abs() < 1e-5,
        "merged {from_merged} against adapted {after}"
    );
    // The run's checkpoints (beside --lora-out) hold the adapters, not the base: a plain export
    // is refused with the merge to run instead, and that merge gives the same model.
    let checkpoints = path("adapter-checkpoints");
    let merged_again = path("merged/again.safetensors");
    refused(
        &["export", &checkpoints, "--out", &merged_again],
        &["a LoRA run's", "--merge-lora --init BASE.safetensors"],
    );
    let (ok, out) = archipelago(&[
        "export",
        &checkpoints,
        "--merge-lora",
        "--init",
        &base,
        "--out",
        &merged_again,
    ]);
    assert!(ok, "{out}");
    let again = eval(&["--init", &merged_again]);
    assert!(
        (again - from_merged).abs() < 1e-6,
        "{again} against {from_merged}"
    );
}
