//! The gpt workload's blocks under sequence parallelism (Korthikanti et al. 2022, §4.2.2;
//! `archipelago_dataflow::sequence_parallel` names the form): each half-layer is a LayerNorm
//! block on this rank's tokens and a mixing block (attention, or the MLP) on the whole sequence
//! between the plan's all-gather and reduce-scatter; the final LayerNorm and the head likewise.
//!
//! The residual stream skips the mixing block as a tensor of its own: a LayerNorm block's
//! segment takes the reduce-scattered output of the half before plus the stream (the trainer adds
//! them: `x = z + x`) and passes that sum on as the stream of the next half.

use burn::module::Module;
use burn::nn::{Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::block::{Activation, Block, BlockModule, Pasts};
use crate::kernels::{Kernels, attention_with_past, causal_attention, gelu, layer_norm, linear, qkv_part};
use crate::zoo::GptEmbedding;
use crate::zoo::int8_layers::{Int8Bytes, Int8Pair, project, quantize_pair};
use crate::zoo::lora::{Adapter, AdapterShape, adapted};
use crate::zoo::tp::TpPlace;
use archipelago_dataflow::Split;
use archipelago_dataflow::tensor_parallel::local_extent;

use super::gpt::LN_EPSILON;

/// Block `index` of gpt `[vocab, ctx, d, layers, heads]` in its sequence-parallel form: the
/// embedding, per layer `[ln1, attention, ln2, mlp]`, the final LayerNorm and the head.
/// The tied head (GPT-2's) is built by the caller: `head(vocab, d, tp)` gives the last block.
/// `adapters(layer, half)` gives the LoRA adapters of a half-layer's two projections (half 0:
/// attention, 1: MLP).
pub fn block<B: Kernels>(
    index: usize,
    [vocab, ctx, d, layers, heads]: [usize; 5],
    tp: TpPlace,
    gelu: Gelu,
    adapters: &dyn Fn(usize, usize) -> [Option<AdapterShape>; 2],
    device: &B::Device,
) -> Box<dyn Block<B>> {
    if index == 0 {
        return Box::new(GptEmbedding::sliced(vocab, ctx, d, tp, device));
    }
    let (layer, part) = ((index - 1) / 4, (index - 1) % 4);
    match (layer < layers, part) {
        (_, 0) | (true, 2) => Box::new(SeqLayerNorm::new(d, device)),
        (true, 1) => {
            Box::new(AttentionMix::sliced(d, heads, tp, device).with_adapters(d, adapters(layer, 0), device))
        }
        (true, _) => {
            Box::new(MlpMix::sliced(d, tp, gelu, device).with_adapters(d, adapters(layer, 1), device))
        }
        (false, _) => Box::new(HeadLinear::sliced(d, vocab, tp, device)),
    }
}

/// GELU's form: the exact one (erf, the gpt workload's) or `transformers`' `gelu_new`, the tanh
/// approximation `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (GPT-2's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gelu {
    /// `x·Φ(x)` with the erf.
    #[default]
    Erf,
    /// The tanh approximation.
    Tanh,
}

impl Gelu {
    fn apply<B: Kernels>(self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Gelu::Erf => gelu(x),
            Gelu::Tanh => burn::tensor::activation::gelu_approximate(x),
        }
    }
}

/// A LayerNorm on this rank's tokens (rows).
#[derive(Module, Debug)]
pub struct SeqLayerNorm<B: Backend> {
    /// The LayerNorm (`ln1`, `ln2` or `ln_f`).
    pub ln: LayerNorm<B>,
}

