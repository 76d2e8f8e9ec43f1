//! Serve what was trained, on another layout (issue 42): a gpt trained at dp=2 × pp=2 with ZeRO-3
//! writes a sharded checkpoint; `serve --checkpoint DIR --tp 2` (and `--pp 2`) reads it
//! resharded to two tensor-parallel ranks (two pipeline stages) with no export step, and gives
//! the same greedy tokens and logits (1e-4) as the same weights exported (`archipelago export`)
//! and run on one device — in process (logits) and over HTTP (the same text as
//! `serve --init EXPORTED`). A LoRA run's checkpoint serves the same way, its adapters on the
//! base file it records, as its merged export does.

mod common;

use std::path::PathBuf;

use serde_json::json;

use archipelago_actors::inference::WholeModel;
use archipelago_actors::inference_sharded::{Layout, ShardedModel};
use archipelago_controller::weight_args::WeightArgs;

use common::{BIN, archipelago, wait_for_line};

const GPT: &str = "gpt:vocab=256,ctx=32,d=32,layers=2,heads=4";

fn weights(init: Option<PathBuf>, checkpoint: Option<PathBuf>) -> WeightArgs {
    WeightArgs {
        model: init.as_ref().map(|_| GPT.to_string()),
        init,
        checkpoint,
        lora_init: None,
    }
}

/// `archipelago serve` with `args`; the process and its address.
fn serve(args: &[&str]) -> (common::Proc, String) {
    let mut child = std::process::Command::new(BIN)
        .arg("serve")
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--cache-tokens", "256"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let line = wait_for_line(&mut child, "listening on http://");
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    (common::Proc(child), addr.to_string())
}

/// The greedy completion's text of `prompt` at `addr`.
fn complete(addr: &str, prompt: &[u32]) -> String {
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0});
    let (status, answer) = common::post_json(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{answer}");
    answer["choices"][0]["text"]
        .as_str()
        .expect("a completion")
        .to_string()
}

