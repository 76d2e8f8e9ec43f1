//! The mlp workload's blocks: `Linear + ReLU`, and the output `Linear`; under tensor
//! parallelism, Megatron's alternating column- and row-parallel layers.

use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::relu;

use crate::block::{Activation, Block, BlockModule};
use crate::kernels::{Kernels, linear};
use crate::zoo::BuildContext;
use crate::zoo::tp::{TpPlace, row_parallel};
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::tensor_parallel::local_extent;

/// Block `ctx.block` of an mlp `[in, hidden, layers, out]`: `Linear + ReLU` blocks, then the
/// output `Linear`; under tp, Megatron's alternating column- and row-parallel layers.
pub(super) fn block<B: Kernels>(
    ctx: &BuildContext,
    spec: &ModelSpec,
    device: &B::Device,
) -> Box<dyn Block<B>> {
    let [input, hidden, layers, out]: [usize; 4] = spec.dims().try_into().expect("an mlp's four dimensions");
    let width_in = if ctx.block == 0 { input } else { hidden };
    if ctx.tp.size > 1 {
        let width_out = if ctx.block < layers { hidden } else { out };
        let (k, tp) = (ctx.block, ctx.tp);
        return Box::new(TpLinearBlock::new(k, layers, width_in, width_out, tp, device));
    }
    if ctx.block < layers {
        Box::new(LinearReluBlock::new(width_in, hidden, device))
    } else {
        Box::new(LinearBlock::new(width_in, out, device))
    }
}

/// `relu(x · W + b)`.
#[derive(Module, Debug)]
pub struct LinearReluBlock<B: burn::tensor::backend::Backend> {
    /// The linear layer (`[d_in, d_out]` weight).
    pub linear: Linear<B>,
}

impl<B: burn::tensor::backend::Backend> LinearReluBlock<B> {
    /// A block mapping `d_in` features to `d_out`.
    pub fn new(d_in: usize, d_out: usize, device: &B::Device) -> Self {
        LinearReluBlock {
            linear: LinearConfig::new(d_in, d_out)
                .with_initializer(Initializer::Zeros)
                .init(device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for LinearReluBlock<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        match x {
            Activation::Rows(x) => Activation::Rows(relu(linear(&self.linear, x))),
            other => panic!("LinearReluBlock takes dense rows, got {other:?}"),
        }
    }
}

/// `x · W + b` (the output layer: logits).
#[derive(Module, Debug)]
pub struct LinearBlock<B: burn::tensor::backend::Backend> {
    /// The linear layer.
    pub linear: Linear<B>,
}

impl<B: burn::tensor::backend::Backend> LinearBlock<B> {
    /// A block mapping `d_in` features to `d_out` logits.
    pub fn new(d_in: usize, d_out: usize, device: &B::Device) -> Self {
        LinearBlock {
            linear: LinearConfig::new(d_in, d_out)
                .with_initializer(Initializer::Zeros)
                .init(device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for LinearBlock<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        match x {
            Activation::Rows(x) => Activation::Rows(linear(&self.linear, x)),
            other => panic!("LinearBlock takes dense rows, got {other:?}"),
        }
    }
}

/// One mlp layer on a tensor-parallel rank (Megatron's MLP, alternating): an even layer is
/// column-parallel (its slice of the outputs, ReLU on them when hidden), an odd one row-parallel
/// (a summand of the outputs, the bias on the first rank). A row-parallel layer's ReLU waits for
/// the all-reduce after it (g) and is applied by the next layer to its input.
#[derive(Module, Debug)]
pub struct TpLinearBlock<B: burn::tensor::backend::Backend> {
    /// This rank's slice of the layer.
    pub linear: Linear<B>,
    /// ReLU of the input first (after a row-parallel hidden layer).
    pub relu_in: bool,
    /// ReLU of the output (a column-parallel hidden layer).
    pub relu_out: bool,
    /// Row-parallel: a summand, the bias on the first rank only.
    pub row: bool,
    /// This rank in its tensor-parallel group.
    pub tp_rank: usize,
    /// The group's size.
    pub tp_size: usize,
}

impl<B: burn::tensor::backend::Backend> TpLinearBlock<B> {
    /// Layer `k` of an mlp with `layers` hidden layers, mapping `d_in` to `d_out`, on rank `tp`.
    pub fn new(k: usize, layers: usize, d_in: usize, d_out: usize, tp: TpPlace, device: &B::Device) -> Self {
        let row = k % 2 == 1;
        let (d_in, d_out) = if row {
            (tp.part(d_in), d_out)
        } else {
            (d_in, local_extent(d_out, tp.size))
        };
        TpLinearBlock {
            linear: LinearConfig::new(d_in, d_out)
                .with_initializer(Initializer::Zeros)
                .init(device),
            relu_in: !row && k > 0,
            relu_out: !row && k < layers,
            row,
            tp_rank: tp.rank,
            tp_size: tp.size,
        }
    }
}

impl<B: Kernels> BlockModule<B> for TpLinearBlock<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Rows(x) = x else {
            panic!("TpLinearBlock takes dense rows, got {x:?}")
        };
        let x = if self.relu_in { relu(x) } else { x };
        let y = if self.row {
            row_parallel(&self.linear, x, TpPlace::new(self.tp_rank, self.tp_size))
        } else {
            linear(&self.linear, x)
        };
        Activation::Rows(if self.relu_out { relu(y) } else { y })
    }
}
