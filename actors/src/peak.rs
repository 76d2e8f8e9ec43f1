//! Physical limits measured on this machine, for benchmarks to compare against: the matmul
//! throughput of the CPU backend on one thread (one actor's core).

use std::time::Instant;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::tensor::{Distribution, Tensor};

/// Median GFLOP/s of `n × n` by `n × n` f32 matmuls on burn's Flex backend (2·n³ FLOP each),
/// over `reps` products after one warm-up.
pub fn matmul_gflops(n: usize, reps: usize) -> f64 {
    let device = FlexDevice;
    let a = Tensor::<Flex, 2>::random([n, n], Distribution::Default, &device);
    let b = Tensor::<Flex, 2>::random([n, n], Distribution::Default, &device);
    let _ = a.clone().matmul(b.clone()).into_data();
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            let c = a.clone().matmul(b.clone()).into_data();
            std::hint::black_box(c);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let s = times[times.len() / 2];
    2.0 * (n as f64).powi(3) / s / 1e9
}

#[cfg(test)]
mod tests {
    #[test]
    fn measures_a_positive_rate() {
        assert!(super::matmul_gflops(64, 3) > 0.0);
    }
}
