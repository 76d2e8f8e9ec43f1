//! The burn backends device actors run on. CPU: `Autodiff<Flex>`, one actor thread per device.

use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};

use archipelago_dataflow::DeviceSpec;

/// The CPU training backend: burn's pure-Rust `Flex` under autodiff.
pub type CpuBackend = Autodiff<Flex>;

/// The burn device for a device spec, or why this build cannot run it.
pub fn device_for(spec: DeviceSpec) -> Result<FlexDevice, String> {
    match spec {
        DeviceSpec::Cpu(_) => Ok(FlexDevice),
        DeviceSpec::Cuda(n) => Err(format!(
            "device cuda:{n} was asked for, but this build has no CUDA backend; use cpu:N devices"
        )),
    }
}
