//! Mixed precision on an actor (Micikevicius et al., 2018): the compute dtype its plan's slices
//! give, as burn's float dtype. The modules an actor holds are the compute copy (cast once when
//! built, kept in that dtype by every load, which rounds the f32 master into it); the master, the
//! gradient buckets and the optimizer state stay f32.

use archipelago_dataflow::{DType, SliceState};
use burn::tensor::FloatDType;

/// burn's float dtype for a plan's floating `dtype`.
///
/// # Panics
/// When `dtype` is not a float type (the plan refuses such a precision first).
pub fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::F32 => FloatDType::F32,
        DType::BF16 => FloatDType::BF16,
        DType::F16 => FloatDType::F16,
        other => panic!("{other} is not a compute dtype"),
    }
}

/// The plan's dtype for burn's float `dtype` (f32, bf16 or f16; any other reads as f32).
pub fn plan_dtype(dtype: FloatDType) -> DType {
    match dtype {
        FloatDType::BF16 => DType::BF16,
        FloatDType::F16 => DType::F16,
        _ => DType::F32,
    }
}

/// The one compute dtype of an actor's slices (f32 when it holds none); an error naming the two
/// when they differ (a per-parameter precision is not built).
pub fn compute_dtype(slices: &[SliceState]) -> Result<FloatDType, String> {
    let first = slices.first().map_or(DType::F32, |s| s.compute);
    match slices.iter().find(|s| s.compute != first) {
        Some(other) => Err(format!(
            "parameter `{}` computes in {} but `{}` in {}: an actor computes in one dtype",
            slices[0].param, first, other.param, other.compute
        )),
        None if first.is_float() => Ok(float_dtype(first)),
        None => Err(format!(
            "parameter `{}` computes in {first}, not a float type",
            slices[0].param
        )),
    }
}
