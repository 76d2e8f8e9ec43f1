//! The flags every process of a cluster takes for its credentials — the token file and, for
//! mutual TLS, `--tls-cert`, `--tls-key` and `--tls-ca` (or `ARCHIPELAGO_TLS_CERT`, `_KEY`,
//! `_CA`) — and `archipelago certs`, which makes a cluster CA and per-process certificates.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;

use archipelago_actors::trust::{Credentials, Tls, TlsFiles};

/// `--tls-cert`, `--tls-key`, `--tls-ca`: all three or none.
#[derive(Debug, Clone, Default, Args, serde::Serialize, serde::Deserialize)]
pub struct TlsArgs {
    /// This process's certificate (PEM), signed by the cluster CA: turns on mutual TLS for
    /// every connection to and from this process (needs --tls-key and --tls-ca).
    #[arg(long, env = "ARCHIPELAGO_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "ARCHIPELAGO_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA's certificate (PEM): peers whose certificates it did not sign are refused.
    #[arg(long, env = "ARCHIPELAGO_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The TLS files when all three are given; none: no TLS; some: an error naming what is missing.
    pub fn files(&self) -> anyhow::Result<Option<TlsFiles>> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            })),
            (cert, key, ca) => {
                let missing: Vec<&str> = [(cert, "--tls-cert"), (key, "--tls-key"), (ca, "--tls-ca")]
                    .into_iter()
                    .filter(|(v, _)| v.is_none())
                    .map(|(_, flag)| flag)
                    .collect();
                anyhow::bail!(
                    "mutual TLS needs --tls-cert, --tls-key and --tls-ca together; missing {} \
                     (`archipelago certs` makes all three)",
                    missing.join(", ")
                )
            }
        }
    }

    /// The process's credentials: the token from `token_file`, with TLS when the flags ask.
    pub fn credentials(&self, token_file: &Path) -> anyhow::Result<Credentials> {
        let credentials = Credentials::new(&super::read_token(token_file)?);
        Ok(match self.files()? {
            None => credentials,
            Some(files) => credentials.with_tls(Arc::new(Tls::load(&files)?)),
        })
    }
}

/// Flags of `archipelago certs`.
#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory of the cluster's PEM files: `ca.pem`, `ca.key` (made when missing, reused
    /// otherwise) and `NAME.pem`, `NAME.key` per --name.
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// A process to certify (repeat): `controller`, `host-0`, … Each certificate is valid as
    /// server and client, for NAME, localhost, 127.0.0.1 and ::1.
    #[arg(long = "name", required = true)]
    pub names: Vec<String>,
    /// Another address or DNS name the processes are reached at (repeat), e.g. a node's IP.
    #[arg(long = "san")]
    pub extra_names: Vec<String>,
}

/// Runs `archipelago certs`.
pub fn certs(args: &CertsArgs) -> anyhow::Result<()> {
    let made = archipelago_actors::trust::certs::make_certs(&args.dir, &args.names, &args.extra_names)
        .map_err(anyhow::Error::msg)?;
    let ca_note = if made.new_ca { "made" } else { "reused" };
    println!(
        "cluster CA {} ({ca_note}; keep {} secret)",
        made.ca.display(),
        args.dir.join("ca.key").display()
    );
    for (cert, key) in &made.issued {
        println!(
            "  --tls-cert {} --tls-key {} --tls-ca {}",
            cert.display(),
            key.display(),
            made.ca.display()
        );
    }
    Ok(())
}
