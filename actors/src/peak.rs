//! Physical limits measured on this machine, for benchmarks to compare against: the matmul
//! throughput of a backend on one device — the CPU backend on one thread (one actor's core), or a
//! GPU with the `cuda` feature.

use std::time::Instant;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

/// Median GFLOP/s of `n × n` by `n × n` f32 matmuls on burn's Flex backend (2·n³ FLOP each),
/// over `reps` products after one warm-up.
pub fn matmul_gflops(n: usize, reps: usize) -> f64 {
    matmul_gflops_on::<Flex>(&FlexDevice, n, reps)
}

/// [`matmul_gflops`] on any backend and device; each product is read back (which waits for a
/// GPU to finish it), so on a GPU use an `n` large enough for the copy of the result not to
/// matter (4096: 64 MiB of result per 137 GFLOP).
pub fn matmul_gflops_on<B: Backend>(device: &B::Device, n: usize, reps: usize) -> f64 {
    gflops_of::<B>(device, n, reps, |a, b| a.matmul(b))
}

/// The GFLOP/s of the matmul CPU devices train with ([`crate::kernels::matmul`]: OpenBLAS or
/// Flex's gemm, as [`crate::kernels::describe`] says), one thread, `n × n` by `n × n`.
pub fn cpu_kernel_matmul_gflops(n: usize, reps: usize) -> f64 {
    gflops_of::<crate::CpuBackend>(&FlexDevice, n, reps, crate::kernels::matmul)
}

fn gflops_of<B: Backend>(
    device: &B::Device,
    n: usize,
    reps: usize,
    mul: impl Fn(Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 2>,
) -> f64 {
    let a = Tensor::<B, 2>::random([n, n], Distribution::Default, device);
    let b = Tensor::<B, 2>::random([n, n], Distribution::Default, device);
    let _ = mul(a.clone(), b.clone()).into_data();
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            let c = mul(a.clone(), b.clone()).into_data();
            std::hint::black_box(c);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let s = times[times.len() / 2];
    2.0 * (n as f64).powi(3) / s / 1e9
}

/// The matmul GFLOP/s of a device spec's backend: `cpu:N` on one thread of Flex, `cuda:N` on that
/// GPU (a build with `cuda`).
pub fn device_matmul_gflops(
    device: archipelago_dataflow::DeviceSpec,
    n: usize,
    reps: usize,
) -> Result<f64, String> {
    match device {
        archipelago_dataflow::DeviceSpec::Cpu(_) => Ok(matmul_gflops(n, reps)),
        #[cfg(feature = "cuda")]
        archipelago_dataflow::DeviceSpec::Cuda(index) => {
            crate::check_devices(&[device])?;
            let gpu = burn::backend::cuda::CudaDevice {
                index: index as usize,
            };
            Ok(matmul_gflops_on::<burn::backend::Cuda>(&gpu, n, reps))
        }
        #[cfg(not(feature = "cuda"))]
        archipelago_dataflow::DeviceSpec::Cuda(_) => crate::check_devices(&[device]).map(|()| 0.0),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn measures_a_positive_rate() {
        assert!(super::matmul_gflops(64, 3) > 0.0);
        let cpu = super::device_matmul_gflops(archipelago_dataflow::DeviceSpec::Cpu(0), 64, 3);
        assert!(cpu.unwrap() > 0.0);
    }
}
