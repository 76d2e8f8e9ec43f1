//! The embedded controller: one process, one device actor per CPU device, in-process fabric.

use std::time::Duration;

use archipelago_dataflow::DeviceSpec;

/// A controller with its own async runtime. Its methods block until the job ends.
pub struct Controller {
    pub(crate) devices: Vec<DeviceSpec>,
    pub(crate) runtime: tokio::runtime::Runtime,
    /// A controller service to submit jobs to instead of running them here.
    pub(crate) remote: Option<crate::cluster::client::RemoteTarget>,
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
        Controller {
            devices,
            runtime,
            remote: None,
        }
    }

    /// A handle on the controller service at `addr` (`archipelago controller`), whose hosts run
    /// the jobs; `credentials` are the cluster's token (a `&str` will do) or
    /// [`Credentials`](archipelago_actors::trust::Credentials) with mutual TLS. Jobs are compiled
    /// and placed by that controller.
    pub fn connect(addr: &str, credentials: impl Into<archipelago_actors::trust::Credentials>) -> Controller {
        let mut controller = Controller::local(Vec::new());
        controller.remote = Some(crate::cluster::client::RemoteTarget {
            addr: addr.to_string(),
            credentials: credentials.into(),
        });
        controller
    }

    /// The devices this controller places actors on.
    pub fn devices(&self) -> &[DeviceSpec] {
        &self.devices
    }
}

/// How long a receive may wait before the actor reports a hang naming its peer.
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(120);
