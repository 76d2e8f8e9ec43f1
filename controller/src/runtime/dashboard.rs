//! The dashboard of a program on the runtime API: its actors (on this process or the cluster's
//! hosts) with their message rates, queues, restarts and failures, sampled twice a second and
//! served on the same page and server-sent events as a training job's dashboard.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use archipelago_actors::runtime::{ActorStats, Runtime, RuntimeHandle};

use crate::dashboard::{ActorView, Dashboard};

/// How often the actors' figures are sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// Serves the dashboard of `runtime`'s actors on `addr` (e.g. `127.0.0.1:0`); returns the
/// address. It runs until the runtime is dropped. On an address other than loopback every
/// request must carry the cluster token of the file `ARCHIPELAGO_TOKEN_FILE` names (without
/// it, such an address is refused).
pub fn serve_dashboard(runtime: &Runtime, addr: &str) -> anyhow::Result<(SocketAddr, Arc<Dashboard>)> {
    let dashboard = Dashboard::new();
    let needs_token = crate::dashboard::access::check_bind(addr, false).is_err();
    if let Some(path) = std::env::var_os(super::TOKEN_FILE_ENV).filter(|_| needs_token) {
        dashboard.require_token(&crate::cluster::read_token(std::path::Path::new(&path))?);
    }
    let handle = runtime.handle().clone();
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let served = crate::dashboard::serve(listener, dashboard.clone())?;
        tokio::spawn(sample(handle, dashboard.clone()));
        Ok::<_, std::io::Error>(served)
    })?;
    Ok((served, dashboard))
}

/// Samples the actors' figures into the dashboard; a failure is reported once, when first seen.
async fn sample(runtime: RuntimeHandle, dashboard: Arc<Dashboard>) {
    let mut last: HashMap<(String, usize), (u64, Instant)> = HashMap::new();
    let mut reported: HashMap<(String, usize), u64> = HashMap::new();
    loop {
        let stats = runtime.actor_stats().await;
        let now = Instant::now();
        let views = stats
            .iter()
            .map(|s| {
                let key = (s.info.host.clone(), s.info.id);
                let rate = match last.insert(key.clone(), (s.handled, now)) {
                    Some((handled, at)) if now > at => {
                        (s.handled - handled.min(s.handled)) as f64 / (now - at).as_secs_f64()
                    }
                    _ => 0.0,
                };
                let seen = reported.entry(key).or_insert(0);
                if s.failures > *seen {
                    *seen = s.failures;
                    dashboard.failure(&failure_line(s));
                }
                view(s, rate)
            })
            .collect();
        dashboard.set_actors(views);
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

fn failure_line(s: &ActorStats) -> String {
    format!(
        "{} panicked ({} failure{} so far, {} restart{}){}",
        s.info,
        s.failures,
        if s.failures == 1 { "" } else { "s" },
        s.restarts,
        if s.restarts == 1 { "" } else { "s" },
        s.ended.as_ref().map_or(String::new(), |e| format!("; {e}"))
    )
}

fn view(s: &ActorStats, calls_per_s: f64) -> ActorView {
    ActorView {
        id: s.info.id,
        name: s.info.name.clone(),
        type_name: s.info.type_name.clone(),
        device: s.info.device.to_string(),
        host: s.info.host.clone(),
        handled: s.handled,
        calls_per_s,
        queue_depth: s.queue_depth,
        restarts: s.restarts,
        failures: s.failures,
        state: s.ended.clone().unwrap_or_else(|| "running".into()),
    }
}
