//! `archipelago host`: one per machine. It serves its fabric, registers its devices with the
//! controller on a `Session`, sends heartbeats carrying what each of its actors is running, and
//! on `Launch` starts its part of the job's actors (the same trainers as a local job, over a
//! gRPC fabric to the other hosts), then runs `Step`s and answers `Ask`s until `Stop`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio_stream::wrappers::UnboundedReceiverStream;

use archipelago_actors::checkpoint::CheckpointReader;
use archipelago_actors::fabric::grpc::{GrpcFabric, Inbox, serve_fabric, with_token};
use archipelago_actors::fabric::{DataPath, Fabric, InProcessFabric, TcpFabric, serve_tcp_fabric};
use archipelago_actors::progress::ActorProgress;
use archipelago_actors::proto::controller_client::ControllerClient;
use archipelago_actors::proto::{
    Answer, Ask, ControllerMessage, Failure, Heartbeat, HostMessage, Launch, Ready, Register, StepDone,
    controller_message, host_message,
};
use archipelago_actors::trust::{Credentials, grpc_endpoint};
use archipelago_dataflow::{ActorId, DeviceSpec, ModelSpec, Plan};

use crate::JobError;
use crate::actor_gang::ActorGang;
use crate::gang::Gang;
use crate::train_job::trainer_factories;

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

pub(crate) type Progress = Arc<Mutex<Vec<(ActorId, Arc<ActorProgress>)>>>;

/// The host's part of the running job. Steps and answers run in their own tasks holding the
/// gang, so that a `Stop` is read while a step hangs: it aborts the fabric, which ends the step.
struct LocalJob {
    name: String,
    gang: Arc<tokio::sync::Mutex<ActorGang>>,
    fabric: Arc<dyn Fabric>,
}

impl LocalJob {
    async fn stop(self, reason: &str) {
        self.fabric.abort(reason);
        self.gang.lock().await.stop().await;
    }
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
    // The raw-TCP tensor port: on the same interface, any free port.
    let tcp_listen = tcp_listen_addr(&options.fabric_listen);
    let tcp_listener = std::net::TcpListener::bind(&tcp_listen)
        .with_context(|| format!("cannot listen for tensors on {tcp_listen}"))?;
    let tcp_addr = published(serve_tcp_fabric(
        tcp_listener,
        inbox.clone(),
        &options.credentials,
    )?);
    let channel = connect(&options.controller, &options.credentials, options.connect_timeout).await?;
    let mut client = ControllerClient::new(channel);
    let (to_controller, outgoing) = unbounded_channel::<HostMessage>();
    let send = |tx: &UnboundedSender<HostMessage>, kind: host_message::Kind| {
        let _ = tx.send(HostMessage { kind: Some(kind) });
    };
    send(
        &to_controller,
        host_message::Kind::Register(Register {
            name: options.name.clone(),
            island: options.island.clone(),
            devices: options.devices.iter().map(|d| d.to_string()).collect(),
            device_memory: options.memory.unwrap_or(0),
            fabric_addr: fabric_addr.clone(),
            pid: std::process::id(),
            tcp_addr: tcp_addr.clone(),
            actor_addr: String::new(),
        }),
    );
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
                "host `{}` registered with the controller at {} (fabric {fabric_addr}, devices {})",
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
    let progress: Progress = Arc::default();
    spawn_heartbeats(to_controller.clone(), progress.clone(), options.heartbeat);
    let mut job: Option<LocalJob> = None;
    let result = loop {
        let message = match incoming.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break Err(anyhow::anyhow!("the controller closed the session")),
            Err(e) => {
                break Err(anyhow::anyhow!(
                    "the session with the controller broke: {}",
                    e.message()
                ));
            }
        };
        let Some(kind) = message.kind else { continue };
        match kind {
            controller_message::Kind::Launch(launch) => {
                if let Some(old) = job.take() {
                    old.stop("a new job was launched").await;
                }
                let name = launch.job.clone();
                let tcp_port = launch
                    .data_path
                    .parse::<DataPath>()
                    .is_ok_and(DataPath::uses_tcp_port);
                let here = if tcp_port { &tcp_addr } else { &fabric_addr };
                match start_job(launch, &inbox, here, &options.credentials).await {
                    Ok((gang, fabric)) => {
                        *progress.lock().expect("progress") =
                            gang.progress().iter().map(|(a, _, p)| (*a, p.clone())).collect();
                        job = Some(LocalJob {
                            name: name.clone(),
                            gang: Arc::new(tokio::sync::Mutex::new(gang)),
                            fabric,
                        });
                        send(&to_controller, host_message::Kind::Ready(Ready { job: name }));
                    }
                    Err(e) => send(&to_controller, failure(&name, &e)),
                }
            }
            controller_message::Kind::Step(step) => {
                let Some(j) = job.as_ref().filter(|j| j.name == step.job) else {
                    send(
                        &to_controller,
                        failure(&step.job, &JobError::Runtime("no such job here".into())),
                    );
                    continue;
                };
                let (gang, tx) = (j.gang.clone(), to_controller.clone());
                tokio::spawn(async move {
                    let result = gang.lock().await.step(step.step).await.map(|mut reports| {
                        let rss = crate::process_stats::peak_rss_bytes();
                        reports.iter_mut().for_each(|r| r.host_peak_rss_bytes = rss);
                        reports
                    });
                    let kind = match result.and_then(|r| {
                        archipelago_actors::codec::encode(&r).map_err(|e| JobError::Runtime(e.to_string()))
                    }) {
                        Ok(reports) => host_message::Kind::StepDone(StepDone {
                            job: step.job,
                            step: step.step,
                            reports: reports.into(),
                        }),
                        Err(e) => failure(&step.job, &e),
                    };
                    send(&tx, kind);
                });
            }
            controller_message::Kind::Ask(ask) => {
                let Some(j) = job.as_ref().filter(|j| j.name == ask.job) else {
                    send(
                        &to_controller,
                        failure(&ask.job, &JobError::Runtime("no such job here".into())),
                    );
                    continue;
                };
                let (gang, tx) = (j.gang.clone(), to_controller.clone());
                tokio::spawn(async move {
                    let kind = match answer(&mut *gang.lock().await, &ask).await {
                        Ok(body) => host_message::Kind::Answer(Answer {
                            job: ask.job,
                            id: ask.id,
                            body: body.into(),
                        }),
                        Err(e) => failure(&ask.job, &e),
                    };
                    send(&tx, kind);
                });
            }
            controller_message::Kind::Stop(stop) => {
                if let Some(j) = job.take_if(|j| j.name == stop.job) {
                    j.stop(&format!("the controller stopped the job: {}", stop.reason))
                        .await;
                    inbox.install(None);
                    progress.lock().expect("progress").clear();
                }
            }
            controller_message::Kind::Accepted(_) => {}
        }
    };
    if let Some(j) = job.take() {
        j.stop("the session with the controller ended").await;
    }
    result
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

