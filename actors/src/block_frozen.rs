//! A block with frozen parameters, as the trainer holds it: it shows the trainer only its
//! trained vector ([`TrainedLayout`]) and keeps the frozen values itself.
//!
//! The trainer's buckets, segments, ZeRO shards, optimizer state and checkpoints all work on
//! trained vectors; a frozen parameter has no place in any of them (as PyTorch's
//! `requires_grad_(False)` with an optimizer built over the trainable parameters, what PEFT does
//! for a base model). [`PartlyFrozen`] takes the frozen parameters out of autodiff (no backward
//! computes their gradient) and writes their values into the module once, when it is built; every
//! later load writes the trained vector only (a frozen base model is never uploaded again), and
//! only the trainable parameters' values, shapes and gradients are handed out.
//!
//! A tie's mirror ([`archipelago_dataflow::ties`]) is frozen in that sense (no place in the
//! trained vector, its values written by the step's `LoadTied`), but when the parameter it mirrors
//! trains, each micro-batch's copy of the block keeps it in autodiff, and its gradient is handed
//! out apart ([`Block::take_tied_grads`]) to be added into the mirrored parameter's.

use std::sync::Arc;

use archipelago_dataflow::TrainedLayout;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use crate::block::{Activation, Block, Pasts};

/// A block whose frozen parameters stay out of the trainer's view.
pub struct PartlyFrozen<B: AutodiffBackend> {
    inner: Box<dyn Block<B>>,
    layout: Arc<TrainedLayout>,
    /// Per parameter (flattening order): a mirror of a trained parameter, tracked in the
    /// micro-batches' copies; `None` when the block has none.
    tied: Option<Arc<Vec<bool>>>,
}

impl<B: AutodiffBackend> PartlyFrozen<B> {
    /// `block` as the trainer holds it: itself when nothing in `layout` is frozen, else with its
    /// frozen parameters out of autodiff and set to `frozen` (their concatenation), once: later
    /// loads ([`Block::load_params`]) write only the trained vector. `tied` (per parameter, or
    /// empty) marks the mirrors of trained parameters.
    ///
    /// # Panics
    /// When `frozen` is not as long as the layout's frozen values.
    pub fn hold(
        block: Box<dyn Block<B>>,
        layout: Arc<TrainedLayout>,
        frozen: &[f32],
        tied: &[bool],
    ) -> Box<dyn Block<B>> {
        if !layout.has_frozen() {
            return block;
        }
        assert_eq!(frozen.len(), layout.frozen_len(), "a block's frozen values");
        let inner = block.freeze(&layout.trainable_mask()).load_frozen(frozen);
        let tied = tied.contains(&true).then(|| Arc::new(tied.to_vec()));
        Box::new(PartlyFrozen { inner, layout, tied })
    }

    fn rewrap(&self, inner: Box<dyn Block<B>>) -> Box<dyn Block<B>> {
        Box::new(PartlyFrozen {
            inner,
            layout: self.layout.clone(),
            tied: self.tied.clone(),
        })
    }
}

impl<B: AutodiffBackend> Block<B> for PartlyFrozen<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        self.inner.forward(x)
    }

    fn forward_cached(&self, x: Activation<B>, pasts: &mut Pasts<B>) -> Activation<B> {
        self.inner.forward_cached(x, pasts)
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
        // The inner block writes only what is in autodiff: the trained vector.
        self.inner.write_params(out)
    }

    fn write_full_params(&self, out: &mut [f32]) {
        self.inner.write_full_params(out)
    }

    fn load_params(self: Box<Self>, flat: &[f32], one_transfer: bool) -> Box<dyn Block<B>> {
        // The frozen parameters stay as they are on the device: nothing of them moves.
        let PartlyFrozen { inner, layout, tied } = *self;
        let inner = inner.load_params(flat, one_transfer);
        Box::new(PartlyFrozen { inner, layout, tied })
    }

    fn load_params_from(self: Box<Self>, whole: Tensor<B::InnerBackend, 1>) -> Box<dyn Block<B>> {
        let PartlyFrozen { inner, layout, tied } = *self;
        let inner = inner.load_params_from(whole);
        Box::new(PartlyFrozen { inner, layout, tied })
    }

    fn fresh_copy(&self) -> Box<dyn Block<B>> {
        let copy = self.inner.fresh_copy();
        match &self.tied {
            Some(tied) => self.rewrap(copy.track(tied)),
            None => self.rewrap(copy),
        }
    }

    fn untracked_copy(&self) -> Box<dyn Block<B>> {
        self.rewrap(self.inner.untracked_copy())
    }

    fn take_grads(&self, grads: &mut B::Gradients) -> Vec<Tensor<B::InnerBackend, 1>> {
        // The frozen parameters are out of autodiff: the inner block skips them (the tracked
        // mirrors of a copy are in it, so it is told which).
        match &self.tied {
            Some(_) => self.inner.take_grads_of(grads, &self.layout.trainable_mask()),
            None => self.inner.take_grads(grads),
        }
    }

    fn take_grads_of(&self, grads: &mut B::Gradients, which: &[bool]) -> Vec<Tensor<B::InnerBackend, 1>> {
        self.inner.take_grads_of(grads, which)
    }

    fn take_tied_grads(&self, grads: &mut B::Gradients) -> Vec<Tensor<B::InnerBackend, 1>> {
        match &self.tied {
            Some(tied) => self.inner.take_grads_of(grads, tied),
            None => Vec::new(),
        }
    }

    fn track(self: Box<Self>, which: &[bool]) -> Box<dyn Block<B>> {
        let PartlyFrozen { inner, layout, tied } = *self;
        let inner = inner.track(which);
        Box::new(PartlyFrozen { inner, layout, tied })
    }

    /// Already frozen as its layout says; `trainable` (over its trained vector) is not consulted.
    fn freeze(self: Box<Self>, _trainable: &[bool]) -> Box<dyn Block<B>> {
        self
    }

    fn load_frozen(self: Box<Self>, values: &[f32]) -> Box<dyn Block<B>> {
        let PartlyFrozen { inner, layout, tied } = *self;
        let inner = inner.load_frozen(values);
        Box::new(PartlyFrozen { inner, layout, tied })
    }

    fn cast_params(self: Box<Self>, dtype: burn::tensor::FloatDType) -> Box<dyn Block<B>> {
        let PartlyFrozen { inner, layout, tied } = *self;
        let inner = inner.cast_params(dtype);
        Box::new(PartlyFrozen { inner, layout, tied })
    }
}
