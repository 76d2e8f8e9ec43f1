//! The mlp workload's blocks: `Linear + ReLU`, and the output `Linear`.

use burn::module::Module;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::relu;

use crate::block::{Activation, BlockModule};
use crate::kernels::{Kernels, linear};

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
