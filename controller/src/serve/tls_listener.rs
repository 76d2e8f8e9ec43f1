//! `archipelago serve` under the cluster's mutual TLS (`--tls-cert --tls-key --tls-ca`, as every
//! process of a cluster takes them): a listener for axum whose connections are TLS streams
//! whose peers showed a certificate the cluster CA signed. Handshakes run on their own tasks
//! (each bounded by the trust module's patience), so a slow or refused client never holds up
//! the others' connections.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use archipelago_actors::trust::Tls;
use axum::serve::Listener;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::server::TlsStream;

/// Handshakes in flight at most (each bounded by the trust module's patience).
const MAX_HANDSHAKES: usize = 256;

/// Accepted connections whose TLS handshake succeeded.
pub struct TlsListener {
    local: SocketAddr,
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

impl TlsListener {
    /// Accepts on `tcp` and hands over each connection once `tls`'s handshake with it is done.
    pub fn new(tcp: TcpListener, tls: Arc<Tls>) -> io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (done, accepted) = mpsc::channel(64);
        let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            while !done.is_closed() {
                // Connections past MAX_HANDSHAKES wait in the kernel's backlog, not as tasks.
                let Ok(permit) = handshakes.clone().acquire_owned().await else {
                    return;
                };
                let Ok((socket, peer)) = tcp.accept().await else {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let (tls, done) = (tls.clone(), done.clone());
                tokio::spawn(async move {
                    let handshake = tls.accept_http1(socket).await;
                    drop(permit);
                    if let Ok(stream) = handshake {
                        let _ = done.send((stream, peer)).await;
                    }
                });
            }
        });
        Ok(TlsListener { local, accepted })
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(connection) => connection,
            // The accepting task ends only with the process.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}
