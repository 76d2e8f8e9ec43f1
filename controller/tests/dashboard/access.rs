//! Nothing listens openly: a dashboard on loopback answers without a token; bound to an open
//! address (`0.0.0.0`: every interface, reached here through 127.0.0.1) it is refused without a
//! token, and with one it answers only requests that carry it (header, `?token=` then the
//! cookie), answering 401 to the rest and logging each refusal. Checked on the library's
//! `serve`, on `archipelago train --dashboard` and `archipelago controller --dashboard` (real
//! processes) and in headless Chromium.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Arc;

use archipelago_controller::dashboard::{Dashboard, HostView, serve};

use super::{BIN, Proc, chromium, dump_dom};

const TOKEN: &str = "tok-3f9a+/=";
const TOKEN_IN_QUERY: &str = "tok-3f9a%2B%2F%3D";

/// Status code, headers and body of `GET path` with extra request `headers`.
fn request(addr: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    let mut text = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    text.push_str("\r\n");
    stream.write_all(text.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"));
    (status, head.to_string(), body.to_string())
}

fn dashboard_with_a_host() -> Arc<Dashboard> {
    let dashboard = Dashboard::new();
    dashboard.set_cluster(vec![HostView {
        name: "host-a".into(),
        island: "default".into(),
        devices: vec!["cpu:0".into(), "cpu:1".into()],
        device_memory: 0,
    }]);
    dashboard
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Serves `dashboard` on `bind`; the address to connect to (127.0.0.1 for `0.0.0.0`).
fn serve_on(rt: &tokio::runtime::Runtime, bind: &str, dashboard: Arc<Dashboard>) -> std::io::Result<String> {
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = serve(listener, dashboard)?;
        Ok(format!("127.0.0.1:{}", addr.port()))
    })
}

#[test]
fn loopback_is_open_without_a_token() {
    let rt = runtime();
    let addr = serve_on(&rt, "127.0.0.1:0", dashboard_with_a_host()).unwrap();
    let (status, _, body) = request(&addr, "/api/cluster", &[]);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("host-a"), "{body}");
}

#[test]
fn an_open_address_is_refused_without_a_token_and_guarded_with_one() {
    let rt = runtime();
    let err = serve_on(&rt, "0.0.0.0:0", dashboard_with_a_host()).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
    assert!(
        err.to_string().contains("127.0.0.1") && err.to_string().contains("--token-file"),
        "the refusal must say the fix: {err}"
    );

    let dashboard = dashboard_with_a_host();
    dashboard.require_token(TOKEN);
    let addr = serve_on(&rt, "0.0.0.0:0", dashboard).unwrap();
    // Negative controls: no token, a wrong one, a prefix of it.
    for headers in [
        vec![],
        vec![("Authorization", "Bearer wrong")],
        vec![("Authorization", "Bearer tok-3f9a")],
        vec![("Cookie", "archipelago_dashboard_token=wrong")],
    ] {
        for path in [
            "/",
            "/api/state",
            "/api/cluster",
            "/events",
            "/api/cluster?token=wrong",
        ] {
            let (status, head, body) = request(&addr, path, &headers);
            assert_eq!(status, 401, "{path} with {headers:?}: {head}\n{body}");
            assert!(
                head.to_ascii_lowercase().contains("www-authenticate: bearer"),
                "{head}"
            );
            assert!(
                !body.contains("host-a"),
                "a refused request leaked the state: {body}"
            );
        }
    }
    let bearer = format!("Bearer {TOKEN}");
    let (status, _, body) = request(&addr, "/api/cluster", &[("Authorization", &bearer)]);
    assert_eq!(status, 200);
    assert!(body.contains("host-a"), "{body}");
    // A browser's first visit: the token in the query, answered with the cookie.
    let (status, head, body) = request(&addr, &format!("/?token={TOKEN_IN_QUERY}"), &[]);
    assert_eq!(status, 200, "{head}");
    assert!(body.contains("host-a"), "the page embeds the state");
    let cookie = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("set-cookie: ")
                .or_else(|| l.strip_prefix("Set-Cookie: "))
        })
        .unwrap_or_else(|| panic!("no cookie set: {head}"));
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap();
    let (status, _, body) = request(&addr, "/api/cluster", &[("Cookie", pair)]);
    assert_eq!(status, 200, "the cookie from ?token= opens the API");
    assert!(body.contains("host-a"), "{body}");
}

