//! The gpt workload's blocks: token + position embedding, pre-LayerNorm transformer layers (each
//! two blocks: causal multi-head attention, then a GELU MLP), and the final LayerNorm + output
//! head.
//!
//! Follows GPT-2 (Radford et al., 2019) as pinned in `shared/WORKLOADS.md`: `x += attn(ln1(x));
//! x += mlp(ln2(x))`, learned positions, untied head without bias, no dropout.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::block::{Activation, Block, BlockModule, Pasts};
use crate::kernels::{Kernels, layer_norm, linear};
use crate::zoo::gpt_sp::{self, Gelu};
use crate::zoo::int8_layers::Int8Bytes;
use crate::zoo::lora::AdapterShape;
use crate::zoo::tp::TpPlace;
use crate::zoo::{AttentionMix, BuildContext, HeadLinear, MlpMix, adapter_shape};
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::tensor_parallel::local_extent;

/// Block `ctx.block` of a gpt `[vocab, ctx, d, layers, heads]`: the embedding, per layer an
/// attention and an MLP half, then the head (or its sequence-parallel form's blocks).
pub(super) fn block<B: Kernels>(
    ctx: &BuildContext,
    spec: &ModelSpec,
    device: &B::Device,
) -> Box<dyn Block<B>> {
    let [vocab, context, d, layers, heads]: [usize; 5] =
        spec.dims().try_into().expect("a gpt's five dimensions");
    let adapters = |layer: usize, half: usize| {
        let [first, second] = [["qkv", "proj"], ["fc1", "fc2"]][half];
        [first, second].map(|m| adapter_shape(spec, &format!("layers.{layer}.{m}")))
    };
    let head = || -> Box<dyn Block<B>> { Box::new(GptHead::sliced(d, vocab, ctx.tp, device)) };
    let dims = [vocab, context, d, layers, heads];
    transformer_block(ctx, dims, Gelu::Erf, &adapters, device, head)
}

/// Block `ctx.block` of a transformer family (gpt, gpt2): the embedding, attention and MLP
/// halves with GELU's form `gelu` and adapters `adapters(layer, half)`, then `head()` (the
/// sequence-parallel form's blocks where the model is in that form).
pub(super) fn transformer_block<B: Kernels>(
    ctx: &BuildContext,
    [vocab, context, d, layers, heads]: [usize; 5],
    gelu: Gelu,
    adapters: &dyn Fn(usize, usize) -> [Option<AdapterShape>; 2],
    device: &B::Device,
    head: impl FnOnce() -> Box<dyn Block<B>>,
) -> Box<dyn Block<B>> {
    let tp = ctx.tp;
    if ctx.sequence_parallel {
        let dims = [vocab, context, d, layers, heads];
        return gpt_sp::block(ctx.block, dims, tp, gelu, adapters, device);
    }
    let layer = ctx.block.saturating_sub(1) / 2;
    if ctx.block == 0 {
        Box::new(GptEmbedding::sliced(vocab, context, d, tp, device))
    } else if ctx.block > 2 * layers {
        head()
    } else if ctx.block % 2 == 1 {
        let mut half = AttentionHalf::sliced(d, heads, tp, device);
        half.attention = half.attention.with_adapters(d, adapters(layer, 0), device);
        Box::new(half)
    } else {
        let mut half = MlpHalf::sliced(d, tp, gelu, device);
        half.mlp = half.mlp.with_adapters(d, adapters(layer, 1), device);
        Box::new(half)
    }
}

/// Token and learned position embeddings: ids `[b, t]` → `[b, t, d]`.
#[derive(Module, Debug)]
pub struct GptEmbedding<B: Backend> {
    /// Token table `[vocab, d]`.
    pub tok_embedding: Embedding<B>,
    /// Position table `[ctx, d]`.
    pub pos_embedding: Embedding<B>,
    /// Under tensor parallelism: the first token id of this rank's rows of the vocabulary.
    pub first_token: usize,
    /// This rank in its tensor-parallel group.
    pub tp_rank: usize,
    /// The group's size (1: the whole table, no masking).
    pub tp_size: usize,
}

impl<B: Backend> GptEmbedding<B> {
    /// Embeddings for `vocab` tokens and `ctx` positions of width `d`.
    pub fn new(vocab: usize, ctx: usize, d: usize, device: &B::Device) -> Self {
        Self::sliced(vocab, ctx, d, TpPlace::default(), device)
    }

