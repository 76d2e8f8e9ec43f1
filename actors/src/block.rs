//! The block trait and parameter flattening for burn modules.
//!
//! A model is an ordered list of blocks. A block is any burn [`Module`] with a forward on an
//! [`Activation`]; implementing [`BlockModule`] is all a user writes. Parameters cross into the
//! runtime as one flat `f32` vector per block, in the module's declaration order
//! ([`burn::module::ModuleVisitor`] to read, [`burn::module::ModuleMapper`] to write back,
//! keeping each `ParamId`; the visitors and mappers are in `visit`), so that buckets, collectives
//! and optimizers work on plain slices.

use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Float, FloatDType, Int, Tensor, TensorData};

use crate::kernels::paged_attention::{PageShape, PagedLayer};
use crate::transfer::{TransferKind, download, upload};

/// What a block keeps of the positions it has seen, for generation (the KV cache of Pope et
/// al., 2022): how many there are and, for an attention block, their keys and values.
#[derive(Debug, Clone)]
pub struct Past<B: Backend> {
    /// Positions seen so far (the next new one is at this position).
    pub offset: usize,
    /// An attention's keys and values of those positions, each `[b, heads, offset, head width]`.
    pub kv: Option<(Tensor<B, 4>, Tensor<B, 4>)>,
}

impl<B: Backend> Default for Past<B> {
    fn default() -> Self {
        Past { offset: 0, kv: None }
    }
}

/// The pasts of the sequences whose new positions lie side by side in one activation
/// (`[1, Σ new, ·]`: continuous batching's flattened step, Yu et al., Orca, OSDI 2022), each with
/// how many new positions it has there, in order.
#[derive(Debug, Clone)]
pub struct Pasts<B: Backend> {
    /// Each sequence's past and its count of new positions.
    pub seqs: Vec<(Past<B>, usize)>,
    /// With a paged cache: the layer's pool and each sequence's block table (the pasts then
    /// hold offsets only).
    pub paged: Option<PagedStep>,
}

/// One attention layer's paged pool during a step ([`crate::kernels::paged_attention`]), and
/// the block table of each sequence in the step, in order.
#[derive(Debug, Clone, Default)]
pub struct PagedStep {
    /// The layer's keys and values.
    pub layer: PagedLayer,
    /// Blocks in the pool.
    pub blocks: usize,
    /// Positions per block.
    pub block_tokens: usize,
    /// Each sequence's blocks.
    pub tables: Vec<Vec<usize>>,
}

impl PagedStep {
    /// Attention of the new positions in the fused projection `qkv` `[1, Σ n, 3d]` — sequence
    /// after sequence, `n` of each after its `offset` (`seqs`) — over each one's paged past and
    /// itself, with `heads` heads: their keys and values written into the pool first. `[1, Σ n, d]`.
    pub fn attend<B: Backend>(
        &mut self,
        qkv: Tensor<B, 3>,
        seqs: &[(Past<B>, usize)],
        heads: usize,
    ) -> Tensor<B, 3> {
        let [_, total, d3] = qkv.dims();
        let d = d3 / 3;
        let (device, dtype) = (qkv.device(), qkv.dtype());
        let rows = (qkv.into_data().convert::<f32>().to_vec::<f32>()).expect("a float projection");
        let shape = PageShape {
            block_tokens: self.block_tokens,
            heads,
            head_width: d / heads,
        };
        self.layer.reserve(self.blocks, shape);
        let mut out = vec![0.0; total * d];
        let mut lse = vec![0.0; total * heads];
        let mut start = 0;
        for ((past, n), table) in seqs.iter().zip(&self.tables) {
            let (first, end) = (start, start + n);
            let qkv = &rows[first * d3..end * d3];
            self.layer.write(shape, table, past.offset, qkv);
            let (out, lse) = (&mut out[first * d..end * d], &mut lse[first * heads..end * heads]);
            self.layer.attend(shape, table, past.offset, qkv, out, lse);
            start = end;
        }
        Tensor::<B, 3>::from_data(TensorData::new(out, [1, total, d]), &device).cast(dtype)
    }
}

