//! Each optimizer against a closed-form reference written out here in f64 (not the optimizer's
//! own loops) from its paper and PyTorch's form — Adam (Kingma & Ba 2015), AdamW (Loshchilov &
//! Hutter 2019), SGD with momentum and Nesterov (Sutskever et al. 2013), LAMB (You et al. 2020),
//! clipping (Pascanu et al. 2013) — over 6 steps on small vectors, and for each a negative
//! control: a deliberately wrong variant (momentum or Nesterov off, bias correction skipped,
//! weight decay coupled, LAMB's norms taken per shard, no clipping) that the same comparison must
//! reject.

use archipelago_dataflow::{LrSchedule, OptimizerSpec};

use super::*;

const STEPS: usize = 6;
const TOL: f64 = 2e-5;

/// The gradient of element `i` at step `t`: values in [-1, 1], the same for every test.
fn grad(t: usize, i: usize) -> f64 {
    (((i * 7 + t * 3) % 11) as f64) / 5.0 - 1.0 + 0.05 * i as f64
}

fn grads(t: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| grad(t, i) as f32).collect()
}

fn init(n: usize) -> Vec<f32> {
    (0..n).map(|i| 0.5 - 0.13 * i as f32).collect()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

/// Runs `spec` for `STEPS` steps over one range (optionally with a layout and a schedule).
fn run(opt: &mut FlatOptimizer, n: usize) -> Vec<f32> {
    let mut p = init(n);
    for t in 1..=STEPS {
        opt.begin_step();
        opt.update(0, &mut p, &grads(t, n));
    }
    p
}

/// `torch.optim.SGD`, written out: d = g + wd·p; b = d (first) or μb + (1 − τ)d; Nesterov
/// d + μb, else b; p −= lr·d.
fn sgd_reference(n: usize, lr: f64, mu: f64, dampening: f64, nesterov: bool, wd: f64) -> Vec<f64> {
    let mut p: Vec<f64> = init(n).iter().map(|&x| x as f64).collect();
    let mut b = vec![0.0f64; n];
    for t in 1..=STEPS {
        for i in 0..n {
            let mut d = grad(t, i) + wd * p[i];
            if mu != 0.0 {
                b[i] = if t == 1 {
                    d
                } else {
                    mu * b[i] + (1.0 - dampening) * d
                };
                d = if nesterov { d + mu * b[i] } else { b[i] };
            }
            p[i] -= lr * d;
        }
    }
    p
}

/// Adam/AdamW written out, with switches for the wrong variants.
fn adam_reference(n: usize, lr: f64, wd: f64, decoupled: bool, bias_correction: bool) -> Vec<f64> {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
    let mut p: Vec<f64> = init(n).iter().map(|&x| x as f64).collect();
    let (mut m, mut v) = (vec![0.0f64; n], vec![0.0f64; n]);
    for t in 1..=STEPS {
        for i in 0..n {
            let mut g = grad(t, i);
            if decoupled {
                p[i] *= 1.0 - lr * wd;
            } else {
                g += wd * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            let (mh, vh) = if bias_correction {
                (m[i] / (1.0 - b1.powi(t as i32)), v[i] / (1.0 - b2.powi(t as i32)))
            } else {
                (m[i], v[i])
            };
            p[i] -= lr * mh / (vh.sqrt() + eps);
        }
    }
    p
}

#[test]
fn plain_sgd_is_exactly_p_minus_lr_g() {
    let mut opt = FlatOptimizer::new(OptimizerSpec::sgd(0.1), 7);
    assert!(!opt.has_state(), "plain SGD keeps no state");
    let got = run(&mut opt, 7);
    let mut expected = init(7);
    for t in 1..=STEPS {
        for (p, g) in expected.iter_mut().zip(grads(t, 7)) {
            *p -= 0.1 * g;
        }
    }
    assert_eq!(got, expected, "bit for bit");
}

#[test]
fn sgd_momentum_and_dampening_match_the_pytorch_form() {
    for (mu, dampening, wd) in [(0.9, 0.0, 0.0), (0.9, 0.3, 0.05)] {
        let spec = OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: mu as f32,
            dampening: dampening as f32,
            nesterov: false,
            weight_decay: wd as f32,
        };
        let got = run(&mut FlatOptimizer::new(spec, 7), 7);
        let reference = sgd_reference(7, 0.1, mu, dampening, false, wd);
        assert!(
            max_diff(&got, &reference) < TOL,
            "μ {mu} τ {dampening}: {got:?} vs {reference:?}"
        );
        // Negative controls: momentum off, and dampening applied on the first step too.
        let plain = sgd_reference(7, 0.1, 0.0, 0.0, false, wd);
        assert!(
            max_diff(&got, &plain) > 100.0 * TOL,
            "momentum off must be caught"
        );
        if dampening != 0.0 {
            let mut wrong = init(7).iter().map(|&x| x as f64).collect::<Vec<_>>();
            let mut b = [0.0f64; 7];
            for t in 1..=STEPS {
                for i in 0..7 {
                    let d = grad(t, i) + wd * wrong[i];
                    b[i] = mu * b[i] + (1.0 - dampening) * d;
                    wrong[i] -= 0.1 * b[i];
                }
            }
            assert!(
                max_diff(&got, &wrong) > 100.0 * TOL,
                "first-step dampening must be caught"
            );
        }
    }
}

#[test]
fn sgd_nesterov_with_weight_decay_matches_the_pytorch_form() {
    let spec = OptimizerSpec::sgd(0.05)
        .with_weight_decay(0.1)
        .with_momentum(0.9, true)
        .unwrap();
    let got = run(&mut FlatOptimizer::new(spec, 7), 7);
    let reference = sgd_reference(7, 0.05, 0.9, 0.0, true, 0.1);
    assert!(max_diff(&got, &reference) < TOL, "{got:?} vs {reference:?}");
    let classic = sgd_reference(7, 0.05, 0.9, 0.0, false, 0.1);
    assert!(
        max_diff(&got, &classic) > 100.0 * TOL,
        "Nesterov off must be caught"
    );
}

#[test]
fn adamw_matches_decoupled_weight_decay() {
    let got = run(
        &mut FlatOptimizer::new(OptimizerSpec::adamw(0.05).with_weight_decay(0.1), 7),
        7,
    );
    let reference = adam_reference(7, 0.05, 0.1, true, true);
    assert!(max_diff(&got, &reference) < TOL, "{got:?} vs {reference:?}");
    let coupled = adam_reference(7, 0.05, 0.1, false, true);
    assert!(
        max_diff(&got, &coupled) > 100.0 * TOL,
        "coupled decay must be caught"
    );
    let uncorrected = adam_reference(7, 0.05, 0.1, true, false);
    assert!(
        max_diff(&got, &uncorrected) > 100.0 * TOL,
        "skipped bias correction must be caught"
    );
}

#[test]
fn adam_weight_decay_is_l2_in_the_gradient() {
    let got = run(
        &mut FlatOptimizer::new(OptimizerSpec::adam(0.05).with_weight_decay(0.1), 7),
        7,
    );
    let reference = adam_reference(7, 0.05, 0.1, false, true);
    assert!(max_diff(&got, &reference) < TOL, "{got:?} vs {reference:?}");
    let decoupled = adam_reference(7, 0.05, 0.1, true, true);
    assert!(max_diff(&got, &decoupled) > 100.0 * TOL);
    let plain = run(&mut FlatOptimizer::new(OptimizerSpec::adam(0.05), 7), 7);
    assert!(max_diff(&plain, &adam_reference(7, 0.05, 0.0, false, true)) < TOL);
}

/// Parameters `a` (elements 0..10, with decay) and `b` (10..13, a bias: no decay).
fn two_params(len: usize, parts: &[(std::ops::Range<usize>, usize)]) -> ParamLayout {
    let parts = parts
        .iter()
        .map(|(range, param)| ParamPart {
            range: range.clone(),
            param: *param,
            decay: *param == 0,
        })
        .collect();
    let layout = ParamLayout::new(parts, 2).unwrap();
    assert_eq!(layout.len(), len);
    layout
}

/// LAMB written out over whole parameters (`params`: element ranges and decay), with the trust
/// ratio computed from norms over `norm_ranges` of each parameter (the whole parameter when
/// right; one shard's part for the negative control).
fn lamb_reference(
    n: usize,
    lr: f64,
    wd: f64,
    params: &[(std::ops::Range<usize>, bool)],
    trust: bool,
) -> Vec<f64> {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-6f64);
    let mut p: Vec<f64> = init(n).iter().map(|&x| x as f64).collect();
    let (mut m, mut v) = (vec![0.0f64; n], vec![0.0f64; n]);
    for t in 1..=STEPS {
        for (range, decay) in params {
            let mut u = Vec::new();
            for i in range.clone() {
                let g = grad(t, i);
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                let mh = m[i] / (1.0 - b1.powi(t as i32));
                let vh = v[i] / (1.0 - b2.powi(t as i32));
                u.push(mh / (vh.sqrt() + eps) + if *decay { wd * p[i] } else { 0.0 });
            }
            let pn = range.clone().map(|i| p[i] * p[i]).sum::<f64>().sqrt();
            let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
            let ratio = if trust && pn > 0.0 && un > 0.0 {
                pn / un
            } else {
                1.0
            };
            for (k, i) in range.clone().enumerate() {
                p[i] -= lr * ratio * u[k];
            }
        }
    }
    p
}

