//! LayerNorm (Ba et al., 2016) over the last dimension as one node of `Autodiff<Flex>`'s graph:
//! the forward makes each row's mean and `1/σ` in two passes and writes `y = x̂·γ + β`, keeping
//! `x̂` and `1/σ`; the backward makes the three gradients in one pass per row,
//! `dx = (g − mean(g) − x̂·mean(g·x̂)) / σ` with `g = dy·γ`, `dγ = Σ dy·x̂`, `dβ = Σ dy`.
//! burn composes LayerNorm of nine tensor ops (mean, subtract, square, mean, add, sqrt, divide,
//! scale, shift), each a graph node with its own buffers forward and backward.

use super::Tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{Flex, FlexTensor};

use super::flex_blas::zeroed;

/// `y = x̂·γ + β` per row of `x` (rows of `gamma.len()`), with `x̂` and `1/σ` per row.
fn forward(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    epsilon: f32,
    y: &mut [f32],
    xhat: &mut [f32],
    rstd: &mut [f32],
) {
    let d = gamma.len();
    for (((x, y), xhat), rstd) in (x.chunks_exact(d))
        .zip(y.chunks_exact_mut(d))
        .zip(xhat.chunks_exact_mut(d))
        .zip(rstd.iter_mut())
    {
        let mean = x.iter().sum::<f32>() / d as f32;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        *rstd = 1.0 / (var + epsilon).sqrt();
        for j in 0..d {
            xhat[j] = (x[j] - mean) * *rstd;
            y[j] = xhat[j] * gamma[j] + beta[j];
        }
    }
}

/// The gradients of `x`, `γ` and `β` from `dy` (rows of `gamma.len()`).
fn backward(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let d = gamma.len();
    for (((dy, xhat), dx), rstd) in (dy.chunks_exact(d))
        .zip(xhat.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
        .zip(rstd.iter())
    {
        let (mut sum_g, mut sum_gx) = (0.0f32, 0.0f32);
        for j in 0..d {
            let g = dy[j] * gamma[j];
            sum_g += g;
            sum_gx += g * xhat[j];
            dgamma[j] += dy[j] * xhat[j];
            dbeta[j] += dy[j];
        }
        let (mean_g, mean_gx) = (sum_g / d as f32, sum_gx / d as f32);
        for j in 0..d {
            dx[j] = rstd * (dy[j] * gamma[j] - mean_g - xhat[j] * mean_gx);
        }
    }
}

#[derive(Debug)]
struct LayerNorm;

impl Backward<Flex, 3> for LayerNorm {
    /// `x̂`, `1/σ` per row, and `γ`.
    type State = (FlexTensor, Vec<f32>, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (xhat, rstd, gamma) = ops.state;
        let dy = grads.consume::<Flex>(&ops.node).to_contiguous();
        let d = gamma.layout().shape().num_elements();
        let (mut dx, mut dgamma, mut dbeta) = (
            zeroed(xhat.layout().shape().to_vec()),
            zeroed(vec![d]),
            zeroed(vec![d]),
        );
        backward(
            dy.storage::<f32>(),
            xhat.storage::<f32>(),
            &rstd,
            gamma.storage::<f32>(),
            dx.storage_mut(),
            dgamma.storage_mut(),
            dbeta.storage_mut(),
        );
        let [x, g, b] = ops.parents;
        for (parent, grad) in [(x, dx), (g, dgamma), (b, dbeta)] {
            if let Some(parent) = parent {
                grads.register::<Flex>(parent.id, grad);
            }
        }
    }
}

/// LayerNorm of `x` (f32, normalised over its last dimension, of `gamma`'s length) as one
/// autodiff node; `None` where it does not apply (another dtype or size; the caller uses burn's).
pub(crate) fn layer_norm<C: CheckpointStrategy>(
    x: &Tracked<C>,
    gamma: &Tracked<C>,
    beta: &Tracked<C>,
    epsilon: f64,
) -> Option<Tracked<C>> {
    let f32_ = burn::tensor::DType::F32;
    if x.primitive.dtype() != f32_ || gamma.primitive.dtype() != f32_ || beta.primitive.dtype() != f32_ {
        return None;
    }
    let shape = x.primitive.layout().shape().to_vec();
    let d = *shape.last()?;
    let (g, b) = (gamma.primitive.to_contiguous(), beta.primitive.to_contiguous());
    if d == 0 || g.layout().shape().num_elements() != d || b.layout().shape().num_elements() != d {
        return None;
    }
    let input = x.primitive.to_contiguous();
    let rows = input.layout().shape().num_elements() / d;
    let (mut y, mut xhat, mut rstd) = (zeroed(shape.clone()), zeroed(shape), vec![0.0f32; rows]);
    forward(
        input.storage::<f32>(),
        g.storage::<f32>(),
        b.storage::<f32>(),
        epsilon as f32,
        y.storage_mut(),
        xhat.storage_mut(),
        &mut rstd,
    );
    let nodes = [x.node.clone(), gamma.node.clone(), beta.node.clone()];
    Some(match LayerNorm.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((xhat, rstd, g), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    })
}
