//! The controller's health endpoint (`archipelago controller --health ADDR`), for process
//! supervisors and Kubernetes probes: `GET /healthz` answers 200 while the process serves,
//! `GET /readyz` 200 once the controller's gRPC service is listening, with the hosts and devices
//! registered. Like the dashboard it binds loopback unless told otherwise, and on any other
//! address every request must carry the cluster token (`Authorization: Bearer …`).
//!
//! `archipelago health URL` is the probe's client: it exits 0 on a 200 and says what it got
//! otherwise, so an `exec` probe needs no curl in the image.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::registry::Registry;

/// The paths the endpoint serves.
pub const PATHS: [&str; 2] = ["/healthz", "/readyz"];

/// Serves the endpoint on `listener`; a non-loopback address needs `token`.
pub fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    token: &str,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let token = crate::dashboard::access::token_for(addr, Some(token))?;
    let app = Router::new()
        .route(PATHS[0], get(|| async { "ok\n" }))
        .route(PATHS[1], get(ready))
        .with_state(registry);
    let app = match token {
        Some(token) => app.layer(axum::middleware::from_fn_with_state(
            token,
            crate::dashboard::access::guard,
        )),
        None => app,
    };
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, service).await {
            tracing::error!("the health endpoint on {addr} stopped: {e}");
        }
    });
    Ok(addr)
}

async fn ready(State(registry): State<Arc<Registry>>) -> String {
    let hosts = registry.hosts();
    let devices: usize = hosts.iter().map(|h| h.devices.len()).sum();
    format!("ready: {} host(s), {devices} device(s)\n", hosts.len())
}

/// `archipelago health URL`: `GET URL` (plain HTTP, e.g. `http://127.0.0.1:7071/readyz`);
/// the body on a 200, an error naming the status or the failure otherwise.
pub async fn probe(url: &str) -> anyhow::Result<String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow::anyhow!("{url}: give an http:// URL of the health endpoint"))?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await?;
        let request = format!("GET /{path} HTTP/1.0\r\nHost: {authority}\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        // An answer of a few lines: 64 KiB bounds what a wrong peer can make this read.
        stream.take(64 << 10).read_to_end(&mut answer).await?;
        anyhow::Ok(String::from_utf8_lossy(&answer).into_owned())
    };
    let answer = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| anyhow::anyhow!("{url}: no answer within 5 s"))?
        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
    let status = answer.lines().next().unwrap_or_default();
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(body.to_string())
    } else {
        anyhow::bail!("{url}: {status} {}", body.trim())
    }
}

/// Flags of `archipelago health`.
#[derive(Debug, clap::Args)]
pub struct HealthArgs {
    /// The endpoint to ask, e.g. `http://127.0.0.1:7071/readyz`.
    pub url: String,
}

/// Runs `archipelago health`: prints the answer, fails unless it is a 200.
pub fn health(args: &HealthArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    print!("{}", runtime.block_on(probe(&args.url))?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_reads_both_paths_and_an_unknown_path_fails() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let registry = Arc::new(Registry::new(None));
            let addr = serve(listener, registry, "t").unwrap();
            assert_eq!(probe(&format!("http://{addr}/healthz")).await.unwrap(), "ok\n");
            let ready = probe(&format!("http://{addr}/readyz")).await.unwrap();
            assert_eq!(ready, "ready: 0 host(s), 0 device(s)\n");
            let missing = probe(&format!("http://{addr}/nothing"))
                .await
                .unwrap_err()
                .to_string();
            assert!(missing.contains("404"), "{missing}");
            assert!(probe("https://x/readyz").await.is_err());
        });
    }

    #[test]
    fn off_loopback_every_probe_needs_the_token() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            serve(listener, Arc::new(Registry::new(None)), "t").unwrap();
            let refused = probe(&format!("http://127.0.0.1:{port}/healthz"))
                .await
                .unwrap_err()
                .to_string();
            assert!(refused.contains("401"), "{refused}");
        });
    }
}