/// One LAMB step over shards: phase 1 on each, the caller's reduction (a sum), phase 2 on each.
fn lamb_steps(shards: &mut [(FlatOptimizer, std::ops::Range<usize>)], p: &mut [f32], t: usize, reduce: bool) {
    let g = grads(t, p.len());
    let mut partial = Vec::new();
    for (opt, range) in shards.iter_mut() {
        opt.begin_step();
        let mut sums = vec![0.0f64; opt.norms_len()];
        opt.accumulate_norms(0, &p[range.clone()], &g[range.clone()], Some(&mut sums));
        partial.push(sums);
    }
    let total: Vec<f64> = (0..partial[0].len())
        .map(|k| partial.iter().map(|s| s[k]).sum())
        .collect();
    for (k, (opt, range)) in shards.iter_mut().enumerate() {
        let norms = if reduce { &total } else { &partial[k] };
        opt.set_norms(&norms.iter().map(|&x| x as f32).collect::<Vec<_>>());
        opt.update(0, &mut p[range.clone()], &[]);
    }
}

#[test]
fn lamb_matches_its_reference_on_one_device() {
    let spec = OptimizerSpec::lamb(0.02).with_weight_decay(0.1);
    let layout = two_params(13, &[(0..10, 0), (10..13, 1)]);
    let mut shards = vec![(FlatOptimizer::new(spec, 13).with_layout(layout), 0..13)];
    let mut p = init(13);
    for t in 1..=STEPS {
        lamb_steps(&mut shards, &mut p, t, true);
    }
    let params = [(0..10, true), (10..13, false)];
    let reference = lamb_reference(13, 0.02, 0.1, &params, true);
    assert!(max_diff(&p, &reference) < TOL, "{p:?} vs {reference:?}");
    let no_trust = lamb_reference(13, 0.02, 0.1, &params, false);
    assert!(
        max_diff(&p, &no_trust) > 100.0 * TOL,
        "a missing trust ratio must be caught"
    );
}

