//! Where a block sits in its tensor-parallel group, and the pieces Megatron-LM's layers need
//! (Shoeybi et al. 2019): a row-parallel projection whose bias (and the residual it is added to)
//! only the group's first rank adds, so that the all-reduce after it (g) sums to exactly one
//! device's output.

use burn::nn::Linear;
use burn::tensor::Tensor;

use crate::kernels::{Kernels, linear, linear_without_bias};

pub use archipelago_dataflow::tensor_parallel::TpPlace;

/// `x · W (+ b on the first rank)`: a row-parallel layer's summand of the group's output.
pub fn row_parallel<B: Kernels, const D: usize>(
    layer: &Linear<B>,
    x: Tensor<B, D>,
    tp: TpPlace,
) -> Tensor<B, D> {
    if tp.leads() {
        linear(layer, x)
    } else {
        linear_without_bias(layer, x)
    }
}