impl<B: Backend> SeqLayerNorm<B> {
    /// A LayerNorm of width `d`.
    pub fn new(d: usize, device: &B::Device) -> Self {
        SeqLayerNorm {
            ln: LayerNormConfig::new(d).with_epsilon(LN_EPSILON).init(device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for SeqLayerNorm<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Rows(x) = x else {
            panic!("SeqLayerNorm takes this rank's tokens as rows")
        };
        Activation::Rows(layer_norm(&self.ln, x, LN_EPSILON))
    }
}

/// Attention between the all-gather and the reduce-scatter: `proj(attn(qkv(u)))`, this rank's
/// heads, the output a summand (the projection's bias on the first rank).
#[derive(Module, Debug)]
pub struct AttentionMix<B: Backend> {
    /// Fused query/key/value projection (this rank's heads of each).
    pub qkv: Linear<B>,
    /// `qkv`'s LoRA adapter, if adapted.
    pub qkv_lora: Option<Adapter<B>>,
    /// Output projection, row-parallel.
    pub proj: Linear<B>,
    /// `proj`'s LoRA adapter, if adapted.
    pub proj_lora: Option<Adapter<B>>,
    /// `qkv` and `proj` in int8, for inference ([`AttentionMix::quantize_int8`]).
    #[module(skip)]
    pub int8: Int8Pair,
    /// This rank's heads.
    pub heads: usize,
    /// This rank in its tensor-parallel group.
    pub tp_rank: usize,
    /// The group's size.
    pub tp_size: usize,
}

impl<B: Backend> AttentionMix<B> {
    /// Rank `tp`'s attention of a layer of width `d` with `heads` heads.
    pub fn sliced(d: usize, heads: usize, tp: TpPlace, device: &B::Device) -> Self {
        AttentionMix {
            qkv: LinearConfig::new(d, 3 * tp.part(d))
                .with_initializer(Initializer::Zeros)
                .init(device),
            qkv_lora: None,
            proj: LinearConfig::new(tp.part(d), d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            proj_lora: None,
            int8: None,
            heads: tp.part(heads),
            tp_rank: tp.rank,
            tp_size: tp.size,
        }
    }
}

impl<B: Backend> AttentionMix<B> {
    /// Where this rank sits in its group.
    pub fn place(&self) -> TpPlace {
        TpPlace::new(self.tp_rank, self.tp_size)
    }

    /// The same attention with LoRA adapters on `qkv` and `proj` where `[qkv, proj]` give them.
    pub fn with_adapters(
        mut self,
        d: usize,
        [qkv, proj]: [Option<AdapterShape>; 2],
        device: &B::Device,
    ) -> Self {
        let tp = self.place();
        let heads = Split::HeadColumns { parts: 3 };
        self.qkv_lora = qkv.map(|a| Adapter::sliced(d, 3 * d, a, heads, tp, device));
        self.proj_lora = proj.map(|a| Adapter::sliced(d, d, a, Split::Rows, tp, device));
        self
    }
}

impl<B: Kernels> AttentionMix<B> {
    /// `proj(attn(qkv(u)))`, this rank's summand (the projection's bias on the first rank).
    pub fn mix(&self, u: Tensor<B, 3>) -> Tensor<B, 3> {
        let qkv = self.qkv(u);
        self.proj(causal_attention(qkv, self.heads))
    }

    /// `qkv(u)`, adapted.
    fn qkv(&self, u: Tensor<B, 3>) -> Tensor<B, 3> {
        let base = project(&self.int8, 0, &self.qkv, u.clone(), self.place());
        adapted(base, &self.qkv_lora, u)
    }

    /// `proj(attended)`, adapted (row-parallel).
    fn proj(&self, attended: Tensor<B, 3>) -> Tensor<B, 3> {
        let base = project(&self.int8, 1, &self.proj, attended.clone(), self.place());
        adapted(base, &self.proj_lora, attended)
    }

    /// `qkv` and `proj` in int8 at `threshold` (LLM.int8), their f32 weights dropped.
    pub fn quantize_int8(&mut self, threshold: f32) -> Result<Int8Bytes, String> {
        let tp = self.place();
        quantize_pair([&mut self.qkv, &mut self.proj], &mut self.int8, threshold, tp)
    }
}

impl<B: Kernels> AttentionMix<B> {
    /// [`AttentionMix::mix`] of new positions `u` `[1, Σ n, d]`, each sequence's `n` after its
    /// past: their keys and values join their sequence's, and their queries attend to those up
    /// to their own position ([`attention_with_past`]); the projections run over all of them at
    /// once.
    pub fn mix_cached(&self, u: Tensor<B, 3>, pasts: &mut Pasts<B>) -> Tensor<B, 3> {
        let qkv = self.qkv(u);
        if let Some(paged) = pasts.paged.as_mut() {
            return self.proj(paged.attend(qkv, &pasts.seqs, self.heads));
        }
        let d = qkv.dims()[2] / 3;
        let h = self.heads;
        let mut outputs = Vec::with_capacity(pasts.seqs.len());
        let mut start = 0;
        for (past, n) in &mut pasts.seqs {
            let rows = qkv.clone().narrow(1, start, *n);
            start += *n;
            let (q, mut k, mut v) = (
                qkv_part(&rows, 0, h),
                qkv_part(&rows, 1, h),
                qkv_part(&rows, 2, h),
            );
            if let Some((past_k, past_v)) = past.kv.take() {
                (k, v) = (Tensor::cat(vec![past_k, k], 2), Tensor::cat(vec![past_v, v], 2));
            }
            past.kv = Some((k.clone(), v.clone()));
            let (attended, _) = attention_with_past(q, k, v, past.offset);
            outputs.push(attended.swap_dims(1, 2).reshape([1, *n, d]));
        }
        self.proj(Tensor::cat(outputs, 1))
    }
}

impl<B: Kernels> BlockModule<B> for AttentionMix<B> {
    fn forward(&self, u: Activation<B>) -> Activation<B> {
        let Activation::Seq(u) = u else {
            panic!("AttentionMix takes the gathered sequence")
        };
        Activation::Seq(self.mix(u))
    }
}

/// The MLP between the all-gather and the reduce-scatter: `fc2(gelu(fc1(u)))`, `fc1`
/// column-parallel, `fc2` row-parallel (its bias on the first rank).
#[derive(Module, Debug)]
pub struct MlpMix<B: Backend> {
    /// Up-projection, column-parallel.
    pub fc1: Linear<B>,
    /// `fc1`'s LoRA adapter, if adapted.
    pub fc1_lora: Option<Adapter<B>>,
    /// Down-projection, row-parallel.
    pub fc2: Linear<B>,
    /// `fc2`'s LoRA adapter, if adapted.
    pub fc2_lora: Option<Adapter<B>>,
    /// `fc1` and `fc2` in int8, for inference ([`MlpMix::quantize_int8`]).
    #[module(skip)]
    pub int8: Int8Pair,
    /// This rank in its tensor-parallel group.
    pub tp_rank: usize,
    /// The group's size.
    pub tp_size: usize,
    /// Whether GELU is the tanh form ([`Gelu::Tanh`]).
    pub tanh_gelu: bool,
}

impl<B: Backend> MlpMix<B> {
    /// Rank `tp`'s MLP of a layer of width `d`, with GELU's form `gelu`.
    pub fn sliced(d: usize, tp: TpPlace, gelu: Gelu, device: &B::Device) -> Self {
        MlpMix {
            fc1: LinearConfig::new(d, tp.part(4 * d))
                .with_initializer(Initializer::Zeros)
                .init(device),
            fc1_lora: None,
            fc2: LinearConfig::new(tp.part(4 * d), d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            fc2_lora: None,
            int8: None,
            tp_rank: tp.rank,
            tp_size: tp.size,
            tanh_gelu: gelu == Gelu::Tanh,
        }
    }
}

impl<B: Backend> MlpMix<B> {
    /// Where this rank sits in its group.
    pub fn place(&self) -> TpPlace {
        TpPlace::new(self.tp_rank, self.tp_size)
    }

    /// The same MLP with LoRA adapters on `fc1` and `fc2` where `[fc1, fc2]` give them.
    pub fn with_adapters(
        mut self,
        d: usize,
        [fc1, fc2]: [Option<AdapterShape>; 2],
        device: &B::Device,
    ) -> Self {
        let tp = self.place();
        self.fc1_lora = fc1.map(|a| Adapter::sliced(d, 4 * d, a, Split::Columns, tp, device));
        self.fc2_lora = fc2.map(|a| Adapter::sliced(4 * d, d, a, Split::Rows, tp, device));
        self
    }
}

impl<B: Kernels> MlpMix<B> {
    /// `fc2(gelu(fc1(u)))`, this rank's summand (`fc2`'s bias on the first rank).
    pub fn mix(&self, u: Tensor<B, 3>) -> Tensor<B, 3> {
        let form = if self.tanh_gelu { Gelu::Tanh } else { Gelu::Erf };
        let fc1 = project(&self.int8, 0, &self.fc1, u.clone(), self.place());
        let up = form.apply(adapted(fc1, &self.fc1_lora, u));
        let fc2 = project(&self.int8, 1, &self.fc2, up.clone(), self.place());
        adapted(fc2, &self.fc2_lora, up)
    }

    /// `fc1` and `fc2` in int8 at `threshold` (LLM.int8), their f32 weights dropped.
    pub fn quantize_int8(&mut self, threshold: f32) -> Result<Int8Bytes, String> {
        let tp = self.place();
        quantize_pair([&mut self.fc1, &mut self.fc2], &mut self.int8, threshold, tp)
    }
}

impl<B: Kernels> BlockModule<B> for MlpMix<B> {
    fn forward(&self, u: Activation<B>) -> Activation<B> {
        let Activation::Seq(u) = u else {
            panic!("MlpMix takes the gathered sequence")
        };
        Activation::Seq(self.mix(u))
    }
}

/// The vocabulary-parallel output head (no bias) on the gathered final LayerNorm's output.
#[derive(Module, Debug)]
pub struct HeadLinear<B: Backend> {
    /// This rank's `ceil(vocab / size)` columns of the head.
    pub head: Linear<B>,
}

impl<B: Backend> HeadLinear<B> {
    /// Rank `tp`'s head of width `d` over `vocab` tokens.
    pub fn sliced(d: usize, vocab: usize, tp: TpPlace, device: &B::Device) -> Self {
        HeadLinear {
            head: LinearConfig::new(d, local_extent(vocab, tp.size))
                .with_initializer(Initializer::Zeros)
                .with_bias(false)
                .init(device),
        }
    }
}

impl<B: Kernels> BlockModule<B> for HeadLinear<B> {
    fn forward(&self, u: Activation<B>) -> Activation<B> {
        let Activation::Seq(u) = u else {
            panic!("HeadLinear takes the gathered sequence")
        };
        Activation::Seq(linear(&self.head, u))
    }
}
