//! Who may read the dashboard. Nothing listens openly: on a loopback address (`127.0.0.0/8`,
//! `::1`) the page is open to the processes of this machine only; bound to any other address
//! (`0.0.0.0`, `::`, an interface's address) it serves only requests that carry the cluster
//! token, and starting it there without a token is refused with the fix.
//!
//! A request proves it knows the token in one of three ways:
//! - the header `Authorization: Bearer <token>` (scripts, `curl -H`);
//! - the query `?token=<token>` (a browser's first visit: the answer then sets an `HttpOnly`,
//!   `SameSite=Strict` cookie so that the page's own requests and its event stream carry it);
//! - that cookie, `archipelago_dashboard_token`.
//!
//! Any other request gets `401 Unauthorized`, and the refusal is logged (method, path, peer; not
//! the wrong token).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The cookie the page gets after a visit with `?token=`.
pub const COOKIE: &str = "archipelago_dashboard_token";

/// Whether a dashboard bound to `ip` is reachable from this machine only.
pub fn is_local_only(ip: IpAddr) -> bool {
    ip.is_loopback()
}

/// The address `--dashboard` binds for `spec`: a bare port means `127.0.0.1:PORT` (the
/// default is never an open address); anything else is used as given.
pub fn bind_address(spec: &str) -> String {
    match spec.trim().parse::<u16>() {
        Ok(port) => format!("127.0.0.1:{port}"),
        Err(_) => spec.trim().to_string(),
    }
}

/// Refuses to serve on `addr` without a token when `addr` is not a loopback address; `None`
/// (no check needed) or `Some(token)` (every request must carry it) otherwise.
pub fn token_for(addr: SocketAddr, token: Option<&str>) -> std::io::Result<Option<Arc<str>>> {
    if is_local_only(addr.ip()) {
        return Ok(None);
    }
    match token.map(str::trim).filter(|t| !t.is_empty()) {
        Some(token) => Ok(Some(Arc::from(token))),
        None => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            refusal(&addr.to_string()),
        )),
    }
}

/// Checks, before anything is bound, that `spec` (a `--dashboard` value) may be served with or
/// without a token; names without a literal IP (`localhost:8080`) are resolved first.
pub fn check_bind(spec: &str, has_token: bool) -> anyhow::Result<()> {
    use std::net::ToSocketAddrs;
    let addr = bind_address(spec);
    let resolved: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| {
            anyhow::anyhow!("--dashboard {spec}: not an address to listen on ({e}); e.g. 127.0.0.1:8080")
        })?
        .collect();
    if has_token || resolved.iter().all(|a| is_local_only(a.ip())) {
        return Ok(());
    }
    anyhow::bail!("{}", refusal(&addr))
}

fn refusal(addr: &str) -> String {
    format!(
        "the dashboard on {addr} would be open to other machines, and no cluster token is set: bind it to \
         127.0.0.1 (e.g. --dashboard 127.0.0.1:8080), or give the token (`train --token-file FILE`; \
         `archipelago controller` uses its own --token-file; in code, Dashboard::require_token) and \
         open the page as http://HOST:PORT/?token=<token>"
    )
}

/// Compares without an early exit on the first differing byte.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `%XX` and `+` decoding of one query value.
fn percent_decode(value: &str) -> Vec<u8> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// Which proof `request` carries, if it is the right token.
fn proof(request: &Request, token: &str) -> Option<Proof> {
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    if bearer.is_some_and(|b| same(b, token.as_bytes())) {
        return Some(Proof::Header);
    }
    let query = request.uri().query().unwrap_or("");
    let from_query = query
        .split('&')
        .filter_map(|kv| kv.strip_prefix("token="))
        .any(|v| same(&percent_decode(v), token.as_bytes()));
    if from_query {
        return Some(Proof::Query);
    }
    let from_cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b';'))
        .filter_map(|c| c.trim_ascii().strip_prefix(format!("{COOKIE}=").as_bytes()))
        .any(|v| same(v, token.as_bytes()));
    from_cookie.then_some(Proof::Cookie)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Proof {
    Header,
    Query,
    Cookie,
}

/// The middleware in front of every route of a dashboard that needs `token`.
pub(crate) async fn guard(
    State(token): State<Arc<str>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    match proof(&request, &token) {
        Some(Proof::Query) => {
            let mut response = next.run(request).await;
            let cookie = format!("{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/");
            if let Ok(value) = HeaderValue::from_str(&cookie) {
                response.headers_mut().append(header::SET_COOKIE, value);
            }
            response
        }
        Some(_) => next.run(request).await,
        None => {
            tracing::warn!(
                "dashboard: refused {} {} from {peer}: no valid cluster token",
                request.method(),
                request.uri().path()
            );
            let mut response = (
                StatusCode::UNAUTHORIZED,
                "this dashboard needs the cluster token: send `Authorization: Bearer <token>`, or open /?token=<token> in the browser\n",
            )
                .into_response();
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_open_and_everything_else_needs_the_token() {
        let open = token_for("127.0.0.1:0".parse().unwrap(), None).unwrap();
        assert!(open.is_none());
        assert!(token_for("[::1]:0".parse().unwrap(), None).unwrap().is_none());
        for addr in ["0.0.0.0:0", "[::]:0", "192.0.2.7:80"] {
            let err = token_for(addr.parse().unwrap(), None).unwrap_err();
            assert!(err.to_string().contains("--token-file"), "{err}");
            let needed = token_for(addr.parse().unwrap(), Some("s3cret\n")).unwrap();
            assert_eq!(needed.as_deref(), Some("s3cret"));
        }
        assert!(token_for("0.0.0.0:0".parse().unwrap(), Some("  ")).is_err());
        assert_eq!(bind_address("8080"), "127.0.0.1:8080");
        assert_eq!(bind_address("0.0.0.0:8080"), "0.0.0.0:8080");
        assert!(check_bind("8080", false).is_ok());
        assert!(check_bind("0.0.0.0:8080", false).is_err());
        assert!(check_bind("0.0.0.0:8080", true).is_ok());
        assert!(check_bind("not an address", true).is_err());
    }

    #[test]
    fn the_token_is_read_from_header_query_or_cookie() {
        let request = |f: fn(axum::http::request::Builder) -> axum::http::request::Builder| {
            f(Request::builder().uri("/api/job"))
                .body(axum::body::Body::empty())
                .unwrap()
        };
        let with = |uri: &str| {
            Request::builder()
                .uri(uri)
                .body(axum::body::Body::empty())
                .unwrap()
        };
        assert_eq!(
            proof(&request(|b| b.header("authorization", "Bearer a+b/c")), "a+b/c"),
            Some(Proof::Header)
        );
        assert_eq!(
            proof(&request(|b| b.header("authorization", "Bearer a+b/d")), "a+b/c"),
            None
        );
        assert_eq!(proof(&with("/?x=1&token=a%2Bb%2Fc"), "a+b/c"), Some(Proof::Query));
        assert_eq!(proof(&with("/?token=a%2Bb%2F"), "a+b/c"), None);
        assert_eq!(proof(&with("/?token=%"), "%"), Some(Proof::Query));
        assert_eq!(
            proof(
                &request(|b| b.header("cookie", "x=1; archipelago_dashboard_token=a+b/c")),
                "a+b/c"
            ),
            Some(Proof::Cookie)
        );
        assert_eq!(proof(&with("/"), "a+b/c"), None);
    }
}