/// Parameter `a` split across two shards at element 4 (as ZeRO cuts a bucket): with the partial
/// norms summed between the phases, the split run equals LAMB on the unsplit parameter and the
/// reference; with each shard's own norms (no reduction) it does not.
#[test]
fn lamb_split_across_two_shards_equals_lamb_on_the_whole_parameter() {
    let spec = OptimizerSpec::lamb(0.02).with_weight_decay(0.1);
    let first = two_params(4, &[(0..4, 0)]);
    let second = two_params(9, &[(0..6, 0), (6..9, 1)]);
    let split = || {
        vec![
            (FlatOptimizer::new(spec, 4).with_layout(first.clone()), 0..4),
            (FlatOptimizer::new(spec, 9).with_layout(second.clone()), 4..13),
        ]
    };
    let whole = two_params(13, &[(0..10, 0), (10..13, 1)]);
    let mut unsplit = vec![(FlatOptimizer::new(spec, 13).with_layout(whole), 0..13)];
    let (mut a, mut b, mut local) = (init(13), init(13), init(13));
    let (mut shards, mut wrong) = (split(), split());
    for t in 1..=STEPS {
        lamb_steps(&mut shards, &mut a, t, true);
        lamb_steps(&mut unsplit, &mut b, t, true);
        lamb_steps(&mut wrong, &mut local, t, false);
    }
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-6, "split {a:?} vs unsplit {b:?}");
    let reference = lamb_reference(13, 0.02, 0.1, &[(0..10, true), (10..13, false)], true);
    assert!(max_diff(&a, &reference) < TOL);
    assert!(
        max_diff(&local, &reference) > 100.0 * TOL,
        "per-shard norms must be caught: {local:?} vs {reference:?}"
    );
}

