//! The gpt2 family's blocks: `transformers.GPT2LMHeadModel`'s forward (the dataflow crate's
//! `family::gpt2` describes it). The embedding and the attention half are the gpt workload's
//! (GPT-2's `c_attn` columns are `[q | k | v]`, heads contiguous, as ours); the MLP half uses the
//! tanh GELU (`gelu_new`); the head is the final LayerNorm and `x · wteᵀ` through a mirror of
//! the token table ([`TiedHead`]), which the runtime loads with the table's values.

use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::block::{Activation, Block, BlockModule};
use crate::kernels::{Kernels, layer_norm};
use crate::zoo::gpt::{LN_EPSILON, transformer_block};
use crate::zoo::gpt_sp::Gelu;
use crate::zoo::tp::TpPlace;
use crate::zoo::{BuildContext, adapter_shape};
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::tensor_parallel::local_extent;

/// Block `ctx.block` of a gpt2 `[vocab, ctx, d, layers, heads]`: the embedding, per layer an
/// attention and an MLP half (tanh GELU), then the tied head (or the sequence-parallel form's
/// blocks, its last the tied projection alone).
pub(super) fn block<B: Kernels>(
    ctx: &BuildContext,
    spec: &ModelSpec,
    device: &B::Device,
) -> Box<dyn Block<B>> {
    let [vocab, context, d, layers, heads]: [usize; 5] =
        spec.dims().try_into().expect("a gpt2's five dimensions");
    let adapters = |layer: usize, half: usize| {
        let [first, second] = [["attn.c_attn", "attn.c_proj"], ["mlp.c_fc", "mlp.c_proj"]][half];
        [first, second].map(|m| adapter_shape(spec, &format!("transformer.h.{layer}.{m}")))
    };
    if ctx.sequence_parallel && ctx.block == 4 * layers + 2 {
        return Box::new(TiedLinear::sliced(vocab, d, ctx.tp, device));
    }
    let head = || -> Box<dyn Block<B>> { Box::new(TiedHead::sliced(d, vocab, ctx.tp, device)) };
    let dims = [vocab, context, d, layers, heads];
    transformer_block(ctx, dims, Gelu::Tanh, &adapters, device, head)
}

/// `x · Wᵀ` with `W` a `[rows, d]` mirror of the token table (this rank's rows of the vocabulary
/// under tensor parallelism; the last rank's past the vocabulary are padding, masked out of the
/// loss as the gpt head's are).
#[derive(Module, Debug)]
pub struct TiedLinear<B: Backend> {
    /// The mirror `[rows, d]` (`lm_head.weight`).
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> TiedLinear<B> {
    /// Rank `tp`'s projection of width `d` onto `vocab` tokens.
    pub fn sliced(vocab: usize, d: usize, tp: TpPlace, device: &B::Device) -> Self {
        let rows = local_extent(vocab, tp.size);
        TiedLinear {
            weight: Param::from_tensor(Tensor::zeros([rows, d], device)),
        }
    }

    /// Logits `[b, t, rows]` of `x` `[b, t, d]`.
    pub fn project(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let w = self.weight.val();
        let rows = w.dims()[0];
        x.reshape([b * t, d]).matmul(w.transpose()).reshape([b, t, rows])
    }
}

impl<B: Kernels> BlockModule<B> for TiedLinear<B> {
    fn forward(&self, u: Activation<B>) -> Activation<B> {
        let Activation::Seq(u) = u else {
            panic!("TiedLinear takes the gathered sequence")
        };
        Activation::Seq(self.project(u))
    }
}

/// The final LayerNorm and the tied output head: `[b, t, d]` → logits `[b, t, vocab]`.
#[derive(Module, Debug)]
pub struct TiedHead<B: Backend> {
    /// Final LayerNorm (`transformer.ln_f`).
    pub ln_f: LayerNorm<B>,
    /// The projection through the token table's mirror.
    pub lm_head: TiedLinear<B>,
}

impl<B: Backend> TiedHead<B> {
    /// Rank `tp`'s vocabulary-parallel head of width `d` over `vocab` tokens.
    pub fn sliced(d: usize, vocab: usize, tp: TpPlace, device: &B::Device) -> Self {
        TiedHead {
            ln_f: LayerNormConfig::new(d).with_epsilon(LN_EPSILON).init(device),
            lm_head: TiedLinear::sliced(vocab, d, tp, device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for TiedHead<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Seq(x) = x else {
            panic!("TiedHead takes a sequence")
        };
        Activation::Seq(self.lm_head.project(layer_norm(&self.ln_f, x, LN_EPSILON)))
    }
}
