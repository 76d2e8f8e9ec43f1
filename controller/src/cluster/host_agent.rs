//! `archipelago host`: one per machine. It serves its fabric ports and an actor port of the
//! runtime API, registers its devices with the controller on a `Session`, and sends heartbeats
//! carrying what each of its actors is running. The controller spawns the job's
//! [`HostPart`](super::host_part::HostPart) here over the actor port and drives the steps by
//! calling it; the session's `Stop` ends the job (even while a step hangs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio_stream::wrappers::UnboundedReceiverStream;

use archipelago_actors::fabric::grpc::{Inbox, serve_fabric, with_token};
use archipelago_actors::fabric::serve_tcp_fabric;
use archipelago_actors::proto::controller_client::ControllerClient;
use archipelago_actors::proto::{
    ControllerMessage, Heartbeat, HostMessage, Register, controller_message, host_message,
};
use archipelago_actors::runtime::Runtime;
use archipelago_actors::runtime::remote::serve_actor_port;
use archipelago_actors::trust::{Credentials, grpc_endpoint};
use archipelago_dataflow::DeviceSpec;

use super::host_part::{self, HostResources, Progress};

/// How a host joins the cluster.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The controller's address (`host:port`).
    pub controller: String,
    /// The cluster token, and TLS when the cluster runs with it.
    pub credentials: Credentials,
    /// This host's name.
    pub name: String,
    /// Its island.
    pub island: String,
    /// The devices it offers.
    pub devices: Vec<DeviceSpec>,
    /// Memory per device in bytes, when known.
    pub memory: Option<u64>,
    /// Where its fabric listens (`127.0.0.1:0` picks a free port).
    pub fabric_listen: String,
    /// The name other hosts dial this host's fabric ports at, when not the bound address (a
    /// DNS name its TLS certificate carries, an address behind NAT).
    pub advertise: Option<String>,
    /// Heartbeat interval.
    pub heartbeat: Duration,
    /// How long to keep trying to reach the controller.
    pub connect_timeout: Duration,
}

/// Runs the host until the controller ends its session (an error) or refuses it.
pub async fn run_host(options: HostOptions) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(&options.fabric_listen)
        .await
        .with_context(|| format!("cannot listen for the fabric on {}", options.fabric_listen))?;
    let inbox = Inbox::default();
    let published = |bound: std::net::SocketAddr| match &options.advertise {
        Some(name) => format!("{name}:{}", bound.port()),
        None => bound.to_string(),
    };
    let fabric_addr = published(serve_fabric(listener, inbox.clone(), &options.credentials)?);
    // The raw-TCP tensor port and the actor port: on the same interface, any free port.
    let tcp_listen = any_port_on(&options.fabric_listen);
    let tcp_listener = std::net::TcpListener::bind(&tcp_listen)
        .with_context(|| format!("cannot listen for tensors on {tcp_listen}"))?;
    let tcp_addr = published(serve_tcp_fabric(
        tcp_listener,
        inbox.clone(),
        &options.credentials,
    )?);
    let progress: Progress = Arc::default();
    let host = HostResources::install(
        options.name.clone(),
        inbox,
        fabric_addr.clone(),
        tcp_addr.clone(),
        options.credentials.clone(),
        progress.clone(),
    )?;
    // The controller spawns the job's host part here and drives it over this port.
    // … and a serving job's part.
    host_part::registry()
        .merge(super::serve_part::registry())
        .install();
    let runtime = Runtime::new("host", &options.name, vec![options.devices[0]]);
    let actor_listener = tokio::net::TcpListener::bind(any_port_on(&options.fabric_listen))
        .await
        .context("cannot listen for actors")?;
    let port = serve_actor_port(
        actor_listener,
        runtime.handle().clone(),
        options.credentials.clone(),
    )?;
    let actor_addr = published(port.addr);
    let result = serve_session(&options, &fabric_addr, &tcp_addr, &actor_addr, &host, progress).await;
    host.stop_job(None, "the session with the controller ended").await;
    port.close();
    // A runtime is not dropped inside an async context.
    let _ = tokio::task::spawn_blocking(move || drop(runtime)).await;
    result
}

