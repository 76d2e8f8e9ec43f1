//! Serve what was trained, on another layout (issue 42): a gpt trained at dp=2 × pp=2 with ZeRO-3
//! writes a sharded checkpoint; `serve --checkpoint DIR --tp 2` (and `--pp 2`) reads it
//! resharded to two tensor-parallel ranks (two pipeline stages) with no export step, and gives
//! the same greedy tokens and logits (1e-4) as the same weights exported (`archipelago export`)
//! and run on one device — in process (logits) and over HTTP (the same text as
//! `serve --init EXPORTED`).

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