    /// Rank `tp`'s vocabulary-parallel embedding: its `ceil(vocab / size)` rows of the token
    /// table (the last rank's past the vocabulary are padding) and, on the first rank only, the
    /// positions; its output is a summand of the group's (Megatron's g sums it).
    pub fn sliced(vocab: usize, ctx: usize, d: usize, tp: TpPlace, device: &B::Device) -> Self {
        let rows = local_extent(vocab, tp.size);
        GptEmbedding {
            tok_embedding: EmbeddingConfig::new(rows, d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            pos_embedding: EmbeddingConfig::new(ctx, d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            first_token: tp.rank * rows,
            tp_rank: tp.rank,
            tp_size: tp.size,
        }
    }
}

impl<B: Kernels> BlockModule<B> for GptEmbedding<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        self.embed(x, None)
    }

    /// The new tokens at their positions after their sequences' pasts.
    fn forward_cached(&self, x: Activation<B>, pasts: &mut Pasts<B>) -> Activation<B> {
        self.embed(x, Some(pasts.positions()))
    }
}

impl<B: Kernels> GptEmbedding<B> {
    /// Token ids `[b, t]` at positions `positions` (`t` of them; `0..t` when `None`).
    fn embed(&self, x: Activation<B>, positions: Option<Vec<i64>>) -> Activation<B> {
        let Activation::Tokens(tokens) = x else {
            panic!("GptEmbedding takes token ids")
        };
        let [b, t] = tokens.dims();
        let device = tokens.device();
        let positions = match positions {
            Some(p) => Tensor::<B, 1, Int>::from_data(burn::tensor::TensorData::new(p, [t]), &device),
            None => Tensor::<B, 1, Int>::arange(0..t as i64, &device),
        }
        .reshape([1, t]);
        if self.tp_size == 1 {
            return Activation::Seq(
                self.tok_embedding.forward(tokens) + self.pos_embedding.forward(positions),
            );
        }
        // Ids outside this rank's rows look up row 0 and are zeroed after.
        let rows = self.tok_embedding.weight.dims()[0];
        let local = tokens.sub_scalar(self.first_token as i64);
        let elsewhere = (local.clone().lower_elem(0)).bool_or(local.clone().greater_equal_elem(rows as i64));
        let found = self.tok_embedding.forward(local.mask_fill(elsewhere.clone(), 0));
        let d = found.dims()[2];
        let own = found.mask_fill(elsewhere.unsqueeze_dim::<3>(2).expand([b, t, d]), 0.0);
        if self.tp_rank == 0 {
            Activation::Seq(own + self.pos_embedding.forward(positions))
        } else {
            Activation::Seq(own)
        }
    }
}

/// The epsilon of every LayerNorm (burn's and PyTorch's default).
pub(super) const LN_EPSILON: f64 = 1e-5;

/// The attention half of a pre-LayerNorm transformer layer: `x + proj(attn(qkv(ln1(x))))`.
///
/// A layer is two blocks (this and [`MlpHalf`]) so that the tensor-parallel all-reduce after each
/// row-parallel projection (Megatron-LM's g) falls between blocks, as an instruction of the step.
/// The attention itself is sequence parallelism's mixing block ([`AttentionMix`]).
#[derive(Module, Debug)]
pub struct AttentionHalf<B: Backend> {
    /// LayerNorm before attention.
    pub ln1: LayerNorm<B>,
    /// `qkv`, attention and `proj` (this rank's heads under tensor parallelism).
    pub attention: AttentionMix<B>,
}

impl<B: Backend> AttentionHalf<B> {
    /// The attention half of a layer of width `d` with `heads` heads.
    pub fn new(d: usize, heads: usize, device: &B::Device) -> Self {
        Self::sliced(d, heads, TpPlace::default(), device)
    }

