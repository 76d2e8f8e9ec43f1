//! Mutual TLS between the processes of a cluster (rustls with ring): every process holds one
//! certificate signed by the cluster's CA and uses it both ways — as a server certificate for
//! what it serves and as a client certificate for what it connects to — and accepts a peer only
//! when the peer's certificate chains to that CA. A host without such a certificate is refused
//! at the handshake, and the refusal is logged with the peer's address.
//!
//! Certificates are plain PEM files, so `archipelago certs` ([`super::certs`]), openssl or a
//! cluster's own PKI make them alike. A server is checked against the address its peer dialled:
//! an IP address in the certificate's subject alternative names for `10.0.0.5:7070`, a DNS name
//! for `node-3:7070`.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection, StreamOwned};
use tokio::net::TcpStream;

/// How long a peer may take over its handshake before the connection is dropped.
pub const HANDSHAKE_PATIENCE: Duration = Duration::from_secs(10);

/// The three PEM files of a process: its certificate (chain), its private key, the cluster CA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This process's certificate, signed by the cluster CA (PEM; a chain is allowed).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The cluster CA's certificate (PEM): peers must chain to it.
    pub ca: PathBuf,
}

/// Why TLS could not be set up; each names the file and what to change.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read the TLS {what} {path}: {source}")]
    Read {
        /// Which file (certificate, key, CA).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A file holds no PEM object of the expected kind.
    #[error("the TLS {what} {path} holds no PEM {expected} (make it with `archipelago certs` or openssl)")]
    Empty {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The PEM kind expected.
        expected: &'static str,
    },
    /// rustls refused the material (a key that does not match the certificate, a CA that is not one).
    #[error("the TLS files {cert} / {key} / {ca} cannot be used: {reason}")]
    Refused {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// The CA file.
        ca: PathBuf,
        /// rustls's reason.
        reason: String,
    },
}

/// A process's TLS identity and trust: server and client configurations built once from its
/// files, shared by every listener and connection of the process.
pub struct Tls {
    server: Arc<ServerConfig>,
    /// The same server side for HTTP/1.1 (ALPN `http/1.1`: `archipelago serve`).
    http1: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    pem: Pem,
}

/// The PEM bytes, kept for tonic's client configuration (which builds its own rustls config).
struct Pem {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls { mutual, cluster CA }")
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// ring's suites, AES-128-GCM first: as safe for a cluster's links and about a third cheaper
/// per byte than AES-256 (the tensor path is bound by the cipher).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

impl Tls {
    /// Loads a process's certificate, key and the cluster CA and builds its configurations.
    pub fn load(files: &TlsFiles) -> Result<Tls, TlsError> {
        let pem = Pem {
            cert: read("certificate", &files.cert)?,
            key: read("key", &files.key)?,
            ca: read("CA certificate", &files.ca)?,
        };
        let empty = |what, path: &Path, expected| TlsError::Empty {
            what,
            path: path.to_path_buf(),
            expected,
        };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem.cert)
            .filter_map(Result::ok)
            .collect();
        if chain.is_empty() {
            return Err(empty("certificate", &files.cert, "CERTIFICATE"));
        }
        let key =
            PrivateKeyDer::from_pem_slice(&pem.key).map_err(|_| empty("key", &files.key, "PRIVATE KEY"))?;
        let mut roots = RootCertStore::empty();
        let (added, _) =
            roots.add_parsable_certificates(CertificateDer::pem_slice_iter(&pem.ca).filter_map(Result::ok));
        if added == 0 {
            return Err(empty("CA certificate", &files.ca, "CERTIFICATE"));
        }
        let refused = |reason: String| TlsError::Refused {
            cert: files.cert.clone(),
            key: files.key.clone(),
            ca: files.ca.clone(),
            reason,
        };
        let roots = Arc::new(roots);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| refused(e.to_string()))?;
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| refused(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| refused(e.to_string()))?;
        let mut http1 = server.clone();
        http1.alpn_protocols = vec![b"http/1.1".to_vec()];
        // gRPC clients (tonic) insist on HTTP/2 by ALPN; the raw data paths offer no ALPN.
        server.alpn_protocols = vec![b"h2".to_vec()];
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| refused(e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| refused(e.to_string()))?;
        Ok(Tls {
            server: Arc::new(server),
            http1: Arc::new(http1),
            client: Arc::new(client),
            pem,
        })
    }

    /// tonic's client configuration with the same identity and CA (for `https://` endpoints).
    pub fn grpc_client(&self) -> tonic::transport::ClientTlsConfig {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.pem.ca))
            .identity(Identity::from_pem(&self.pem.cert, &self.pem.key))
    }

    /// The server side of a handshake on an accepted connection, within [`HANDSHAKE_PATIENCE`].
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server.clone());
        within_patience(acceptor.accept(tcp)).await
    }

    /// [`Tls::accept`] for an HTTP/1.1 server (ALPN `http/1.1`; the same identity, the same
    /// demand for a certificate the cluster CA signed).
    pub async fn accept_http1(
        &self,
        tcp: TcpStream,
    ) -> io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.http1.clone());
        within_patience(acceptor.accept(tcp)).await
    }

    /// The client side of a handshake with the server dialled at `addr` (`host:port`).
    pub async fn connect(
        &self,
        addr: &str,
        tcp: TcpStream,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let connector = tokio_rustls::TlsConnector::from(self.client.clone());
        within_patience(connector.connect(server_name(addr)?, tcp)).await
    }

    /// [`Tls::accept`] on a blocking socket (the raw-TCP data path's reader threads).
    pub fn accept_blocking(
        &self,
        tcp: std::net::TcpStream,
    ) -> io::Result<StreamOwned<ServerConnection, std::net::TcpStream>> {
        let connection = ServerConnection::new(self.server.clone()).map_err(io::Error::other)?;
        handshake_blocking(connection, tcp)
    }

    /// [`Tls::connect`] on a blocking socket (the raw-TCP data path's writer threads).
    pub fn connect_blocking(
        &self,
        addr: &str,
        tcp: std::net::TcpStream,
    ) -> io::Result<StreamOwned<ClientConnection, std::net::TcpStream>> {
        let connection =
            ClientConnection::new(self.client.clone(), server_name(addr)?).map_err(io::Error::other)?;
        handshake_blocking(connection, tcp)
    }
}

