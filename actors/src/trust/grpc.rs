//! gRPC over the cluster's credentials: servers accept through [`Tls`] (refusals logged with
//! the peer's address, which tonic would only trace at debug level) or plain TCP, and clients
//! dial `https://` with the process's certificate or `http://` without TLS.

use std::io;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Router, TcpIncoming};
use tonic::transport::{Endpoint, Error};

use super::{Credentials, Tls};

/// Serves `router` on `listener` until the server fails: over TLS when `credentials` carry it.
/// `what` names the service in refusal logs ("the controller", "the fabric").
pub async fn serve_grpc(
    router: Router,
    listener: TcpListener,
    credentials: &Credentials,
    what: &str,
) -> Result<(), Error> {
    match credentials.tls() {
        None => {
            // No Nagle: a ring step waits on each message.
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            router.serve_with_incoming(incoming).await
        }
        Some(tls) => {
            router
                .serve_with_incoming(accept_tls(listener, tls.clone(), what.to_string()))
                .await
        }
    }
}

/// The connections accepted on `listener` whose TLS handshake succeeded; each handshake runs in
/// its own task, so a slow or hostile peer holds up no one else.
fn accept_tls(
    listener: TcpListener,
    tls: Arc<Tls>,
    what: String,
) -> ReceiverStream<io::Result<tokio_rustls::server::TlsStream<TcpStream>>> {
    let (accepted, stream) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        while !accepted.is_closed() {
            let (tcp, peer) = match listener.accept().await {
                Ok(connection) => connection,
                Err(e) => {
                    tracing::warn!("{what}: accepting a connection failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let (tls, accepted, what) = (tls.clone(), accepted.clone(), what.clone());
            tokio::spawn(async move {
                match tls.accept(tcp).await {
                    Ok(stream) => {
                        let _ = accepted.send(Ok(stream)).await;
                    }
                    Err(e) => tracing::warn!(%peer, "{what} refused a connection at the TLS handshake: {e}"),
                }
            });
        }
    });
    ReceiverStream::new(stream)
}

/// The endpoint of the gRPC server at `addr` (`host:port`): `https://` with this process's
/// certificate when the credentials carry TLS, `http://` otherwise; no Nagle.
pub fn grpc_endpoint(addr: &str, credentials: &Credentials) -> Result<Endpoint, String> {
    let scheme = if credentials.tls().is_some() {
        "https"
    } else {
        "http"
    };
    let endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| format!("bad address {addr}: {e}"))?
        .tcp_nodelay(true);
    match credentials.tls() {
        None => Ok(endpoint),
        Some(tls) => endpoint
            .tls_config(tls.grpc_client())
            .map_err(|e| format!("TLS towards {addr}: {e}")),
    }
}
