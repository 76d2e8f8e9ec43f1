//! The GPUs this host offers, from the CUDA driver (loaded at run time; builds with `cuda` only).

use serde::{Deserialize, Serialize};

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Its ordinal: the `N` of `cuda:N`.
    pub index: u32,
    /// The driver's name for it.
    pub name: String,
    /// Its memory in bytes.
    pub memory_bytes: u64,
    /// Its compute capability, `(major, minor)` (bf16 tensor cores from 8.0); `(0, 0)` where
    /// unknown (a report from before it was read).
    #[serde(default)]
    pub compute_capability: (u32, u32),
}

/// Whether a GPU of compute capability `capability` computes in `dtype` (a compute dtype of
/// `--precision`): bf16 arithmetic needs 8.0 (Ampere) or later, f16 and f32 run on every GPU
/// the CUDA backend supports. An error that names the GPU's capability and the fix.
pub fn runs_compute_dtype(
    gpu: &str,
    capability: (u32, u32),
    dtype: archipelago_dataflow::DType,
) -> Result<(), String> {
    let (major, minor) = capability;
    if dtype == archipelago_dataflow::DType::BF16 && major > 0 && major < 8 {
        return Err(format!(
            "--precision bf16 on {gpu}: its compute capability {major}.{minor} has no bf16 arithmetic \
             (8.0 and later do); use --precision f32 there, or a GPU of compute capability 8.0 or later"
        ));
    }
    Ok(())
}

/// The GPUs the CUDA driver sees, or why there are none to be had (no driver, the driver failed,
/// a build without the `cuda` feature).
pub fn list() -> Result<Vec<Gpu>, String> {
    #[cfg(feature = "cuda")]
    return probe::list();
    #[cfg(not(feature = "cuda"))]
    Err(match driver_gpu_count() {
        0 => "this build has no CUDA backend (rebuild with `--features cuda` to use GPUs)".to_string(),
        n => format!(
            "this build has no CUDA backend, though the NVIDIA driver reports {n} GPU(s): rebuild \
             with `--features cuda` to use them"
        ),
    })
}

/// GPUs the NVIDIA kernel driver lists under `/proc/driver/nvidia/gpus` (0 without the driver).
pub fn driver_gpu_count() -> usize {
    std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count())
}

/// What a GPU's memory pool holds, from burn's runtime (cubecl) on that device. cubecl keeps a
/// pool per stream and picks the stream by the calling thread, so read from an actor's device
/// thread this is that actor's pool (actors whose threads share a stream share it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// Bytes of live tensors now.
    pub in_use: u64,
    /// The most bytes of live tensors seen at the end of an instruction of the step (the
    /// executor's reading; within an instruction the temporaries go higher).
    pub peak_in_use: u64,
    /// Bytes the pool has taken from the device: it keeps what it took, so at a step's end this
    /// is the step's high-water mark (and that of the steps before it), padding included.
    pub reserved: u64,
}

/// The memory pool of `device` for the calling thread now; None on CPU devices, in builds
/// without `cuda`, or where the runtime cannot tell (its server gone: cubecl would panic, which
/// is caught here, so a failing step still gets its own error reported).
pub fn memory_usage(device: archipelago_dataflow::DeviceSpec) -> Option<DeviceMemory> {
    #[cfg(feature = "cuda")]
    if let Some(n) = device.cuda_ordinal() {
        use cubecl::Runtime;
        let usage = std::panic::catch_unwind(|| {
            let client = cubecl::cuda::CudaRuntime::client(&cubecl::cuda::CudaDevice::new(n as usize));
            client.memory_usage().ok()
        })
        .ok()
        .flatten()?;
        return Some(DeviceMemory {
            in_use: usage.bytes_in_use,
            peak_in_use: usage.bytes_in_use,
            reserved: usage.bytes_reserved,
        });
    }
    let _ = device;
    None
}

/// The smallest memory of the GPUs among `devices` (a plan's memory budget per device when the
/// job gives none), None without GPUs among them or where the driver cannot tell.
pub fn smallest_memory(devices: &[archipelago_dataflow::DeviceSpec]) -> Option<u64> {
    let wanted: Vec<u32> = devices.iter().filter_map(|d| d.cuda_ordinal()).collect();
    if wanted.is_empty() {
        return None;
    }
    let gpus = list().ok()?;
    wanted
        .iter()
        .filter_map(|n| gpus.iter().find(|g| g.index == *n).map(|g| g.memory_bytes))
        .min()
}

#[cfg(feature = "cuda")]
mod probe {
    use cudarc::driver::{result, sys};

    use super::Gpu;

    pub(super) fn list() -> Result<Vec<Gpu>, String> {
        // SAFETY: only tries to open the driver's shared library (libcuda.so), which has no
        // initialisation side effects beyond loading it.
        #[allow(unsafe_code)]
        let present = unsafe { sys::is_culib_present() };
        if !present {
            return Err(
                "no NVIDIA driver was found on this host (libcuda.so could not be loaded; \
                        install the driver or put its directory in LD_LIBRARY_PATH)"
                    .into(),
            );
        }
        result::init().map_err(|e| format!("the NVIDIA driver failed to initialise: {e}"))?;
        let count = result::device::get_count()
            .map_err(|e| format!("the NVIDIA driver could not count GPUs: {e}"))?;
        (0..count)
            .map(|i| {
                let dev = result::device::get(i).map_err(|e| format!("cuda:{i}: {e}"))?;
                let name = result::device::get_name(dev).map_err(|e| format!("cuda:{i}: {e}"))?;
                // SAFETY: `dev` is a device handle the driver just returned for ordinal `i`.
                #[allow(unsafe_code)]
                let memory =
                    unsafe { result::device::total_mem(dev) }.map_err(|e| format!("cuda:{i}: {e}"))?;
                let attribute = |attribute| {
                    // SAFETY: `dev` is a device handle the driver just returned for ordinal `i`.
                    #[allow(unsafe_code)]
                    let value = unsafe { result::device::get_attribute(dev, attribute) };
                    value
                        .map(|v| v.max(0) as u32)
                        .map_err(|e| format!("cuda:{i}: {e}"))
                };
                use sys::CUdevice_attribute::{
                    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
                    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
                };
                Ok(Gpu {
                    index: i as u32,
                    name,
                    memory_bytes: memory as u64,
                    compute_capability: (attribute(MAJOR)?, attribute(MINOR)?),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use archipelago_dataflow::DType;

    /// bf16 is refused below compute capability 8.0, naming the GPU, its capability and the fix;
    /// f32 and f16 run everywhere; an unknown capability is not refused.
    #[test]
    fn bf16_needs_compute_capability_eight() {
        let refused = super::runs_compute_dtype("cuda:0 (Tesla V100)", (7, 0), DType::BF16).unwrap_err();
        assert!(
            refused.contains("7.0") && refused.contains("--precision f32"),
            "{refused}"
        );
        for ok in [
            ((8, 0), DType::BF16),
            ((9, 0), DType::BF16),
            ((7, 0), DType::F16),
            ((7, 0), DType::F32),
        ] {
            assert_eq!(super::runs_compute_dtype("cuda:0", ok.0, ok.1), Ok(()), "{ok:?}");
        }
        assert_eq!(super::runs_compute_dtype("cuda:0", (0, 0), DType::BF16), Ok(()));
    }
}
