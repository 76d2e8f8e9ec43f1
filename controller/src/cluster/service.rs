//! The controller's gRPC service (`archipelago controller`): hosts open a `Session` and register
//! their devices; clients `Submit` jobs, which run one at a time on the registered hosts, and
//! `Serve` models (serving jobs, beside the training job: each on the host holding the fewest,
//! kept while the client's call is open). Every call must carry the cluster's token; a refusal
//! is logged with the peer's address. With TLS in the credentials, hosts and clients must also show a certificate signed by the cluster CA.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::unbounded_channel;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status, Streaming};

use archipelago_actors::fabric::grpc::TokenCheck;
use archipelago_actors::proto::controller_server::{Controller as ControllerRpc, ControllerServer};
use archipelago_actors::proto::{
    Accepted, ActorSlot, ClusterReply, ClusterRequest, ControllerMessage, HostMessage, JobEvent, JobRequest,
    controller_message, host_message, job_event,
};
use archipelago_actors::trust::{Credentials, serve_grpc};
use archipelago_dataflow::{DeviceSpec, Program};

pub use super::registry::ClusterConfig;
use super::registry::{HostInfo, Registry};
use super::remote_job::{RemoteOptions, run_job};
use super::serving_job::{ServingJob, ServingJobs};
use crate::serve::ServeArgs;

struct ControllerService {
    registry: Arc<Registry>,
    config: ClusterConfig,
    /// The cluster's credentials (the controller shows them at the hosts' actor ports).
    credentials: Credentials,
    /// One job at a time.
    running: Arc<tokio::sync::Mutex<()>>,
    /// The serving jobs.
    serving: Arc<ServingJobs>,
}

