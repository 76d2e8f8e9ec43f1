//! The router of `archipelago serve --controller ADDR --replicas R`: one HTTP front end in the
//! client's process, in front of the job's R replicas (one service each, on R distinct hosts).
//! It answers OpenAI's routes as a local `serve` does — `POST /v1/completions` and
//! `POST /v1/chat/completions` (whole or streamed), `GET /v1/models` — by forwarding each
//! request to the live replica with the fewest requests in flight through this router
//! ([`proxy`]), carrying the cluster token the hosts demand off loopback; `GET /health` answers
//! here: how many replicas are live, and each one's host, address, state and load.
//!
//! A replica is lost when the controller says its host was lost ([`ReplicaSet::lose`], from the
//! client's job events) or when its connection breaks under a request: the requests in flight
//! through it then fail at once with an error naming its host (HTTP 502 in OpenAI's error
//! shape, or, for a stream already started, an error event before the stream closes), and no
//! request goes to it again. With no live replica left every request gets 503.
//!
//! ```text
//! client ──▶ router (--listen) ──┬──▶ replica 0 on host `h1` (http://h1:PORT)
//!                                └──▶ replica 1 on host `h2` (http://h2:PORT)
//! ```

pub mod front_end;
pub mod proxy;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router as Routes;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tokio::sync::watch;

use archipelago_actors::trust::Tls;

use super::openai::ApiError;

/// A replica as the controller announced it.
#[derive(Debug, Clone)]
pub struct ReplicaAddress {
    /// Its index in the job (0-based).
    pub index: usize,
    /// The host it runs on.
    pub host: String,
    /// `http://ADDR` or `https://ADDR`.
    pub url: String,
}

/// One replica behind the router.
pub struct RoutedReplica {
    /// Where it is.
    pub address: ReplicaAddress,
    /// `ADDR` of its URL (`host:port`).
    authority: String,
    /// Whether it speaks HTTPS (under the cluster's mutual TLS).
    https: bool,
    /// Requests in flight through it now.
    in_flight: AtomicUsize,
    /// Why it was lost, once it is.
    lost: watch::Sender<Option<String>>,
}

impl RoutedReplica {
    /// `replica I on host `H``.
    pub fn who(&self) -> String {
        format!("replica {} on host `{}`", self.address.index, self.address.host)
    }

    fn lost_why(&self) -> Option<String> {
        self.lost.borrow().clone()
    }
}

/// The job's replicas as the router sees them.
pub struct ReplicaSet {
    /// The serving job's name.
    pub job: String,
    replicas: Vec<RoutedReplica>,
    /// Sent to every replica as `Authorization: Bearer`.
    token: String,
    /// The cluster's TLS, for replicas that speak HTTPS.
    tls: Option<Arc<Tls>>,
    /// The largest request body read.
    pub max_body_bytes: usize,
    /// Requests forwarded at once (`--max-connections`); more get 503.
    pub connections: Arc<tokio::sync::Semaphore>,
    /// Held while a replica is picked, so that two requests arriving together see each other.
    picking: Mutex<()>,
}

/// A request in flight through a replica; dropping it (the answer sent, or the client gone)
/// counts it out.
pub struct InFlight {
    set: Arc<ReplicaSet>,
    index: usize,
}

