//! OpenBLAS against Flex's own matmul at every layout the models make, gradients included, calls
//! from several threads at once, and a negative control that shows the comparison catches a
//! wrong transpose; without OpenBLAS, such a test fails under CI and is skipped elsewhere; the
//! fused attention, GELU and LayerNorm against burn's composed ops, each with its control.

use burn::backend::flex::{Flex, FlexDevice, FlexTensor};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{Distribution, Tensor, TensorData, TensorPrimitive};

use super::openblas::{self, OpenBlas, Operand};
use super::{CpuMatmul, flex_blas, matmul, select};
use crate::{CpuBackend, prerequisite};

/// The loaded OpenBLAS, under the rule of [`crate::prerequisite`]: under CI its absence fails
/// the test, elsewhere the test is skipped and says why.
pub(super) fn blas() -> Option<&'static OpenBlas> {
    let fix = "scripts/test.sh installs Debian's libopenblas0-pthread (as root or with sudo)";
    prerequisite::require(openblas::library(), fix)
}

fn random(shape: Vec<usize>, seed: u64) -> FlexTensor {
    let n: usize = shape.iter().product();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect();
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn values(t: FlexTensor) -> (Vec<usize>, Vec<f32>) {
    let data = t.into_data();
    (data.shape.to_vec(), data.to_vec().unwrap())
}

/// The tolerance of an element: f32 reduction order over the products' lengths.
fn tolerance(want: f32) -> f32 {
    1e-5 * (1.0 + want.abs()) * 16.0
}

/// Same shape and every element within f32 reduction-order tolerance of the reference.
fn compare(what: &str, got: FlexTensor, want: FlexTensor) -> Result<(), String> {
    let ((gs, g), (ws, w)) = (values(got), values(want));
    if gs != ws {
        return Err(format!("{what}: shape {gs:?}, expected {ws:?}"));
    }
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        if (a - b).abs() > tolerance(*b) {
            return Err(format!("{what}: element {i} is {a}, expected {b}"));
        }
    }
    Ok(())
}

/// A negative control: `broken` lands at least 10× the tolerance away from `want` somewhere
/// (a different shape counts as caught).
fn assert_caught(what: &str, broken: FlexTensor, want: FlexTensor) {
    let ((gs, g), (ws, w)) = (values(broken), values(want));
    if gs != ws {
        return;
    }
    let excess = (g.iter().zip(&w))
        .map(|(a, b)| (a - b).abs() / tolerance(*b))
        .fold(0.0f32, f32::max);
    eprintln!("{what}: caught at {excess:.1}× the tolerance");
    assert!(
        excess >= 10.0,
        "{what}: lands only {excess:.2}× past the tolerance (10× needed)"
    );
}

/// The operand pairs the zoo makes, as (name, lhs, rhs) views.
fn cases() -> Vec<(&'static str, FlexTensor, FlexTensor)> {
    let t = |x: FlexTensor| x.transpose(0, 1);
    vec![
        ("plain 2-D", random(vec![37, 19], 1), random(vec![19, 23], 2)),
        (
            "lhs transposed (xᵀ·dy)",
            t(random(vec![19, 37], 3)),
            random(vec![19, 23], 4),
        ),
        (
            "rhs transposed (dy·Wᵀ)",
            random(vec![37, 19], 5),
            t(random(vec![23, 19], 6)),
        ),
        (
            "both transposed",
            t(random(vec![19, 37], 7)),
            t(random(vec![23, 19], 8)),
        ),
        (
            "padded rows (narrow)",
            random(vec![37, 40], 9).narrow(1, 5, 19),
            random(vec![19, 23], 10),
        ),
        (
            "flipped (copied first)",
            random(vec![37, 19], 11),
            Flex::float_flip(random(vec![19, 23], 12), &[0]),
        ),
        ("one row", random(vec![1, 19], 13), random(vec![19, 23], 14)),
        ("one column", random(vec![37, 19], 15), random(vec![19, 1], 16)),
        ("k = 0", random(vec![4, 0], 17), random(vec![0, 3], 18)),
        (
            "attention scores q·kᵀ",
            random(vec![2, 5, 3, 4], 19).transpose(1, 2),
            random(vec![2, 5, 3, 4], 20).transpose(1, 2).transpose(2, 3),
        ),
        (
            "attention mix",
            random(vec![2, 3, 5, 5], 21),
            random(vec![2, 5, 3, 4], 22).transpose(1, 2),
        ),
        (
            "broadcast batch",
            random(vec![1, 3, 6, 4], 23),
            random(vec![2, 1, 4, 5], 24),
        ),
    ]
}

