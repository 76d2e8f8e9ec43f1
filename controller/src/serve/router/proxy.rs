//! Forwarding one request of the router ([`super`]) to a replica: the body read (at most
//! `--max-body-bytes`, else 413; a body that breaks off before its end, 400), the live replica with the fewest requests in flight picked,
//! a fresh HTTP/1.1 connection opened to it (hyper's client; TLS under the cluster's identity
//! for an `https://` replica), the request sent with the cluster token, and the answer relayed
//! chunk by chunk — a server-sent-events stream token by token as the replica sends it.
//!
//! A replica that cannot be reached before the request went out is marked lost and the
//! request goes to another one (nothing ran there). Once sent, a broken connection or the
//! controller's word that the replica's host was lost ends the request at once: before the
//! answer's head with HTTP 502 in OpenAI's error shape naming the host, during a stream with an
//! error event naming it (`data: {"error": …}`) before the stream closes; the replica is marked
//! lost either way, so the requests after go to the others.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::{InFlight, ReplicaSet, RoutedReplica};
use crate::serve::openai::ApiError;

/// Why a forwarded request did not get its answer's head.
enum Failure {
    /// The replica's address refused or did not answer a connection: the replica is lost (the
    /// request never went out and goes to another).
    Unreachable(String),
    /// This request failed at the replica (a connection this side could not open, a TLS or HTTP
    /// handshake that failed, a connection that broke under the request): it fails alone and the
    /// replica stays (the controller says when its host is lost).
    Broken(String),
    /// The replica was lost (its host, as the controller or another request found).
    Lost(String),
}

/// The router's handler of every forwarded route.
pub async fn forward(State(set): State<Arc<ReplicaSet>>, request: Request) -> Response {
    let Ok(_slot) = set.connections.clone().try_acquire_owned() else {
        return ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "too_many_requests",
            "the router forwards --max-connections requests at once: try again".to_string(),
        )
        .into_response();
    };
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, set.max_body_bytes).await {
        Ok(body) => body,
        Err(e) => return unread_body(e, set.max_body_bytes).into_response(),
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let content_type = parts.headers.get(header::CONTENT_TYPE);
    loop {
        let Some(flight) = set.pick() else {
            return ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "no_replica",
                set.all_lost(),
            )
            .into_response();
        };
        let replica = flight.replica();
        let mut lost = replica.lost.subscribe();
        if lost.borrow().is_some() {
            // Lost since it was picked: nothing went there yet.
            continue;
        }
        let request = Outgoing {
            method: &parts.method,
            path,
            content_type,
            body: body.clone(),
        };
        let sent = tokio::select! {
            sent = send(&set, replica, request) => sent,
            why = lost_now(&mut lost) => Err(Failure::Lost(why)),
        };
        let why = match sent {
            Ok(answer) => return relay(answer, flight, lost),
            Err(Failure::Unreachable(why)) => {
                if set.lose(replica.address.index, &why) {
                    tracing::warn!(
                        "{} was lost: {why}; the request goes to another replica",
                        replica.who()
                    );
                }
                continue;
            }
            Err(Failure::Broken(why)) => why,
            Err(Failure::Lost(why)) => why,
        };
        return lost_answer(replica, &why).into_response();
    }
}

/// The answer to a request body that could not be read: 413 when it is over `limit` bytes, 400
/// when it broke off (or was malformed) before its end — the client's fault either way, but
/// only the first is cured by a smaller body.
fn unread_body(error: axum::Error, limit: usize) -> ApiError {
    let error = error.into_inner();
    if error.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
        return ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body is over {limit} bytes (--max-body-bytes)"),
        );
    }
    ApiError::status(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "body_unreadable",
        format!("the request body could not be read to its end: {error}"),
    )
}

/// How long the router waits for a replica to take a connection.
const CONNECT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether a connection error says the replica's address is gone (nothing listens there, or
/// its host cannot be reached), not that this side could not open one.
fn refused_or_unreachable(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | HostUnreachable | NetworkUnreachable | TimedOut
    )
}

/// The request as it goes to a replica.
struct Outgoing<'r> {
    method: &'r Method,
    path: &'r str,
    content_type: Option<&'r HeaderValue>,
    body: Bytes,
}

/// 502 in OpenAI's shape: `replica I on host `H` failed or was lost: why` (`was lost` once the
/// replica is known lost).
fn lost_answer(replica: &RoutedReplica, why: &str) -> ApiError {
    let what = match replica.lost.borrow().is_some() {
        true => "was lost",
        false => "failed or was lost",
    };
    ApiError::status(
        StatusCode::BAD_GATEWAY,
        "server_error",
        "replica_lost",
        format!("{} {what}: {why}", replica.who()),
    )
}

/// Why the replica was lost, once it is (never, while it is live).
async fn lost_now(lost: &mut watch::Receiver<Option<String>>) -> String {
    let why = (lost.wait_for(Option::is_some).await)
        .ok()
        .and_then(|why| why.clone());
    match why {
        Some(why) => why,
        // The set is gone: the router with it.
        None => std::future::pending().await,
    }
}

