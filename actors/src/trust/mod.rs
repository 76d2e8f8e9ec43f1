//! What a process shows and checks at every connection between processes: the cluster token
//! (every gRPC call, every raw-TCP and actor-port connection presents it) and, when the cluster
//! runs with TLS, mutual TLS under the cluster's CA ([`tls`]). Both are carried together as
//! [`Credentials`], so a listener or a connection cannot be set up with one and not the other.
//!
//! - [`tls`]: rustls configurations from PEM files, handshakes on async and blocking sockets;
//! - [`grpc`]: tonic servers and endpoints over those credentials;
//! - [`certs`]: a cluster CA and per-process certificates (`archipelago certs`).

pub mod certs;
pub mod grpc;
pub mod tls;

use std::io;
use std::sync::Arc;

pub use grpc::{grpc_endpoint, serve_grpc};
pub use tls::{BlockingStream, Tls, TlsError, TlsFiles};

/// A connection's byte stream: plain TCP or TLS over it.
pub trait AsyncStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> AsyncStream for S {}

/// The cluster token and, optionally, this process's TLS identity and the cluster CA.
#[derive(Clone)]
pub struct Credentials {
    token: Arc<str>,
    tls: Option<Arc<Tls>>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token itself.
        write!(
            f,
            "Credentials {{ token: <{} bytes>, tls: {} }}",
            self.token.len(),
            self.tls.is_some()
        )
    }
}

impl Credentials {
    /// Token only: connections in clear (loopback, or a network the cluster trusts).
    pub fn new(token: &str) -> Credentials {
        Credentials {
            token: token.into(),
            tls: None,
        }
    }

    /// The same token, with mutual TLS under `tls`.
    pub fn with_tls(self, tls: Arc<Tls>) -> Credentials {
        Credentials {
            tls: Some(tls),
            ..self
        }
    }

    /// The cluster token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The TLS identity, when the cluster runs with TLS.
    pub fn tls(&self) -> Option<&Arc<Tls>> {
        self.tls.as_ref()
    }

    /// The server side of an accepted connection: its TLS handshake when the credentials carry
    /// TLS, the socket as it is otherwise.
    pub async fn accept(&self, tcp: tokio::net::TcpStream) -> io::Result<Box<dyn AsyncStream>> {
        Ok(match &self.tls {
            None => Box::new(tcp),
            Some(tls) => Box::new(tls.accept(tcp).await?),
        })
    }

    /// The client side of a connection to the server dialled at `addr`: its TLS handshake
    /// when the credentials carry TLS, the socket as it is otherwise.
    pub async fn connect(&self, addr: &str, tcp: tokio::net::TcpStream) -> io::Result<Box<dyn AsyncStream>> {
        Ok(match &self.tls {
            None => Box::new(tcp),
            Some(tls) => Box::new(tls.connect(addr, tcp).await?),
        })
    }

    /// [`Credentials::accept`] on a blocking socket.
    pub fn accept_blocking(&self, tcp: std::net::TcpStream) -> io::Result<BlockingStream> {
        Ok(match &self.tls {
            None => BlockingStream::Plain(tcp),
            Some(tls) => BlockingStream::Server(Box::new(tls.accept_blocking(tcp)?)),
        })
    }

    /// [`Credentials::connect`] on a blocking socket.
    pub fn connect_blocking(&self, addr: &str, tcp: std::net::TcpStream) -> io::Result<BlockingStream> {
        Ok(match &self.tls {
            None => BlockingStream::Plain(tcp),
            Some(tls) => BlockingStream::Client(Box::new(tls.connect_blocking(addr, tcp)?)),
        })
    }
}

impl From<&str> for Credentials {
    fn from(token: &str) -> Credentials {
        Credentials::new(token)
    }
}

impl From<&String> for Credentials {
    fn from(token: &String) -> Credentials {
        Credentials::new(token)
    }
}

impl From<String> for Credentials {
    fn from(token: String) -> Credentials {
        Credentials::new(&token)
    }
}