impl<B: Backend> Pasts<B> {
    /// The absolute positions of the new ones, sequence after sequence.
    pub fn positions(&self) -> Vec<i64> {
        (self.seqs.iter())
            .flat_map(|(past, new)| (past.offset..past.offset + new).map(|p| p as i64))
            .collect()
    }
}

/// What flows between blocks.
#[derive(Debug, Clone)]
pub enum Activation<B: Backend> {
    /// Dense rows `[batch, features]`.
    Rows(Tensor<B, 2>),
    /// Token ids `[batch, seq]`.
    Tokens(Tensor<B, 2, Int>),
    /// A sequence of vectors `[batch, seq, width]`.
    Seq(Tensor<B, 3>),
}

impl<B: AutodiffBackend> Activation<B> {
    /// A fresh leaf of the autodiff graph with the same values (the input of a segment), so a
    /// segment's backward stops at its input and yields the input's gradient.
    pub fn leaf(&self) -> Activation<B> {
        match self {
            Activation::Rows(t) => Activation::Rows(t.clone().detach().require_grad()),
            Activation::Seq(t) => Activation::Seq(t.clone().detach().require_grad()),
            Activation::Tokens(t) => Activation::Tokens(t.clone()),
        }
    }

    /// The same values outside autodiff, even where they are a leaf that requires a gradient
    /// (burn's `detach` keeps that): ops on them record nothing.
    pub fn untracked(self) -> Activation<B> {
        match self {
            Activation::Rows(t) => Activation::Rows(t.detach().set_require_grad(false)),
            Activation::Seq(t) => Activation::Seq(t.detach().set_require_grad(false)),
            Activation::Tokens(t) => Activation::Tokens(t),
        }
    }

    /// The same values in `dtype` (token ids unchanged; a no-op when already in it): a batch's
    /// rows or a received activation entering a block that computes in `dtype`.
    pub fn cast(self, dtype: FloatDType) -> Activation<B> {
        match self {
            Activation::Rows(t) => Activation::Rows(t.cast(dtype)),
            Activation::Seq(t) => Activation::Seq(t.cast(dtype)),
            Activation::Tokens(t) => Activation::Tokens(t),
        }
    }

    /// The gradient of this leaf, removed from `grads` (None for token ids).
    pub fn take_grad(&self, grads: &mut B::Gradients) -> Option<Activation<B>> {
        match self {
            Activation::Rows(t) => t
                .grad_remove(grads)
                .map(|g| Activation::Rows(Tensor::from_inner(g))),
            Activation::Seq(t) => t
                .grad_remove(grads)
                .map(|g| Activation::Seq(Tensor::from_inner(g))),
            Activation::Tokens(_) => None,
        }
    }

    /// `sum(self ⊙ upstream)`: backpropagating it gives the vector–Jacobian product of the
    /// segment that produced `self` with the upstream gradient.
    ///
    /// # Panics
    /// When the two activations are of different kinds.
    pub fn dot(&self, upstream: &Activation<B>) -> Tensor<B, 1> {
        match (self, upstream) {
            (Activation::Rows(y), Activation::Rows(g)) => (y.clone() * g.clone()).sum(),
            (Activation::Seq(y), Activation::Seq(g)) => (y.clone() * g.clone()).sum(),
            _ => panic!("upstream gradient does not match the activation kind"),
        }
    }
}

/// A burn module that can be a block: a forward on an activation.
pub trait BlockModule<B: AutodiffBackend>: Module<B> + Send + 'static {
    /// The block's forward.
    fn forward(&self, x: Activation<B>) -> Activation<B>;

    /// The forward of new positions that follow the sequences' pasts (generation: `x` holds
    /// only the new positions, sequence after sequence in one row, each sequence's starting at
    /// its past's offset); what it keeps of them goes into the pasts (an attention's keys and
    /// values). The default is [`BlockModule::forward`]: a block whose output at a position
    /// depends on that position's input alone.
    fn forward_cached(&self, x: Activation<B>, _pasts: &mut Pasts<B>) -> Activation<B> {
        self.forward(x)
    }

    /// The block's linear layers in int8 for inference (LLM.int8,
    /// [`crate::kernels::int8`]), their f32 weights dropped; the bytes before and after. The
    /// default: a block without layers to quantize.
    fn quantize_int8(&mut self, _threshold: f32) -> Result<crate::zoo::int8_layers::Int8Bytes, String> {
        Ok(Default::default())
    }
}

