//! The matmul of `Autodiff<Flex>` with OpenBLAS in its forward and in both halves of its
//! backward (`dlhs = dy · rhsᵀ`, `drhs = lhsᵀ · dy`), as burn's own autodiff matmul is built
//! (same graph node, same checkpointing of the inputs), only the inner kernel differs.
//!
//! Batch dimensions that broadcast would need their gradient summed back to the operand's shape:
//! those products take burn's own autodiff matmul (none of the zoo's do).

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, TensorMetadata};

use super::cast::convert;
use super::{active_openblas, flex_blas};

/// `lhs · rhs` on Flex tensors: OpenBLAS where it is in use and applies, Flex's gemm otherwise.
///
/// 16-bit operands (mixed precision) are widened to f32 for OpenBLAS and the product rounded back
/// to their dtype: f32 arithmetic, as Flex's own bf16 matmul does, at OpenBLAS's speed.
pub(crate) fn inner_matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let Some(blas) = active_openblas() else {
        return Flex::float_matmul(lhs, rhs);
    };
    let dtype = lhs.dtype();
    if dtype != DType::F32 && rhs.dtype() == dtype {
        let wide = |t| convert(t, DType::F32);
        let (l, r) = (wide(lhs.clone()), wide(rhs.clone()));
        return match flex_blas::matmul(blas, &l, &r) {
            Some(product) => convert(product, dtype),
            None => Flex::float_matmul(lhs, rhs),
        };
    }
    match flex_blas::matmul(blas, &lhs, &rhs) {
        Some(product) => product,
        None => Flex::float_matmul(lhs, rhs),
    }
}

#[derive(Debug)]
struct BlasMatmul;

impl Backward<Flex, 2> for BlasMatmul {
    /// The checkpointed inputs each gradient needs: `lhs` for `drhs`, `rhs` for `dlhs`.
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (lhs, rhs) = ops.state;
        let lhs: Option<FlexTensor> = lhs.map(|id| checkpointer.retrieve_node_output(id));
        let rhs: Option<FlexTensor> = rhs.map(|id| checkpointer.retrieve_node_output(id));
        binary::<Flex, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| inner_matmul(grad, Flex::float_transpose(rhs.expect("rhs kept for dlhs"))),
            |grad| inner_matmul(Flex::float_transpose(lhs.expect("lhs kept for drhs")), grad),
        );
    }
}

/// Whether every batch dimension of the two operands is the same size (no broadcast).
fn same_batch(lhs: &FlexTensor, rhs: &FlexTensor) -> bool {
    let (l, r) = (lhs.shape(), rhs.shape());
    let dims = l.num_dims();
    dims >= 2 && r.num_dims() == dims && (0..dims - 2).all(|i| l[i] == r[i])
}

/// The autodiff matmul of `Autodiff<Flex, C>` with [`inner_matmul`] as its kernel.
pub(crate) fn matmul<C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<Flex, C>>,
    rhs: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    if !same_batch(&lhs.primitive, &rhs.primitive) {
        return Autodiff::<Flex, C>::float_matmul(lhs, rhs);
    }
    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    match BlasMatmul
        .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let lhs_state = rhs_tracked.then(|| prep.checkpoint(&lhs));
            let rhs_state = lhs_tracked.then(|| prep.checkpoint(&rhs));
            prep.finish((lhs_state, rhs_state), inner_matmul(lhs.primitive, rhs.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(inner_matmul(lhs.primitive, rhs.primitive)),
    }
}
