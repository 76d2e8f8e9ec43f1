//! Attention over a paged key/value cache (vLLM's PagedAttention, Kwon et al., SOSP 2023): our
//! CPU kernel. One attention layer's keys and values for every sequence of a replica live in one
//! pool of fixed-size blocks, allocated once; a sequence holds a block table, and its position
//! `p` is row `table[p / block_tokens] · block_tokens + p mod block_tokens` of the pool. New
//! positions' keys and values are written in place, and each new query attends, head by head,
//! to its sequence's positions up to its own straight through the table (no gather, no copy of
//! the past), returning its output and the softmax's log-sum-exp, as
//! [`super::attention_with_past`] does for a contiguous past.

/// How a layer's pool is cut: positions per block, heads, values per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageShape {
    /// Positions per block.
    pub block_tokens: usize,
    /// Attention heads.
    pub heads: usize,
    /// Values per head.
    pub head_width: usize,
}

impl PageShape {
    /// Values of one position's keys (or values): every head's.
    pub fn width(&self) -> usize {
        self.heads * self.head_width
    }

    /// The pool row of position `p` of the sequence with block `table`.
    fn row(&self, table: &[usize], p: usize) -> usize {
        let block = *table.get(p / self.block_tokens).unwrap_or_else(|| {
            panic!(
                "position {p} is past the sequence's {} blocks of {}",
                table.len(),
                self.block_tokens
            )
        });
        block * self.block_tokens + p % self.block_tokens
    }
}

/// One attention layer's keys and values for the whole pool, a row of
/// [`PageShape::width`] values per position.
#[derive(Debug, Clone, Default)]
pub struct PagedLayer {
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl PagedLayer {
    /// Allocates `blocks` blocks of `shape` the first time (zeros); later calls keep the pool.
    pub fn reserve(&mut self, blocks: usize, shape: PageShape) {
        if self.keys.is_empty() {
            let len = blocks * shape.block_tokens * shape.width();
            self.keys = vec![0.0; len];
            self.values = vec![0.0; len];
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.keys.len() + self.values.len())
    }

    /// Writes the keys and values of `n` new positions `offset..offset + n` of a sequence, from
    /// rows of a fused projection `qkv` (`n` rows of `[q | k | v]`, each `width` wide).
    pub fn write(&mut self, shape: PageShape, table: &[usize], offset: usize, qkv: &[f32]) {
        let w = shape.width();
        for (i, row) in qkv.chunks_exact(3 * w).enumerate() {
            let at = shape.row(table, offset + i) * w;
            self.keys[at..at + w].copy_from_slice(&row[w..2 * w]);
            self.values[at..at + w].copy_from_slice(&row[2 * w..]);
        }
    }

    /// Causal attention of the `n` new queries in `qkv` (positions `offset..offset + n`, their
    /// keys and values already written) over their sequence's positions up to each one's own:
    /// `out` gets `n` rows of `width` (heads side by side), `lse` the log-sum-exp of each query's
    /// scores, `n · heads` of them (query-major).
    pub fn attend(
        &self,
        shape: PageShape,
        table: &[usize],
        offset: usize,
        qkv: &[f32],
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        let (w, hd) = (shape.width(), shape.head_width);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut scores = Vec::new();
        for (i, row) in qkv.chunks_exact(3 * w).enumerate() {
            let seen = offset + i + 1;
            let rows: Vec<usize> = (0..seen).map(|p| shape.row(table, p) * w).collect();
            for h in 0..shape.heads {
                let q = &row[h * hd..(h + 1) * hd];
                scores.clear();
                scores.extend(rows.iter().map(|&r| {
                    let k = &self.keys[r + h * hd..r + (h + 1) * hd];
                    q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
                }));
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for s in &mut scores {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let o = &mut out[i * w + h * hd..i * w + (h + 1) * hd];
                o.fill(0.0);
                for (&r, &p) in rows.iter().zip(&scores) {
                    let v = &self.values[r + h * hd..r + (h + 1) * hd];
                    let weight = p / sum;
                    o.iter_mut().zip(v).for_each(|(o, v)| *o += weight * v);
                }
                lse[i * shape.heads + h] = max + sum.ln();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexDevice;
    use burn::tensor::{Distribution, Tensor};

    use super::*;
    use crate::CpuBackend;
    use crate::kernels::{attention_with_past, qkv_part};

    type B = CpuBackend;

    fn flat(t: Tensor<B, 3>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    /// A sequence of 11 positions prefilled as 7 then decoded 4 more, through a table of
    /// scattered blocks of 3 among other sequences' blocks: the outputs and log-sum-exps of
    /// attention over the contiguous past; a wrong table (another sequence's block) is caught.
    #[test]
    fn paged_attention_equals_attention_over_the_contiguous_past() {
        let (heads, hd, t) = (2, 4, 11);
        let w = heads * hd;
        let shape = PageShape {
            block_tokens: 3,
            heads,
            head_width: hd,
        };
        let qkv = Tensor::<B, 3>::random([1, t, 3 * w], Distribution::Normal(0.0, 1.0), &FlexDevice);
        let rows = flat(qkv.clone());
        let table = [5, 1, 7, 2];
        let mut layer = PagedLayer::default();
        layer.reserve(8, shape);
        // Another sequence's blocks hold other keys.
        let other = vec![0.5; 3 * 3 * w];
        layer.write(shape, &[0, 3, 4], 0, &other);
        let (mut out, mut lse) = (vec![0.0; t * w], vec![0.0; t * heads]);
        for (start, n) in [(0, 7), (7, 1), (8, 1), (9, 2)] {
            let part = &rows[start * 3 * w..(start + n) * 3 * w];
            layer.write(shape, &table, start, part);
            let (o, l) = (
                &mut out[start * w..(start + n) * w],
                &mut lse[start * heads..(start + n) * heads],
            );
            layer.attend(shape, &table, start, part, o, l);
        }
        let (want, want_lse) = attention_with_past(
            qkv_part(&qkv, 0, heads),
            qkv_part(&qkv, 1, heads),
            qkv_part(&qkv, 2, heads),
            0,
        );
        let want = flat(want.swap_dims(1, 2).reshape([1, t, w]));
        let want_lse = flat(want_lse.swap_dims(1, 2));
        let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
        assert!(worst(&out, &want) < 1e-5, "outputs off by {}", worst(&out, &want));
        assert!(
            worst(&lse, &want_lse) < 1e-5,
            "lse off by {}",
            worst(&lse, &want_lse)
        );

        // The control: the last query read through a table whose first block is another's.
        let last = &rows[10 * 3 * w..];
        let (mut o, mut l) = (vec![0.0; w], vec![0.0; heads]);
        layer.attend(shape, &[0, 1, 7, 2], 10, last, &mut o, &mut l);
        assert!(worst(&o, &want[10 * w..]) > 1e-2, "a wrong table is caught");
    }

    #[test]
    fn the_pool_is_allocated_once() {
        let shape = PageShape {
            block_tokens: 4,
            heads: 2,
            head_width: 8,
        };
        let mut layer = PagedLayer::default();
        layer.reserve(10, shape);
        assert_eq!(layer.bytes(), 2 * 4 * 10 * 4 * 16);
        layer.write(shape, &[3], 0, &[1.0; 48]);
        layer.reserve(20, shape);
        assert_eq!(layer.bytes(), 2 * 4 * 10 * 4 * 16, "kept");
    }
}