async fn start_job(
    launch: Launch,
    inbox: &Inbox,
    here: &str,
    credentials: &Credentials,
) -> Result<(ActorGang, Arc<dyn Fabric>), JobError> {
    let plan: Plan = archipelago_actors::codec::decode(&launch.plan)
        .map_err(|e| JobError::Runtime(format!("unreadable plan: {e}")))?;
    let patience = Duration::from_millis(launch.patience_ms);
    let local = Arc::new(InProcessFabric::new(plan.actors.len(), patience));
    inbox.install(Some(local.clone()));
    let fabric: Arc<dyn Fabric> = match launch.data_path.parse::<DataPath>().map_err(JobError::Runtime)? {
        DataPath::Grpc => Arc::new(
            GrpcFabric::connect(&launch.actor_addrs, here, local, credentials)
                .await
                .map_err(JobError::Runtime)?,
        ),
        path @ (DataPath::Tcp | DataPath::Shm | DataPath::Auto) => {
            let addrs = launch.actor_addrs.clone();
            let (here, credentials) = (here.to_string(), credentials.clone());
            let connect = move || TcpFabric::connect(&addrs, &here, local, &credentials, path);
            let fabric = tokio::task::spawn_blocking(connect)
                .await
                .map_err(|e| JobError::Runtime(e.to_string()))?
                .map_err(JobError::Runtime)?;
            Arc::new(fabric)
        }
    };
    let restore = if launch.restore.is_empty() {
        None
    } else {
        let reader =
            CheckpointReader::open(std::path::Path::new(&launch.restore)).map_err(JobError::Runtime)?;
        Some(Arc::new(reader))
    };
    let spec = ModelSpec::parse(&plan.program.model.name)?;
    let builders = archipelago_actors::Builders::zoo(spec);
    let actors: Vec<ActorId> = launch.actors.iter().map(|&a| a as ActorId).collect();
    let devices: Vec<DeviceSpec> = actors.iter().map(|&a| plan.actors[a].device).collect();
    builders.check(&devices).map_err(JobError::Runtime)?;
    let factories = trainer_factories(&plan, &builders, &actors, restore);
    let mut streams: Vec<_> = actors.iter().map(|&a| plan.actors[a].stream.clone()).collect();
    crate::hang::inject_stream_fault(&mut streams, plan.program.test_fault);
    let watchdog = patience + Duration::from_secs(10);
    let gang = ActorGang::start(&launch.job, streams, factories, fabric.clone(), watchdog).await?;
    Ok((gang, fabric))
}

async fn answer(gang: &mut ActorGang, ask: &Ask) -> Result<Vec<u8>, JobError> {
    let json = match ask.what.as_str() {
        "block_squares" => serde_json::to_vec(&gang.block_squares().await?),
        "checkpoint" => {
            serde_json::to_vec(&gang.checkpoint(std::path::Path::new(&ask.path), ask.step).await?)
        }
        other => return Err(JobError::Runtime(format!("unknown question `{other}`"))),
    };
    json.map_err(|e| JobError::Runtime(e.to_string()))
}

fn failure(job: &str, error: &JobError) -> host_message::Kind {
    let actor_failure = match error {
        JobError::Actor(f) => serde_json::to_vec(f).unwrap_or_default(),
        _ => Vec::new(),
    };
    host_message::Kind::Failure(Failure {
        job: job.to_string(),
        message: error.to_string(),
        actor_failure: actor_failure.into(),
    })
}

/// The raw-TCP tensor port listens on the fabric's interface, on any free port.
fn tcp_listen_addr(fabric_listen: &str) -> String {
    match fabric_listen.rsplit_once(':') {
        Some((host, _)) => format!("{host}:0"),
        None => "127.0.0.1:0".into(),
    }
}
