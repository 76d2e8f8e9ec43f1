//! Generation with a KV cache (issue 41): decoding one position a step over the cached keys and
//! values gives what recomputing the whole sequence gives (64 greedy tokens: the same tokens,
//! every step's logits within 1e-5) for gpt2 and gpt, and a decode that forgets the cache is
//! caught; the fixture's GPT-2 continues its prompt as `transformers`' greedy search does, with
//! and without the PEFT adapter (logits within 1e-4 at every step).

use std::path::{Path, PathBuf};

use archipelago_actors::block::initial_params;
use archipelago_actors::generate::argmax;
use archipelago_actors::inference::{WholeModel, read_weights};
use archipelago_actors::peft::read_config;
use archipelago_actors::tensor_file::TensorFile;
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::family::gpt2_from_config;
use archipelago_integration_tests::{MARGIN, assert_caught};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/gpt2")
        .join(name)
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// `spec` with its seeded initial weights (`seed`).
fn seeded(spec: &str, seed: u64) -> WholeModel {
    let spec = ModelSpec::parse(spec).expect("spec");
    let values: Vec<Vec<f32>> = (spec.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, seed))
        .collect();
    WholeModel::load(&spec, &values).expect("the model")
}

/// The logits of the last of `ids`, the whole sequence computed again.
fn recomputed_last(model: &WholeModel, ids: &[u32], vocab: usize) -> Vec<f32> {
    let all = model.logits(ids, 1).expect("logits");
    all[all.len() - vocab..].to_vec()
}

#[test]
fn cached_decoding_equals_recomputing_the_sequence() {
    let prompt: Vec<u32> = vec![3, 17, 42, 5, 88, 61, 9, 30];
    for spec in [
        "gpt2:vocab=97,ctx=80,d=32,layers=2,heads=4",
        "gpt:vocab=97,ctx=80,d=32,layers=2,heads=4",
    ] {
        let model = seeded(spec, 11);
        let greedy = model.greedy(&prompt, 64).expect("greedy");
        let mut ids = prompt.clone();
        let mut worst = 0.0f32;
        for (token, cached) in greedy.tokens.iter().zip(&greedy.logits) {
            let whole = recomputed_last(&model, &ids, 97);
            worst = worst.max(max_difference(cached, &whole));
            assert_eq!(
                *token,
                argmax(&whole),
                "{spec}: the recomputed argmax after {ids:?}"
            );
            ids.push(*token);
        }
        eprintln!("{spec}: 64 cached steps, largest logit difference {worst:e}");
        assert!(worst <= 1e-5, "{spec}: cached logits differ by {worst:e}");

        // The control: decoding that keeps no keys or values (each new position sees itself
        // alone) is caught by the same comparison.
        let mut logits = model.extend(&mut model.start(), &prompt).expect("prefill");
        let mut ids = prompt.clone();
        let mut control = 0.0f32;
        for _ in 0..8 {
            let next = argmax(&logits[logits.len() - 97..]);
            ids.push(next);
            logits = model.extend(&mut model.start(), &[next]).expect("a step");
            control = control.max(max_difference(&logits, &recomputed_last(&model, &ids, 97)));
        }
        assert_caught(
            &format!("{spec}: a decode without its cache"),
            control as f64,
            1e-5,
            MARGIN,
        );
    }
}

/// The fixture's GPT-2 continues its prompt token for token as `transformers`' greedy search
/// (`scripts/gpt2_fixture.py`), each step's logits within 1e-4 of `transformers`' at that
/// position; with the PEFT adapter, as PEFT's model does.
#[test]
fn the_fixture_gpt2_continues_as_transformers_with_and_without_its_adapter() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    let config = std::fs::read_to_string(fixture("config.json")).unwrap();
    let base = gpt2_from_config(&serde_json::from_str(&config).unwrap()).unwrap();
    let adapted = (base.clone())
        .with_lora(read_config(&fixture("adapter")).unwrap())
        .unwrap();
    let file = TensorFile::open(&fixture("expected.safetensors")).unwrap();
    let prompt: Vec<u32> = (expected["prompt"].as_array().unwrap().iter())
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let vocab = base.get("vocab").unwrap();
    for (spec, adapter, ids, logits) in [
        (&base, None, "ids", "logits"),
        (
            &adapted,
            Some(fixture("adapter")),
            "lora_greedy_ids",
            "lora_greedy_logits",
        ),
    ] {
        let values = read_weights(spec, &fixture("model.safetensors"), adapter.as_deref()).unwrap();
        let model = WholeModel::load(spec, &values).unwrap();
        let want_ids: Vec<u32> = file.read_ints(ids).unwrap().iter().map(|&i| i as u32).collect();
        let want_logits = file.read_f32(logits).unwrap();
        let new = want_ids.len() - prompt.len();
        let greedy = model.greedy(&prompt, new).unwrap();
        assert_eq!(
            greedy.tokens,
            want_ids[prompt.len()..],
            "{spec}: the continuation"
        );
        let mut worst = 0.0f32;
        for (step, got) in greedy.logits.iter().enumerate() {
            let at = prompt.len() - 1 + step;
            worst = worst.max(max_difference(got, &want_logits[at * vocab..(at + 1) * vocab]));
        }
        eprintln!("{spec}: {new} tokens as transformers', largest logit difference {worst:e}");
        assert!(worst <= 1e-4, "{spec}: logits differ by {worst:e}");
    }
}
