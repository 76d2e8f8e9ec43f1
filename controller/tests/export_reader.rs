//! An export read the way a PyTorch or Hugging Face user reads one: from the file alone. The
//! reader here takes the architecture from `config.json` (width, layers, heads, inner width,
//! LayerNorm ε, activation, tying), derives every tensor's PyTorch name and shape from it, checks
//! the file holds exactly those, and runs its own forward (f64, written from GPT-2's definition,
//! sharing no code with the runtime) on a batch. Its loss must equal archipelago's own loss of
//! the same weights on the same batch (`train --init` with a zero learning rate). A reader that
//! guessed the head count instead of reading it (the weights' shapes do not show it) gets another
//! loss: the negative control.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use archipelago_actors::tensor_file::TensorFile;

const SPEC: &str = "gpt:vocab=16,ctx=8,d=16,layers=2,heads=2";
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../integration-tests/fixtures/torch");

fn archipelago(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_archipelago"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "archipelago {args:?}:\n{text}");
    text
}

/// What the reader takes from `config.json`.
#[derive(Debug, Clone, Copy)]
struct Config {
    vocab: usize,
    ctx: usize,
    d: usize,
    layers: usize,
    heads: usize,
    inner: usize,
    eps: f64,
}

impl Config {
    fn read(path: &Path) -> Config {
        let c: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let n = |k: &str| {
            c[k].as_u64()
                .unwrap_or_else(|| panic!("config.json lacks {k}: {c}")) as usize
        };
        assert_eq!(c["family"], "gpt");
        assert_eq!(c["activation_function"], "gelu (exact, erf)");
        assert_eq!(c["tie_word_embeddings"], false);
        assert_eq!(c["head_bias"], false);
        Config {
            vocab: n("vocab_size"),
            ctx: n("n_positions"),
            d: n("n_embd"),
            layers: n("n_layer"),
            heads: n("n_head"),
            inner: n("n_inner"),
            eps: c["layer_norm_epsilon"].as_f64().unwrap(),
        }
    }

    /// Every tensor's PyTorch name and shape, as the architecture implies them.
    fn tensors(&self) -> BTreeMap<String, Vec<usize>> {
        let (d, i) = (self.d, self.inner);
        let mut out = BTreeMap::from([
            ("tok.weight".to_string(), vec![self.vocab, d]),
            ("pos.weight".to_string(), vec![self.ctx, d]),
            ("ln_f.weight".to_string(), vec![d]),
            ("ln_f.bias".to_string(), vec![d]),
            ("head.weight".to_string(), vec![self.vocab, d]),
        ]);
        for l in 0..self.layers {
            for (name, shape) in [
                ("ln1.weight", vec![d]),
                ("ln1.bias", vec![d]),
                ("qkv.weight", vec![3 * d, d]),
                ("qkv.bias", vec![3 * d]),
                ("proj.weight", vec![d, d]),
                ("proj.bias", vec![d]),
                ("ln2.weight", vec![d]),
                ("ln2.bias", vec![d]),
                ("fc1.weight", vec![i, d]),
                ("fc1.bias", vec![i]),
                ("fc2.weight", vec![d, i]),
                ("fc2.bias", vec![d]),
            ] {
                out.insert(format!("layers.{l}.{name}"), shape);
            }
        }
        out
    }
}

/// The weights, by name, as f64.
struct Weights(BTreeMap<String, Vec<f64>>);

impl Weights {
    fn w(&self, name: &str) -> &[f64] {
        &self.0[name]
    }
}

/// `x · Wᵀ + b` for rows of `x` (`[n, in]`), `W` `[out, in]` as nn.Linear holds it.
fn linear(x: &[Vec<f64>], w: &[f64], b: Option<&[f64]>, out: usize) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            (0..out)
                .map(|o| {
                    let dot: f64 = row.iter().zip(&w[o * row.len()..]).map(|(a, b)| a * b).sum();
                    dot + b.map_or(0.0, |b| b[o])
                })
                .collect()
        })
        .collect()
}

fn layer_norm(x: &[Vec<f64>], g: &[f64], b: &[f64], eps: f64) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            let n = row.len() as f64;
            let mean = row.iter().sum::<f64>() / n;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            (row.iter().enumerate())
                .map(|(i, v)| (v - mean) / (var + eps).sqrt() * g[i] + b[i])
                .collect()
        })
        .collect()
}

/// erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7).
fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let poly =
        t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    (1.0 - poly * (-x * x).exp()).copysign(x)
}