#[test]
fn openblas_matmul_equals_flex_at_every_layout_the_models_make() {
    let Some(blas) = blas() else { return };
    for (what, lhs, rhs) in cases() {
        let got = flex_blas::matmul(blas, &lhs, &rhs).unwrap_or_else(|| panic!("{what}: not taken"));
        compare(what, got, Flex::float_matmul(lhs, rhs)).unwrap();
    }
    // Negative control: the same comparison catches a product that ignores a transpose (square,
    // so that both readings lie inside the slice).
    let (lhs, rhs) = (random(vec![23, 23], 3), random(vec![23, 17], 4));
    let reference = Flex::float_matmul(lhs.clone().transpose(0, 1), rhs.clone());
    let product = |transposed| {
        let mut c = vec![0.0f32; 23 * 17];
        let b = Operand {
            transposed: false,
            ld: 17,
        };
        blas.sgemm(
            (23, 17, 23),
            lhs.storage(),
            Operand { transposed, ld: 23 },
            rhs.storage(),
            b,
            &mut c,
            17,
        )
        .unwrap();
        FlexTensor::from_data(TensorData::new(c, [23, 17]))
    };
    compare("control", product(true), reference.clone()).unwrap();
    assert_caught("a lost transpose", product(false), reference);
}

#[test]
fn gradients_through_openblas_equal_burns_matmul() {
    if blas().is_none() {
        return;
    }
    assert!(select(CpuMatmul::Auto).unwrap().contains("OpenBLAS"));
    let device = FlexDevice;
    let x = Tensor::<CpuBackend, 4>::random([2, 3, 5, 4], Distribution::Default, &device);
    let w = Tensor::<CpuBackend, 4>::random([2, 3, 6, 4], Distribution::Default, &device);
    let run = |ours: bool| {
        let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
        let wt = w.clone().swap_dims(2, 3);
        let y = if ours {
            matmul(x.clone(), wt)
        } else {
            x.clone().matmul(wt)
        };
        let loss = (y.clone() * y).sum();
        let grads = loss.backward();
        let grad = |t: &Tensor<CpuBackend, 4>| match t.grad(&grads).unwrap().into_primitive() {
            TensorPrimitive::Float(t) => t,
            TensorPrimitive::QFloat(_) => unreachable!("f32 gradients"),
        };
        (grad(&x), grad(&w))
    };
    let ((dx, dw), (dx_ref, dw_ref)) = (run(true), run(false));
    compare("dx", dx.clone(), dx_ref).unwrap();
    compare("dw", dw, dw_ref).unwrap();
    // Negative control: the comparison catches a gradient scaled by a factor of 1.01.
    let scaled = Flex::float_mul_scalar(dx.clone(), 1.01f32.into());
    assert_caught("scaled dx", scaled, dx);
}

#[test]
fn concurrent_calls_from_several_threads_give_the_one_thread_products() {
    let Some(blas) = blas() else { return };
    let jobs: Vec<_> = (0..4)
        .map(|t| {
            let (m, n, k) = (64 + 37 * t, 96 + 11 * t, 128 + 29 * t);
            let (a, b) = (random(vec![m, k], t as u64), random(vec![k, n], 100 + t as u64));
            let want = flex_blas::matmul(blas, &a, &b).unwrap();
            (a, b, values(want).1)
        })
        .collect();
    std::thread::scope(|scope| {
        for (a, b, want) in &jobs {
            scope.spawn(move || {
                for _ in 0..40 {
                    let got = values(flex_blas::matmul(blas, a, b).unwrap()).1;
                    assert!(got == *want, "a concurrent sgemm gave another product");
                }
            });
        }
    });
}

/// The test the rule of [`crate::prerequisite`] is shown on (it needs OpenBLAS), and the library
/// it is pointed at: one that does not exist.
const NEEDS_OPENBLAS: &str = "kernels::tests::openblas_matmul_equals_flex_at_every_layout_the_models_make";
const MISSING_LIBRARY: &str = "/nonexistent/archipelago-test/libopenblas.so.0";

