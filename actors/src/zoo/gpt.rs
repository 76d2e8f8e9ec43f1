//! The gpt workload's blocks: token + position embedding, pre-LayerNorm transformer layers with
//! causal multi-head attention and a GELU MLP, and the final LayerNorm + output head.
//!
//! Follows GPT-2 (Radford et al., 2019) as pinned in `shared/WORKLOADS.md`: `x += attn(ln1(x));
//! x += mlp(ln2(x))`, learned positions, untied head without bias, no dropout.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

use crate::block::{Activation, BlockModule};

/// Token and learned position embeddings: ids `[b, t]` → `[b, t, d]`.
#[derive(Module, Debug)]
pub struct GptEmbedding<B: Backend> {
    /// Token table `[vocab, d]`.
    pub tok_embedding: Embedding<B>,
    /// Position table `[ctx, d]`.
    pub pos_embedding: Embedding<B>,
}

impl<B: Backend> GptEmbedding<B> {
    /// Embeddings for `vocab` tokens and `ctx` positions of width `d`.
    pub fn new(vocab: usize, ctx: usize, d: usize, device: &B::Device) -> Self {
        GptEmbedding {
            tok_embedding: EmbeddingConfig::new(vocab, d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            pos_embedding: EmbeddingConfig::new(ctx, d)
                .with_initializer(Initializer::Zeros)
                .init(device),
        }
    }
}

impl<B: AutodiffBackend> BlockModule<B> for GptEmbedding<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Tokens(tokens) = x else {
            panic!("GptEmbedding takes token ids")
        };
        let [_, t] = tokens.dims();
        let positions = Tensor::<B, 1, Int>::arange(0..t as i64, &tokens.device()).reshape([1, t]);
        Activation::Seq(self.tok_embedding.forward(tokens) + self.pos_embedding.forward(positions))
    }
}

/// One pre-LayerNorm transformer layer with causal self-attention.
#[derive(Module, Debug)]
pub struct TransformerLayer<B: Backend> {
    /// LayerNorm before attention.
    pub ln1: LayerNorm<B>,
    /// Fused query/key/value projection `[d, 3d]`.
    pub qkv: Linear<B>,
    /// Attention output projection `[d, d]`.
    pub proj: Linear<B>,
    /// LayerNorm before the MLP.
    pub ln2: LayerNorm<B>,
    /// MLP up-projection `[d, 4d]`.
    pub fc1: Linear<B>,
    /// MLP down-projection `[4d, d]`.
    pub fc2: Linear<B>,
    /// Attention heads.
    pub heads: usize,
}

impl<B: Backend> TransformerLayer<B> {
    /// A layer of width `d` with `heads` heads.
    pub fn new(d: usize, heads: usize, device: &B::Device) -> Self {
        TransformerLayer {
            ln1: LayerNormConfig::new(d).init(device),
            qkv: LinearConfig::new(d, 3 * d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            proj: LinearConfig::new(d, d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            ln2: LayerNormConfig::new(d).init(device),
            fc1: LinearConfig::new(d, 4 * d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            fc2: LinearConfig::new(4 * d, d)
                .with_initializer(Initializer::Zeros)
                .init(device),
            heads,
        }
    }

    fn attention(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let h = self.heads;
        let hd = d / h;
        let qkv = self.qkv.forward(x);
        let split = |i: usize| {
            qkv.clone()
                .narrow(2, i * d, d)
                .reshape([b, t, h, hd])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (split(0), split(1), split(2));
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((hd as f32).sqrt());
        let mask: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
            .collect();
        let mask = Tensor::<B, 2>::from_data(TensorData::new(mask, [t, t]), &scores.device());
        let weights = softmax(scores + mask.reshape([1, 1, t, t]), 3);
        let y = weights.matmul(v).swap_dims(1, 2).reshape([b, t, d]);
        self.proj.forward(y)
    }
}

impl<B: AutodiffBackend> BlockModule<B> for TransformerLayer<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Seq(x) = x else {
            panic!("TransformerLayer takes a sequence")
        };
        let x = x.clone() + self.attention(self.ln1.forward(x));
        let mlp = self
            .fc2
            .forward(gelu(self.fc1.forward(self.ln2.forward(x.clone()))));
        Activation::Seq(x + mlp)
    }
}

/// Final LayerNorm and the untied output head (no bias): `[b, t, d]` → logits `[b, t, vocab]`.
#[derive(Module, Debug)]
pub struct GptHead<B: Backend> {
    /// Final LayerNorm.
    pub ln_f: LayerNorm<B>,
    /// Output head `[d, vocab]`.
    pub head: Linear<B>,
}

impl<B: Backend> GptHead<B> {
    /// A head of width `d` over `vocab` tokens.
    pub fn new(d: usize, vocab: usize, device: &B::Device) -> Self {
        GptHead {
            ln_f: LayerNormConfig::new(d).init(device),
            head: LinearConfig::new(d, vocab)
                .with_initializer(Initializer::Zeros)
                .with_bias(false)
                .init(device),
        }
    }
}

impl<B: AutodiffBackend> BlockModule<B> for GptHead<B> {
    fn forward(&self, x: Activation<B>) -> Activation<B> {
        let Activation::Seq(x) = x else {
            panic!("GptHead takes a sequence")
        };
        Activation::Seq(self.head.forward(self.ln_f.forward(x)))
    }
}
