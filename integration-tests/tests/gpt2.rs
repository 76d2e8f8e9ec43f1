//! GPT-2 against `transformers` (issue 40): the fixture of `scripts/gpt2_fixture.py` (a tiny
//! random `GPT2LMHeadModel`, its weights as `save_pretrained`, a bare `GPT2Model` state dict and
//! a full state dict with the tied head and mask buffers write them, token ids, the model's
//! logits) read by `--init`'s reader; archipelago's logits match to 1e-4 and give the same greedy
//! continuation, its evaluation of a tokenized text gives `transformers`' loss, and what it
//! writes reads back. Negative controls: the erf GELU in place of the tanh one, an untied head,
//! a key the model lacks and a misshapen tensor are caught.

use std::path::{Path, PathBuf};

use archipelago_actors::inference::{WholeModel, read_weights};
use archipelago_actors::tensor_file::TensorFile;
use archipelago_actors::weights_file::write_weights;
use archipelago_actors::zoo::{self, BuildContext, Gelu, MlpHalf};
use archipelago_actors::{CpuBackend, block::Block};
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::family::gpt2_from_config;
use archipelago_integration_tests::torch_fixture::{
    Weights, read_weights as read_file, write_weights as write_file,
};
use burn::backend::flex::FlexDevice;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/gpt2")
        .join(name)
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("expected.json")).expect("expected.json");
    serde_json::from_str(&text).expect("expected.json")
}

/// The model of the fixture's `config.json`.
fn spec() -> ModelSpec {
    let text = std::fs::read_to_string(fixture("config.json")).expect("config.json");
    gpt2_from_config(&serde_json::from_str(&text).expect("config.json")).expect("a gpt2 config")
}

/// The fixture's ids and `transformers`' logits for them (`logits` or `lora_logits`).
fn ids_and_logits(which: &str) -> (Vec<u32>, Vec<f32>) {
    let file = TensorFile::open(&fixture("expected.safetensors")).expect("expected.safetensors");
    let ids = file
        .read_ints("ids")
        .expect("ids")
        .iter()
        .map(|&i| i as u32)
        .collect();
    (ids, file.read_f32(which).expect(which))
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Whether each position from the prompt's last on predicts (top-1) the token after it.
fn greedy_holds(logits: &[f32], ids: &[u32], vocab: usize, prompt: usize) -> bool {
    (prompt - 1..ids.len() - 1).all(|p| {
        let row = &logits[p * vocab..(p + 1) * vocab];
        let top = (0..vocab).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
        top == ids[p + 1] as usize
    })
}

#[test]
fn the_config_json_gives_the_fixtures_model() {
    let want = expected()["spec"].as_str().unwrap().to_string();
    assert_eq!(spec().explicit(), want);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("config.json")).unwrap()).unwrap();
    config["activation_function"] = "relu".into();
    let err = gpt2_from_config(&config).unwrap_err();
    assert!(
        err.contains("`activation_function`") && err.contains("gelu_new"),
        "{err}"
    );
    config["activation_function"] = "gelu_new".into();
    config["scale_attn_by_inverse_layer_idx"] = true.into();
    let err = gpt2_from_config(&config).unwrap_err();
    assert!(err.contains("`scale_attn_by_inverse_layer_idx`"), "{err}");
}

