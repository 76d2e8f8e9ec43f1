//! The matmul rate of this machine's CPU as an actor sees it: `[m, k] · [k, n]` with the kernel
//! jobs run (`ARCHIPELAGO_CPU_MATMUL`, see [`super::describe`]), on one thread per actor, timed
//! over repeats after a warm-up. `archipelago plan` calibrates its cost model with it.

use std::time::Instant;

use burn::backend::flex::FlexDevice;
use burn::tensor::{Distribution, Tensor};

/// Floating-point operations per second of `[m, k] · [k, n]` (2·m·k·n flops each) on a CPU
/// device: the median of `repeats` timed products after one untimed.
pub fn cpu_matmul_flops_per_s(m: usize, k: usize, n: usize, repeats: usize) -> f64 {
    let device = FlexDevice;
    let lhs = Tensor::<crate::CpuBackend, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device);
    let rhs = Tensor::<crate::CpuBackend, 2>::random([k, n], Distribution::Normal(0.0, 1.0), &device);
    let run = || {
        let began = Instant::now();
        let product = super::matmul(lhs.clone(), rhs.clone());
        std::hint::black_box(product.into_data());
        began.elapsed().as_secs_f64()
    };
    run();
    let mut times: Vec<f64> = (0..repeats.max(1)).map(|_| run()).collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2].max(1e-9);
    2.0 * (m * k * n) as f64 / median
}
