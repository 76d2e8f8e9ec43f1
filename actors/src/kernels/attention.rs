//! Causal multi-head self-attention on Flex tensors straight from the fused `qkv` projection,
//! forward and backward, with OpenBLAS for the four products per head.
//!
//! `qkv` is `[b, t, 3d]` (queries, keys, values side by side, heads `hd = d / h` wide inside
//! each); the output `[b, t, d]` has the heads side by side again, ready for the output
//! projection. Each head's `Q`, `K`, `V` are read where they lie (rows `3d` apart) and its output
//! written where it belongs (rows `d` apart): none of the narrow / reshape / swap_dims copies of
//! the composed version, no mask tensor, one pass of softmax per row. The softmax probabilities
//! `P` `[b, h, t, t]` are kept for the backward (the composed version keeps the same tensor):
//!
//! - forward: `S = Q Kᵀ / √hd`, `P = softmax(S)` over the keys `j ≤ i` (0 beyond), `Y = P V`;
//! - backward: `dP = dY Vᵀ`, `dV = Pᵀ dY`, `dS = P ⊙ (dP − rowsum(dP ⊙ P)) / √hd`, `dQ = dS K`,
//!   `dK = dSᵀ Q` (Vaswani et al. 2017; the softmax gradient as in FlashAttention's backward).

use burn::backend::flex::FlexTensor;
use burn::tensor::DType;

use super::openblas::{OpenBlas, Operand};

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    /// Sequences.
    pub b: usize,
    /// Positions per sequence.
    pub t: usize,
    /// Model width (`3d` columns in `qkv`).
    pub d: usize,
    /// Heads.
    pub h: usize,
}

impl Dims {
    fn hd(&self) -> usize {
        self.d / self.h
    }
    /// Where head `head`'s part `part` (0 q, 1 k, 2 v) of sequence `seq` starts in `qkv`.
    fn at(&self, seq: usize, part: usize, head: usize) -> usize {
        seq * self.t * 3 * self.d + part * self.d + head * self.hd()
    }
    fn scale(&self) -> f32 {
        (self.hd() as f32).sqrt()
    }
}

/// The sizes of `qkv` `[b, t, 3d]` with `heads` heads, if it is a contiguous f32 tensor of that
/// form (otherwise the caller uses the composed version).
pub(crate) fn dims(qkv: &FlexTensor, heads: usize) -> Option<Dims> {
    let shape = qkv.layout().shape();
    if qkv.dtype() != DType::F32 || shape.num_dims() != 3 || heads == 0 || !shape[2].is_multiple_of(3) {
        return None;
    }
    let d = shape[2] / 3;
    (d.is_multiple_of(heads) && d > 0).then_some(Dims {
        b: shape[0],
        t: shape[1],
        d,
        h: heads,
    })
}

fn slice(t: &FlexTensor) -> &[f32] {
    t.as_slice().expect("a contiguous f32 tensor")
}

fn row_major(ld: usize) -> Operand {
    Operand {
        transposed: false,
        ld,
    }
}

fn transposed(ld: usize) -> Operand {
    Operand { transposed: true, ld }
}

/// The forward: the attention output `[b, t, d]` and the probabilities `P` `[b, h, t, t]`.
pub(crate) fn forward(
    blas: &OpenBlas,
    qkv: &FlexTensor,
    dims: Dims,
) -> Result<(FlexTensor, FlexTensor), String> {
    let Dims { b, t, d, h } = dims;
    let (hd, scale) = (dims.hd(), dims.scale());
    let qkv = slice(qkv);
    let mut y = super::flex_blas::zeroed(vec![b, t, d]);
    let mut p = super::flex_blas::zeroed(vec![b, h, t, t]);
    let (ys, ps): (&mut [f32], &mut [f32]) = (y.storage_mut(), p.storage_mut());
    for seq in 0..b {
        for head in 0..h {
            let probs = &mut ps[(seq * h + head) * t * t..][..t * t];
            let (q, k) = (&qkv[dims.at(seq, 0, head)..], &qkv[dims.at(seq, 1, head)..]);
            blas.sgemm((t, t, hd), q, row_major(3 * d), k, transposed(3 * d), probs, t)?;
            for (i, row) in probs.chunks_exact_mut(t).enumerate() {
                causal_softmax_row(row, i, scale);
            }
            let v = &qkv[dims.at(seq, 2, head)..];
            let out = &mut ys[seq * t * d + head * hd..];
            blas.sgemm((t, hd, t), probs, row_major(t), v, row_major(3 * d), out, d)?;
        }
    }
    Ok((y, p))
}

