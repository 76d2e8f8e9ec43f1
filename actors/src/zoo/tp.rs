//! Where a block sits in its tensor-parallel group, and the pieces Megatron-LM's layers need
//! (Shoeybi et al. 2019): a row-parallel projection whose bias (and the residual it is added to)
//! only the group's first rank adds, so that the all-reduce after it (g) sums to exactly one
//! device's output.

use burn::nn::Linear;
use burn::tensor::Tensor;

use crate::kernels::{Kernels, linear};

pub use archipelago_dataflow::tensor_parallel::TpPlace;

/// `x · W (+ b on the first rank)`: a row-parallel layer's summand of the group's output.
pub fn row_parallel<B: Kernels, const D: usize>(
    layer: &Linear<B>,
    x: Tensor<B, D>,
    tp: TpPlace,
) -> Tensor<B, D> {
    if tp.leads() || layer.bias.is_none() {
        return linear(layer, x);
    }
    let mut dims = x.dims();
    let d_in = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let y = if B::flattens_linear() {
        B::kernel_linear(x.reshape([rows, d_in]), layer.weight.val(), None)
    } else {
        x.reshape([rows, d_in]).matmul(layer.weight.val())
    };
    dims[D - 1] = y.dims()[1];
    y.reshape(dims)
}
