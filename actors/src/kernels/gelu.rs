//! GELU (the erf form, `x·Φ(x)`) as one node of `Autodiff<Flex>`'s graph, in loops the compiler
//! vectorises: the forward writes the output and the derivative `Φ(x) + x·φ(x)` in one pass (both
//! need the same `exp(−x²/2)`), and the backward is one multiply by that derivative. Flex computes
//! GELU with a scalar `erff` per element forward and `erff` + `expf` again backward: 8 % of a
//! gpt-tiny step (`perf`, 2026-11-26).
//!
//! `erfc` is Abramowitz & Stegun's 7.1.26 (|error| ≤ 1.5·10⁻⁷), `exp` a Cody–Waite reduction with
//! a degree-6 polynomial (relative error about 2·10⁻⁷ on the range used), both branch-free. The
//! loops run with AVX2 and FMA where the CPU has them (chosen at run time), at the x86-64 baseline
//! (SSE2) elsewhere.
#![allow(unsafe_code)]

use super::Tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::FloatTensorOps;

/// `exp(u)` for `u ≤ 0`; 0 below −80 (where it is under 2·10⁻³⁵).
#[inline(always)]
fn exp_nonpositive(u0: f32) -> f32 {
    let u = u0.max(-80.0);
    // u = n·ln2 + r, |r| ≤ ln2/2; n rounded by the 1.5·2²³ trick (exact for |n| < 2²²).
    const ROUND: f32 = 12_582_912.0;
    let big = u * std::f32::consts::LOG2_E + ROUND;
    let n = big - ROUND;
    let r = (u - n * 0.693_145_75) - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (0.166_666_67 + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    // 2ⁿ from its exponent bits (n ≥ −116 here, a normal number), `n` read from `big`'s low
    // mantissa bits in wrapping integer arithmetic: `n as i32 + 127` is overflow-checked in the
    // dev profile, and the check's branch kept LLVM from vectorising the loop there (scalar
    // `vmulss`: GELU was 13 % of a gpt-tiny step).
    let biased = big.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    let scale = f32::from_bits(biased << 23);
    if u0 < -80.0 { 0.0 } else { p * scale }
}

/// `y = x·Φ(x)` and `d = Φ(x) + x·φ(x)` for every element.
#[inline(always)]
fn gelu_lanes(x: &[f32], y: &mut [f32], d: &mut [f32]) {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [0.254_829_6, -0.284_496_74, 1.421_413_7, -1.453_152_1, 1.061_405_4];
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    for ((x, y), d) in x.iter().zip(y.iter_mut()).zip(d.iter_mut()) {
        let x = *x;
        let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
        let t = 1.0 / (1.0 + P * z);
        let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
        let gauss = exp_nonpositive(-0.5 * x * x); // exp(−z²)
        // Φ(x) = 1 − erfc(|x|/√2)/2 for x ≥ 0, erfc(|x|/√2)/2 below (no cancellation there).
        let half_tail = 0.5 * poly * gauss;
        let cdf = if x < 0.0 { half_tail } else { 1.0 - half_tail };
        *y = x * cdf;
        *d = cdf + x * INV_SQRT_2PI * gauss;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn gelu_avx2(x: &[f32], y: &mut [f32], d: &mut [f32]) {
    gelu_lanes(x, y, d)
}

/// GELU of `x` and its derivative, on the widest vectors the CPU has.
pub(crate) fn gelu_with_derivative(x: &[f32], y: &mut [f32], d: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: `gelu_avx2` only needs the AVX2 and FMA instructions, and the CPU has both
        // (checked just above); its arguments are ordinary slices.
        return unsafe { gelu_avx2(x, y, d) };
    }
    gelu_lanes(x, y, d)
}

#[derive(Debug)]
struct Gelu;

impl Backward<Flex, 1> for Gelu {
    /// The derivative at every element.
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let derivative = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |dy| Flex::float_mul(dy, derivative));
    }
}

