//! int8 linear layers for inference, as LLM.int8() (Dettmers et al., "LLM.int8(): 8-bit Matrix
//! Multiplication for Transformers at Scale", NeurIPS 2022) does them: the weight `[in, out]` is
//! kept as int8 with one absmax scale per output column (vector-wise quantization); at each
//! product, the input features whose magnitude reaches the outlier threshold in any row go
//! through an f32 product with those rows of the weight dequantized (the mixed-precision
//! decomposition), and the rest are quantized per row (absmax) and multiplied int8 × int8 with
//! i32 accumulation, then scaled back by the row's and the column's scales. Our own CPU kernel:
//! burn's Flex dequantizes, and OpenBLAS has no int8 GEMM.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// LLM.int8()'s default outlier threshold.
pub const DEFAULT_OUTLIER_THRESHOLD: f32 = 6.0;

/// A weight `[rows (in), cols (out)]` in int8, one scale per output column.
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Weight {
    /// Input features.
    pub rows: usize,
    /// Output features.
    pub cols: usize,
    /// `round(w / scale[col])`, row-major `[rows, cols]`.
    pub values: Vec<i8>,
    /// Per output column: its largest magnitude over 127 (1 for an all-zero column).
    pub scales: Vec<f32>,
}

impl Int8Weight {
    /// Quantizes `w` (row-major `[rows, cols]`) column by column.
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Int8Weight {
        assert_eq!(w.len(), rows * cols, "a [{rows}, {cols}] weight");
        let mut absmax = vec![0.0f32; cols];
        for row in w.chunks_exact(cols) {
            for (m, &v) in absmax.iter_mut().zip(row) {
                *m = m.max(v.abs());
            }
        }
        let scales: Vec<f32> = absmax
            .iter()
            .map(|&m| if m > 0.0 { m / 127.0 } else { 1.0 })
            .collect();
        let values = (w.chunks_exact(cols))
            .flat_map(|row| {
                row.iter()
                    .zip(&scales)
                    .map(|(&v, &s)| (v / s).round().clamp(-127.0, 127.0) as i8)
            })
            .collect();
        Int8Weight {
            rows,
            cols,
            values,
            scales,
        }
    }

    /// Bytes held: one per value and four per column scale.
    pub fn bytes(&self) -> usize {
        self.values.len() + 4 * self.scales.len()
    }

    /// `x` (row-major `[n, rows]`) times this weight: `[n, cols]`, input features reaching
    /// `threshold` in magnitude (in any row) through the f32 path; also how many there were.
    pub fn matmul(&self, x: &[f32], threshold: f32) -> (Vec<f32>, usize) {
        let (k, m) = (self.rows, self.cols);
        assert_eq!(x.len() % k.max(1), 0, "rows of {k} input features");
        let n = x.len() / k.max(1);
        let mut outlier = vec![false; k];
        for row in x.chunks_exact(k) {
            for (o, &v) in outlier.iter_mut().zip(row) {
                *o |= v.abs() >= threshold;
            }
        }
        let outliers: Vec<usize> = (0..k).filter(|&f| outlier[f]).collect();
        let mut out = vec![0.0f32; n * m];
        let mut xq = vec![0i8; k];
        let mut acc = vec![0i32; m];
        for (row, y) in x.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
            // The row's regular features, absmax-quantized.
            let absmax = (row.iter().zip(&outlier))
                .filter(|(_, o)| !**o)
                .fold(0.0f32, |a, (v, _)| a.max(v.abs()));
            let row_scale = if absmax > 0.0 { absmax / 127.0 } else { 1.0 };
            for ((q, &v), &o) in xq.iter_mut().zip(row).zip(&outlier) {
                *q = if o {
                    0
                } else {
                    (v / row_scale).round().clamp(-127.0, 127.0) as i8
                };
            }
            acc.fill(0);
            for (f, &q) in xq.iter().enumerate() {
                if q != 0 {
                    let w = &self.values[f * m..(f + 1) * m];
                    for (a, &wv) in acc.iter_mut().zip(w) {
                        *a += i32::from(q) * i32::from(wv);
                    }
                }
            }
            for ((yv, &a), &s) in y.iter_mut().zip(&acc).zip(&self.scales) {
                *yv = a as f32 * row_scale * s;
            }
            // The outlier features in f32, their weight rows dequantized.
            for &f in &outliers {
                let v = row[f];
                let w = &self.values[f * m..(f + 1) * m];
                for ((yv, &wv), &s) in y.iter_mut().zip(w).zip(&self.scales) {
                    *yv += v * f32::from(wv) * s;
                }
            }
        }
        (out, outliers.len())
    }
}

/// A linear layer in int8: the weight, the bias in f32, the outlier threshold, and how many
/// outlier features its products have met (summed over calls).
#[derive(Debug)]
pub struct Int8Linear {
    /// The weight.
    pub weight: Int8Weight,
    /// The bias (f32).
    pub bias: Option<Vec<f32>>,
    /// Input magnitude from which a feature takes the f32 path.
    pub threshold: f32,
    /// Outlier features met so far, over all calls.
    pub outliers_seen: AtomicU64,
}