/// [`NEEDS_OPENBLAS`] alone, in a child process of this test binary, with OpenBLAS pointed at
/// [`MISSING_LIBRARY`], `CI` as given and `skip_log` as the skip log: whether it passed, and its
/// output.
fn run_without_openblas(ci: Option<&str>, skip_log: &std::path::Path) -> (bool, String) {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", NEEDS_OPENBLAS, "--nocapture", "--test-threads=1"])
        .env(openblas::LIBRARY_ENV, MISSING_LIBRARY)
        .env(prerequisite::SKIP_LOG_ENV, skip_log)
        .env_remove(prerequisite::CI_ENV);
    if let Some(ci) = ci {
        command.env(prerequisite::CI_ENV, ci);
    }
    let out = command.output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// Without OpenBLAS, a test that needs it fails under CI naming the library it could not load
/// and the variable that named it; elsewhere it passes as skipped, with one line in the skip log.
#[test]
fn without_openblas_a_test_needing_it_fails_under_ci_and_is_logged_as_skipped_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("skipped.txt");
    let (passed, said) = run_without_openblas(Some("true"), &log);
    assert!(
        !passed
            && said.contains("1 failed")
            && said.contains("under CI")
            && said.contains(MISSING_LIBRARY)
            && said.contains(openblas::LIBRARY_ENV),
        "under CI:\n{said}"
    );
    assert!(!log.exists(), "nothing is skipped under CI");
    let (passed, said) = run_without_openblas(None, &log);
    assert!(passed && said.contains("1 passed"), "outside CI:\n{said}");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.starts_with(&format!("skipped {NEEDS_OPENBLAS}: "))
            && logged.contains(MISSING_LIBRARY)
            && logged.lines().count() == 1,
        "{logged}"
    );
}

/// The fused attention (one graph node, OpenBLAS) gives the composed version's output and `qkv`
/// gradient; a version without the causal mask is caught by the same comparison.
#[test]
fn fused_attention_equals_the_composed_one_forward_and_backward() {
    if blas().is_none() {
        return;
    }
    assert!(select(CpuMatmul::Auto).unwrap().contains("OpenBLAS"));
    let device = FlexDevice;
    let (b, t, d, heads) = (2, 7, 8, 2);
    let qkv = Tensor::<CpuBackend, 3>::random([b, t, 3 * d], Distribution::Default, &device);
    let weights = Tensor::<CpuBackend, 3>::random([b, t, d], Distribution::Default, &device);
    let prim = |t: Tensor<burn::backend::Flex, 3>| match t.into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => unreachable!("f32"),
    };
    let run = |attend: &dyn Fn(Tensor<CpuBackend, 3>) -> Tensor<CpuBackend, 3>| {
        let x = qkv.clone().require_grad();
        let y = attend(x.clone());
        let grads = (y.clone() * weights.clone()).sum().backward();
        (prim(y.inner()), prim(x.grad(&grads).unwrap()))
    };
    let fused = qkv.clone().into_primitive().tensor();
    assert!(
        super::autodiff_attention::applies(&fused.primitive, heads).is_some(),
        "the fused attention must be the one under test"
    );
    let (y, dqkv) = run(&|x| super::causal_attention(x, heads));
    let (y_ref, dqkv_ref) = run(&|x| super::composed_causal_attention(x, heads));
    compare("attention output", y.clone(), y_ref).unwrap();
    compare("qkv gradient", dqkv.clone(), dqkv_ref).unwrap();
    // Negative control: attention that also sees later positions.
    let unmasked = |x: Tensor<CpuBackend, 3>| super::composed_attention(x, heads, false);
    let (y_bad, dqkv_bad) = run(&unmasked);
    assert_caught("negative control output", y, y_bad);
    assert_caught("negative control gradient", dqkv, dqkv_bad);
}

