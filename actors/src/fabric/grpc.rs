//! The fabric between hosts: actors of this host exchange tensors through in-process mailboxes;
//! a tensor for an actor on another host goes out on one long-lived gRPC stream per peer host
//! (`Fabric.Push`), as raw little-endian f32 bytes in chunks of at most [`CHUNK_BYTES`], and the
//! receiving host assembles it (chunks in order, once each, the buffer growing with what arrives:
//! [`assembly`](super::assembly)) and drops it into the receiver's mailbox. Collectives and the executor see the same [`Fabric`] trait either way.
//!
//! Every call carries the job token (`authorization: Bearer …`); a peer without it is refused.
//! With TLS in the [`Credentials`], the streams run over mutual TLS under the cluster CA.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};

use archipelago_dataflow::ActorId;

use super::{Fabric, FabricError, HostRoutes, InProcessFabric, Link, Tag};
use crate::proto::fabric_client::FabricClient;
use crate::proto::fabric_server::{Fabric as FabricService, FabricServer};
use crate::proto::{PushReply, TensorChunk};
use crate::trust::{Credentials, grpc_endpoint, serve_grpc};
use crate::typed_tensor::TypedTensor;

/// Largest payload of one chunk (DESIGN.md: ≥ 1 MiB chunks).
pub const CHUNK_BYTES: usize = 4 << 20;
/// gRPC message limit on both sides (tonic's default is 4 MiB).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// HTTP/2 flow-control windows (stream and connection): several chunks in flight.
const WINDOW_BYTES: u32 = 32 << 20;

/// Where arriving tensors go: the running job's mailboxes (none between jobs).
#[derive(Clone, Default)]
pub struct Inbox {
    job: Arc<Mutex<Option<Arc<InProcessFabric>>>>,
}

impl Inbox {
    /// Delivers arriving tensors to `mailboxes` from now on (a job's launch).
    pub fn install(&self, mailboxes: Option<Arc<InProcessFabric>>) {
        *self.job.lock().expect("inbox") = mailboxes;
    }

    /// The mailboxes of the job running now, if any.
    pub(crate) fn current(&self) -> Option<Arc<InProcessFabric>> {
        self.job.lock().expect("inbox").clone()
    }

    /// Aborts the running job's mailboxes (a peer's connection broke).
    pub(crate) fn abort(&self, reason: &str) {
        if let Some(mailboxes) = self.job.lock().expect("inbox").clone() {
            mailboxes.abort(reason);
        }
    }

    pub(crate) fn deliver(
        &self,
        from: ActorId,
        to: ActorId,
        tag: Tag,
        tensor: TypedTensor,
    ) -> Result<(), Status> {
        let job = self.job.lock().expect("inbox").clone();
        let mailboxes = job.ok_or_else(|| Status::failed_precondition("no job is running on this host"))?;
        mailboxes
            .send(from, to, tag, tensor)
            .map_err(|e| Status::unavailable(e.to_string()))
    }
}

/// Checks the bearer token of every call.
#[derive(Clone)]
pub struct TokenCheck {
    expected: Arc<String>,
}

impl TokenCheck {
    /// Accepts calls carrying `token`.
    pub fn new(token: &str) -> TokenCheck {
        TokenCheck {
            expected: Arc::new(format!("Bearer {token}")),
        }
    }

    /// Refuses a request without the token, logging the refusal.
    pub fn check<T>(&self, request: Request<T>) -> Result<Request<T>, Status> {
        match request.metadata().get("authorization") {
            Some(v) if v.as_bytes() == self.expected.as_bytes() => Ok(request),
            got => {
                let peer = request
                    .remote_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|| "?".into());
                let what = if got.is_some() {
                    "a wrong token"
                } else {
                    "no token"
                };
                tracing::warn!(%peer, "refused a call with {what}");
                Err(Status::unauthenticated(format!(
                    "refused: {what} (pass the cluster's --token-file)"
                )))
            }
        }
    }
}

/// Adds the bearer token to outgoing calls.
pub fn with_token<T>(token: &str, message: T) -> Result<Request<T>, Status> {
    let mut request = Request::new(message);
    let value = MetadataValue::try_from(format!("Bearer {token}"))
        .map_err(|_| Status::invalid_argument("the token must be printable ASCII"))?;
    request.metadata_mut().insert("authorization", value);
    Ok(request)
}

struct PushService {
    inbox: Inbox,
}