async fn within_patience<T>(handshake: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(HANDSHAKE_PATIENCE, handshake)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake did not finish"))?
}

/// Runs a handshake to its end on a blocking socket (bounded by [`HANDSHAKE_PATIENCE`] per
/// read), so that a refused peer is known before any frame is read or written.
fn handshake_blocking<C, S>(
    mut connection: C,
    mut tcp: std::net::TcpStream,
) -> io::Result<StreamOwned<C, std::net::TcpStream>>
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<S>>,
    S: rustls::SideData,
{
    let previous = tcp.read_timeout()?;
    tcp.set_read_timeout(Some(HANDSHAKE_PATIENCE))?;
    while connection.is_handshaking() {
        connection.complete_io(&mut tcp)?;
    }
    // Anything the handshake left to send (a TLS 1.3 session ticket) goes out now.
    while connection.wants_write() {
        connection.write_tls(&mut tcp)?;
    }
    tcp.set_read_timeout(previous)?;
    Ok(StreamOwned::new(connection, tcp))
}

/// The name a server's certificate must carry for `addr` (`host:port`, `[v6]:port`).
fn server_name(addr: &str) -> io::Result<ServerName<'static>> {
    let host = match addr.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{addr}: not a host name: {e}"),
        )
    })
}

/// A blocking stream that is either plain TCP or TLS over it: the raw-TCP data path reads and
/// writes through it unchanged.
pub enum BlockingStream {
    /// No TLS.
    Plain(std::net::TcpStream),
    /// The server side of a TLS connection.
    Server(Box<StreamOwned<ServerConnection, std::net::TcpStream>>),
    /// The client side of a TLS connection.
    Client(Box<StreamOwned<ClientConnection, std::net::TcpStream>>),
}

impl Read for BlockingStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            BlockingStream::Plain(s) => s.read(buf),
            BlockingStream::Server(s) => s.read(buf),
            BlockingStream::Client(s) => s.read(buf),
        }
    }
}

impl Write for BlockingStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            BlockingStream::Plain(s) => s.write(buf),
            BlockingStream::Server(s) => s.write(buf),
            BlockingStream::Client(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            BlockingStream::Plain(s) => s.flush(),
            BlockingStream::Server(s) => s.flush(),
            BlockingStream::Client(s) => s.flush(),
        }
    }
}

impl BlockingStream {
    /// Ends the stream cleanly: a TLS peer is told (close_notify) that no more frames follow.
    pub fn close(&mut self) -> io::Result<()> {
        match self {
            BlockingStream::Plain(_) => Ok(()),
            BlockingStream::Server(s) => {
                s.conn.send_close_notify();
                s.flush()
            }
            BlockingStream::Client(s) => {
                s.conn.send_close_notify();
                s.flush()
            }
        }
    }
}
