//! The embedded controller: one process, one device actor per CPU device, in-process fabric.

use std::time::Duration;

use archipelago_dataflow::DeviceSpec;

/// A controller with its own async runtime. Its methods block until the job ends.
pub struct Controller {
    pub(crate) devices: Vec<DeviceSpec>,
    pub(crate) runtime: tokio::runtime::Runtime,
}

impl Controller {
    /// A controller that runs actors in this process on `devices`.
    ///
    /// # Panics
    /// When the async runtime cannot be created (no threads available).
    pub fn local(devices: Vec<DeviceSpec>) -> Controller {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("controller")
            .enable_all()
            .build()
            .expect("tokio runtime");
        Controller { devices, runtime }
    }

    /// The devices this controller places actors on.
    pub fn devices(&self) -> &[DeviceSpec] {
        &self.devices
    }
}

/// How long a receive may wait before the actor reports a hang naming its peer.
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(120);
