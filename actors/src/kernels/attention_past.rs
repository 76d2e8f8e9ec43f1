//! Attention of new queries over cached and new keys and values: the one kernel generation's
//! prefill (every prompt position new) and decoding (one new position a step) share (Pope et al.,
//! "Efficiently Scaling Transformer Inference", 2022, on the cache; the causal rule is
//! Vaswani et al.'s). Query `i` of the `n` new ones sits at absolute position `offset + i` and
//! sees keys `j ≤ offset + i` of the `offset + n` it is given. It also returns each query's
//! log-sum-exp of its scaled scores (FlashAttention's statistic, Dao et al. 2022), which a
//! backward over token slices (TeraPipe) needs beside the output.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, FloatDType, Tensor};

/// `softmax(q·kᵀ/√hd + causal mask)·v` for `q` `[b, h, n, hd]` at positions `offset..offset + n`
/// over `k`, `v` `[b, h, offset + n, hd]`: the output `[b, h, n, hd]` (in `q`'s dtype) and the
/// log-sum-exp `[b, h, n]` (f32). Scores, mask and softmax are in f32 whatever the dtype.
///
/// # Panics
/// When `k` does not hold `offset + n` positions.
pub fn attention_with_past<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    offset: usize,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let [_, _, n, hd] = q.dims();
    let total = k.dims()[2];
    assert_eq!(
        total,
        offset + n,
        "keys for {offset} cached and {n} new positions"
    );
    let dtype = q.dtype();
    let scores = q
        .matmul(k.swap_dims(2, 3))
        .cast(FloatDType::F32)
        .div_scalar((hd as f32).sqrt());
    // Query i sees keys up to offset + i: the mask is true above that diagonal.
    let device = scores.device();
    let later = Tensor::<B, 2, Bool>::tril_mask([n, total], offset as i64, &device);
    let scores = scores.mask_fill(later.reshape([1, 1, n, total]), f32::NEG_INFINITY);
    let max = scores.clone().max_dim(3);
    let lse = (scores.clone() - max.clone()).exp().sum_dim(3).log() + max;
    let weights = (scores - lse.clone()).exp().cast(dtype);
    (weights.matmul(v), lse.squeeze_dim::<3>(3))
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;
    use burn::tensor::{Distribution, Tensor};

    use super::*;
    use crate::CpuBackend;
    use crate::kernels::{composed_causal_attention, qkv_part};

    type B = CpuBackend;

    /// Prefill (every position new) equals causal attention of the fused projection; decoding
    /// the last position over the cache equals that position's row of it; the log-sum-exp is
    /// the softmax's normaliser (its weights sum to 1).
    #[test]
    fn prefill_and_decoding_equal_causal_attention() {
        let (b, t, h, hd) = (2, 7, 3, 4);
        let d = h * hd;
        let qkv = Tensor::<B, 3>::random([b, t, 3 * d], Distribution::Normal(0.0, 1.0), &FlexDevice);
        let whole = composed_causal_attention(qkv.clone(), h);
        let split = |i: usize| qkv_part(&qkv, i, h);
        let (q, k, v) = (split(0), split(1), split(2));
        let (prefill, lse) = attention_with_past(q.clone(), k.clone(), v.clone(), 0);
        let prefill = prefill.swap_dims(1, 2).reshape([b, t, d]);
        prefill
            .clone()
            .into_data()
            .assert_approx_eq::<f32>(&whole.clone().into_data(), Default::default());
        let (last, _) = attention_with_past(q.narrow(2, t - 1, 1), k.clone(), v, t - 1);
        let last = last.swap_dims(1, 2).reshape([b, 1, d]);
        last.into_data()
            .assert_approx_eq::<f32>(&whole.narrow(1, t - 1, 1).into_data(), Default::default());
        // Σ_j exp(s_ij − lse_i) = 1 over the keys query i sees.
        let scores = split(0).matmul(k.swap_dims(2, 3)).div_scalar((hd as f32).sqrt());
        let mask = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, &FlexDevice).reshape([1, 1, t, t]);
        let sums = (scores - lse.unsqueeze_dim::<4>(3))
            .exp()
            .mask_fill(mask, 0.0)
            .sum_dim(3);
        sums.into_data().assert_approx_eq::<f32>(
            &Tensor::<B, 4>::ones([b, h, t, 1], &FlexDevice).into_data(),
            Default::default(),
        );
    }
}
