//! The PyTorch fixture (`integration-tests/fixtures/torch/`, written by
//! `scripts/torch_reference.py --fixture`): its files, the program that trains the same in
//! archipelago (`--init`, `--data`, the same optimizer flags), safetensors files read with the
//! `safetensors` crate, and the element-wise comparison of two sets of named weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use archipelago_controller::TrainOptions;
use archipelago_controller::export::export;
use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::{
    LrDecay, LrSchedule, ModelSpec, OptimizerSpec, ParallelPlan, ParamGroups, Program,
};
use safetensors::{Dtype, SafeTensors};

/// The fixture's directory.
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/torch")
}

/// A file of the fixture.
pub fn fixture_file(name: &str) -> PathBuf {
    fixture_dir().join(name)
}

/// `expected.json`: PyTorch's runs.
pub fn expected() -> serde_json::Value {
    let path = fixture_file("expected.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("expected.json")
}

/// Named f32 tensors: shape and values.
pub type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Every tensor of a safetensors file (all must be f32), read with the `safetensors` crate.
pub fn read_weights(path: &Path) -> Weights {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32, "{name} in {}", path.display());
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// Writes named f32 tensors as a safetensors file.
pub fn write_weights(path: &Path, weights: &Weights) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(n, (s, v))| {
            (
                n.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).expect("a view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write weights");
}

/// The program of fixture model `model` (`mlp` or `gpt`) under optimizer run `run` (`sgd` or
/// `adamw`), starting from `init` on the fixture's batches, laid out as `layout` (its batch is
/// replaced by the fixture's).
pub fn fixture_program(model: &str, run: &str, init: &Path, layout: ParallelPlan) -> Program {
    fixture_program_in(&fixture_dir(), &expected(), model, run, init, layout)
}

/// [`fixture_program`] of a fixture in `dir` whose PyTorch runs are `expected` (the GPT-2
/// fixture's `training.json` has the same form).
pub fn fixture_program_in(
    dir: &Path,
    expected: &serde_json::Value,
    model: &str,
    run: &str,
    init: &Path,
    layout: ParallelPlan,
) -> Program {
    let m = &expected["models"][model];
    let flags = &m["runs"][run]["flags"];
    let steps = expected["steps"].as_u64().expect("steps");
    let num = |key: &str| flags[key].as_f64().map(|v| v as f32);
    let mut optimizer = OptimizerSpec::named(
        flags["optimizer"].as_str().expect("optimizer"),
        num("lr").expect("lr"),
    )
    .expect("optimizer");
    if let Some(wd) = num("weight_decay") {
        optimizer = optimizer.with_weight_decay(wd);
    }
    let decay: LrDecay = flags["lr_schedule"]
        .as_str()
        .unwrap_or("constant")
        .parse()
        .expect("schedule");
    let schedule = LrSchedule {
        warmup_steps: flags["warmup_steps"].as_u64().unwrap_or(0),
        decay,
        total_steps: steps,
        final_fraction: num("lr_final_fraction").unwrap_or(1.0),
    };
    let spec = ModelSpec::parse(m["spec"].as_str().expect("spec")).expect("spec");
    let mut program = Program::new(spec)
        .with_optimizer(optimizer)
        .with_lr_schedule(schedule)
        .with_clip_grad_norm(num("clip_grad_norm"))
        .with_param_groups(ParamGroups::NoDecayForVectors)
        .with_plan(ParallelPlan {
            batch: m["batch"].as_u64().expect("batch") as usize,
            ..layout
        });
    program.init = Some(init.display().to_string());
    program.data = DataSpec::TensorFile {
        path: dir
            .join(format!("{model}.data.safetensors"))
            .display()
            .to_string(),
    };
    program
}

/// Trains `program` for `steps` steps, checkpointing after the last, and exports that checkpoint
/// to `out`; returns the report.
pub fn train_and_export(program: &Program, steps: u64, out: &Path) -> archipelago_controller::TrainReport {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = TrainOptions {
        keep_params: true,
        steps,
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: steps,
        ..TrainOptions::default()
    };
    let report = crate::train_program(program, &options);
    export(dir.path(), out).unwrap_or_else(|e| panic!("export: {e}"));
    report
}

/// Largest element-wise excess of `run` over `allclose(reference, rtol, atol)` (≤ 1 passes) and
/// the largest absolute difference, over every tensor; `tolerance(name, index)` gives each
/// element's `(rtol, atol)`. The two must hold the same names and shapes.
pub fn weights_excess(
    reference: &Weights,
    run: &Weights,
    tolerance: impl Fn(&str, usize) -> (f64, f64),
) -> (f64, f64) {
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        run.keys().collect::<Vec<_>>(),
        "tensor names"
    );
    let (mut excess, mut abs) = (0.0f64, 0.0f64);
    for (name, (shape, values)) in reference {
        let (run_shape, run_values) = &run[name];
        assert_eq!(shape, run_shape, "{name}");
        for (i, (&x, &y)) in values.iter().zip(run_values).enumerate() {
            let (rtol, atol) = tolerance(name, i);
            let d = (x as f64 - y as f64).abs();
            abs = abs.max(d);
            excess = excess.max(d / (atol + rtol * (x as f64).abs()));
        }
    }
    (excess, abs)
}