/// Certificates for tests: a cluster CA with members `a` and `b`, and a foreign CA with `x`.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::{Credentials, Tls, TlsFiles};

    /// Two CAs' worth of PEM files in a temporary directory.
    pub struct TestCerts {
        dir: tempfile::TempDir,
    }

    impl TestCerts {
        /// Makes the cluster CA (members `a`, `b`) and a foreign CA (member `x`).
        pub fn new() -> TestCerts {
            let dir = tempfile::tempdir().unwrap();
            super::certs::make_certs(&dir.path().join("cluster"), &["a".into(), "b".into()], &[]).unwrap();
            super::certs::make_certs(&dir.path().join("foreign"), &["x".into()], &[]).unwrap();
            TestCerts { dir }
        }

        fn path(&self, ca: &str, file: &str) -> PathBuf {
            self.dir.path().join(ca).join(file)
        }

        fn credentials(&self, token: &str, (ca, name): (&str, &str), trusts: &str) -> Credentials {
            let files = TlsFiles {
                cert: self.path(ca, &format!("{name}.pem")),
                key: self.path(ca, &format!("{name}.key")),
                ca: self.path(trusts, "ca.pem"),
            };
            Credentials::new(token).with_tls(Arc::new(Tls::load(&files).unwrap()))
        }

        /// A member of the cluster.
        pub fn member(&self, token: &str) -> Credentials {
            self.credentials(token, ("cluster", "a"), "cluster")
        }

        /// Trusts the cluster CA but shows a certificate the foreign CA signed.
        pub fn foreign_certificate(&self, token: &str) -> Credentials {
            self.credentials(token, ("foreign", "x"), "cluster")
        }

        /// Trusts only the foreign CA (so it refuses the cluster's servers).
        pub fn foreign_trust(&self, token: &str) -> Credentials {
            self.credentials(token, ("foreign", "x"), "foreign")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certs_reuse_the_ca_and_never_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let first = certs::make_certs(dir.path(), &["controller".into()], &["10.0.0.5".into()]).unwrap();
        assert!(first.new_ca);
        let ca = std::fs::read(&first.ca).unwrap();
        let second = certs::make_certs(dir.path(), &["host-0".into()], &[]).unwrap();
        assert!(!second.new_ca);
        assert_eq!(std::fs::read(&second.ca).unwrap(), ca, "the CA was replaced");
        let again = certs::make_certs(dir.path(), &["host-0".into()], &[]).unwrap_err();
        assert!(again.contains("never overwritten"), "{again}");
        assert!(certs::make_certs(dir.path(), &["../evil".into()], &[]).is_err());
        let files = TlsFiles {
            cert: second.issued[0].0.clone(),
            key: second.issued[0].1.clone(),
            ca: second.ca.clone(),
        };
        let host = Tls::load(&files).unwrap();
        // A certificate of the reused CA and one of the first run trust each other.
        let controller = Tls::load(&TlsFiles {
            cert: first.issued[0].0.clone(),
            key: first.issued[0].1.clone(),
            ca: first.ca.clone(),
        })
        .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            let mut stream = controller.accept_blocking(tcp).unwrap();
            let mut got = [0u8; 5];
            std::io::Read::read_exact(&mut stream, &mut got).unwrap();
            got
        });
        let tcp = std::net::TcpStream::connect(&addr).unwrap();
        let mut stream = host.connect_blocking(&addr, tcp).unwrap();
        std::io::Write::write_all(&mut stream, b"hello").unwrap();
        std::io::Write::flush(&mut stream).unwrap();
        assert_eq!(&server.join().unwrap(), b"hello");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&second.issued[0].1)
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "a private key is readable by others: {mode:o}");
        }
    }

    /// Whether a client dialling `name` accepts the server certificate `cert` (both members of
    /// the CA in `dir`).
    fn accepts(dir: &std::path::Path, server: &str, client: &str, name: &str) -> bool {
        let load = |who: &str| {
            Tls::load(&TlsFiles {
                cert: dir.join(format!("{who}.pem")),
                key: dir.join(format!("{who}.key")),
                ca: dir.join("ca.pem"),
            })
            .unwrap()
        };
        let (server, client) = (load(server), load(client));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepting = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            let _ = server.accept_blocking(tcp);
        });
        let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let accepted = client.connect_blocking(&format!("{name}:{port}"), tcp).is_ok();
        accepting.join().unwrap();
        accepted
    }

    /// The Kubernetes manifests' certificate: one wildcard name for every host pod
    /// (`*.archipelago-hosts.default`) and the controller's Service name.
    #[test]
    fn a_wildcard_certificate_covers_the_names_it_should_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let names = [
            "archipelago-controller".to_string(),
            "*.archipelago-hosts.default".to_string(),
        ];
        certs::make_certs(dir.path(), &["cluster".into(), "client".into()], &names).unwrap();
        for name in [
            "archipelago-host-3.archipelago-hosts.default",
            "archipelago-controller",
            "localhost",
        ] {
            assert!(accepts(dir.path(), "cluster", "client", name), "{name} refused");
        }
        for name in [
            "archipelago-host-3.archipelago-hosts.other",
            "evil.example",
            "a.b.archipelago-hosts.default",
        ] {
            assert!(!accepts(dir.path(), "cluster", "client", name), "{name} accepted");
        }
    }

    #[test]
    fn unusable_files_are_named_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let made = certs::make_certs(dir.path(), &["a".into(), "b".into()], &[]).unwrap();
        let (a, b) = (&made.issued[0], &made.issued[1]);
        let load = |cert: &PathLike, key: &PathLike, ca: &PathLike| {
            Tls::load(&TlsFiles {
                cert: cert.into(),
                key: key.into(),
                ca: ca.into(),
            })
            .unwrap_err()
            .to_string()
        };
        type PathLike = std::path::Path;
        let missing = dir.path().join("missing.pem");
        assert!(load(&missing, &a.1, &made.ca).contains("cannot read the TLS certificate"));
        // A key where the certificate should be, a certificate where the key should be.
        assert!(load(&a.1, &a.1, &made.ca).contains("holds no PEM CERTIFICATE"));
        assert!(load(&a.0, &a.0, &made.ca).contains("holds no PEM PRIVATE KEY"));
        assert!(load(&a.0, &a.1, &a.1).contains("CA certificate"));
        // b's key with a's certificate.
        let mismatch = load(&a.0, &b.1, &made.ca);
        assert!(mismatch.contains("cannot be used"), "{mismatch}");
    }
}