/// Causal multi-head attention of one sequence's `qkv` rows (`[t, 3d]`, `[q | k | v]`).
fn attention(qkv: &[Vec<f64>], d: usize, heads: usize) -> Vec<Vec<f64>> {
    let (t, hd) = (qkv.len(), d / heads);
    let mut y = vec![vec![0.0; d]; t];
    for h in 0..heads {
        for i in 0..t {
            let q = &qkv[i][h * hd..(h + 1) * hd];
            let scores: Vec<f64> = (0..=i)
                .map(|j| {
                    let k = &qkv[j][d + h * hd..d + (h + 1) * hd];
                    q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::MIN, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            for (j, e) in exps.iter().enumerate() {
                for c in 0..hd {
                    y[i][h * hd + c] += e / sum * qkv[j][2 * d + h * hd + c];
                }
            }
        }
    }
    y
}

/// Mean next-token cross-entropy of `rows` (each `ctx + 1` tokens) under the model `c` describes.
fn loss(c: &Config, w: &Weights, rows: &[Vec<usize>]) -> f64 {
    let (d, mut total, mut count) = (c.d, 0.0, 0);
    for row in rows {
        let (inputs, targets) = (&row[..c.ctx], &row[1..]);
        let mut x: Vec<Vec<f64>> = (inputs.iter().enumerate())
            .map(|(p, &t)| {
                (0..d)
                    .map(|k| w.w("tok.weight")[t * d + k] + w.w("pos.weight")[p * d + k])
                    .collect()
            })
            .collect();
        for l in 0..c.layers {
            let p = |n: &str| format!("layers.{l}.{n}");
            let h = layer_norm(&x, w.w(&p("ln1.weight")), w.w(&p("ln1.bias")), c.eps);
            let qkv = linear(&h, w.w(&p("qkv.weight")), Some(w.w(&p("qkv.bias"))), 3 * d);
            let a = linear(
                &attention(&qkv, d, c.heads),
                w.w(&p("proj.weight")),
                Some(w.w(&p("proj.bias"))),
                d,
            );
            x = add(&x, &a);
            let h = layer_norm(&x, w.w(&p("ln2.weight")), w.w(&p("ln2.bias")), c.eps);
            let mut f = linear(&h, w.w(&p("fc1.weight")), Some(w.w(&p("fc1.bias"))), c.inner);
            f.iter_mut()
                .flatten()
                .for_each(|v| *v = 0.5 * *v * (1.0 + erf(*v / 2f64.sqrt())));
            x = add(
                &x,
                &linear(&f, w.w(&p("fc2.weight")), Some(w.w(&p("fc2.bias"))), d),
            );
        }
        let logits = linear(
            &layer_norm(&x, w.w("ln_f.weight"), w.w("ln_f.bias"), c.eps),
            w.w("head.weight"),
            None,
            c.vocab,
        );
        for (z, &t) in logits.iter().zip(targets) {
            let max = z.iter().copied().fold(f64::MIN, f64::max);
            let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            total += lse - z[t];
            count += 1;
        }
    }
    total / count as f64
}

fn add(a: &[Vec<f64>], b: &[Vec<f64>]) -> Vec<Vec<f64>> {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p + q).collect())
        .collect()
}

#[test]
fn an_export_read_from_its_config_alone_gives_archipelagos_loss() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, model) = (dir.path().join("ckpt"), dir.path().join("model.safetensors"));
    let (ckpt, model) = (ckpt.to_str().unwrap(), model.to_str().unwrap());
    let data = format!("{FIXTURE}/gpt.data.safetensors");
    let init = format!("{FIXTURE}/gpt.init.safetensors");
    let common = ["--batch", "4", "--data", &data];
    archipelago(
        &[
            &[
                "train",
                "--model",
                SPEC,
                "--steps",
                "3",
                "--init",
                &init,
                "--checkpoint-dir",
                ckpt,
            ],
            &common[..],
        ]
        .concat(),
    );
    archipelago(&["export", ckpt, "--out", model]);

    // The reader: the architecture from config.json, the tensors checked against it.
    let config = Config::read(&dir.path().join("config.json"));
    let file = TensorFile::open(Path::new(model)).unwrap();
    let held: BTreeMap<String, Vec<usize>> = (file.names().into_iter())
        .map(|n| (n.to_string(), file.info(n).unwrap().1.to_vec()))
        .collect();
    assert_eq!(
        held,
        config.tensors(),
        "the file's tensors are not the ones its config implies"
    );
    let weights = Weights(
        (held.keys())
            .map(|n| {
                (
                    n.clone(),
                    file.read_f32(n).unwrap().into_iter().map(f64::from).collect(),
                )
            })
            .collect(),
    );

    // archipelago's loss of the exported weights on step 1's batch (rows 4..8 of the file: step
    // s takes rows (s·b + j) mod n), with a learning rate of zero.
    let spec = format!(
        "gpt:vocab={},ctx={},d={},layers={},heads={}",
        config.vocab, config.ctx, config.d, config.layers, config.heads
    );
    // The file's own metadata names the same model.
    assert_eq!(file.meta().get("archipelago_model"), Some(&spec));
    let report = dir.path().join("report.json");
    let run = [
        "train",
        "--model",
        &spec,
        "--steps",
        "1",
        "--init",
        model,
        "--optimizer",
        "sgd",
        "--lr",
        "0",
    ];
    archipelago(&[&run[..], &common[..], &["--report", report.to_str().unwrap()]].concat());
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let ours = r["steps"][0]["loss"].as_f64().unwrap();

    let tokens = TensorFile::open(Path::new(&data))
        .unwrap()
        .read_ints("tokens")
        .unwrap();
    let width = config.ctx + 1;
    let rows: Vec<Vec<usize>> = (4..8)
        .map(|i| {
            tokens[i * width..(i + 1) * width]
                .iter()
                .map(|&t| t as usize)
                .collect()
        })
        .collect();
    let read = loss(&config, &weights, &rows);
    assert!(
        (read - ours).abs() < 1e-5 * ours.abs().max(1.0),
        "the reader's loss {read} differs from archipelago's {ours}"
    );
    // Negative control: the head count guessed (1 or 4 fit the same shapes) gives another loss.
    for heads in [1, 4] {
        let guessed = loss(&Config { heads, ..config }, &weights, &rows);
        assert!(
            (guessed - ours).abs() > 1e-4,
            "heads={heads} should not match: {guessed} vs {ours}"
        );
    }
}