impl InFlight {
    /// The replica it goes through.
    pub fn replica(&self) -> &RoutedReplica {
        &self.set.replicas[self.index]
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.set.replicas[self.index]
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl ReplicaSet {
    /// The router's view of `addresses`, every one live; refused when a URL is not
    /// `http://ADDR` or `https://ADDR` (or HTTPS without the cluster's TLS).
    pub fn new(
        job: &str,
        addresses: Vec<ReplicaAddress>,
        token: &str,
        tls: Option<Arc<Tls>>,
        (max_body_bytes, max_connections): (usize, usize),
    ) -> Result<ReplicaSet, String> {
        let mut replicas = Vec::with_capacity(addresses.len());
        for address in addresses {
            let (https, authority) = match address.url.split_once("://") {
                Some(("http", rest)) => (false, rest),
                Some(("https", rest)) if tls.is_some() => (true, rest),
                _ => {
                    return Err(format!(
                        "replica {} on host `{}` listens at `{}`: the router reaches http:// (or https:// with --tls-*) only",
                        address.index, address.host, address.url
                    ));
                }
            };
            replicas.push(RoutedReplica {
                authority: authority.trim_end_matches('/').to_string(),
                https,
                in_flight: AtomicUsize::new(0),
                lost: watch::Sender::new(None),
                address,
            });
        }
        Ok(ReplicaSet {
            job: job.to_string(),
            replicas,
            token: token.to_string(),
            tls,
            max_body_bytes,
            connections: Arc::new(tokio::sync::Semaphore::new(max_connections.max(1))),
            picking: Mutex::new(()),
        })
    }

    /// Marks replica `index` lost for `why`: the requests in flight through it fail now, naming
    /// its host, and none go to it again. Whether it was live until now.
    pub fn lose(&self, index: usize, why: &str) -> bool {
        let Some(replica) = self.replicas.iter().find(|r| r.address.index == index) else {
            return false;
        };
        replica.lost.send_if_modified(|lost| match lost {
            Some(_) => false,
            None => {
                *lost = Some(why.to_string());
                true
            }
        })
    }

    /// The replicas still live.
    pub fn live(&self) -> usize {
        (self.replicas.iter())
            .filter(|r| r.lost.borrow().is_none())
            .count()
    }

    /// The live replica with the fewest requests in flight (the first of those), counted as
    /// holding one more; `None` when every replica is lost.
    pub fn pick(self: &Arc<Self>) -> Option<InFlight> {
        let _picking = self.picking.lock().unwrap_or_else(|e| e.into_inner());
        let (index, replica) = (self.replicas.iter().enumerate())
            .filter(|(_, r)| r.lost.borrow().is_none())
            .min_by_key(|(_, r)| r.in_flight.load(Ordering::Relaxed))?;
        replica.in_flight.fetch_add(1, Ordering::Relaxed);
        Some(InFlight {
            set: self.clone(),
            index,
        })
    }

    /// Why every replica is lost, one after another.
    fn all_lost(&self) -> String {
        let whys: Vec<String> = (self.replicas.iter())
            .map(|r| r.lost_why().unwrap_or_else(|| format!("{} is live", r.who())))
            .collect();
        format!(
            "serving job {}: every replica was lost: {}",
            self.job,
            whys.join("; ")
        )
    }
}

/// The router's routes over `set`; with `token`, every request must carry it.
pub fn app(set: Arc<ReplicaSet>, token: Option<Arc<str>>) -> Routes {
    let app = Routes::new()
        .route("/v1/completions", post(proxy::forward))
        .route("/v1/chat/completions", post(proxy::forward))
        .route("/v1/models", get(proxy::forward))
        .route("/health", get(health))
        .fallback(not_found)
        .with_state(set);
    match token {
        Some(token) => app.layer(middleware::from_fn_with_state(token, require_token)),
        None => app,
    }
}

/// How many replicas are live, and each one's host, address, state and requests in flight;
/// 503 when none is.
async fn health(State(set): State<Arc<ReplicaSet>>) -> Response {
    let live = set.live();
    let replicas: Vec<_> = (set.replicas.iter())
        .map(|r| {
            let lost = r.lost_why();
            json!({
                "replica": r.address.index,
                "host": r.address.host,
                "url": r.address.url,
                "state": if lost.is_some() { "lost" } else { "serving" },
                "why": lost,
                "in_flight": r.in_flight.load(Ordering::Relaxed),
            })
        })
        .collect();
    let (status, word) = match live {
        0 => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        _ => (StatusCode::OK, "ok"),
    };
    let body = json!({
        "status": word,
        "job": set.job,
        "replicas": set.replicas.len(),
        "live": live,
        "replica_states": replicas,
    });
    (status, axum::Json(body)).into_response()
}

/// 401 in OpenAI's shape without the cluster token.
async fn require_token(State(token): State<Arc<str>>, request: Request, next: Next) -> Response {
    match crate::serve::http::refused_without(&request, &token, "router") {
        Some(refused) => refused,
        None => next.run(request).await,
    }
}

async fn not_found(request: Request<Body>) -> Response {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!(
            "no route {} {}: this router answers POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health",
            request.method(),
            request.uri().path()
        ),
    )
    .into_response()
}
