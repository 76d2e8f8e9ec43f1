//! A process of the program's own binary serving as a host: a runtime on its devices, its
//! actor port, and a session with the controller (registration with the port's address,
//! heartbeats). It runs until the controller ends the session, then stops its actors.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::sync::mpsc::unbounded_channel;
use tokio_stream::wrappers::UnboundedReceiverStream;

use archipelago_actors::fabric::grpc::with_token;
use archipelago_actors::proto::controller_client::ControllerClient;
use archipelago_actors::proto::{HostMessage, Register, controller_message, host_message};
use archipelago_actors::runtime::remote::serve_actor_port;
use archipelago_actors::runtime::{PeerHosts, Runtime};
use archipelago_actors::trust::Credentials;
use archipelago_dataflow::DeviceSpec;

use super::{CONTROLLER_ENV, DEVICES_ENV, HOST_NAME_ENV, ISLAND_ENV, LISTEN_ENV, read_credentials};
use crate::cluster::host_agent::{connect, spawn_heartbeats};

/// How a program's process serves as a host.
#[derive(Debug, Clone)]
pub struct HostSettings {
    /// The controller's address.
    pub controller: String,
    /// The cluster token, and TLS when the cluster runs with it.
    pub credentials: Credentials,
    /// The devices offered.
    pub devices: Vec<DeviceSpec>,
    /// The host's name.
    pub name: String,
    /// Its island.
    pub island: String,
    /// Where the actor port listens.
    pub listen: String,
}

impl HostSettings {
    /// Settings from the environment (`ARCHIPELAGO_CONTROLLER`, `auto` in a Slurm job;
    /// `ARCHIPELAGO_TOKEN_FILE`,
    /// `ARCHIPELAGO_TLS_CERT`/`_KEY`/`_CA`, `ARCHIPELAGO_DEVICES`, `ARCHIPELAGO_HOST_NAME`, `ARCHIPELAGO_ISLAND`,
    /// `ARCHIPELAGO_LISTEN`).
    pub fn from_env() -> anyhow::Result<HostSettings> {
        use crate::cluster::slurm;
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let controller = var(CONTROLLER_ENV)
            .ok_or_else(|| anyhow::anyhow!("a host needs {CONTROLLER_ENV}: the controller's host:port"))?;
        let devices = var(DEVICES_ENV).unwrap_or_else(|| "cpu:0".into());
        let listen = var(LISTEN_ENV).unwrap_or_else(|| "127.0.0.1:0".into());
        let place = slurm::HostPlace::resolve(
            &slurm::ProcessEnv,
            &devices,
            &listen,
            var(HOST_NAME_ENV),
            var(ISLAND_ENV),
        )?;
        Ok(HostSettings {
            controller: crate::cluster::commands::controller_addr(&controller)?,
            credentials: read_credentials()?,
            devices: DeviceSpec::parse_list(&place.devices)
                .with_context(|| format!("{DEVICES_ENV}={}", place.devices))?,
            name: place.name,
            island: place.island,
            listen: place.listen,
        })
    }
}

/// Serves as a host until the controller ends the session (exporting its actors' figures as
/// OpenTelemetry metrics when `OTEL_EXPORTER_OTLP_ENDPOINT` is set).
pub fn serve_as_host(settings: &HostSettings) -> anyhow::Result<()> {
    let runtime = Runtime::new(&super::job_name(), &settings.name, settings.devices.clone());
    crate::telemetry::export_actor_metrics(&runtime);
    let handle = runtime.handle().clone();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&settings.listen)
            .await
            .with_context(|| format!("cannot listen for actors on {}", settings.listen))?;
        let port = serve_actor_port(listener, handle.clone(), settings.credentials.clone())?;
        handle.set_peer_hosts(peer_hosts(settings));
        let channel = connect(
            &settings.controller,
            &settings.credentials,
            Duration::from_secs(10),
        )
        .await?;
        let (to_controller, outgoing) = unbounded_channel::<HostMessage>();
        let register = Register {
            name: settings.name.clone(),
            island: settings.island.clone(),
            devices: settings.devices.iter().map(|d| d.to_string()).collect(),
            device_memory: 0,
            fabric_addr: String::new(),
            pid: std::process::id(),
            tcp_addr: String::new(),
            actor_addr: port.addr.to_string(),
        };
        let _ = to_controller.send(HostMessage {
            kind: Some(host_message::Kind::Register(register)),
        });
        let request = with_token(
            settings.credentials.token(),
            UnboundedReceiverStream::new(outgoing),
        )?;
        let mut incoming = ControllerClient::new(channel)
            .session(request)
            .await
            .map_err(|s| {
                anyhow::anyhow!(
                    "the controller at {} refused this host: {}",
                    settings.controller,
                    s.message()
                )
            })?
            .into_inner();
        match incoming.message().await? {
            Some(m) if matches!(m.kind, Some(controller_message::Kind::Accepted(_))) => {
                println!(
                    "host `{}` serves actors on {} for the controller at {}",
                    settings.name, port.addr, settings.controller
                );
            }
            other => bail!("the controller answered the registration with {other:?}"),
        }
        spawn_heartbeats(to_controller.clone(), Default::default(), Duration::from_secs(1));
        loop {
            match incoming.message().await {
                Ok(Some(m)) if matches!(m.kind, Some(controller_message::Kind::Stop(_))) => break,
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        port.close();
        Ok(())
    })
}

/// The other hosts, as the controller lists them when this host looks an actor up by name.
fn peer_hosts(settings: &HostSettings) -> PeerHosts {
    let (controller, credentials) = (settings.controller.clone(), settings.credentials.clone());
    Arc::new(move || {
        let (controller, credentials) = (controller.clone(), credentials.clone());
        Box::pin(async move {
            let slots = super::driver::ask_for_slots(&controller, &credentials, 1)
                .await
                .map_err(|e| format!("{e:#}"))?;
            Ok(slots.into_iter().map(|s| (s.host, s.addr)).collect())
        })
    })
}