    /// Rank `tp`'s attention half: its `heads / size` heads (q, k and v each cut per head,
    /// column-parallel), the row-parallel output projection over them; the first rank adds the
    /// projection's bias and the residual, so the group's outputs sum to the layer's.
    pub fn sliced(d: usize, heads: usize, tp: TpPlace, device: &B::Device) -> Self {
        AttentionHalf {
            ln1: LayerNormConfig::new(d).with_epsilon(LN_EPSILON).init(device),
            attention: AttentionMix::sliced(d, heads, tp, device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for AttentionHalf<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        self.residual(x, |u| self.attention.mix(u))
    }

    /// The new positions attend to their sequence's past keys and values and their own.
    fn forward_cached(&self, x: Activation<B>, pasts: &mut Pasts<B>) -> Activation<B> {
        self.residual(x, |u| self.attention.mix_cached(u, pasts))
    }

    fn quantize_int8(&mut self, threshold: f32) -> Result<Int8Bytes, String> {
        self.attention.quantize_int8(threshold)
    }
}

impl<B: Kernels> AttentionHalf<B> {
    /// `x + mix(ln1(x))` (the mix alone past the first tp rank).
    fn residual(&self, x: Activation<B>, mix: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>) -> Activation<B> {
        let Activation::Seq(x) = x else {
            panic!("AttentionHalf takes a sequence")
        };
        let y = mix(layer_norm(&self.ln1, x.clone(), LN_EPSILON));
        Activation::Seq(if self.attention.place().leads() { x + y } else { y })
    }
}

/// The MLP half of a pre-LayerNorm transformer layer: `x + fc2(gelu(fc1(ln2(x))))`; the MLP is
/// sequence parallelism's mixing block ([`MlpMix`]).
#[derive(Module, Debug)]
pub struct MlpHalf<B: Backend> {
    /// LayerNorm before the MLP.
    pub ln2: LayerNorm<B>,
    /// `fc1` (column-parallel) and `fc2` (row-parallel, bias on the first rank).
    pub mlp: MlpMix<B>,
}

impl<B: Backend> MlpHalf<B> {
    /// The MLP half of a layer of width `d` (the erf GELU).
    pub fn new(d: usize, device: &B::Device) -> Self {
        Self::sliced(d, TpPlace::default(), Gelu::Erf, device)
    }

    /// Rank `tp`'s MLP half: `fc1` column-parallel, `fc2` row-parallel (bias and residual on the
    /// first rank), with GELU's form `gelu`.
    pub fn sliced(d: usize, tp: TpPlace, gelu: Gelu, device: &B::Device) -> Self {
        MlpHalf {
            ln2: LayerNormConfig::new(d).with_epsilon(LN_EPSILON).init(device),
            mlp: MlpMix::sliced(d, tp, gelu, device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for MlpHalf<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Seq(x) = x else {
            panic!("MlpHalf takes a sequence")
        };
        let y = self.mlp.mix(layer_norm(&self.ln2, x.clone(), LN_EPSILON));
        Activation::Seq(if self.mlp.place().leads() { x + y } else { y })
    }

    fn quantize_int8(&mut self, threshold: f32) -> Result<Int8Bytes, String> {
        self.mlp.quantize_int8(threshold)
    }
}

/// Final LayerNorm and the untied output head (no bias): `[b, t, d]` → logits `[b, t, vocab]`.
#[derive(Module, Debug)]
pub struct GptHead<B: Backend> {
    /// Final LayerNorm.
    pub ln_f: LayerNorm<B>,
    /// Output head `[d, vocab]` (this rank's columns under tensor parallelism).
    pub head: HeadLinear<B>,
}

impl<B: Backend> GptHead<B> {
    /// A head of width `d` over `vocab` tokens.
    pub fn new(d: usize, vocab: usize, device: &B::Device) -> Self {
        Self::sliced(d, vocab, TpPlace::default(), device)
    }

    /// Rank `tp`'s vocabulary-parallel head: its `ceil(vocab / size)` columns of the logits (the
    /// last rank's past the vocabulary are padding, masked out of the loss).
    pub fn sliced(d: usize, vocab: usize, tp: TpPlace, device: &B::Device) -> Self {
        GptHead {
            ln_f: LayerNormConfig::new(d).with_epsilon(LN_EPSILON).init(device),
            head: HeadLinear::sliced(d, vocab, tp, device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for GptHead<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Seq(x) = x else {
            panic!("GptHead takes a sequence")
        };
        Activation::Seq(linear(&self.head.head, layer_norm(&self.ln_f, x, LN_EPSILON)))
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;
    use burn::tensor::Distribution;

    use super::*;
    use crate::CpuBackend;
    use crate::block::{Block, describe_shapes, initial_params};

    /// Attention is causal: changing the input at position 4 leaves the outputs before it as they
    /// were and changes those from it on.
    #[test]
    fn a_later_position_never_changes_an_earlier_output() {
        let device = FlexDevice;
        let layer: Box<dyn Block<CpuBackend>> = Box::new(AttentionHalf::<CpuBackend>::new(8, 2, &device));
        let init = initial_params(&describe_shapes("layer", &layer.param_shapes()), 3);
        let layer = layer.load_params(&init, false);
        let x = Tensor::<CpuBackend, 3>::random([1, 6, 8], Distribution::Default, &device);
        let changed = x.clone().slice_assign(
            [0..1, 4..5, 0..8],
            Tensor::random([1, 1, 8], Distribution::Default, &device),
        );
        let out = |x: Tensor<CpuBackend, 3>| match layer.forward(Activation::Seq(x)) {
            Activation::Seq(y) => y.into_data().convert::<f32>().to_vec::<f32>().unwrap(),
            _ => unreachable!(),
        };
        let (a, b) = (out(x), out(changed));
        assert_eq!(a[..4 * 8], b[..4 * 8], "an earlier position saw a later one");
        assert_ne!(a[4 * 8..5 * 8], b[4 * 8..5 * 8]);
    }
}