#[test]
fn chromium_opens_a_guarded_dashboard_with_the_token_only() {
    let Some(browser) = chromium() else {
        return;
    };
    let rt = runtime();
    let dashboard = dashboard_with_a_host();
    dashboard.require_token(TOKEN);
    let addr = serve_on(&rt, "0.0.0.0:0", dashboard).unwrap();
    let refused = dump_dom(&browser, &format!("http://{addr}/"));
    assert!(!refused.contains("<td>host-a</td>"), "{refused}");
    assert!(refused.contains("needs the cluster token"), "{refused}");
    let page = dump_dom(&browser, &format!("http://{addr}/?token={TOKEN_IN_QUERY}"));
    assert!(page.contains("<td>host-a</td>"), "{page}");
    assert!(page.contains("<td>cpu:0, cpu:1</td>"), "{page}");
}

#[test]
fn train_refuses_an_open_dashboard_without_a_token_and_guards_it_with_one() {
    let out = Command::new(BIN)
        .args([
            "train",
            "--model",
            "mlp:in=8,hidden=8,layers=2,out=2",
            "--steps",
            "1",
        ])
        .args(["--dashboard", "0.0.0.0:0"])
        .env_remove("ARCHIPELAGO_TOKEN_FILE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an open dashboard without a token must be refused"
    );
    assert!(
        stderr.contains("--token-file") && stderr.contains("127.0.0.1"),
        "the refusal must say the fix: {stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("step "),
        "refused before the job starts"
    );

    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let mut child = Command::new(BIN)
        .args([
            "train",
            "--model",
            "mlp:in=8,hidden=8,layers=2,out=2",
            "--steps",
            "2",
        ])
        .args([
            "--dashboard",
            "0.0.0.0:0",
            "--dashboard-linger-s",
            "60",
            "--quiet",
        ])
        .arg("--token-file")
        .arg(&token_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let _job = Proc(child);
    let mut lines = BufReader::new(stdout).lines().map(|l| l.unwrap());
    let port = lines
        .find_map(|l| {
            l.strip_prefix("dashboard at http://0.0.0.0:")
                .map(|p| p.trim_end_matches('/').to_string())
        })
        .expect("the dashboard address");
    let addr = format!("127.0.0.1:{port}");
    let (status, _, _) = request(&addr, "/api/job", &[]);
    assert_eq!(status, 401);
    let bearer = format!("Bearer {TOKEN}");
    let (status, _, body) = request(&addr, "/api/cluster", &[("Authorization", &bearer)]);
    assert_eq!(status, 200);
    assert!(body.contains("\"local\""), "{body}");
    // The refusal is in the process's log.
    let logged = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.contains("refused GET /api/job"));
    let logged = logged.expect("the 401 is logged");
    assert!(logged.contains("no valid cluster token"), "{logged}");
}

#[test]
fn the_controller_dashboard_on_an_open_address_needs_the_cluster_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let mut child = Command::new(BIN)
        .args([
            "controller",
            "--listen",
            "127.0.0.1:0",
            "--dashboard",
            "0.0.0.0:0",
        ])
        .arg("--token-file")
        .arg(&token_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _controller = Proc(child);
    let port = BufReader::new(stdout)
        .lines()
        .map(|l| l.unwrap())
        .find_map(|l| {
            l.strip_prefix("dashboard at http://0.0.0.0:")
                .map(|p| p.trim_end_matches('/').to_string())
        })
        .expect("the dashboard address");
    let addr = format!("127.0.0.1:{port}");
    assert_eq!(request(&addr, "/api/cluster", &[]).0, 401);
    let bearer = format!("Bearer {TOKEN}");
    let (status, _, body) = request(&addr, "/api/cluster", &[("Authorization", &bearer)]);
    assert_eq!(status, 200, "{body}");
}