/// Opens a connection to `replica` and sends `request` with the cluster token; the answer's
/// head (its body still coming).
async fn send(
    set: &ReplicaSet,
    replica: &RoutedReplica,
    request: Outgoing<'_>,
) -> Result<hyper::Response<Incoming>, Failure> {
    let url = &replica.address.url;
    let failed = |e: &dyn std::fmt::Display| Failure::Broken(format!("cannot reach {url}: {e}"));
    let tcp = match tokio::time::timeout(CONNECT_PATIENCE, TcpStream::connect(&replica.authority)).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) if refused_or_unreachable(&e) => {
            return Err(Failure::Unreachable(format!("cannot connect to {url}: {e}")));
        }
        Ok(Err(e)) => return Err(failed(&e)),
        Err(_) => {
            let why = format!("{url} did not answer a connection within {CONNECT_PATIENCE:?}");
            return Err(Failure::Unreachable(why));
        }
    };
    let _ = tcp.set_nodelay(true);
    let mut builder = hyper::Request::builder()
        .method(request.method.clone())
        .uri(request.path)
        .header(header::HOST, &replica.authority)
        .header(header::AUTHORIZATION, format!("Bearer {}", set.token));
    if let Some(content_type) = request.content_type {
        builder = builder.header(header::CONTENT_TYPE, content_type);
    }
    let outgoing = (builder.body(Body::from(request.body))).map_err(|e| failed(&e))?;
    match (&set.tls, replica.https) {
        (Some(tls), true) => {
            let stream = (tls.connect(&replica.authority, tcp).await).map_err(|e| failed(&e))?;
            exchange(TokioIo::new(stream), outgoing).await
        }
        _ => exchange(TokioIo::new(tcp), outgoing).await,
    }
}

/// One HTTP/1.1 exchange on `io`; the connection is driven by a task of its own until the
/// answer's body is read (or dropped).
async fn exchange<Io>(io: Io, request: hyper::Request<Body>) -> Result<hyper::Response<Incoming>, Failure>
where
    Io: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = (hyper::client::conn::http1::handshake(io).await)
        .map_err(|e| Failure::Broken(format!("the HTTP handshake failed: {e}")))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    (sender.send_request(request).await)
        .map_err(|e| Failure::Broken(format!("its connection broke under a request: {e}")))
}

/// What the relay of an answer's body carries from chunk to chunk.
struct Relay {
    chunks: axum::body::BodyDataStream,
    lost: watch::Receiver<Option<String>>,
    flight: InFlight,
    event_stream: bool,
}

/// The replica's answer relayed: its status and headers, then its body chunk by chunk until it
/// ends, its connection breaks or the replica is lost (an error event naming the host closes a
/// stream; any other body is cut off).
fn relay(
    answer: hyper::Response<Incoming>,
    flight: InFlight,
    lost: watch::Receiver<Option<String>>,
) -> Response {
    let (mut parts, body) = answer.into_parts();
    for hop_by_hop in [header::CONNECTION, header::TRANSFER_ENCODING] {
        parts.headers.remove(hop_by_hop);
    }
    parts.headers.remove("keep-alive");
    let event_stream = (parts.headers.get(header::CONTENT_TYPE))
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let relay = Relay {
        chunks: Body::new(body).into_data_stream(),
        lost,
        flight,
        event_stream,
    };
    let stream = futures::stream::unfold(Some(relay), |relay| async move {
        let mut relay = relay?;
        let why = tokio::select! {
            chunk = relay.chunks.next() => match chunk {
                Some(Ok(bytes)) => return Some((Ok(bytes), Some(relay))),
                None => return None,
                Some(Err(e)) => format!("its connection broke during an answer: {e}"),
            },
            why = lost_now(&mut relay.lost) => why,
        };
        let error = lost_answer(relay.flight.replica(), &why);
        let last = match relay.event_stream {
            true => Ok(Bytes::from(format!("data: {}\n\n", error.body()))),
            false => Err(std::io::Error::other(error.message)),
        };
        Some((last, None))
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read(body: Body, limit: usize) -> StatusCode {
        match axum::body::to_bytes(body, limit).await {
            Ok(_) => StatusCode::OK,
            Err(e) => unread_body(e, limit).into_response().status(),
        }
    }

    /// Over the limit is 413; a body that breaks off is 400, not 413 (a smaller body would not
    /// help); within the limit it reads.
    #[tokio::test]
    async fn an_oversized_body_is_413_and_a_broken_one_400() {
        assert_eq!(
            read(Body::from(vec![b'x'; 100]), 10).await,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(read(Body::from(vec![b'x'; 10]), 10).await, StatusCode::OK);
        let broken = futures::stream::iter([
            Ok(Bytes::from_static(b"{\"prompt\"")),
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "reset by peer",
            )),
        ]);
        assert_eq!(
            read(Body::from_stream(broken), 1000).await,
            StatusCode::BAD_REQUEST
        );
    }
}