#[test]
fn fused_gelu_equals_burns_forward_and_backward() {
    let device = FlexDevice;
    let x = Tensor::<CpuBackend, 3>::random([3, 5, 7], Distribution::Uniform(-4.0, 4.0), &device);
    let weights = Tensor::<CpuBackend, 3>::random([3, 7, 5], Distribution::Default, &device);
    let prim = |t: Tensor<burn::backend::Flex, 3>| match t.into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => unreachable!("f32"),
    };
    // Through a transposed view: the fused GELU reads any layout.
    let run = |gelu: &dyn Fn(Tensor<CpuBackend, 3>) -> Tensor<CpuBackend, 3>| {
        let x = x.clone().require_grad();
        let y = gelu(x.clone().swap_dims(1, 2));
        let grads = (y.clone() * weights.clone()).sum().backward();
        (prim(y.inner()), prim(x.grad(&grads).unwrap()))
    };
    let (y, dx) = run(&super::gelu);
    let (y_ref, dx_ref) = run(&burn::tensor::activation::gelu);
    compare("gelu output", y.clone(), y_ref).unwrap();
    compare("gelu gradient", dx.clone(), dx_ref).unwrap();
    // Negative control: the sigmoid approximation of GELU, x·σ(1.702·x).
    let (y_bad, dx_bad) = run(&|x| x.clone() * burn::tensor::activation::sigmoid(x * 1.702));
    assert_caught("negative control output", y, y_bad);
    assert_caught("negative control gradient", dx, dx_bad);
}

#[test]
fn fused_layer_norm_equals_burns_forward_and_all_three_gradients() {
    use burn::module::Param;
    use burn::nn::LayerNormConfig;
    let device = FlexDevice;
    let (b, t, d) = (3, 5, 16);
    let x = Tensor::<CpuBackend, 3>::random([b, t, d], Distribution::Uniform(-3.0, 5.0), &device);
    let weights = Tensor::<CpuBackend, 3>::random([b, t, d], Distribution::Default, &device);
    let mut layer = LayerNormConfig::new(d).init::<CpuBackend>(&device);
    // Not the initial ones and zeros: γ and β must matter for the gradients to be checked.
    layer.gamma = Param::from_tensor(Tensor::random([d], Distribution::Uniform(0.5, 1.5), &device));
    layer.beta = Some(Param::from_tensor(Tensor::random(
        [d],
        Distribution::Uniform(-0.5, 0.5),
        &device,
    )));
    let prim = |t: Tensor<burn::backend::Flex, 3>| match t.into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => unreachable!("f32"),
    };
    let prim1 = |t: Tensor<burn::backend::Flex, 1>| match t.into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => unreachable!("f32"),
    };
    type Norm<'a> =
        &'a dyn Fn(&burn::nn::LayerNorm<CpuBackend>, Tensor<CpuBackend, 3>) -> Tensor<CpuBackend, 3>;
    let run = |norm: Norm| {
        let x = x.clone().require_grad();
        let y = norm(&layer, x.clone());
        let grads = (y.clone() * weights.clone()).sum().backward();
        let gamma = layer.gamma.val().grad(&grads).unwrap();
        let beta = layer.beta.as_ref().unwrap().val().grad(&grads).unwrap();
        (
            prim(y.inner()),
            prim(x.grad(&grads).unwrap()),
            prim1(gamma),
            prim1(beta),
        )
    };
    let (y, dx, dg, db) = run(&|l, x| super::layer_norm(l, x, 1e-5));
    let (y_ref, dx_ref, dg_ref, db_ref) = run(&|l, x| l.forward(x));
    compare("layer norm output", y.clone(), y_ref).unwrap();
    compare("x gradient", dx.clone(), dx_ref).unwrap();
    compare("gamma gradient", dg.clone(), dg_ref).unwrap();
    compare("beta gradient", db, db_ref).unwrap();
    // Negative control: a norm that does not centre its rows (x / rms · γ + β, RMSNorm's form).
    let rms = |l: &burn::nn::LayerNorm<CpuBackend>, x: Tensor<CpuBackend, 3>| {
        let scale = (x.clone() * x.clone()).mean_dim(2).add_scalar(1e-5).sqrt();
        x / scale * l.gamma.val().reshape([1, 1, d]) + l.beta.as_ref().unwrap().val().reshape([1, 1, d])
    };
    let (y_bad, dx_bad, dg_bad, _) = run(&rms);
    assert_caught("negative control output", y, y_bad);
    assert_caught("negative control x gradient", dx, dx_bad);
    assert_caught("negative control gamma gradient", dg, dg_bad);
}