/// The gradients' norm over two shards exceeds the bound: the factor `max/(‖g‖ + 1e-6)` < 1
/// scales every gradient before the update (SGD and Adam, against references fed the scaled
/// gradients); an unclipped run is rejected by the same comparison.
#[test]
fn clipping_engages_above_the_bound() {
    let g = grads(1, 7);
    let squares = sum_of_squares(&g[..3]) + sum_of_squares(&g[3..]);
    let norm = g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
    assert!(norm > 1.0, "the test's gradients must exceed the bound ({norm})");
    let expected = 0.5 / (norm + 1e-6);
    for spec in [OptimizerSpec::sgd(0.1), OptimizerSpec::adam(0.1)] {
        let mut opt = FlatOptimizer::new(spec, 7);
        opt.begin_step();
        let factor = opt.clip(squares, 0.5);
        assert!(
            (factor as f64 - expected).abs() < 1e-6 && factor < 1.0,
            "{factor} vs {expected}"
        );
        let mut p = init(7);
        opt.update(0, &mut p[..3], &g[..3]);
        opt.update(3, &mut p[3..], &g[3..]);
        // Reference: one step with the clipped gradients, written out.
        let reference: Vec<f64> = init(7)
            .iter()
            .zip(&g)
            .map(|(&p, &g)| {
                let g = g as f64 * expected;
                match spec {
                    // Adam's first step moves by lr·sign(g) (m̂/√v̂ = g/|g|).
                    OptimizerSpec::Adam { .. } => p as f64 - 0.1 * g / (g.abs() + 1e-8),
                    _ => p as f64 - 0.1 * g,
                }
            })
            .collect();
        assert!(
            max_diff(&p, &reference) < TOL,
            "{}: {p:?} vs {reference:?}",
            spec.name()
        );
        if let OptimizerSpec::Sgd { .. } = spec {
            let unclipped: Vec<f64> = init(7)
                .iter()
                .zip(&g)
                .map(|(&p, &g)| (p - 0.1 * g) as f64)
                .collect();
            assert!(
                max_diff(&p, &unclipped) > 100.0 * TOL,
                "no clipping must be caught"
            );
        }
    }
}

#[test]
fn clipping_is_the_identity_below_the_bound() {
    let g = grads(2, 7);
    let mut clipped = FlatOptimizer::new(OptimizerSpec::adamw(0.1), 7);
    let mut plain = clipped.clone();
    clipped.begin_step();
    assert_eq!(clipped.clip(sum_of_squares(&g), 100.0), 1.0);
    plain.begin_step();
    let (mut a, mut b) = (init(7), init(7));
    clipped.update(0, &mut a, &g);
    plain.update(0, &mut b, &g);
    assert_eq!(a, b, "bit for bit");
}