#[tonic::async_trait]
impl FabricService for PushService {
    async fn push(&self, request: Request<Streaming<TensorChunk>>) -> Result<Response<PushReply>, Status> {
        let mut stream = request.into_inner();
        let mut assembler = super::assembly::Assembler::default();
        let mut tensors = 0;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            let Some(((from, to, edge, seq), tensor)) =
                assembler.take(&chunk).map_err(Status::invalid_argument)?
            else {
                continue;
            };
            let tag = Tag { edge, seq };
            self.inbox.deliver(from as ActorId, to as ActorId, tag, tensor)?;
            tensors += 1;
        }
        Ok(Response::new(PushReply { tensors }))
    }
}

/// Serves this host's `Fabric` on `listener` (e.g. bound to 127.0.0.1:0) on the current tokio
/// runtime; returns its address.
pub fn serve_fabric(
    listener: tokio::net::TcpListener,
    inbox: Inbox,
    credentials: &Credentials,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let check = TokenCheck::new(credentials.token());
    let credentials = credentials.clone();
    let service = FabricServer::new(PushService { inbox })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let service = tonic::service::interceptor::InterceptedService::new(service, move |r| check.check(r));
    tokio::spawn(async move {
        // Large windows for bulk streams.
        let router = Server::builder()
            .initial_stream_window_size(WINDOW_BYTES)
            .initial_connection_window_size(WINDOW_BYTES)
            .add_service(service);
        if let Err(e) = serve_grpc(router, listener, &credentials, "the fabric").await {
            tracing::error!("the fabric server on {addr} stopped: {e}");
        }
    });
    Ok(addr)
}

/// A job's fabric on one host: local actors through mailboxes, remote ones through one gRPC
/// stream per peer host.
pub type GrpcFabric = HostRoutes<GrpcLink>;

/// The outgoing gRPC stream towards one peer host.
pub struct GrpcLink(UnboundedSender<TensorChunk>);

impl GrpcFabric {
    /// The fabric of a job whose actor `a` is served at `addrs[a]`; actors at `here` are local
    /// and receive through `local` (also installed in this host's [`Inbox`]). Opens one stream
    /// per peer host.
    pub async fn connect(
        addrs: &[String],
        here: &str,
        local: Arc<InProcessFabric>,
        credentials: &Credentials,
    ) -> Result<GrpcFabric, String> {
        let token = credentials.token();
        let mut links = HashMap::new();
        for addr in HostRoutes::<GrpcLink>::peers(addrs, here) {
            let channel: Channel = grpc_endpoint(addr, credentials)
                .map_err(|e| format!("the fabric of host {addr}: {e}"))?
                .initial_stream_window_size(WINDOW_BYTES)
                .initial_connection_window_size(WINDOW_BYTES)
                .connect()
                .await
                .map_err(|e| format!("cannot reach the fabric of host {addr}: {e}"))?;
            let mut client = FabricClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            let (tx, rx) = unbounded_channel();
            let request =
                with_token(token, UnboundedReceiverStream::new(rx)).map_err(|e| e.message().to_string())?;
            let (peer, mailboxes) = (addr.to_string(), local.clone());
            tokio::spawn(async move {
                if let Err(e) = client.push(request).await {
                    let reason = format!("the tensor stream to host {peer} failed: {}", e.message());
                    tracing::error!("{reason}");
                    mailboxes.abort(&reason);
                }
            });
            links.insert(addr.to_string(), GrpcLink(tx));
        }
        Ok(HostRoutes::new(addrs, local, links))
    }
}

impl Link for GrpcLink {
    fn push(&self, from: ActorId, to: ActorId, tag: Tag, tensor: TypedTensor) -> Result<(), FabricError> {
        let shape: Vec<u64> = tensor.shape().iter().map(|&d| d as u64).collect();
        let size = tensor.dtype().size();
        let per_chunk = CHUNK_BYTES / size * size;
        let bytes = tensor.bytes();
        let mut offset = 0;
        loop {
            let end = (offset + per_chunk).min(bytes.len());
            let chunk = TensorChunk {
                from: from as u32,
                to: to as u32,
                edge: tag.edge,
                seq: tag.seq,
                shape: shape.clone(),
                offset: offset as u64,
                data: bytes::Bytes::copy_from_slice(&bytes[offset..end]),
                dtype: u32::from(tensor.dtype().code()),
            };
            self.0.send(chunk).map_err(|_| {
                FabricError::Aborted(format!("the tensor stream to actor {to}'s host is closed"))
            })?;
            offset = end;
            if offset >= bytes.len() {
                return Ok(());
            }
        }
    }

