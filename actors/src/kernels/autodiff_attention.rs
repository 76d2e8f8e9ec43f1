//! Causal self-attention from `qkv` as one node of `Autodiff<Flex>`'s graph: the forward and
//! backward of [`super::attention`] (OpenBLAS products, no head-split copies), keeping `qkv` and
//! the probabilities for the backward. Where it does not apply (OpenBLAS not in force, a
//! non-contiguous or oddly shaped `qkv`) [`applies`] says no and the caller composes the attention
//! from burn's ops.

use super::Tracked;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::{Flex, FlexTensor};

use super::attention::{self, Dims};
use super::{active_openblas, openblas};

#[derive(Debug)]
struct FusedAttention;

impl Backward<Flex, 1> for FusedAttention {
    /// `qkv` (checkpointed), the probabilities `P` and the sizes.
    type State = (NodeId, FlexTensor, Dims);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (qkv, p, dims) = ops.state;
        let qkv: FlexTensor = checkpointer.retrieve_node_output(qkv);
        unary::<Flex, _>(ops.parents, ops.node, grads, |dy| {
            let blas = openblas::library().expect("OpenBLAS ran this attention's forward");
            let dy = if dy.is_contiguous() {
                dy
            } else {
                dy.to_contiguous()
            };
            attention::backward(blas, &qkv, &p, &dy, dims)
                .unwrap_or_else(|why| panic!("attention backward {dims:?}: {why}"))
        });
    }
}

/// OpenBLAS and the sizes, where the fused attention applies to `qkv` with `heads` heads: OpenBLAS
/// in force and a contiguous f32 `[b, t, 3d]` with `d` a multiple of `heads`.
pub(crate) fn applies(qkv: &FlexTensor, heads: usize) -> Option<(&'static openblas::OpenBlas, Dims)> {
    let dims = attention::dims(qkv, heads)?;
    qkv.is_contiguous().then_some(())?;
    Some((active_openblas()?, dims))
}

/// The attention of `qkv` as one autodiff node (where [`applies`] said it does).
pub(crate) fn attention<C: CheckpointStrategy>(
    qkv: Tracked<C>,
    blas: &openblas::OpenBlas,
    dims: Dims,
) -> Tracked<C> {
    let (y, p) = attention::forward(blas, &qkv.primitive, dims)
        .unwrap_or_else(|why| panic!("attention forward {dims:?}: {why}"));
    match FusedAttention
        .prepare::<C>([qkv.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let kept = prep.checkpoint(&qkv);
            prep.finish((kept, p, dims), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}
