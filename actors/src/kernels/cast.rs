//! Casts between f32 and the 16-bit floats on Flex tensors, in one pass over the elements (the
//! `half` crate's conversions, round to nearest even), as one node of `Autodiff<Flex>`'s graph
//! whose backward casts the gradient back. Flex's own `float_cast` goes through a `Vec<f64>`
//! (two allocations and three passes per cast): with the fused kernels taking bf16 at their f32
//! edges (mixed precision, issue 38) its casts and bf16 element-wise ops were a third of a bf16
//! gpt-tiny step (`perf`, 2026-11-27).
//!
//! A tensor whose elements fill its buffer exactly (a contiguous tensor, or a permutation of one:
//! the transposed views of the backward) is converted where it lies and keeps its layout, so the
//! matmul still reads it without a copy.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::tensor::{Bytes, DType, FloatDType};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::Tracked;
use crate::typed_tensor::narrow_bf16;

/// `t` as `dtype` (f32, bf16 or f16), itself when it already is.
///
/// # Panics
/// For other dtypes (the trainer computes in these three only).
pub(crate) fn convert(t: FlexTensor, dtype: DType) -> FlexTensor {
    if t.dtype() == dtype {
        return t;
    }
    let fills_buffer =
        t.layout().start_offset() == 0 && t.bytes().len() == t.layout().num_elements() * t.dtype().size();
    let t = if fills_buffer { t } else { t.to_contiguous() };
    let layout = t.layout().clone();
    let bytes = match (t.dtype(), dtype) {
        (DType::BF16, DType::F32) => map(bytemuck::cast_slice::<bf16, u16>(t.storage::<bf16>()), widen_bf16),
        (DType::F16, DType::F32) => {
            let mut wide = vec![0.0f32; t.storage::<f16>().len()];
            t.storage::<f16>().convert_to_f32_slice(&mut wide);
            Bytes::from_elems(wide)
        }
        (DType::F32, DType::BF16) => map(t.storage::<f32>(), narrow_bf16),
        (DType::F32, DType::F16) => {
            let mut narrow = vec![f16::ZERO; t.storage::<f32>().len()];
            narrow.convert_from_f32_slice(t.storage::<f32>());
            Bytes::from_elems(narrow)
        }
        (DType::BF16, DType::F16) => map(t.storage::<bf16>(), |x| f16::from_f32(x.to_f32())),
        (DType::F16, DType::BF16) => map(t.storage::<f16>(), |x| bf16::from_f32(x.to_f32())),
        (from, to) => panic!("no cast from {from:?} to {to:?} in the trainer's kernels"),
    };
    FlexTensor::new(bytes, layout, dtype)
}

/// bf16's bits widened to f32 (exact).
#[inline(always)]
fn widen_bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Every element of `values` through `f`, as a buffer.
fn map<A: Copy, B: bytemuck::Pod + Send + Sync>(values: &[A], f: impl Fn(A) -> B) -> Bytes {
    Bytes::from_elems(values.iter().map(|&x| f(x)).collect::<Vec<B>>())
}

#[derive(Debug)]
struct Cast;

impl Backward<burn::backend::flex::Flex, 1> for Cast {
    /// The dtype of the input, the gradient's.
    type State = DType;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let input_dtype = ops.state;
        unary::<burn::backend::flex::Flex, _>(ops.parents, ops.node, grads, |dy| convert(dy, input_dtype));
    }
}

/// `x` as `dtype`, one autodiff node (none when it already is).
pub(crate) fn cast<C: CheckpointStrategy>(x: Tracked<C>, dtype: FloatDType) -> Tracked<C> {
    let (from, to) = (x.primitive.dtype(), DType::from(dtype));
    if from == to {
        return x;
    }
    let y = convert(x.primitive, to);
    match Cast.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(from, y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    /// The branch-free bf16 rounding is `half`'s, on every rounding case, the extremes and NaN.
    #[test]
    fn bf16_rounding_is_halfs() {
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        values.extend([f32::NAN, f32::from_bits(0x7F80_0001), f32::MIN_POSITIVE, 1e-40]);
        let mut state = 0x9E37_79B9u32;
        for _ in 0..100_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            values.push(f32::from_bits(state));
        }
        // Ties, both parities, and just above and below them.
        for hi in [0x3F80u32, 0x3F81, 0x7F7F] {
            for lo in [0x7FFFu32, 0x8000, 0x8001] {
                values.push(f32::from_bits(hi << 16 | lo));
            }
        }
        for x in values {
            assert_eq!(
                narrow_bf16(x),
                bf16::from_f32(x).to_bits(),
                "{x:e} ({:#x})",
                x.to_bits()
            );
            let back = widen_bf16(narrow_bf16(x));
            assert!(back.to_bits() == bf16::from_f32(x).to_f32().to_bits() || back.is_nan());
        }
    }

    /// The same values as Flex's own cast, both ways, for contiguous and transposed tensors.
    #[test]
    fn casts_agree_with_flex_and_keep_the_layout() {
        use burn::backend::flex::Flex;
        use burn::tensor::ops::FloatTensorOps;
        let values: Vec<f32> = (0..24)
            .map(|i| (i as f32 - 11.5) * 0.37 + 1e-3 * i as f32)
            .collect();
        let t = FlexTensor::from_data(TensorData::new(values, [4, 6]));
        for tensor in [t.clone(), t.transpose(0, 1)] {
            for (dtype, float) in [(DType::BF16, FloatDType::BF16), (DType::F16, FloatDType::F16)] {
                let ours = convert(tensor.clone(), dtype);
                assert_eq!(ours.layout().shape(), tensor.layout().shape());
                let flex = Flex::float_cast(tensor.clone(), float);
                assert_eq!(ours.into_data(), flex.clone().into_data(), "{dtype:?}");
                let back = convert(flex.clone(), DType::F32).into_data();
                assert_eq!(back, Flex::float_cast(flex, FloatDType::F32).into_data());
            }
        }
    }
}