impl Int8Linear {
    /// `w` `[rows, cols]` (row-major) and its bias, quantized.
    pub fn new(w: &[f32], rows: usize, cols: usize, bias: Option<Vec<f32>>, threshold: f32) -> Int8Linear {
        Int8Linear {
            weight: Int8Weight::quantize(w, rows, cols),
            bias,
            threshold,
            outliers_seen: AtomicU64::new(0),
        }
    }

    /// `x · W (+ b)` over `x`'s last dimension.
    pub fn forward<B: Backend, const D: usize>(&self, x: Tensor<B, D>, with_bias: bool) -> Tensor<B, D> {
        let device = x.device();
        let mut dims = x.dims();
        let values = (x.into_data().convert::<f32>().to_vec::<f32>()).expect("f32 activations");
        let (mut out, outliers) = self.weight.matmul(&values, self.threshold);
        self.outliers_seen.fetch_add(outliers as u64, Ordering::Relaxed);
        if let Some(bias) = self.bias.as_ref().filter(|_| with_bias) {
            for row in out.chunks_exact_mut(self.weight.cols) {
                row.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
            }
        }
        dims[D - 1] = self.weight.cols;
        Tensor::from_data(TensorData::new(out, dims), &device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use archipelago_dataflow::rng::SplitMix64;

    fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut rng = SplitMix64::keyed(&[seed]);
        (0..n).map(|_| rng.uniform_in(-1.0, 1.0) as f32 * scale).collect()
    }

    fn product(x: &[f32], w: &[f32], k: usize, m: usize) -> Vec<f32> {
        let n = x.len() / k;
        let mut out = vec![0.0; n * m];
        for i in 0..n {
            for f in 0..k {
                for j in 0..m {
                    out[i * m + j] += x[i * k + f] * w[f * m + j];
                }
            }
        }
        out
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn the_int8_product_is_close_to_f32_and_bytes_are_a_quarter() {
        let (n, k, m) = (5, 64, 48);
        let (x, w) = (random(n * k, 1, 1.0), random(k * m, 2, 0.1));
        let q = Int8Weight::quantize(&w, k, m);
        assert_eq!(q.bytes(), k * m + 4 * m);
        let (y, outliers) = q.matmul(&x, DEFAULT_OUTLIER_THRESHOLD);
        assert_eq!(outliers, 0);
        let exact = product(&x, &w, k, m);
        let scale = exact.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert!(
            worst(&y, &exact) < 0.02 * scale,
            "{} vs {scale}",
            worst(&y, &exact)
        );
    }

    /// A feature of magnitude 20 among ones: at the default threshold it takes the f32 path
    /// and the product stays close to f32's; forced through int8 (threshold past it), the row's
    /// scale grows twentyfold and the other features lose their precision.
    #[test]
    fn outlier_features_take_the_f32_path() {
        let (n, k, m) = (4, 64, 32);
        let mut x = random(n * k, 3, 1.0);
        for row in 0..n {
            x[row * k + 7] = 20.0 * if row % 2 == 0 { 1.0 } else { -1.0 };
        }
        let w = random(k * m, 4, 0.1);
        let exact = product(&x, &w, k, m);
        let q = Int8Weight::quantize(&w, k, m);
        // The reference for the f32 path: x times the dequantized weight.
        let dequantized: Vec<f32> = (q.values.iter().enumerate())
            .map(|(i, &v)| f32::from(v) * q.scales[i % m])
            .collect();
        let (all_f32, every) = q.matmul(&x, 0.0);
        assert_eq!(every, k, "threshold 0: every feature is an outlier");
        assert!(worst(&all_f32, &product(&x, &dequantized, k, m)) < 1e-4);
        let (decomposed, outliers) = q.matmul(&x, DEFAULT_OUTLIER_THRESHOLD);
        assert_eq!(outliers, 1);
        let (forced, none) = q.matmul(&x, 1e9);
        assert_eq!(none, 0);
        let (good, bad) = (worst(&decomposed, &exact), worst(&forced, &exact));
        assert!(bad > 4.0 * good, "decomposed {good}, all int8 {bad}");
        let layer = Int8Linear::new(&w, k, m, Some(vec![0.5; m]), 2.0);
        let x_tensor = Tensor::<crate::CpuBackend, 2>::from_data(
            TensorData::new(x.clone(), [n, k]),
            &Default::default(),
        );
        let through = layer.forward(x_tensor, true).into_data().to_vec::<f32>().unwrap();
        let (expected, _) = q.matmul(&x, 2.0);
        assert!(worst(&through, &expected.iter().map(|v| v + 0.5).collect::<Vec<_>>()) < 1e-6);
        assert!(layer.outliers_seen.load(Ordering::Relaxed) >= 1);
    }
}