/// The schedule sets each step's rate: SGD under warmup 2 then cosine to 0 at step 6 equals the
/// reference with the rates written out; the same run at a constant rate is rejected.
#[test]
fn the_schedule_sets_each_steps_rate() {
    let schedule = LrSchedule::cosine(2, 6).with_final_fraction(0.0);
    let mut opt = FlatOptimizer::new(OptimizerSpec::sgd(0.1), 7).with_schedule(schedule);
    let got = run(&mut opt, 7);
    let pi = std::f64::consts::PI;
    let rates = [
        0.05,
        0.1,
        0.1 * 0.5 * (1.0 + (pi / 4.0).cos()),
        0.05,
        0.1 * 0.5 * (1.0 + (3.0 * pi / 4.0).cos()),
        0.0,
    ];
    let mut reference: Vec<f64> = init(7).iter().map(|&x| x as f64).collect();
    for (t, lr) in rates.iter().enumerate() {
        for (i, p) in reference.iter_mut().enumerate() {
            *p -= lr * grad(t + 1, i);
        }
    }
    assert!(max_diff(&got, &reference) < TOL, "{got:?} vs {reference:?}");
    assert!(opt.lr().abs() < 1e-9, "the last step runs at the final fraction");
    let constant = sgd_reference(7, 0.1, 0.0, 0.0, false, 0.0);
    assert!(max_diff(&got, &constant) > 100.0 * TOL);
}

/// Parameter groups: elements 0..4 (a matrix) take AdamW's decay, 4..7 (a bias) do not.
#[test]
fn weight_decay_skips_parameters_without_decay() {
    let layout = ParamLayout::new(
        vec![
            ParamPart {
                range: 0..4,
                param: 0,
                decay: true,
            },
            ParamPart {
                range: 4..7,
                param: 1,
                decay: false,
            },
        ],
        2,
    )
    .unwrap();
    let spec = OptimizerSpec::adamw(0.05).with_weight_decay(0.1);
    let got = run(&mut FlatOptimizer::new(spec, 7).with_layout(layout), 7);
    let decayed = adam_reference(7, 0.05, 0.1, true, true);
    let undecayed = adam_reference(7, 0.05, 0.0, true, true);
    assert!(max_diff(&got[..4], &decayed[..4]) < TOL);
    assert!(max_diff(&got[4..], &undecayed[4..]) < TOL);
    assert!(
        max_diff(&got[4..], &decayed[4..]) > 100.0 * TOL,
        "decay on a bias must be caught"
    );
}

/// A run stopped after 3 steps, its state, step counter and schedule position moved into a
/// fresh optimizer (as a checkpoint does), equals 6 uninterrupted steps bit for bit, for each
/// stateful rule; a schedule position left at 0 (the warmup again) is caught.
#[test]
fn resuming_from_state_and_step_counter_equals_not_stopping() {
    let schedule = LrSchedule::linear(2, 6).with_final_fraction(0.1);
    for spec in [
        OptimizerSpec::sgd(0.1).with_momentum(0.9, true).unwrap(),
        OptimizerSpec::adamw(0.05),
        OptimizerSpec::lamb(0.02),
    ] {
        let fresh = || FlatOptimizer::new(spec, 7).with_schedule(schedule);
        let step = |opt: &mut FlatOptimizer, p: &mut [f32], t: usize| {
            opt.begin_step();
            let g = grads(t, 7);
            let mut sums = vec![0.0; opt.norms_len()];
            opt.accumulate_norms(0, p, &g, Some(&mut sums));
            if opt.norms_len() > 0 {
                opt.set_norms(&sums.iter().map(|&x| x as f32).collect::<Vec<_>>());
            }
            opt.update(0, p, &g);
        };
        let (mut straight, mut p) = (fresh(), init(7));
        for t in 1..=STEPS {
            step(&mut straight, &mut p, t);
        }
        let (mut first, mut q) = (fresh(), init(7));
        for t in 1..=3 {
            step(&mut first, &mut q, t);
        }
        let (m, v) = first.state(0..7);
        let mut resumed = fresh();
        resumed.set_state(0, m, v);
        resumed.set_steps(first.steps());
        let mut reset = resumed.clone();
        resumed.set_schedule_step(first.schedule_step());
        let mut r = q.clone();
        for t in 4..=STEPS {
            step(&mut resumed, &mut q, t);
            step(&mut reset, &mut r, t);
        }
        assert_eq!(p, q, "{}", spec.name());
        assert!(
            max_diff(&r, &p.iter().map(|&x| x as f64).collect::<Vec<_>>()) >= 100.0 * TOL,
            "{}: reset schedule",
            spec.name()
        );
        assert_eq!(
            resumed.state_bytes(),
            4 * 7 * spec.state_floats_per_param(),
            "{}: the state the memory estimate counts",
            spec.name()
        );
    }
}

