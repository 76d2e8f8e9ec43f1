//! A block with frozen parameters, as the trainer holds it: it shows the trainer only its
//! trained vector ([`TrainedLayout`]) and keeps the frozen values itself.
//!
//! The trainer's buckets, segments, ZeRO shards, optimizer state and checkpoints all work on
//! trained vectors; a frozen parameter has no place in any of them (as PyTorch's
//! `requires_grad_(False)` with an optimizer built over the trainable parameters, what PEFT does
//! for a base model). [`PartlyFrozen`] merges the frozen values back in whenever parameters are
//! loaded into the module, takes the frozen parameters out of autodiff (no backward computes
//! their gradient), and hands out only the trainable parameters' values, shapes and gradients.

use std::sync::Arc;

use archipelago_dataflow::TrainedLayout;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Float, Tensor, TensorData};

use crate::block::{Activation, Block};
use crate::transfer::{TransferKind, upload};

/// A block whose frozen parameters stay out of the trainer's view.
pub struct PartlyFrozen<B: AutodiffBackend> {
    inner: Box<dyn Block<B>>,
    layout: Arc<TrainedLayout>,
    /// The frozen parameters' values, concatenated in flattening order.
    frozen: Arc<Vec<f32>>,
}

impl<B: AutodiffBackend> PartlyFrozen<B> {
    /// `block` as the trainer holds it: itself when nothing in `layout` is frozen, else wrapped
    /// with its frozen parameters out of autodiff. Load the trained vector next
    /// ([`Block::load_params`]): that also writes `frozen` into the module.
    ///
    /// # Panics
    /// When `frozen` is not as long as the layout's frozen values.
    pub fn hold(
        block: Box<dyn Block<B>>,
        layout: Arc<TrainedLayout>,
        frozen: Arc<Vec<f32>>,
    ) -> Box<dyn Block<B>> {
        if !layout.has_frozen() {
            return block;
        }
        assert_eq!(frozen.len(), layout.frozen_len(), "a block's frozen values");
        let inner = block.freeze(&layout.trainable_mask());
        Box::new(PartlyFrozen {
            inner,
            layout,
            frozen,
        })
    }

    fn rewrap(&self, inner: Box<dyn Block<B>>) -> Box<dyn Block<B>> {
        Box::new(PartlyFrozen {
            inner,
            layout: self.layout.clone(),
            frozen: self.frozen.clone(),
        })
    }
}

impl<B: AutodiffBackend> Block<B> for PartlyFrozen<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        self.inner.forward(x)
    }

    fn num_params(&self) -> usize {
        self.layout.trained_len()
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mask = self.layout.trainable_mask();
        let shapes = self.inner.param_shapes().into_iter().zip(mask);
        shapes
            .filter(|(_, trains)| *trains)
            .map(|(shape, _)| shape)
            .collect()
    }

    fn write_params(&self, out: &mut [f32]) {
        let mut full = vec![0.0; self.layout.full_len()];
        self.inner.write_params(&mut full);
        for (trained, full_range) in self.layout.trained_in_full(0..self.layout.trained_len()) {
            out[trained].copy_from_slice(&full[full_range]);
        }
    }

    fn write_full_params(&self, out: &mut [f32]) {
        self.inner.write_params(out)
    }

    fn load_params(self: Box<Self>, flat: &[f32], one_transfer: bool) -> Box<dyn Block<B>> {
        let full = self.layout.merge(flat, &self.frozen);
        let PartlyFrozen {
            inner,
            layout,
            frozen,
        } = *self;
        let loaded = inner.load_params(&full, one_transfer);
        Box::new(PartlyFrozen {
            inner: loaded,
            layout,
            frozen,
        })
    }

    fn load_params_from(self: Box<Self>, whole: Tensor<B::InnerBackend, 1>) -> Box<dyn Block<B>> {
        let device = whole.device();
        let pieces: Vec<Tensor<B::InnerBackend, 1>> = (self.layout.runs().iter())
            .map(|run| {
                let at = run.at..run.at + run.full.len();
                if run.trained {
                    whole.clone().slice([at])
                } else {
                    let values = TensorData::new(self.frozen[at.clone()].to_vec(), [at.len()]);
                    upload::<B::InnerBackend, 1, Float>(values, &device, TransferKind::Parameter)
                }
            })
            .collect();
        let full = Tensor::cat(pieces, 0);
        let PartlyFrozen {
            inner,
            layout,
            frozen,
        } = *self;
        let loaded = inner.load_params_from(full);
        Box::new(PartlyFrozen {
            inner: loaded,
            layout,
            frozen,
        })
    }

    fn fresh_copy(&self) -> Box<dyn Block<B>> {
        self.rewrap(self.inner.fresh_copy())
    }

    fn untracked_copy(&self) -> Box<dyn Block<B>> {
        self.rewrap(self.inner.untracked_copy())
    }

    fn take_grads(&self, grads: &mut B::Gradients) -> Vec<Tensor<B::InnerBackend, 1>> {
        // The frozen parameters are out of autodiff: the inner block skips them.
        self.inner.take_grads(grads)
    }

    /// Already frozen as its layout says; `trainable` (over its trained vector) is not consulted.
    fn freeze(self: Box<Self>, _trainable: &[bool]) -> Box<dyn Block<B>> {
        self
    }
}