#[test]
fn a_checkpoint_trained_at_dp2_pp2_zero3_serves_at_tp2_and_pp2_as_its_export_on_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, out) = (dir.path().join("ckpt"), dir.path().join("model.safetensors"));
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        GPT,
        "--steps",
        "3",
        "--batch",
        "8",
        "--dp",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--zero",
        "3",
        "--lr",
        "0.01",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(ok, "{text}");
    let (ok, text) = archipelago(&["export", ckpt.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(ok, "{text}");

    let (spec, trained, _) = weights(None, Some(ckpt.clone())).load().unwrap();
    let (_, exported, _) = weights(Some(out.clone()), None).load().unwrap();
    let one = WholeModel::load(&spec, &exported).unwrap();
    let prompt = [5, 17, 33, 2, 60, 41];
    let want = one.greedy(&prompt, 12).unwrap();
    for layout in [Layout { tp: 2, pp: 1 }, Layout { tp: 1, pp: 2 }] {
        let sharded = ShardedModel::load(&spec, &trained, layout).unwrap();
        let archipelago_actors::generate::Greedy { tokens, logits } = sharded.greedy(&prompt, 12).unwrap();
        assert_eq!((want.logits.len(), logits.len()), (12, 12));
        assert!(logits.iter().chain(&want.logits).all(|row| row.len() == 256));
        let mut worst = 0.0f32;
        for (i, (w, g)) in want.logits.iter().zip(&logits).enumerate() {
            worst = w.iter().zip(g).fold(worst, |m, (a, b)| m.max((a - b).abs()));
            let mut sorted = w.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 1e-3 {
                assert_eq!(tokens[i], want.tokens[i], "token {i} at {layout}");
            }
        }
        eprintln!("checkpoint at {layout} against its export on one device: logits {worst:.2e}");
        assert!(worst < 1e-4, "{layout}: {worst}");
    }
    // Trained weights, not a fresh model's: the export differs from a seed-0 start.
    let fresh = WholeModel::load(&spec, &initial(&spec))
        .unwrap()
        .greedy(&prompt, 1)
        .unwrap();
    assert!(
        (fresh.logits[0][0] - want.logits[0][0]).abs() > 1e-6,
        "the checkpoint holds untrained weights"
    );

    let (_one_server, one_addr) = serve(&["--init", out.to_str().unwrap(), "--model", GPT]);
    let want = complete(&one_addr, &prompt);
    for layout in [["--tp", "2"], ["--pp", "2"]] {
        let (_server, addr) = serve(&[&["--checkpoint", ckpt.to_str().unwrap()][..], &layout].concat());
        assert_eq!(complete(&addr, &prompt), want, "served at {layout:?}");
    }
}

fn initial(spec: &archipelago_dataflow::ModelSpec) -> Vec<Vec<f32>> {
    (spec.desc().blocks.iter())
        .map(|b| archipelago_actors::block::initial_params(&b.param_descs, 0))
        .collect()
}

/// A LoRA run's checkpoint (adapters on `transformers`' GPT-2 fixture, trained at dp=2 × pp=2
/// with ZeRO-3) serves at tp=2 and at pp=2 with no export step — its adapters from the
/// checkpoint, the base from the file it records — as the merged export does on one device:
/// the same greedy tokens, logits within 1e-4, the same text over HTTP; a base whose SHA-256 is
/// not the recorded one is refused.
#[test]
fn a_lora_runs_checkpoint_serves_at_tp2_and_pp2_as_its_merged_export() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, merged) = (dir.path().join("ckpt"), dir.path().join("merged.safetensors"));
    let base = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../integration-tests/fixtures/gpt2/model.safetensors"
    );
    let model = "gpt2:vocab=320,ctx=16,d=16,layers=2,heads=4";
    let (ok, text) = archipelago(&[
        "train",
        "--model",
        model,
        "--init",
        base,
        "--lora-rank",
        "2",
        "--lora-targets",
        "c_attn,c_proj",
        "--dp",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--zero",
        "3",
        "--steps",
        "3",
        "--batch",
        "8",
        "--lr",
        "0.05",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(ok, "{text}");
    let (ok, text) = archipelago(&[
        "export",
        ckpt.to_str().unwrap(),
        "--merge-lora",
        "--init",
        base,
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");

    let (spec, adapted, source) = weights(None, Some(ckpt.clone())).load().unwrap();
    assert!(
        spec.lora().is_some() && source.contains("(adapters) on"),
        "{spec} from {source}"
    );
    let merged_args = WeightArgs {
        model: Some(model.to_string()),
        init: Some(merged.clone()),
        checkpoint: None,
        lora_init: None,
    };
    let (base_spec, merged_values, _) = merged_args.load().unwrap();
    let prompt = [5, 17, 33, 2];
    let want = WholeModel::load(&base_spec, &merged_values)
        .unwrap()
        .greedy(&prompt, 12)
        .unwrap();
    for layout in [Layout { tp: 2, pp: 1 }, Layout { tp: 1, pp: 2 }] {
        let sharded = ShardedModel::load(&spec, &adapted, layout).unwrap();
        let got = sharded.greedy(&prompt, 12).unwrap();
        assert_eq!(got.logits.len(), 12);
        let mut worst = 0.0f32;
        for (i, (w, g)) in want.logits.iter().zip(&got.logits).enumerate() {
            assert_eq!(w.len(), g.len());
            worst = w.iter().zip(g).fold(worst, |m, (a, b)| m.max((a - b).abs()));
            let mut sorted = w.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 1e-3 {
                assert_eq!(got.tokens[i], want.tokens[i], "token {i} at {layout}");
            }
        }
        eprintln!("LoRA checkpoint at {layout} against its merged export on one device: logits {worst:.2e}");
        assert!(worst < 1e-4, "{layout}: {worst}");
    }
    // The adapters moved the model: the base alone answers otherwise.
    let base_args = WeightArgs {
        init: Some(base.into()),
        ..merged_args
    };
    let (_, base_values, _) = base_args.load().unwrap();
    let alone = WholeModel::load(&base_spec, &base_values)
        .unwrap()
        .greedy(&prompt, 1)
        .unwrap();
    assert!(
        (alone.logits[0][0] - want.logits[0][0]).abs() > 1e-6,
        "the adapters changed nothing"
    );

    let (_one_server, one_addr) = serve(&["--init", merged.to_str().unwrap(), "--model", model]);
    let want = complete(&one_addr, &prompt);
    for layout in [["--tp", "2"], ["--pp", "2"]] {
        let (_server, addr) = serve(&[&["--checkpoint", ckpt.to_str().unwrap()][..], &layout].concat());
        assert_eq!(
            complete(&addr, &prompt),
            want,
            "LoRA checkpoint served at {layout:?}"
        );
    }
    let other = dir.path().join("other.safetensors");
    let mut bytes = std::fs::read(base).unwrap();
    bytes.push(0);
    std::fs::write(&other, bytes).unwrap();
    let wrong = WeightArgs {
        init: Some(other),
        ..weights(None, Some(ckpt))
    };
    let refused = wrong.load().unwrap_err();
    assert!(
        refused.contains("adapters were trained on") && refused.contains("SHA-256"),
        "{refused}"
    );
}