    fn path(&self) -> super::DataPath {
        super::DataPath::Grpc
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    /// Two hosts on 127.0.0.1 serving the gRPC fabric under `credentials`, two actors each
    /// (actor `a` on host `a / 2`), connected: each host's address and fabric, and the runtime
    /// the servers run on.
    pub(crate) fn two_hosts(
        credentials: &Credentials,
    ) -> (Vec<String>, Vec<Arc<GrpcFabric>>, tokio::runtime::Runtime) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (hosts, fabrics) = runtime.block_on(async {
            let mut hosts = Vec::new();
            for _ in 0..2 {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let inbox = Inbox::default();
                let addr = serve_fabric(listener, inbox.clone(), credentials).unwrap();
                hosts.push((addr.to_string(), inbox));
            }
            let actor_addrs: Vec<String> = (0..4).map(|a| hosts[a / 2].0.clone()).collect();
            let mut fabrics = Vec::new();
            for (addr, inbox) in &hosts {
                let local = Arc::new(InProcessFabric::new(4, Duration::from_secs(20)));
                inbox.install(Some(local.clone()));
                let fabric = GrpcFabric::connect(&actor_addrs, addr, local, credentials)
                    .await
                    .unwrap();
                fabrics.push(Arc::new(fabric));
            }
            (hosts, fabrics)
        });
        (
            hosts.into_iter().map(|(addr, _)| addr).collect(),
            fabrics,
            runtime,
        )
    }

    /// A ring of messages over [`two_hosts`] (each message spanning several gRPC chunks) arrives
    /// whole. Returns the first host's address and the runtime the servers run on.
    fn ring_across_two_hosts(credentials: &Credentials) -> (String, tokio::runtime::Runtime) {
        let (hosts, fabrics, runtime) = two_hosts(credentials);
        let len = 3 * (CHUNK_BYTES / 4) + 17; // each ring message spans several gRPC chunks
        let [a, b] = [fabrics[0].clone(), fabrics[1].clone()];
        crate::fabric::testing::ring_exchange_across_two_hosts([a, b], len, len / 2);
        (hosts[0].clone(), runtime)
    }

    /// What the fabric at `addr` answers a push from a peer with `credentials`.
    fn push_from(
        runtime: &tokio::runtime::Runtime,
        addr: &str,
        credentials: &Credentials,
    ) -> Result<(), String> {
        runtime.block_on(async {
            let channel = grpc_endpoint(addr, credentials)?
                .connect()
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let request = with_token(credentials.token(), tokio_stream::iter(Vec::<TensorChunk>::new()))
                .map_err(|e| e.to_string())?;
            let reply = FabricClient::new(channel).push(request).await;
            reply
                .map(|_| ())
                .map_err(|e| format!("{:?}: {}", e.code(), e.message()))
        })
    }

    /// Every dtype crosses gRPC bit for bit, a bf16 tensor spanning several chunks included.
    #[test]
    fn every_dtype_round_trips_over_grpc() {
        let (_, fabrics, _runtime) = two_hosts(&"secret".into());
        crate::fabric::testing::every_dtype_round_trips([fabrics[0].clone(), fabrics[1].clone()]);
        let len = 3 * CHUNK_BYTES / 4 + 3;
        let values: Vec<half::bf16> = (0..len).map(|k| half::bf16::from_bits(k as u16)).collect();
        let big = TypedTensor::from_values(vec![len], &values);
        let tag = Tag { edge: 12, seq: 0 };
        fabrics[0].send(0, 2, tag, big.clone()).unwrap();
        let got = fabrics[1].recv(2, 0, tag).unwrap();
        assert_eq!((got.dtype(), got.bytes()), (big.dtype(), big.bytes()));
    }

    #[test]
    fn ring_exchange_across_two_hosts_and_token_refusal() {
        let (addr, runtime) = ring_across_two_hosts(&"secret".into());
        let refused = push_from(&runtime, &addr, &"wrong".into()).unwrap_err();
        assert!(refused.starts_with("Unauthenticated"), "{refused}");
        push_from(&runtime, &addr, &"secret".into()).unwrap();
    }

    /// Over mutual TLS the ring arrives the same; a client in clear, one with a certificate the
    /// cluster CA did not sign, one that does not trust the cluster CA and a member with a
    /// wrong token are all refused; a member with the token is served.
    #[test]
    fn over_mutual_tls_the_ring_arrives_and_strangers_are_refused() {
        let certs = crate::trust::testing::TestCerts::new();
        let (addr, runtime) = ring_across_two_hosts(&certs.member("secret"));
        for (who, intruder) in [
            ("in clear", Credentials::new("secret")),
            ("with a foreign certificate", certs.foreign_certificate("secret")),
            ("trusting another CA", certs.foreign_trust("secret")),
        ] {
            let refused = push_from(&runtime, &addr, &intruder);
            assert!(refused.is_err(), "a client {who} was served");
        }
        let refused = push_from(&runtime, &addr, &certs.member("wrong")).unwrap_err();
        assert!(refused.starts_with("Unauthenticated"), "{refused}");
        push_from(&runtime, &addr, &certs.member("secret")).unwrap();
    }
}