#[tonic::async_trait]
impl ControllerRpc for ControllerService {
    type SessionStream = UnboundedReceiverStream<Result<ControllerMessage, Status>>;
    type SubmitStream = UnboundedReceiverStream<Result<JobEvent, Status>>;
    type ServeStream = UnboundedReceiverStream<Result<JobEvent, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<HostMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let peer = request.remote_addr();
        let mut incoming = request.into_inner();
        let first = incoming
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("the session ended before the host registered"))?;
        let Some(host_message::Kind::Register(r)) = first.kind else {
            return Err(Status::invalid_argument("a session starts with Register"));
        };
        let devices = r
            .devices
            .iter()
            .map(|d| d.parse::<DeviceSpec>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if devices.is_empty() {
            return Err(Status::invalid_argument(
                "a host must offer at least one device (--devices)",
            ));
        }
        let info = HostInfo {
            id: 0,
            name: r.name,
            island: r.island,
            devices,
            device_memory: r.device_memory,
            fabric_addr: r.fabric_addr,
            tcp_addr: r.tcp_addr,
            pid: r.pid,
            actor_addr: r.actor_addr,
        };
        let (tx, rx) = unbounded_channel();
        let id = self
            .registry
            .register(info, tx.clone())
            .map_err(Status::already_exists)?;
        tracing::info!(host = id, ?peer, "session open");
        let _ = tx.send(Ok(ControllerMessage {
            kind: Some(controller_message::Kind::Accepted(Accepted { host: id })),
        }));
        let registry = self.registry.clone();
        tokio::spawn(async move {
            loop {
                match incoming.message().await {
                    Ok(Some(HostMessage {
                        kind: Some(host_message::Kind::Heartbeat(h)),
                    })) => registry.heartbeat(id, h.actors),
                    // A second registration is not a sign of life: ignored.
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        registry.gone(id, "it closed its session");
                        break;
                    }
                    Err(e) => {
                        registry.gone(id, &format!("its session broke ({})", e.message()));
                        break;
                    }
                }
            }
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn cluster(&self, request: Request<ClusterRequest>) -> Result<Response<ClusterReply>, Status> {
        let needed = request.into_inner().min_devices.max(1) as usize;
        let wait = self.config.wait_for_hosts;
        let hosts = self.registry.wait_for_devices(needed, wait, true).await;
        let slots: Vec<ActorSlot> = hosts
            .iter()
            .flat_map(|h| {
                h.devices.iter().map(|d| ActorSlot {
                    host: h.name.clone(),
                    island: h.island.clone(),
                    addr: h.actor_addr.clone(),
                    device: d.to_string(),
                })
            })
            .collect();
        if slots.len() < needed {
            return Err(Status::failed_precondition(format!(
                "the program needs {needed} devices but the cluster's hosts running it offer {} after waiting {wait:?}; start more hosts of the program's binary (ARCHIPELAGO_ROLE=host) or ask for fewer devices",
                slots.len()
            )));
        }
        Ok(Response::new(ClusterReply { slots }))
    }

    async fn submit(&self, request: Request<JobRequest>) -> Result<Response<Self::SubmitStream>, Status> {
        let request = request.into_inner();
        let program: Program = serde_json::from_slice(&request.program)
            .map_err(|e| Status::invalid_argument(format!("unreadable program: {e}")))?;
        let options: RemoteOptions = serde_json::from_slice(&request.options)
            .map_err(|e| Status::invalid_argument(format!("unreadable options: {e}")))?;
        let (tx, rx) = unbounded_channel();
        let (registry, config, running) = (self.registry.clone(), self.config.clone(), self.running.clone());
        let credentials = self.credentials.clone();
        tokio::spawn(async move {
            let _one_at_a_time = running.lock().await;
            let event = match run_job(registry, program, options, config, credentials, tx.clone()).await {
                Ok(report) => match serde_json::to_vec(&report) {
                    Ok(json) => job_event::Kind::Report(json.into()),
                    Err(e) => job_event::Kind::Error(e.to_string()),
                },
                Err(e) => job_event::Kind::Error(e.to_string()),
            };
            let _ = tx.send(Ok(JobEvent { kind: Some(event) }));
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn serve(
        &self,
        request: Request<archipelago_actors::proto::ServeRequest>,
    ) -> Result<Response<Self::ServeStream>, Status> {
        let request = request.into_inner();
        let args: ServeArgs = serde_json::from_slice(&request.args)
            .map_err(|e| Status::invalid_argument(format!("unreadable serve flags: {e}")))?;
        let name = self
            .serving
            .name(&request.job)
            .map_err(Status::invalid_argument)?;
        let (tx, rx) = unbounded_channel();
        let job = ServingJob {
            registry: self.registry.clone(),
            config: self.config.clone(),
            credentials: self.credentials.clone(),
            jobs: self.serving.clone(),
            name,
            args,
            events: tx,
        };
        tokio::spawn(job.run());
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

/// Serves the controller on `listener` (on the current tokio runtime) under the cluster's
/// `credentials`; returns its address and registry. A monitor declares silent hosts lost.
pub fn serve_controller(
    listener: tokio::net::TcpListener,
    credentials: &Credentials,
    config: ClusterConfig,
) -> std::io::Result<(SocketAddr, Arc<Registry>)> {
    let addr = listener.local_addr()?;
    let registry = Arc::new(Registry::new(config.dashboard.clone()));
    let host_timeout = config.host_timeout;
    let service = ControllerService {
        registry: registry.clone(),
        config,
        credentials: credentials.clone(),
        running: Arc::default(),
        serving: Arc::default(),
    };
    let check = TokenCheck::new(credentials.token());
    let credentials = credentials.clone();
    let service =
        tonic::service::interceptor::InterceptedService::new(ControllerServer::new(service), move |r| {
            check.check(r)
        });
    tokio::spawn(async move {
        let router = Server::builder().add_service(service);
        if let Err(e) = serve_grpc(router, listener, &credentials, "the controller").await {
            tracing::error!("the controller service on {addr} stopped: {e}");
        }
    });
    let monitor = registry.clone();
    tokio::spawn(async move {
        let tick = (host_timeout / 10).max(Duration::from_millis(50));
        loop {
            tokio::time::sleep(tick).await;
            monitor.expire(host_timeout);
        }
    });
    Ok((addr, registry))
}