/// A block as the runtime holds it (object safe).
pub trait Block<B: AutodiffBackend>: Send {
    /// The forward.
    fn forward(&self, x: Activation<B>) -> Activation<B>;
    /// The forward of new positions after the pasts ([`BlockModule::forward_cached`]).
    fn forward_cached(&self, x: Activation<B>, pasts: &mut Pasts<B>) -> Activation<B>;
    /// [`BlockModule::quantize_int8`].
    fn quantize_int8(&mut self, _threshold: f32) -> Result<crate::zoo::int8_layers::Int8Bytes, String> {
        Err("this block cannot run in int8".into())
    }
    /// Number of f32 parameters.
    fn num_params(&self) -> usize;
    /// Parameter paths and shapes in flattening order.
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)>;
    /// Copies the trainable parameters (those in autodiff; all of them unless [`Block::freeze`]
    /// took some out) into `out` (length [`Block::num_params`]).
    fn write_params(&self, out: &mut [f32]);
    /// Replaces the trainable parameters with `flat` (frozen ones keep their values), keeping
    /// ids and `require_grad`; with `one_transfer`
    /// `flat` goes to the device in one write and each parameter is a slice of it there (GPUs),
    /// else each parameter is written on its own.
    fn load_params(self: Box<Self>, flat: &[f32], one_transfer: bool) -> Box<dyn Block<B>>;
    /// Replaces the parameters with slices of `whole`, a flat tensor already on the block's
    /// device (training state on the device): nothing crosses between host and device.
    fn load_params_from(self: Box<Self>, whole: Tensor<B::InnerBackend, 1>) -> Box<dyn Block<B>>;
    /// A copy whose parameters are fresh autodiff leaves over the same values (no bytes copied):
    /// each micro-batch's forward runs on its own copy, so the graphs of micro-batches in flight
    /// share no node and burn never merges them (its graph cleanup after one micro-batch's
    /// backward could otherwise drop parts of another's graph).
    fn fresh_copy(&self) -> Box<dyn Block<B>>;
    /// A copy whose parameters are plain values outside autodiff (no bytes copied): a forward
    /// through it records no graph, so its intermediates are freed as it goes (the forward of a
    /// checkpointed segment, recomputed with [`Block::fresh_copy`] in the backward).
    fn untracked_copy(&self) -> Box<dyn Block<B>>;
    /// Moves this block's parameter gradients out of `grads` as flat tensors on the block's
    /// device, in flattening order (zeros where a trainable parameter has none; nothing for a
    /// frozen one, see [`Block::freeze`]). The caller reads a whole gradient bucket back to host
    /// memory with [`read_flat`].
    fn take_grads(&self, grads: &mut B::Gradients) -> Vec<Tensor<B::InnerBackend, 1>>;
    /// Moves the gradients of the parameters whose `which` entry (flattening order, frozen ones
    /// included) is true out of `grads`, in order (zeros where one has none).
    fn take_grads_of(&self, grads: &mut B::Gradients, which: &[bool]) -> Vec<Tensor<B::InnerBackend, 1>>;
    /// The gradients of the mirrors this block keeps in autodiff though they are not in its
    /// trained vector ([`crate::block_frozen::PartlyFrozen`]; a tie's, [`archipelago_dataflow::ties`]),
    /// moved out of `grads` in order; none for a block without.
    fn take_tied_grads(&self, _grads: &mut B::Gradients) -> Vec<Tensor<B::InnerBackend, 1>> {
        Vec::new()
    }
    /// The same block with the parameters whose `which` entry is true back in autodiff, as
    /// fresh leaves (a tie's mirror in the copy a micro-batch runs on).
    fn track(self: Box<Self>, which: &[bool]) -> Box<dyn Block<B>>;
    /// The same block with the parameters whose `trainable` entry (flattening order) is false
    /// taken out of autodiff: no backward computes their gradient and [`Block::take_grads`]
    /// skips them. The trainer holds such a block through [`crate::block_frozen::PartlyFrozen`].
    fn freeze(self: Box<Self>, trainable: &[bool]) -> Box<dyn Block<B>>;
    /// Copies all the parameters, frozen ones included, into `out` (the block's full vector,
    /// [`archipelago_dataflow::TrainedLayout::full_len`] long); the same as
    /// [`Block::write_params`] for a block with nothing frozen.
    fn write_full_params(&self, out: &mut [f32]);
    /// Replaces the frozen parameters (those [`Block::freeze`] took out of autodiff) with
    /// `values`, their concatenation in flattening order.
    fn load_frozen(self: Box<Self>, values: &[f32]) -> Box<dyn Block<B>>;
    /// The same block with every parameter in `dtype` (ids and `require_grad` kept): the 16-bit
    /// compute copy of mixed precision. Loads keep a parameter's dtype ([`Block::load_params`]
    /// rounds the f32 master into it), and its gradients come in it ([`read_flat`] widens them).
    fn cast_params(self: Box<Self>, dtype: FloatDType) -> Box<dyn Block<B>>;
}

