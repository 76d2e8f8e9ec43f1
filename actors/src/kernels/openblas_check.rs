//! The check every OpenBLAS candidate passes before it multiplies for the process: its products
//! through [`flex_blas::matmul`] (the path training takes) equal Flex's own at the layouts the
//! models make — plain, either operand transposed, batched attention views — at sizes that take
//! both OpenBLAS's small-matrix and blocked paths, within the rounding two correct f32 products
//! may differ by. OpenBLAS's core-type variable exists because older builds computed wrong
//! products on some new CPUs; a candidate that fails gives way to the next (`core_type.rs`).
//! It costs a few milliseconds, once per process.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::TensorData;
use burn::tensor::ops::FloatTensorOps;

use super::flex_blas;
use super::openblas::OpenBlas;

/// Deterministic values in [-0.5, 0.5) of the given shape.
fn values(shape: Vec<usize>, seed: u64) -> FlexTensor {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    FlexTensor::from_data(TensorData::new(data, shape))
}

/// The operand pairs checked, as (name, lhs, rhs) views.
fn cases() -> Vec<(&'static str, FlexTensor, FlexTensor)> {
    let t = |x: FlexTensor| x.transpose(0, 1);
    vec![
        (
            "plain 130×96·96×70",
            values(vec![130, 96], 1),
            values(vec![96, 70], 2),
        ),
        (
            "plain 300×280·280×260",
            values(vec![300, 280], 3),
            values(vec![280, 260], 4),
        ),
        (
            "lhs transposed (xᵀ·dy)",
            t(values(vec![200, 64], 5)),
            values(vec![200, 72], 6),
        ),
        (
            "rhs transposed (dy·Wᵀ)",
            values(vec![77, 64], 7),
            t(values(vec![130, 64], 8)),
        ),
        (
            "attention scores q·kᵀ",
            values(vec![2, 33, 4, 16], 9).transpose(1, 2),
            values(vec![2, 33, 4, 16], 10).transpose(1, 2).transpose(2, 3),
        ),
    ]
}

/// Whether `blas` multiplies as Flex does (see the module); the first difference otherwise.
pub(super) fn agrees_with_flex(blas: &OpenBlas) -> Result<(), String> {
    for (what, lhs, rhs) in cases() {
        let k = lhs.layout().shape()[lhs.layout().num_dims() - 1];
        let got = flex_blas::matmul(blas, &lhs, &rhs)
            .ok_or_else(|| format!("{what}: OpenBLAS's path refused the operands"))?;
        let magnitude = Flex::float_matmul(Flex::float_abs(lhs.clone()), Flex::float_abs(rhs.clone()));
        let want = Flex::float_matmul(lhs, rhs);
        let (got, want, magnitude) = (flat(got), flat(want), flat(magnitude));
        if got.len() != want.len() {
            return Err(format!(
                "{what}: {} values where Flex gives {}",
                got.len(),
                want.len()
            ));
        }
        // A correct f32 sum of k products lies within about k·2⁻²⁴·Σ|a·b| of the exact one, two
        // such sums within k·2⁻²³ of each other: twice that is allowed (NaN never is).
        let slack = 2.0 * k as f32 * f32::EPSILON;
        for (i, ((g, w), m)) in got.iter().zip(&want).zip(&magnitude).enumerate() {
            let close = (g - w).abs() <= slack * m + 1e-30;
            if !close {
                return Err(format!(
                    "{what}: value {i} is {g} where Flex's gemm gives {w} ({}: wrong products)",
                    blas.core
                ));
            }
        }
    }
    Ok(())
}

fn flat(t: FlexTensor) -> Vec<f32> {
    t.into_data().to_vec().unwrap_or_default()
}
