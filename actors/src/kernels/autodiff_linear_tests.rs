//! The fused 16-bit linear against the composed one (the backend's matmul, burn's broadcast add)
//! forward and in all three gradients, within 16-bit rounding; the f32 linear bit for bit the
//! composed one; and negative controls (a bias gradient that forgets the sum over rows, one in
//! the wrong dtype) that the same comparison catches.

use burn::backend::flex::{FlexDevice, FlexTensor};
use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{DType, Distribution, FloatDType, Tensor};

use super::super::tests::blas;
use super::super::{CpuMatmul, composed_linear, linear, matmul, select};
use super::{applies, convert};
use crate::CpuBackend;

type Layer = Linear<CpuBackend>;
type LinearFn<'a> = &'a dyn Fn(&Layer, Tensor<CpuBackend, 3>) -> Tensor<CpuBackend, 3>;

/// A linear layer `[d_in] → [d_out]` with random weight and bias in `dtype`.
fn layer(d_in: usize, d_out: usize, dtype: FloatDType) -> Layer {
    let device = FlexDevice;
    let mut layer = LinearConfig::new(d_in, d_out).init::<CpuBackend>(&device);
    let uniform = Distribution::Uniform(-1.0, 1.0);
    let weight = Tensor::<CpuBackend, 2>::random([d_in, d_out], uniform, &device);
    let bias = Tensor::<CpuBackend, 1>::random([d_out], uniform, &device);
    layer.weight = Param::from_tensor(weight.cast(dtype));
    layer.bias = Some(Param::from_tensor(bias.cast(dtype)));
    layer
}

/// The output and the gradients of `x`, `W` and `b` of `f(layer, x)` under the loss
/// `Σ y·weights` (in f32).
fn run(
    f: LinearFn,
    layer: &Layer,
    x: &Tensor<CpuBackend, 3>,
    weights: &Tensor<CpuBackend, 3>,
) -> [FlexTensor; 4] {
    let x = x.clone().require_grad();
    let y = f(layer, x.clone());
    let grads = (y.clone().cast(FloatDType::F32) * weights.clone())
        .sum()
        .backward();
    let prim = |t: Tensor<burn::backend::Flex, 3>| t.into_primitive().tensor();
    let prim2 = |t: Tensor<burn::backend::Flex, 2>| t.into_primitive().tensor();
    let prim1 = |t: Tensor<burn::backend::Flex, 1>| t.into_primitive().tensor();
    let bias = layer.bias.as_ref().unwrap().val();
    [
        prim(y.inner()),
        prim(x.grad(&grads).unwrap()),
        prim2(layer.weight.val().grad(&grads).unwrap()),
        prim1(bias.grad(&grads).unwrap()),
    ]
}

/// [`linear`]'s flattening around [`composed_linear`]: today's path, the reference.
fn composed(layer: &Layer, x: Tensor<CpuBackend, 3>) -> Tensor<CpuBackend, 3> {
    let [b, t, d] = x.dims();
    let bias = layer.bias.as_ref().map(|bias| bias.val());
    let y = composed_linear(x.reshape([b * t, d]), layer.weight.val(), bias);
    let d_out = y.dims()[1];
    y.reshape([b, t, d_out])
}

/// The composed linear with the forward unchanged but a bias gradient that forgets the sum over
/// rows (it is the first row of `dy`): `b` enters as `b.detach() + mask·(b − b.detach())`.
fn forgets_the_row_sum(layer: &Layer, x: Tensor<CpuBackend, 3>) -> Tensor<CpuBackend, 3> {
    let [b, t, d] = x.dims();
    let bias = layer.bias.as_ref().unwrap().val();
    let mut first_row = vec![0.0f32; b * t];
    first_row[0] = 1.0;
    let mask = Tensor::<CpuBackend, 1>::from_floats(first_row.as_slice(), &FlexDevice)
        .cast(bias.dtype())
        .reshape([b * t, 1]);
    let y = matmul(x.reshape([b * t, d]), layer.weight.val());
    let zero_valued = (bias.clone() - bias.clone().detach()).unsqueeze_dim(0) * mask;
    let y = y + bias.detach().unsqueeze_dim(0) + zero_valued;
    let d_out = y.dims()[1];
    y.reshape([b, t, d_out])
}