/// Reads flat device tensors (a gradient bucket, in order) into `out`, or, when `accumulate`,
/// adds them to what `out` holds. With `one_transfer` (a GPU) they are concatenated on the
/// device first and cross to host memory in one read, not one per tensor; without (the CPU
/// backend, whose tensors already are in host memory) each is copied straight into its place.
///
/// # Panics
/// When the tensors do not add up to `out.len()` elements.
pub fn read_flat<B: Backend>(
    parts: Vec<Tensor<B, 1>>,
    out: &mut [f32],
    accumulate: bool,
    one_transfer: bool,
) {
    let total: usize = parts.iter().map(|t| t.shape().num_elements()).sum();
    assert_eq!(total, out.len(), "gradient bucket size");
    let mut put = |at: usize, values: &[f32]| {
        let target = &mut out[at..at + values.len()];
        if accumulate {
            target.iter_mut().zip(values).for_each(|(t, v)| *t += v);
        } else {
            target.copy_from_slice(values);
        }
    };
    if one_transfer && parts.len() > 1 {
        let data = download(Tensor::cat(parts, 0), TransferKind::Gradient).convert::<f32>();
        put(0, data.as_slice::<f32>().expect("f32 gradients"));
        return;
    }
    let mut at = 0;
    for part in parts {
        let data = download(part, TransferKind::Gradient).convert::<f32>();
        let values = data.as_slice::<f32>().expect("f32 gradients");
        put(at, values);
        at += values.len();
    }
}

