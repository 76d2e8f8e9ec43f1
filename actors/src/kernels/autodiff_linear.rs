//! The 16-bit linear layer of `Autodiff<Flex>` (mixed precision, issue 38) as one graph node:
//! `y = round(x·W + b)` with the product (OpenBLAS) and the bias add in f32 and one rounding to
//! the 16-bit dtype, and a backward that makes `dx = dy·Wᵀ`, `dW = xᵀ·dy` and `db = Σ_rows dy` in
//! f32, each rounded once to its operand's dtype (the gradients burn hands a bf16 leaf).
//!
//! Composed of burn's ops ([`super::composed_linear`]) the bias add and, backward, the bias
//! gradient's row sum ran in bf16 through Flex's scalar element-wise path (through f32 per
//! element): Flex's `binary_op` and `sum_dim` were 28 % and 6 % of a bf16 gpt-tiny step, most
//! of it this layer's; with this node 11–12 % and 0.2–0.3 % (the rest: the residual adds and
//! the accumulation of gradients), and the step 1.2–1.5× f32's from 1.85× (`perf`, 2026-11-27).
//! Here they are f32 loops the compiler vectorises, between the widening of the operands
//! (`cast.rs`) and the rounding of the results. f32 layers keep the composed path, as do layers
//! without a bias and every layer where OpenBLAS is not in force ([`applies`]).
//!
//! The backward widens the checkpointed 16-bit `x` and `W` again (as the matmul node does)
//! rather than keep their f32 copies from the forward: twice the memory for one pass each.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::DType;
use burn::tensor::ops::FloatTensorOps;

use super::cast::convert;
use super::openblas::{self, OpenBlas};
use super::{Tracked, active_openblas, flex_blas};

/// OpenBLAS, where the fused linear applies to `x` `[rows, d_in]`, `weight` `[d_in, d_out]` and
/// `bias` `[d_out]`: all three of one 16-bit dtype (bf16 or f16) and OpenBLAS in force.
pub(crate) fn applies(x: &FlexTensor, weight: &FlexTensor, bias: &FlexTensor) -> Option<&'static OpenBlas> {
    let dtype = x.dtype();
    let sixteen_bit = matches!(dtype, DType::BF16 | DType::F16);
    (sixteen_bit && weight.dtype() == dtype && bias.dtype() == dtype).then_some(())?;
    let (xs, ws, bs) = (x.layout().shape(), weight.layout().shape(), bias.layout().shape());
    let shaped = xs.num_dims() == 2 && ws.num_dims() == 2 && bs.num_dims() == 1;
    (shaped && xs[1] == ws[0] && bs[0] == ws[1]).then_some(())?;
    active_openblas()
}

/// `lhs · rhs` of f32 tensors: OpenBLAS, or Flex's gemm where OpenBLAS's path does not take them.
fn product(blas: &OpenBlas, lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    flex_blas::matmul(blas, &lhs, &rhs).unwrap_or_else(|| Flex::float_matmul(lhs, rhs))
}

/// `y += bias` on every row of a contiguous `[rows, bias.len()]` buffer.
fn add_to_rows(y: &mut [f32], bias: &[f32]) {
    for row in y.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// `Σ_rows dy` of a contiguous `[rows, n]` buffer, as an `[n]` tensor.
fn sum_rows(dy: &[f32], n: usize) -> FlexTensor {
    let mut sum = flex_blas::zeroed(vec![n]);
    let out = sum.storage_mut::<f32>();
    if n > 0 {
        for row in dy.chunks_exact(n) {
            for (s, d) in out.iter_mut().zip(row) {
                *s += d;
            }
        }
    }
    sum
}

/// `x·W + b` in f32, rounded once to `dtype`.
fn forward(
    blas: &OpenBlas,
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: &FlexTensor,
    dtype: DType,
) -> FlexTensor {
    let wide = |t: &FlexTensor| convert(t.clone(), DType::F32);
    // Contiguous with the buffer to itself (OpenBLAS's products are), so written in place.
    let mut y = product(blas, wide(x), wide(weight)).to_contiguous();
    let bias = wide(bias).to_contiguous();
    add_to_rows(y.storage_mut::<f32>(), bias.storage::<f32>());
    convert(y, dtype)
}

#[derive(Debug)]
struct FusedLinear;

impl Backward<Flex, 3> for FusedLinear {
    /// The checkpointed inputs each product needs (`x` for `dW`, `W` for `dx`) and the operands'
    /// 16-bit dtype, the gradients'.
    type State = (Option<NodeId>, Option<NodeId>, DType);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (x, weight, dtype) = ops.state;
        let x: Option<FlexTensor> = x.map(|id| checkpointer.retrieve_node_output(id));
        let weight: Option<FlexTensor> = weight.map(|id| checkpointer.retrieve_node_output(id));
        let blas = openblas::library().expect("OpenBLAS ran this linear's forward");
        let dy = convert(grads.consume::<Flex>(&ops.node), DType::F32);
        let wide = |t: FlexTensor| convert(t, DType::F32);
        let [x_node, weight_node, bias_node] = ops.parents;
        if let Some(node) = x_node {
            let weight = wide(weight.expect("W kept for dx"));
            let dx = product(blas, dy.clone(), Flex::float_transpose(weight));
            grads.register::<Flex>(node.id, convert(dx, dtype));
        }
        if let Some(node) = weight_node {
            let x = wide(x.expect("x kept for dW"));
            let dw = product(blas, Flex::float_transpose(x), dy.clone());
            grads.register::<Flex>(node.id, convert(dw, dtype));
        }
        if let Some(node) = bias_node {
            let n = dy.layout().shape()[1];
            let db = sum_rows(dy.to_contiguous().storage::<f32>(), n);
            grads.register::<Flex>(node.id, convert(db, dtype));
        }
    }
}

/// `x·W + b` as one autodiff node (where [`applies`] gave `blas`).
pub(crate) fn linear<C: CheckpointStrategy>(
    x: Tracked<C>,
    weight: Tracked<C>,
    bias: Tracked<C>,
    blas: &OpenBlas,
) -> Tracked<C> {
    let dtype = x.primitive.dtype();
    let y = forward(blas, &x.primitive, &weight.primitive, &bias.primitive, dtype);
    let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
    let nodes = [x.node.clone(), weight.node.clone(), bias.node.clone()];
    match FusedLinear.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(mut prep) => {
            let x_state = weight_tracked.then(|| prep.checkpoint(&x));
            let weight_state = x_tracked.then(|| prep.checkpoint(&weight));
            prep.finish((x_state, weight_state, dtype), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

#[cfg(test)]
#[path = "autodiff_linear_tests.rs"]
mod tests;