/// How far a run is from PyTorch's: each an excess over its tolerance (≤ 1 passes).
#[derive(Debug)]
pub struct TorchComparison {
    /// Parameters, element by element.
    pub param_excess: f64,
    /// The largest absolute parameter difference.
    pub param_abs: f64,
    /// Every step's loss, learning rate and (when clipping) gradient norm.
    pub figures_excess: f64,
}

/// Trains `program` as the fixture's run `run` of `model` (as many steps as PyTorch ran) and
/// compares it with PyTorch's `torch` record (`expected.json`) and final weights: every step's
/// loss (SGD 1e-5, AdamW 1e-4 relative), learning rate (1e-6) and, when clipping, gradient norm
/// (1e-4); the parameters element by element, SGD's within 1e-5 relative (with a floor of 1e-5 of
/// the model's largest element for elements near zero), AdamW's as allclose(rtol 1e-4,
/// atol 1e-3·lr) but for the key bias (below).
pub fn compare_with_torch(
    program: &Program,
    model: &str,
    run: &str,
    torch: &serde_json::Value,
) -> TorchComparison {
    compare_with_torch_in(&fixture_dir(), program, model, run, torch)
}

/// [`compare_with_torch`] against the final weights of a fixture in `dir`.
pub fn compare_with_torch_in(
    dir: &Path,
    program: &Program,
    model: &str,
    run: &str,
    torch: &serde_json::Value,
) -> TorchComparison {
    let reference = read_weights(&dir.join(format!("{model}.{run}.final.safetensors")));
    let out = tempfile::tempdir().expect("temp dir");
    let file = out.path().join("final.safetensors");
    let sgd = torch["flags"]["optimizer"] == "sgd";
    let lr = torch["flags"]["lr"].as_f64().expect("lr");
    let series = |key: &str| -> Vec<f64> {
        torch[key]
            .as_array()
            .expect(key)
            .iter()
            .map(|v| v.as_f64().expect(key))
            .collect()
    };
    let steps = series("losses").len();
    let report = train_and_export(program, steps as u64, &file);
    let loss_rtol = if sgd { 1e-5 } else { 1e-4 };
    let mut figures_excess = 0.0f64;
    let mut excess = |ours: f64, theirs: f64, rtol: f64| {
        figures_excess = figures_excess.max((ours - theirs).abs() / (rtol * theirs.abs()));
    };
    assert_eq!(report.steps.len(), steps);
    for ((s, loss), (rate, norm)) in report
        .steps
        .iter()
        .zip(series("losses"))
        .zip(series("lrs").into_iter().zip(series("grad_norms")))
    {
        excess(s.loss as f64, loss, loss_rtol);
        excess(s.lr.expect("the rate is reported") as f64, rate, 1e-6);
        if let Some(n) = s.grad_norm {
            excess(n as f64, norm, 1e-4);
        }
    }
    let weights = read_weights(&file);
    let largest = reference
        .values()
        .flat_map(|(_, v)| v)
        .fold(0.0f64, |m, &x| m.max((x as f64).abs()));
    // The key bias (the middle third of `qkv.bias`, GPT-2's `c_attn.bias`) has a gradient of exactly zero in exact
    // arithmetic (softmax is shift-invariant: q·b_k adds the same to every key's score), so both
    // sides move it by rounding noise alone, which Adam scales to steps of up to ±lr: under AdamW
    // its elements are held only to that bound, twice the sum of the rates.
    let noise_bound = 2.0 * series("lrs").iter().sum::<f64>();
    let key_bias = |name: &str, i: usize| {
        let len = reference[name].1.len();
        (name.ends_with("qkv.bias") || name.ends_with("c_attn.bias")) && (len / 3..2 * len / 3).contains(&i)
    };
    let (param_excess, param_abs) = weights_excess(&reference, &weights, |name, i| {
        if sgd {
            (1e-5, 1e-5 * largest)
        } else if key_bias(name, i) {
            (0.0, noise_bound)
        } else {
            (1e-4, 1e-3 * lr)
        }
    });
    TorchComparison {
        param_excess,
        param_abs,
        figures_excess,
    }
}