/// Same dtype, same shape, and every element within `1e-2 · max |want|` (16-bit rounding of the
/// sums, with their order and number of roundings differing).
fn compare(what: &str, got: &FlexTensor, want: &FlexTensor) -> Result<(), String> {
    if got.dtype() != want.dtype() {
        return Err(format!(
            "{what}: dtype {:?}, expected {:?}",
            got.dtype(),
            want.dtype()
        ));
    }
    let values = |t: &FlexTensor| {
        let data = convert(t.clone(), DType::F32).into_data();
        (data.shape.to_vec(), data.to_vec::<f32>().unwrap())
    };
    let ((gs, g), (ws, w)) = (values(got), values(want));
    if gs != ws {
        return Err(format!("{what}: shape {gs:?}, expected {ws:?}"));
    }
    let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        // NaN fails too.
        let within = (a - b).abs() <= 1e-2 * scale;
        if !within {
            return Err(format!(
                "{what}: element {i} is {a}, expected {b} (scale {scale})"
            ));
        }
    }
    Ok(())
}

/// Whether the fused node takes `layer` on `x` (flattened as [`linear`] does).
fn fused_applies(layer: &Layer, x: &Tensor<CpuBackend, 3>) -> bool {
    let [b, t, d] = x.dims();
    let prim = |t: Tensor<CpuBackend, 2>| t.into_primitive().tensor().primitive;
    let bias = layer.bias.as_ref().unwrap().val().into_primitive().tensor();
    let x = prim(x.clone().reshape([b * t, d]));
    applies(&x, &prim(layer.weight.val()), &bias.primitive).is_some()
}

const NAMES: [&str; 4] = ["output", "x gradient", "weight gradient", "bias gradient"];

#[test]
fn fused_16_bit_linear_equals_the_composed_one_forward_and_all_three_gradients() {
    if blas().is_none() {
        return;
    }
    assert!(select(CpuMatmul::Auto).unwrap().contains("OpenBLAS"));
    let device = FlexDevice;
    let (b, t, d_in, d_out) = (2, 7, 16, 24);
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        let layer = layer(d_in, d_out, dtype);
        let x = Tensor::<CpuBackend, 3>::random([b, t, d_in], Distribution::Default, &device).cast(dtype);
        let weights = Tensor::<CpuBackend, 3>::random([b, t, d_out], Distribution::Default, &device);
        assert!(
            fused_applies(&layer, &x),
            "the fused linear must be the one under test ({dtype:?})"
        );
        let fused = run(&|l, x| linear(l, x), &layer, &x, &weights);
        let want = run(&composed, &layer, &x, &weights);
        for ((name, got), want) in NAMES.iter().zip(&fused).zip(&want) {
            compare(&format!("{dtype:?} {name}"), got, want).unwrap();
        }
        // Negative controls: a bias gradient without the sum over rows (the rest unchanged), and
        // the right bias gradient in f32.
        let broken = run(&forgets_the_row_sum, &layer, &x, &weights);
        for ((name, got), want) in NAMES.iter().zip(&broken).zip(&want).take(3) {
            compare(&format!("control {name}"), got, want).unwrap();
        }
        let caught = compare("control bias gradient", &broken[3], &fused[3]).unwrap_err();
        eprintln!("{dtype:?} forgotten row sum: {caught}");
        let wide = convert(fused[3].clone(), DType::F32);
        let caught = compare("f32 bias gradient", &wide, &want[3]).unwrap_err();
        assert!(caught.contains("dtype"), "{caught}");
    }
}

/// f32 layers keep today's path: the same output and gradients, bit for bit.
#[test]
fn f32_linear_is_the_composed_one_bit_for_bit() {
    let device = FlexDevice;
    let (b, t, d_in, d_out) = (3, 5, 12, 20);
    let layer = layer(d_in, d_out, FloatDType::F32);
    let x = Tensor::<CpuBackend, 3>::random([b, t, d_in], Distribution::Default, &device);
    let weights = Tensor::<CpuBackend, 3>::random([b, t, d_out], Distribution::Default, &device);
    assert!(!fused_applies(&layer, &x));
    if !<CpuBackend as super::super::Kernels>::flattens_linear() {
        // Without OpenBLAS `linear` is burn's `Linear::forward`, as before this node.
        return;
    }
    let got = run(&|l, x| linear(l, x), &layer, &x, &weights);
    let want = run(&composed, &layer, &x, &weights);
    for ((name, got), want) in NAMES.iter().zip(got).zip(want) {
        assert_eq!(got.into_data(), want.into_data(), "f32 {name}");
    }
}