impl<B: AutodiffBackend, M: BlockModule<B>> Block<B> for M {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        BlockModule::forward(self, x)
    }

    fn forward_cached(&self, x: Activation<B>, pasts: &mut Pasts<B>) -> Activation<B> {
        BlockModule::forward_cached(self, x, pasts)
    }

    fn quantize_int8(&mut self, threshold: f32) -> Result<crate::zoo::int8_layers::Int8Bytes, String> {
        BlockModule::quantize_int8(self, threshold)
    }

    fn num_params(&self) -> usize {
        Module::num_params(self)
    }

    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut v = ShapeVisitor {
            path: Vec::new(),
            out: Vec::new(),
        };
        self.visit(&mut v);
        v.out
    }

    fn write_params(&self, out: &mut [f32]) {
        let mut v = FlattenVisitor {
            out,
            offset: 0,
            frozen_too: false,
        };
        self.visit(&mut v);
    }

    fn write_full_params(&self, out: &mut [f32]) {
        let mut v = FlattenVisitor {
            out,
            offset: 0,
            frozen_too: true,
        };
        self.visit(&mut v);
    }

    fn load_frozen(self: Box<Self>, values: &[f32]) -> Box<dyn Block<B>> {
        let mut mapper = LoadMapper {
            flat: values,
            whole: None,
            offset: 0,
            frozen: true,
        };
        Box::new((*self).map(&mut mapper))
    }

    fn load_params(self: Box<Self>, flat: &[f32], one_transfer: bool) -> Box<dyn Block<B>> {
        let whole = (one_transfer && !flat.is_empty()).then(|| {
            let device = self.devices().into_iter().next().unwrap_or_default();
            upload::<B, 1, Float>(
                TensorData::new(flat.to_vec(), [flat.len()]),
                &device,
                TransferKind::Parameter,
            )
        });
        let mut mapper = LoadMapper {
            flat,
            whole,
            offset: 0,
            frozen: false,
        };
        Box::new((*self).map(&mut mapper))
    }

    fn load_params_from(self: Box<Self>, whole: Tensor<B::InnerBackend, 1>) -> Box<dyn Block<B>> {
        let mut mapper = LoadMapper {
            flat: &[],
            whole: Some(Tensor::from_inner(whole)),
            offset: 0,
            frozen: false,
        };
        Box::new((*self).map(&mut mapper))
    }

    fn fresh_copy(&self) -> Box<dyn Block<B>> {
        Box::new(self.clone().map(&mut FreshLeafMapper))
    }

    fn untracked_copy(&self) -> Box<dyn Block<B>> {
        Box::new(self.clone().map(&mut UntrackedMapper))
    }

    fn take_grads(&self, grads: &mut B::Gradients) -> Vec<Tensor<B::InnerBackend, 1>> {
        let mut v = GradVisitor::<B> {
            grads,
            parts: Vec::new(),
            which: None,
            index: 0,
        };
        self.visit(&mut v);
        v.parts
    }

    fn take_grads_of(&self, grads: &mut B::Gradients, which: &[bool]) -> Vec<Tensor<B::InnerBackend, 1>> {
        let mut v = GradVisitor::<B> {
            grads,
            parts: Vec::new(),
            which: Some(which),
            index: 0,
        };
        self.visit(&mut v);
        v.parts
    }

    fn track(self: Box<Self>, which: &[bool]) -> Box<dyn Block<B>> {
        Box::new((*self).map(&mut TrackedMapper {
            which,
            tracked: true,
            index: 0,
        }))
    }

    fn freeze(self: Box<Self>, trainable: &[bool]) -> Box<dyn Block<B>> {
        let frozen: Vec<bool> = trainable.iter().map(|trains| !trains).collect();
        Box::new((*self).map(&mut TrackedMapper {
            which: &frozen,
            tracked: false,
            index: 0,
        }))
    }

    fn cast_params(self: Box<Self>, dtype: FloatDType) -> Box<dyn Block<B>> {
        Box::new((*self).map(&mut CastMapper(dtype)))
    }
}