/// Every form of the file gives `transformers`' logits (1e-4) and its greedy continuation.
#[test]
fn logits_match_transformers_for_every_file_form() {
    let (spec, e) = (spec(), expected());
    let (ids, want) = ids_and_logits("logits");
    let (vocab, prompt) = (spec.get("vocab").unwrap(), e["prompt"].as_array().unwrap().len());
    assert_eq!(
        ids.iter().map(|&i| i as u64).collect::<Vec<_>>(),
        e["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect::<Vec<_>>()
    );
    for form in ["model.safetensors", "bare.safetensors", "full.safetensors"] {
        let model = WholeModel::from_file(&spec, &fixture(form)).unwrap_or_else(|e| panic!("{form}: {e}"));
        let got = model.logits(&ids, 1).unwrap();
        let difference = max_difference(&got, &want);
        assert!(difference < 1e-4, "{form}: logits differ by {difference}");
        assert!(
            greedy_holds(&got, &ids, vocab, prompt),
            "{form}: another greedy continuation"
        );
    }
}

/// Negative control: the exact (erf) GELU in GPT-2's MLP moves the logits past the tolerance.
#[test]
fn the_erf_gelu_is_caught() {
    let spec = spec();
    let (ids, want) = ids_and_logits("logits");
    let values = read_weights(&spec, &fixture("model.safetensors"), None).unwrap();
    let gpt2 = zoo::builder::<CpuBackend>("gpt2").unwrap();
    let d = spec.get("d").unwrap();
    let erf = |ctx: &BuildContext| -> Box<dyn Block<CpuBackend>> {
        let mlp_half =
            ctx.block > 0 && ctx.block.is_multiple_of(2) && ctx.block < spec.desc().blocks.len() - 1;
        if mlp_half {
            Box::new(MlpHalf::<CpuBackend>::sliced(d, ctx.tp, Gelu::Erf, &FlexDevice))
        } else {
            gpt2(ctx, &spec, &FlexDevice)
        }
    };
    let model = WholeModel::load_built(&spec, &values, &erf).unwrap();
    let difference = max_difference(&model.logits(&ids, 1).unwrap(), &want);
    assert!(difference > 1e-4, "the erf GELU went unseen ({difference})");
}

/// A copy of the fixture's full file, changed by `change`.
fn changed_file(dir: &Path, change: impl FnOnce(&mut Weights)) -> PathBuf {
    let mut weights = read_file(&fixture("full.safetensors"));
    change(&mut weights);
    let path = dir.join("changed.safetensors");
    write_file(&path, &weights);
    path
}

/// An untied head, a key the model lacks and a misshapen tensor are refused, naming them.
#[test]
fn files_that_are_not_this_gpt2_are_refused() {
    let (spec, dir) = (spec(), tempfile::tempdir().unwrap());
    let untied = changed_file(dir.path(), |w| w.get_mut("lm_head.weight").unwrap().1[7] += 0.5);
    let err = WholeModel::from_file(&spec, &untied).err().unwrap();
    assert!(
        err.contains("`lm_head.weight` differs from `transformer.wte.weight` (element 7"),
        "{err}"
    );
    let extra = changed_file(dir.path(), |w| {
        w.insert(
            "transformer.h.0.mlp.c_gate.weight".into(),
            (vec![2], vec![0.0, 1.0]),
        );
    });
    let err = WholeModel::from_file(&spec, &extra).err().unwrap();
    assert!(
        err.contains("not parameters of this model: transformer.h.0.mlp.c_gate.weight"),
        "{err}"
    );
    // `c_attn` stored as `nn.Linear` would (`[out, in]`) rather than `Conv1D`'s `[in, out]`.
    let transposed = changed_file(dir.path(), |w| {
        let (shape, _) = w.get_mut("transformer.h.1.attn.c_attn.weight").unwrap();
        shape.reverse();
    });
    let err = WholeModel::from_file(&spec, &transposed).err().unwrap();
    assert!(
        err.contains("`transformer.h.1.attn.c_attn.weight` is F32 [48, 16], expected F32 [16, 48]"),
        "{err}"
    );
}

/// `archipelago eval`'s loss of the tokenized text equals `transformers`' (windows of ctx
/// inputs every ctx tokens).
#[test]
fn evaluation_gives_transformers_loss() {
    let (spec, e) = (spec(), expected());
    let tokenizer = fixture("../tokenizer/tokenizer.json");
    let stream = archipelago_actors::text_tokens::text_stream(
        fixture("eval.txt").to_str().unwrap(),
        Some(tokenizer.to_str().unwrap()),
        spec.get("ctx").unwrap(),
        spec.get("vocab").unwrap(),
    )
    .unwrap();
    let ids = stream.ids();
    assert_eq!(ids.len() as u64, e["eval"]["ids"].as_u64().unwrap());
    let model = WholeModel::from_file(&spec, &fixture("model.safetensors")).unwrap();
    let got = model.evaluate(ids).unwrap();
    let want = e["eval"]["loss"].as_f64().unwrap();
    assert_eq!(got.predicted, ids.len() - 1);
    assert!((got.loss - want).abs() < 1e-5, "loss {} against {want}", got.loss);
    assert!((got.perplexity - e["eval"]["perplexity"].as_f64().unwrap()).abs() < 1e-2);
}

/// What `export` writes for a gpt2 is `save_pretrained`'s layout: prefixed keys, no `lm_head`,
/// the same tensors; it reads back to the same logits.
#[test]
fn written_weights_are_transformers_layout_and_read_back() {
    let spec = spec();
    let values = read_weights(&spec, &fixture("bare.safetensors"), None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model.safetensors");
    write_weights(&out, &spec, &values).unwrap();
    let (written, saved) = (read_file(&out), read_file(&fixture("model.safetensors")));
    assert_eq!(
        written, saved,
        "the export differs from save_pretrained's tensors"
    );
    let (ids, want) = ids_and_logits("logits");
    let model = WholeModel::from_file(&spec, &out).unwrap();
    assert!(max_difference(&model.logits(&ids, 1).unwrap(), &want) < 1e-4);
    let config = spec.config();
    assert_eq!(
        (
            config["model_type"].as_str(),
            config["tie_word_embeddings"].as_bool()
        ),
        (Some("gpt2"), Some(true))
    );
    assert_eq!(gpt2_from_config(&config).unwrap(), spec);
}
