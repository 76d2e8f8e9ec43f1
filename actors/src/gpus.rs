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
                Ok(Gpu {
                    index: i as u32,
                    name,
                    memory_bytes: memory as u64,
                })
            })
            .collect()
    }
}
