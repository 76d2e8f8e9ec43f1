//! A closed-form reference for the optimizer tests, written out here in f64 and sharing no
//! code with the library's trainer or optimizers: the forward and backward of a one-hidden-layer
//! mlp (`Linear → ReLU → Linear`, mean cross-entropy) by hand, and the update rules from their
//! papers in PyTorch's form — AdamW (Loshchilov & Hutter 2019), SGD with momentum and Nesterov
//! (Sutskever et al. 2013), LAMB (You et al. 2020, a trust ratio per parameter), clipping by the
//! global norm (Pascanu et al. 2013, as `clip_grad_norm_`) and linear warmup then cosine decay.
//! Only the initial weights (the library's initialisation from `(seed, name)`) and the batches
//! (the seeded cluster pool) are taken from the library: they are inputs, not what is checked.
//!
//! Each rule can be run with one deliberate [`Mistake`], the negative controls of the tests.

use archipelago_actors::block::initial_params;
use archipelago_actors::checkpoint::{CheckpointReader, step_dir};
use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::data::ClusterPool;
use archipelago_dataflow::{ModelSpec, Program};

use crate::train_program;

/// An update rule, written out.
#[derive(Debug, Clone, Copy)]
pub enum Rule {
    /// `torch.optim.SGD` with momentum (dampening 0), optionally Nesterov, with weight decay.
    Sgd {
        /// Peak learning rate.
        lr: f64,
        /// Momentum μ.
        momentum: f64,
        /// Nesterov's variant.
        nesterov: bool,
        /// L2 weight decay (matrices only).
        wd: f64,
    },
    /// `torch.optim.AdamW` (decoupled decay on matrices only).
    AdamW {
        /// Peak learning rate.
        lr: f64,
        /// β1, β2, ε.
        betas: (f64, f64, f64),
        /// Decoupled weight decay.
        wd: f64,
    },
    /// LAMB: Adam's direction plus decay, scaled per parameter by ‖p‖ / ‖u‖.
    Lamb {
        /// Peak learning rate.
        lr: f64,
        /// β1, β2, ε.
        betas: (f64, f64, f64),
        /// Weight decay inside the direction (matrices only).
        wd: f64,
    },
}

/// A deliberately wrong variant the comparison must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mistake {
    /// SGD without its momentum buffer.
    NoMomentum,
    /// AdamW's decay coupled into the gradient (Adam's L2).
    CoupledDecay,
    /// LAMB without the trust ratio (ratio 1).
    NoTrustRatio,
    /// LAMB's norms taken over the first half of each parameter only (one shard's norms).
    HalfParameterNorms,
    /// Clipping left out.
    Unclipped,
}

/// A run of the reference.
#[derive(Debug, Clone)]
pub struct Reference {
    /// The rule.
    pub rule: Rule,
    /// Clip to this global norm.
    pub clip: Option<f64>,
    /// Linear warmup over this many steps, then cosine decay to 10% at step `.1`.
    pub schedule: Option<(u64, u64)>,
    /// A deliberate mistake.
    pub mistake: Option<Mistake>,
}

/// What the reference computed.
#[derive(Debug, Clone)]
pub struct Trajectory {
    /// Each step's mean loss.
    pub losses: Vec<f64>,
    /// Each step's global gradient norm.
    pub norms: Vec<f64>,
    /// Each step's clipping factor (1: not clipped).
    pub clip_factors: Vec<f64>,
    /// The final parameters, in the model's order (weight and bias of each layer).
    pub params: Vec<Vec<f64>>,
}

/// The layer widths `(in, hidden, out)` of a one-hidden-layer mlp spec.
fn dims(model: &ModelSpec) -> (usize, usize, usize) {
    match (model.family().name(), model.dims()) {
        ("mlp", &[input, hidden, 1, out]) => (input, hidden, out),
        _ => panic!("the closed form is written for an mlp with one hidden layer"),
    }
}