mod init;
mod visit;
pub use init::{check_described, describe_shapes, init_local_range, init_param, init_range, initial_params};
use visit::{
    CastMapper, FlattenVisitor, FreshLeafMapper, GradVisitor, LoadMapper, ShapeVisitor, TrackedMapper,
    UntrackedMapper,
};

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::{Distribution, Tensor, TensorData};

    use super::*;
    use crate::CpuBackend;
    use crate::zoo::{LinearBlock, LinearReluBlock};

    type B = CpuBackend;

    /// A bucket of two blocks read in one transfer (or tensor by tensor) equals each parameter's
    /// gradient read alone,
    /// in flattening order; accumulating adds; a block without gradients gives zeros.
    #[test]
    fn a_bucket_of_gradients_is_read_in_one_transfer_in_flattening_order() {
        let device = FlexDevice;
        let load = |module_shapes: Vec<(String, Vec<usize>)>, i: usize| {
            initial_params(&describe_shapes(&format!("b{i}"), &module_shapes), 5)
        };
        let b0 = LinearReluBlock::<B>::new(3, 4, &device);
        let init0 = load(Block::param_shapes(&b0), 0);
        let b0 = b0.map(&mut LoadMapper::<B> {
            flat: &init0,
            whole: None,
            offset: 0,
            frozen: false,
        });
        let b1 = LinearBlock::<B>::new(4, 2, &device);
        let init1 = load(Block::param_shapes(&b1), 1);
        let b1 = b1.map(&mut LoadMapper::<B> {
            flat: &init1,
            whole: None,
            offset: 0,
            frozen: false,
        });
        let total = init0.len() + init1.len();
        let x = Tensor::<B, 2>::random([5, 3], Distribution::Default, &device);
        let loss = || match Block::forward(&b1, Block::forward(&b0, Activation::Rows(x.clone()))) {
            Activation::Rows(t) => (t.clone() * t).sum(),
            _ => unreachable!(),
        };
        // Expected: each parameter's gradient read on its own.
        let mut grads = loss().backward();
        let mut expected = Vec::new();
        b0.visit(&mut ExpectedGrads::<B> {
            grads: &mut grads,
            out: &mut expected,
        });
        b1.visit(&mut ExpectedGrads::<B> {
            grads: &mut grads,
            out: &mut expected,
        });
        assert_eq!(expected.len(), total);
        assert!(expected.iter().any(|&g| g != 0.0));
        let take = |grads: &mut <B as AutodiffBackend>::Gradients| {
            let mut parts = Block::take_grads(&b0, grads);
            parts.extend(Block::take_grads(&b1, grads));
            parts
        };
        for one_transfer in [true, false] {
            let mut flat = vec![f32::NAN; total];
            read_flat(take(&mut loss().backward()), &mut flat, false, one_transfer);
            assert_eq!(flat, expected);
            read_flat(take(&mut loss().backward()), &mut flat, true, one_transfer);
            let doubled: Vec<f32> = expected.iter().map(|g| 2.0 * g).collect();
            assert_eq!(flat, doubled);
            // No backward reached these parameters: zeros.
            let unrelated = Tensor::<B, 1>::from_data(TensorData::from([1.0f32]), &device).require_grad();
            read_flat(
                take(&mut unrelated.sum().backward()),
                &mut flat,
                false,
                one_transfer,
            );
            assert!(flat.iter().all(|&g| g == 0.0));
        }
    }

    /// Parameters written in one transfer and sliced on the device equal those written one by
    /// one: same values read back, same forward, still trainable leaves.
    #[test]
    fn parameters_written_in_one_transfer_equal_those_written_one_by_one() {
        let device = FlexDevice;
        let block = |one_transfer: bool| {
            let b: Box<dyn Block<B>> = Box::new(LinearReluBlock::<B>::new(3, 4, &device));
            let init = initial_params(&describe_shapes("b", &b.param_shapes()), 9);
            b.load_params(&init, one_transfer)
        };
        let (one, each) = (block(true), block(false));
        let mut read = [vec![0.0; one.num_params()], vec![0.0; each.num_params()]];
        one.write_params(&mut read[0]);
        each.write_params(&mut read[1]);
        assert_eq!(read[0], read[1]);
        let x = Tensor::<B, 2>::random([5, 3], Distribution::Default, &device);
        let out = |b: &dyn Block<B>| match b.forward(Activation::Rows(x.clone())) {
            Activation::Rows(t) => t,
            _ => unreachable!(),
        };
        let (y1, y2) = (out(one.as_ref()), out(each.as_ref()));
        assert_eq!(y1.clone().into_data(), y2.into_data());
        let mut grads = y1.sum().backward();
        let parts = one.take_grads(&mut grads);
        assert!(parts.iter().all(|p| p.shape().num_elements() > 0));
        let mut flat = vec![0.0; one.num_params()];
        read_flat(parts, &mut flat, false, true);
        assert!(
            flat.iter().any(|&g| g != 0.0),
            "the sliced parameters got no gradient"
        );
    }

    struct ExpectedGrads<'a, B: AutodiffBackend> {
        grads: &'a mut B::Gradients,
        out: &'a mut Vec<f32>,
    }

    impl<B: AutodiffBackend> ModuleVisitor<B> for ExpectedGrads<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = param.val().grad_remove(self.grads).expect("a gradient");
            self.out
                .extend(grad.into_data().convert::<f32>().as_slice::<f32>().unwrap());
        }
    }
}