#[test]
#[should_panic(expected = "reduced norms")]
fn lamb_refuses_to_update_without_its_norms() {
    let mut opt = FlatOptimizer::new(OptimizerSpec::lamb(0.1), 3);
    opt.begin_step();
    opt.update(0, &mut [1.0, 2.0, 3.0], &[0.1, 0.2, 0.3]);
}

#[test]
fn adam_first_step_moves_each_parameter_by_lr() {
    let mut opt = FlatOptimizer::new(OptimizerSpec::adam(0.1), 3);
    let mut p = vec![1.0, 1.0, 1.0];
    opt.begin_step();
    opt.update(0, &mut p, &[0.5, -2.0, 0.0]);
    assert!(
        (p[0] - 0.9).abs() < 1e-5 && (p[1] - 1.1).abs() < 1e-5 && p[2] == 1.0,
        "{p:?}"
    );
    assert_eq!(opt.state_bytes(), 24);
}

#[test]
fn updating_in_ranges_equals_updating_whole() {
    let grads: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
    for spec in [
        OptimizerSpec::adam(0.01),
        OptimizerSpec::adamw(0.01),
        OptimizerSpec::sgd(0.01).with_momentum(0.9, false).unwrap(),
    ] {
        let mut whole = FlatOptimizer::new(spec, 10);
        let mut parts = whole.clone();
        let (mut a, mut b) = (vec![0.5f32; 10], vec![0.5f32; 10]);
        for _ in 0..3 {
            whole.begin_step();
            whole.update(0, &mut a, &grads);
            parts.begin_step();
            parts.update(6, &mut b[6..], &grads[6..]);
            parts.update(0, &mut b[..6], &grads[..6]);
        }
        assert_eq!(a, b, "{}", spec.name());
    }
}

/// With the state on the device the host optimizer keeps no moments: released, it holds no
/// state bytes and reads empty slices; made again (for a checkpoint), it takes state back.
#[test]
fn released_state_holds_nothing_until_made_again() {
    let mut opt = FlatOptimizer::new(OptimizerSpec::adamw(0.01), 5);
    assert_eq!(opt.state_bytes(), 40);
    opt.release_state();
    assert_eq!(opt.state_bytes(), 0);
    assert_eq!(opt.state(0..5), (&[][..], &[][..]));
    opt.ensure_state();
    assert_eq!(opt.state_bytes(), 40);
    opt.set_state(1, &[1.0, 2.0], &[3.0, 4.0]);
    assert_eq!(opt.state(1..3), (&[1.0, 2.0][..], &[3.0, 4.0][..]));
    let mut sgd = FlatOptimizer::new(OptimizerSpec::sgd(0.1), 5);
    sgd.release_state();
    sgd.ensure_state();
    assert_eq!(sgd.state_bytes(), 0, "plain SGD keeps no state to make");
}