/// Mean cross-entropy of a batch and its gradients `[dW0, db0, dW1, db1]` (weights `[in, out]`).
fn loss_and_gradients(
    p: &[Vec<f64>],
    (i, h, o): (usize, usize, usize),
    x: &[f32],
    labels: &[u32],
) -> (f64, Vec<Vec<f64>>) {
    let n = labels.len();
    let mut g = vec![vec![0.0; i * h], vec![0.0; h], vec![0.0; h * o], vec![0.0; o]];
    let mut loss = 0.0;
    for r in 0..n {
        let xr = &x[r * i..(r + 1) * i];
        let z: Vec<f64> = (0..h)
            .map(|k| p[1][k] + (0..i).map(|j| xr[j] as f64 * p[0][j * h + k]).sum::<f64>())
            .collect();
        let a: Vec<f64> = z.iter().map(|&v| v.max(0.0)).collect();
        let logits: Vec<f64> = (0..o)
            .map(|c| p[3][c] + (0..h).map(|k| a[k] * p[2][k * o + c]).sum::<f64>())
            .collect();
        let top = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|l| (l - top).exp()).sum();
        let label = labels[r] as usize;
        loss -= logits[label] - top - sum.ln();
        let dl: Vec<f64> = (0..o)
            .map(|c| ((logits[c] - top).exp() / sum - f64::from(u8::from(c == label))) / n as f64)
            .collect();
        for k in 0..h {
            for c in 0..o {
                g[2][k * o + c] += a[k] * dl[c];
            }
        }
        for c in 0..o {
            g[3][c] += dl[c];
        }
        for k in 0..h {
            if z[k] <= 0.0 {
                continue;
            }
            let dz: f64 = (0..o).map(|c| dl[c] * p[2][k * o + c]).sum();
            for j in 0..i {
                g[0][j * h + k] += xr[j] as f64 * dz;
            }
            g[1][k] += dz;
        }
    }
    (loss / n as f64, g)
}