/// `row[..=i] = softmax(row[..=i] / scale)`, `row[i + 1..] = 0`, as burn's softmax computes it
/// (`exp(x − max) / Σ exp(x − max)`).
fn causal_softmax_row(row: &mut [f32], i: usize, scale: f32) {
    let (seen, future) = row.split_at_mut(i + 1);
    let mut max = f32::NEG_INFINITY;
    for s in seen.iter_mut() {
        *s /= scale;
        max = max.max(*s);
    }
    let mut sum = 0.0;
    for s in seen.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in seen.iter_mut() {
        *s /= sum;
    }
    future.fill(0.0);
}

/// The backward: the gradient of `qkv` `[b, t, 3d]` from the output's gradient `dy` `[b, t, d]`.
pub(crate) fn backward(
    blas: &OpenBlas,
    qkv: &FlexTensor,
    p: &FlexTensor,
    dy: &FlexTensor,
    dims: Dims,
) -> Result<FlexTensor, String> {
    let Dims { b, t, d, h } = dims;
    let (hd, scale) = (dims.hd(), dims.scale());
    let (qkv, ps, dys) = (slice(qkv), slice(p), slice(dy));
    let mut dqkv = super::flex_blas::zeroed(vec![b, t, 3 * d]);
    let dq: &mut [f32] = dqkv.storage_mut();
    let mut ds = vec![0.0f32; t * t];
    for seq in 0..b {
        for head in 0..h {
            let probs = &ps[(seq * h + head) * t * t..][..t * t];
            let dy_h = &dys[seq * t * d + head * hd..];
            let (q, k, v) = (
                &qkv[dims.at(seq, 0, head)..],
                &qkv[dims.at(seq, 1, head)..],
                &qkv[dims.at(seq, 2, head)..],
            );
            // dV = Pᵀ dY, into the values' columns of dqkv.
            let dv = &mut dq[dims.at(seq, 2, head)..];
            blas.sgemm((t, hd, t), probs, transposed(t), dy_h, row_major(d), dv, 3 * d)?;
            // dP = dY Vᵀ, then dS = P ⊙ (dP − rowsum(dP ⊙ P)) / scale.
            blas.sgemm((t, t, hd), dy_h, row_major(d), v, transposed(3 * d), &mut ds, t)?;
            for (dp_row, p_row) in ds.chunks_exact_mut(t).zip(probs.chunks_exact(t)) {
                let dot: f32 = dp_row.iter().zip(p_row).map(|(g, p)| g * p).sum();
                for (g, p) in dp_row.iter_mut().zip(p_row) {
                    *g = p * (*g - dot) / scale;
                }
            }
            // dQ = dS K and dK = dSᵀ Q, into their columns of dqkv.
            blas.sgemm(
                (t, hd, t),
                &ds,
                row_major(t),
                k,
                row_major(3 * d),
                &mut dq[dims.at(seq, 0, head)..],
                3 * d,
            )?;
            blas.sgemm(
                (t, hd, t),
                &ds,
                transposed(t),
                q,
                row_major(3 * d),
                &mut dq[dims.at(seq, 1, head)..],
                3 * d,
            )?;
        }
    }
    Ok(dqkv)
}