/// GELU of `x` (f32) as one autodiff node.
pub(crate) fn gelu<C: CheckpointStrategy>(x: Tracked<C>) -> Tracked<C> {
    let input = x.primitive.to_contiguous();
    let dims = input.layout().shape().to_vec();
    let (mut y, mut d) = (
        super::flex_blas::zeroed(dims.clone()),
        super::flex_blas::zeroed(dims),
    );
    gelu_with_derivative(input.storage::<f32>(), y.storage_mut(), d.storage_mut());
    match Gelu.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(d, y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GELU and its derivative in f64, Φ integrated by Simpson's rule (the reference).
    fn gelu_f64(x: f64) -> (f64, f64) {
        let phi = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        // Φ(x) = 0.5 + ∫₀ˣ φ, by Simpson's rule with 2000 intervals (error ≪ 1e-9 here).
        let n = 2000;
        let h = x / n as f64;
        let mut sum = phi(0.0) + phi(x);
        for i in 1..n {
            sum += phi(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
        }
        let cdf = 0.5 + sum * h / 3.0;
        (x * cdf, cdf + x * phi(x))
    }

    /// The grid of the checks: −12 … 12 in steps of 0.01.
    fn grid() -> Vec<f32> {
        (-1200..=1200).map(|i| i as f32 / 100.0).collect()
    }

    /// The largest error of `y` and `d` against the exact values, relative to `1 + |exact|`.
    fn worst_error(xs: &[f32], y: &[f32], d: &[f32]) -> f64 {
        let mut worst = 0.0f64;
        for (i, &x) in xs.iter().enumerate() {
            let (ye, de) = gelu_f64(x as f64);
            worst = worst
                .max((y[i] as f64 - ye).abs() / (1.0 + ye.abs()))
                .max((d[i] as f64 - de).abs() / (1.0 + de.abs()));
        }
        worst
    }

    const TOLERANCE: f64 = 4e-7;

    #[test]
    fn gelu_and_its_derivative_match_the_exact_ones() {
        let xs = grid();
        let (mut y, mut d) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
        gelu_with_derivative(&xs, &mut y, &mut d);
        let worst = worst_error(&xs, &y, &d);
        assert!(worst <= TOLERANCE, "{worst}");
        // The baseline loop (no AVX2) too.
        let (mut y, mut d) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
        gelu_lanes(&xs, &mut y, &mut d);
        let worst = worst_error(&xs, &y, &d);
        assert!(worst <= TOLERANCE, "{worst}");
        // Extremes: no NaN, the limits.
        let xs = [-1e30f32, -200.0, -80.0, 0.0, 80.0, 200.0, 1e30];
        let (mut y, mut d) = ([0.0; 7], [0.0; 7]);
        gelu_with_derivative(&xs, &mut y, &mut d);
        assert!(y.iter().chain(&d).all(|v| v.is_finite()), "{y:?} {d:?}");
        assert!(
            y[0] == 0.0 && y[1] == 0.0 && y[3] == 0.0 && d[0] == 0.0 && d[1] == 0.0,
            "{y:?} {d:?}"
        );
        assert!(
            y[5] == 200.0 && y[6] == 1e30 && d[5] == 1.0 && d[6] == 1.0,
            "{y:?} {d:?}"
        );
    }

    #[test]
    fn the_comparison_catches_the_tanh_approximation() {
        // Negative control: the tanh form of GELU (what some models use instead), with its
        // exact derivative, fails the same check.
        let xs = grid();
        let k = (2.0f32 / std::f32::consts::PI).sqrt();
        let y: Vec<f32> = (xs.iter())
            .map(|&x| 0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh()))
            .collect();
        let d: Vec<f32> = (xs.iter())
            .map(|&x| {
                let th = (k * (x + 0.044715 * x * x * x)).tanh();
                0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x)
            })
            .collect();
        let worst = worst_error(&xs, &y, &d);
        assert!(worst > TOLERANCE, "{worst}");
    }
}