/// Trains the program's model (an mlp with one hidden layer, on its seeded clusters, global
/// batch `program.plan.batch`) for `steps` steps under `reference`.
pub fn train(program: &Program, reference: &Reference, steps: u64) -> Trajectory {
    let spec = ModelSpec::parse(&program.model.name).expect("a zoo spec");
    let (i, h, o) = dims(&spec);
    let mut p: Vec<Vec<f64>> = program
        .model
        .blocks
        .iter()
        .flat_map(|b| {
            let flat = initial_params(&b.param_descs, program.seed);
            let split = b.param_descs[0].len();
            [flat[..split].to_vec(), flat[split..].to_vec()]
        })
        .map(|v| v.into_iter().map(f64::from).collect())
        .collect();
    let decays = [true, false, true, false];
    let pool = ClusterPool::new(program.seed, i, o);
    let batch = program.plan.batch;
    let mut state: Vec<[Vec<f64>; 2]> = p
        .iter()
        .map(|v| [vec![0.0; v.len()], vec![0.0; v.len()]])
        .collect();
    let mut out = Trajectory {
        losses: Vec::new(),
        norms: Vec::new(),
        clip_factors: Vec::new(),
        params: Vec::new(),
    };
    for t in 1..=steps {
        let data = pool.batch(t, batch, 0..batch);
        let (loss, g) = loss_and_gradients(&p, (i, h, o), &data.x, &data.labels);
        let norm = g.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
        let c = match (reference.clip, reference.mistake) {
            (Some(max), m) if m != Some(Mistake::Unclipped) => (max / (norm + 1e-6)).min(1.0),
            _ => 1.0,
        };
        out.losses.push(loss);
        out.norms.push(norm);
        out.clip_factors.push(c);
        let factor = match reference.schedule {
            None => 1.0,
            Some((w, _)) if t <= w => t as f64 / w as f64,
            Some((w, total)) => {
                let progress = ((t - w) as f64 / (total - w) as f64).min(1.0);
                0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        };
        for (k, param) in p.iter_mut().enumerate() {
            let grad: Vec<f64> = g[k].iter().map(|x| c * x).collect();
            update(reference, t, factor, decays[k], param, &mut state[k], &grad);
        }
    }
    out.params = p;
    out
}

/// One step of the rule on one parameter.
fn update(
    r: &Reference,
    t: u64,
    factor: f64,
    decays: bool,
    p: &mut [f64],
    state: &mut [Vec<f64>; 2],
    g: &[f64],
) {
    let [m, v] = state;
    match r.rule {
        Rule::Sgd {
            lr,
            momentum,
            nesterov,
            wd,
        } => {
            let (lr, wd) = (lr * factor, if decays { wd } else { 0.0 });
            for e in 0..p.len() {
                let d = g[e] + wd * p[e];
                if r.mistake == Some(Mistake::NoMomentum) {
                    p[e] -= lr * d;
                    continue;
                }
                m[e] = if t == 1 { d } else { momentum * m[e] + d };
                p[e] -= lr * if nesterov { d + momentum * m[e] } else { m[e] };
            }
        }
        Rule::AdamW {
            lr,
            betas: (b1, b2, eps),
            wd,
        } => {
            let (lr, wd) = (lr * factor, if decays { wd } else { 0.0 });
            let coupled = r.mistake == Some(Mistake::CoupledDecay);
            for e in 0..p.len() {
                let grad = if coupled { g[e] + wd * p[e] } else { g[e] };
                if !coupled {
                    p[e] *= 1.0 - lr * wd;
                }
                m[e] = b1 * m[e] + (1.0 - b1) * grad;
                v[e] = b2 * v[e] + (1.0 - b2) * grad * grad;
                let (mh, vh) = (m[e] / (1.0 - b1.powi(t as i32)), v[e] / (1.0 - b2.powi(t as i32)));
                p[e] -= lr * mh / (vh.sqrt() + eps);
            }
        }
        Rule::Lamb {
            lr,
            betas: (b1, b2, eps),
            wd,
        } => {
            let (lr, wd) = (lr * factor, if decays { wd } else { 0.0 });
            let mut u = vec![0.0; p.len()];
            for e in 0..p.len() {
                m[e] = b1 * m[e] + (1.0 - b1) * g[e];
                v[e] = b2 * v[e] + (1.0 - b2) * g[e] * g[e];
                let (mh, vh) = (m[e] / (1.0 - b1.powi(t as i32)), v[e] / (1.0 - b2.powi(t as i32)));
                u[e] = mh / (vh.sqrt() + eps) + wd * p[e];
            }
            let counted = if r.mistake == Some(Mistake::HalfParameterNorms) {
                p.len().div_ceil(2)
            } else {
                p.len()
            };
            let pn = p[..counted].iter().map(|x| x * x).sum::<f64>().sqrt();
            let un = u[..counted].iter().map(|x| x * x).sum::<f64>().sqrt();
            let ratio = if r.mistake == Some(Mistake::NoTrustRatio) || pn == 0.0 || un == 0.0 {
                1.0
            } else {
                pn / un
            };
            for e in 0..p.len() {
                p[e] -= lr * ratio * u[e];
            }
        }
    }
}

/// Trains `program` for `steps` steps on the embedded controller, checkpointing after the last,
/// and reads every parameter back by name (in the model's order), whatever the layout sharded.
pub fn train_and_read(program: &Program, steps: u64) -> (TrainReport, Vec<Vec<f32>>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = TrainOptions {
        keep_params: true,
        steps,
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: steps,
        ..TrainOptions::default()
    };
    let report = train_program(program, &options);
    (report, read_params(&step_dir(dir.path(), steps), program))
}

/// Every parameter of `program`'s model read by name from the checkpoint in `dir`, in the
/// model's order.
pub fn read_params(dir: &std::path::Path, program: &Program) -> Vec<Vec<f32>> {
    let reader = CheckpointReader::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    program
        .model
        .blocks
        .iter()
        .flat_map(|b| &b.param_descs)
        .map(|p| {
            reader
                .read_param(&p.name, &p.shape, 0..p.len(), &[])
                .unwrap_or_else(|e| panic!("{}: {e}", p.name))
                .0
        })
        .collect()
}

/// Largest element-wise excess of `got` over `allclose(rtol, atol)` against `expected`
/// (≤ 1 passes), and the largest absolute difference.
pub fn excess(expected: &[Vec<f64>], got: &[Vec<f32>], rtol: f64, atol: f64) -> (f64, f64) {
    assert_eq!(expected.len(), got.len(), "parameter counts");
    let (mut worst, mut abs) = (0.0f64, 0.0f64);
    for (a, b) in expected.iter().zip(got) {
        assert_eq!(a.len(), b.len(), "parameter sizes");
        for (&x, &y) in a.iter().zip(b) {
            let d = (x - y as f64).abs();
            abs = abs.max(d);
            worst = worst.max(d / (atol + rtol * x.abs()));
        }
    }
    (worst, abs)
}