/// Registers with the controller, sends heartbeats and ends jobs on `Stop`, until the session
/// ends.
async fn serve_session(
    options: &HostOptions,
    fabric_addr: &str,
    tcp_addr: &str,
    actor_addr: &str,
    host: &HostResources,
    progress: Progress,
) -> anyhow::Result<()> {
    let channel = connect(&options.controller, &options.credentials, options.connect_timeout).await?;
    let mut client = ControllerClient::new(channel);
    let (to_controller, outgoing) = unbounded_channel::<HostMessage>();
    let _ = to_controller.send(HostMessage {
        kind: Some(host_message::Kind::Register(Register {
            name: options.name.clone(),
            island: options.island.clone(),
            devices: options.devices.iter().map(|d| d.to_string()).collect(),
            device_memory: options.memory.unwrap_or(0),
            fabric_addr: fabric_addr.to_string(),
            pid: std::process::id(),
            tcp_addr: tcp_addr.to_string(),
            actor_addr: actor_addr.to_string(),
        })),
    });
    let request = with_token(
        options.credentials.token(),
        UnboundedReceiverStream::new(outgoing),
    )?;
    let mut incoming = match client.session(request).await {
        Ok(response) => response.into_inner(),
        Err(status) if status.code() == tonic::Code::Unauthenticated => {
            bail!(
                "the controller at {} refused this host: {}",
                options.controller,
                status.message()
            )
        }
        Err(status) => bail!(
            "the controller at {} refused the session: {}{}",
            options.controller,
            status.message(),
            if options.credentials.tls().is_some() {
                " (a TLS connection dropped after the handshake: is --tls-cert signed by the cluster's CA?)"
            } else {
                ""
            }
        ),
    };
    match incoming.message().await? {
        Some(ControllerMessage {
            kind: Some(controller_message::Kind::Accepted(a)),
        }) => {
            tracing::info!(host = a.host, "registered with the controller");
            println!(
                "host `{}` registered with the controller at {} (fabric {fabric_addr}, actors {actor_addr}, devices {})",
                options.name,
                options.controller,
                options
                    .devices
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        other => bail!("the controller answered the registration with {other:?}"),
    }
    spawn_heartbeats(to_controller.clone(), progress, options.heartbeat);
    loop {
        let message = match incoming.message().await {
            Ok(Some(m)) => m,
            Ok(None) => bail!("the controller closed the session"),
            Err(e) => bail!("the session with the controller broke: {}", e.message()),
        };
        if let Some(controller_message::Kind::Stop(stop)) = message.kind {
            let reason = format!("the controller stopped the job: {}", stop.reason);
            host.stop_job(Some(&stop.job), &reason).await;
        }
    }
}

/// Connects to the controller, retrying until `timeout` while nothing listens at `addr` yet
/// (hosts may start before it); any other failure — a refused TLS handshake, a peer that is
/// not a controller — ends the attempt at once with its causes.
pub(crate) async fn connect(
    addr: &str,
    credentials: &Credentials,
    timeout: Duration,
) -> anyhow::Result<tonic::transport::Channel> {
    let endpoint = grpc_endpoint(addr, credentials).map_err(|e| anyhow::anyhow!("the controller: {e}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Ok(channel),
            Err(e) if !nothing_listens(&e) => {
                bail!(
                    "the controller at {addr} could not be reached: {:#}",
                    anyhow::Error::from(e)
                )
            }
            Err(e) if Instant::now() >= deadline => {
                bail!(
                    "cannot reach the controller at {addr} after {timeout:?}: {:#}",
                    anyhow::Error::from(e)
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Whether a connection failed because nothing listens there (yet): worth retrying.
fn nothing_listens(error: &tonic::transport::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::TimedOut
            );
        }
        cause = e.source();
    }
    false
}

pub(crate) fn spawn_heartbeats(
    to_controller: UnboundedSender<HostMessage>,
    progress: Progress,
    every: Duration,
) {
    tokio::spawn(async move {
        loop {
            let actors = progress
                .lock()
                .expect("progress")
                .iter()
                .map(|(actor, p)| crate::hang::actor_state(*actor, &p.snapshot()))
                .collect();
            let unix_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let beat = HostMessage {
                kind: Some(host_message::Kind::Heartbeat(Heartbeat { unix_ms, actors })),
            };
            if to_controller.send(beat).is_err() {
                return;
            }
            tokio::time::sleep(every).await;
        }
    });
}

/// Any free port on the fabric's interface.
fn any_port_on(fabric_listen: &str) -> String {
    match fabric_listen.rsplit_once(':') {
        Some((host, _)) => format!("{host}:0"),
        None => "127.0.0.1:0".into(),
    }
}
