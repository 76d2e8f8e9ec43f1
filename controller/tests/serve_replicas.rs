//! `archipelago serve --controller ADDR --replicas 2` (issue 42), as a user runs it: a
//! controller and two `archipelago host` processes on 127.0.0.1, one replica placed on each,
//! the client's router in front of them on its own `--listen`. A long stream is opened on each
//! replica, then under a load of concurrent completions one host is SIGKILLed: every request
//! that fails fails within 5 s of the kill with HTTP 502 naming that host, at least one does
//! (the kill landed mid-load), every other request gets its whole completion; the stream on
//! the killed host ends within 5 s with an error event naming it, the other runs to `[DONE]`;
//! the requests after the kill all go to the survivor, `/health` says one replica of two is
//! live, the dashboard shows the lost replica failed (naming the host) and the other serving
//! (`/api/serving`, and the page's rows in headless Chromium),
//! and the client stays up — until the other host is killed too: the job fails and the client
//! exits 1 naming both hosts. `--replicas 3` with two hosts is refused before anything starts,
//! naming the count. Under mutual TLS the router reaches HTTPS replicas (completions, chat,
//! the model list).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use archipelago_actors::block::initial_params;
use archipelago_actors::trust::certs::make_certs;
use archipelago_actors::weights_file::write_weights;
use archipelago_dataflow::ModelSpec;

mod common;

use common::{BIN, Cluster, Proc, chromium, dump_dom, tls_flags};

/// Tokens each completion of the load asks for: enough to keep it in flight for a while.
const MAX_TOKENS: u64 = 1000;
/// Requests of the load, and how many at once.
const LOAD: usize = 12;
const AT_ONCE: usize = 4;
/// The bound on reporting a lost replica's requests failed.
const FAILURE_BOUND: Duration = Duration::from_secs(5);

/// A GPT-2 of random weights with a long context (no stop token: every completion runs to
/// `max_tokens`); its `--model` and `--init`.
fn long_context_model(dir: &std::path::Path) -> (String, String) {
    let spec = ModelSpec::parse("gpt2:vocab=320,ctx=2048,d=64,layers=4,heads=4").unwrap();
    let values: Vec<Vec<f32>> = (spec.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, 5))
        .collect();
    let init = dir.join("model.safetensors");
    write_weights(&init, &spec, &values).unwrap();
    (spec.explicit(), init.to_string_lossy().into_owned())
}

/// `archipelago serve --controller … --replicas N --listen 127.0.0.1:0` for job `job`.
fn serve_command(cluster: &Cluster, model: &(String, String), replicas: usize, job: &str) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--controller", &cluster.addr, "--token-file"])
        .arg(cluster.dir.path().join("token"))
        .args(["--model", &model.0, "--init", &model.1])
        .args(["--replicas", &replicas.to_string(), "--listen", "127.0.0.1:0"])
        .args(["--cache-tokens", "4096", "--job", job]);
    command
}

/// An HTTP/1.0 exchange with `addr`: the status and the body (empty when the connection broke).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return (0, text);
    };
    let status = (head.split_whitespace().nth(1)).and_then(|s| s.parse().ok());
    (status.unwrap_or(0), body.to_string())
}

fn get_json(addr: &str, path: &str) -> Value {
    let (status, body) = http(addr, "GET", path, "");
    assert!(status == 200 || status == 503, "GET {path}: {status} {body}");
    serde_json::from_str(&body).unwrap()
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One completion of the load: when it was sent and answered, its status and answer.
#[derive(Debug)]
struct Outcome {
    sent: Instant,
    answered: Instant,
    status: u16,
    answer: Value,
}

/// Sends `count` completions to `router`, `at_once` at a time; every outcome.
fn load(router: &str, count: usize, at_once: usize) -> Vec<Outcome> {
    let next = Arc::new(Mutex::new(0usize));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..at_once)
        .map(|_| {
            let (router, next, outcomes) = (router.to_string(), next.clone(), outcomes.clone());
            std::thread::spawn(move || {
                loop {
                    let n = {
                        let mut next = next.lock().unwrap();
                        *next += 1;
                        *next
                    };
                    if n > count {
                        return;
                    }
                    let request = json!({"prompt": format!("request {n}:"), "max_tokens": MAX_TOKENS, "temperature": 0});
                    let sent = Instant::now();
                    let (status, body) = http(&router, "POST", "/v1/completions", &request.to_string());
                    let answered = Instant::now();
                    let answer = serde_json::from_str(&body).unwrap_or(Value::String(body));
                    outcomes.lock().unwrap().push(Outcome {
                        sent,
                        answered,
                        status,
                        answer,
                    });
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    Arc::try_unwrap(outcomes).unwrap().into_inner().unwrap()
}

/// The whole completion: `max_tokens` tokens, ended by the length.
fn assert_complete(outcome: &Outcome) {
    assert_eq!(outcome.status, 200, "{outcome:?}");
    let choice = &outcome.answer["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{outcome:?}");
    assert_eq!(
        outcome.answer["usage"]["completion_tokens"], MAX_TOKENS,
        "{outcome:?}"
    );
    assert!(!choice["text"].as_str().unwrap().is_empty(), "{outcome:?}");
}

/// A streamed completion's lines as they came, and when the stream closed.
struct Streamed {
    lines: Vec<String>,
    closed: Instant,
}

/// Opens a streamed completion of `max_tokens` on `router` and waits for its first token; the
/// thread that reads the rest.
fn open_stream(router: &str, max_tokens: u64) -> std::thread::JoinHandle<Streamed> {
    let body = json!({"prompt": "a long story:", "max_tokens": max_tokens, "temperature": 0, "stream": true})
        .to_string();
    let mut stream = TcpStream::connect(router).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.0\r\nHost: {router}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(stream);
    let mut lines = Vec::new();
    while !lines.last().is_some_and(|l: &String| l.starts_with("data: ")) {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the stream closed before its first token: {lines:?}"
        );
        lines.push(line.trim_end().to_string());
    }
    std::thread::spawn(move || {
        for line in reader.lines() {
            match line {
                Ok(line) => lines.push(line),
                Err(_) => break,
            }
        }
        Streamed {
            lines,
            closed: Instant::now(),
        }
    })
}

/// The replica states `/health` of the router gives, by host.
fn replica_state(health: &Value, host: &str) -> Value {
    (health["replica_states"].as_array().unwrap().iter())
        .find(|r| r["host"] == host)
        .cloned()
        .unwrap_or(Value::Null)
}

/// The client of `serve --controller … --replicas 2` for job `pair`, its router's address and
/// the lines it printed (read on as it prints them).
struct Client {
    process: Proc,
    router: String,
    printed: Arc<Mutex<Vec<String>>>,
}

fn start_client(cluster: &Cluster, model: &(String, String)) -> Client {
    let log = std::fs::File::create(cluster.dir.path().join("client.err")).unwrap();
    let mut child: Child = serve_command(cluster, model, 2, "pair")
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let process = Proc(child);
    let printed = Arc::new(Mutex::new(Vec::new()));
    let listening = loop {
        let line = lines.next().expect("the client ended before listening").unwrap();
        printed.lock().unwrap().push(line.clone());
        if line.contains("listening on http://") {
            break line;
        }
    };
    let reading = printed.clone();
    std::thread::spawn(move || {
        lines
            .map_while(Result::ok)
            .for_each(|l| reading.lock().unwrap().push(l))
    });
    assert!(
        listening.contains("replica 0 on host `h1`") && listening.contains("replica 1 on host `h2`"),
        "{listening}"
    );
    let router = listening
        .split("http://")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    Client {
        process,
        router: router.to_string(),
        printed,
    }
}

/// Every failed request of the load failed within the bound of the kill, naming h2; at least
/// one did; every other got its whole completion. No request sent once h2 was `gone` failed
/// (SIGKILL takes effect when the dying process next runs: until `wait` reaps it, its listening
/// socket still takes connections, and a request sent in that window breaks like one in
/// flight). With `gone` `None`, a request sent after the kill may have failed too (h2 frozen:
/// its connections hang until the controller's word), still within the bound.
fn assert_load_outcomes(outcomes: &[Outcome], killed: Instant, gone: Option<Instant>) {
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.status != 200).collect();
    let slowest = (failed.iter())
        .map(|o| o.answered.saturating_duration_since(killed))
        .max();
    eprintln!(
        "{} of {} requests failed (slowest report {slowest:?} after the kill), {} finished",
        failed.len(),
        outcomes.len(),
        outcomes.len() - failed.len()
    );
    assert!(
        !failed.is_empty(),
        "no request was in flight on h2 when it was killed"
    );
    for outcome in &failed {
        assert_eq!(outcome.status, 502, "{outcome:?}");
        let message = outcome.answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("host `h2`") && message.contains("lost"),
            "{outcome:?}"
        );
        assert!(
            gone.is_none_or(|gone| outcome.sent < gone),
            "a request sent after h2 was gone failed: {outcome:?}"
        );
        let after = outcome.answered.saturating_duration_since(killed);
        assert!(
            after <= FAILURE_BOUND,
            "reported {after:?} after the kill: {outcome:?}"
        );
    }
    for outcome in outcomes.iter().filter(|o| o.status == 200) {
        assert_complete(outcome);
    }
}

/// The stream on h2 ended within the bound of the kill with an error event naming h2 (no
/// `[DONE]`); the other ran to `[DONE]`.
fn assert_streams(streams: [Streamed; 2], killed: Instant) {
    let ended_by_error = |s: &Streamed| s.lines.iter().any(|l| l.contains("\"error\""));
    let [first, second] = streams;
    let (cut, whole) = match ended_by_error(&first) {
        true => (first, second),
        false => (second, first),
    };
    let error = cut.lines.iter().find(|l| l.contains("\"error\"")).unwrap();
    let after = cut.closed.saturating_duration_since(killed);
    eprintln!("the stream on h2 ended {after:?} after the kill: {error}");
    assert!(error.contains("host `h2`") && error.contains("lost"), "{error}");
    assert!(
        after <= FAILURE_BOUND,
        "the stream on h2 ended {after:?} after the kill"
    );
    assert!(!cut.lines.iter().any(|l| l == "data: [DONE]"), "{:?}", cut.lines);
    assert!(!ended_by_error(&whole), "{:?}", whole.lines);
    let last = whole.lines.iter().rev().find(|l| !l.is_empty());
    assert_eq!(last.map(String::as_str), Some("data: [DONE]"));
}

/// The dashboard shows h2's replica failed naming its host, h1's serving.
fn assert_dashboard(dashboard: &str) {
    let row = |host: &str| {
        let rows: Vec<Value> = serde_json::from_str(&http(dashboard, "GET", "/api/serving", "").1).unwrap();
        rows.into_iter().find(|r| r["job"] == "pair" && r["host"] == host)
    };
    wait_until(
        "the dashboard shows h2's replica failed",
        Duration::from_secs(30),
        || row("h2").is_some_and(|r| r["state"] == "failed"),
    );
    let lost = row("h2").unwrap();
    assert!(lost["reason"].as_str().unwrap().contains("host `h2`"), "{lost}");
    assert_eq!(lost["replicas"], 2, "{lost}");
    assert_eq!(row("h1").unwrap()["state"], "serving");
    if let Some(browser) = chromium() {
        let dom = dump_dom(&browser, &format!("http://{dashboard}/"));
        for cell in [
            "<td>pair replica 0</td><td>h1</td>",
            "<td>pair replica 1</td><td>h2</td>",
        ] {
            assert!(dom.contains(cell), "no `{cell}` in the page's serving table");
        }
        let row = dom.split("<td>pair replica 1</td>").nth(1).unwrap();
        let row = row.split("</tr>").next().unwrap();
        assert!(
            row.contains("<td>failed: serving job pair replica 1") && row.contains("`h2`"),
            "{row}"
        );
    }
}

/// `/health`'s replicas and live replicas.
fn live_of(router: &str) -> (Option<u64>, Option<u64>) {
    let health = get_json(router, "/health");
    (health["replicas"].as_u64(), health["live"].as_u64())
}

/// How h2 goes away mid-load.
#[derive(Clone, Copy, PartialEq)]
enum Loss {
    /// SIGKILL: its connections break at once.
    Killed,
    /// SIGSTOP: its connections hang; only the controller's word (its heartbeats stop) tells.
    Frozen,
}

#[test]
fn two_replicas_on_two_hosts_one_host_killed_mid_load() {
    one_host_lost_mid_load(Loss::Killed);
}

#[test]
fn two_replicas_on_two_hosts_one_host_frozen_mid_load_is_told_by_the_controller() {
    one_host_lost_mid_load(Loss::Frozen);
}

/// The scenario of the file's doc with h2 lost as `loss` says.
fn one_host_lost_mid_load(loss: Loss) {
    let (mut cluster, dashboard) = Cluster::start_with_dashboard(1.0, 3.0);
    cluster.add_host("h1", "cpu:0");
    cluster.add_host("h2", "cpu:0");
    let model = long_context_model(cluster.dir.path());

    if loss == Loss::Killed {
        // More replicas than hosts: refused, naming the count, before anything starts.
        let out = serve_command(&cluster, &model, 3, "three").output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{said}");
        assert!(
            said.contains("--replicas 3 needs 3 distinct hosts") && said.contains("but 2"),
            "{said}"
        );
    }

    let mut client = start_client(&cluster, &model);
    let router = client.router.clone();
    assert_eq!(live_of(&router), (Some(2), Some(2)));

    // A long stream on each replica (the second goes to the one the first left idle), then the
    // load; h2 is killed once two requests of the load are in flight through it too.
    let streams = [open_stream(&router, 1500), open_stream(&router, 1500)];
    let loader = {
        let router = router.clone();
        std::thread::spawn(move || load(&router, LOAD, AT_ONCE))
    };
    wait_until("requests in flight on h2", Duration::from_secs(60), || {
        replica_state(&get_json(&router, "/health"), "h2")["in_flight"].as_u64() >= Some(3)
    });
    let (_, mut h2) = cluster.hosts.remove(1);
    let (killed, gone) = match loss {
        Loss::Killed => {
            let killed = Instant::now();
            h2.0.kill().unwrap();
            let _ = h2.0.wait();
            (killed, Some(Instant::now()))
        }
        Loss::Frozen => {
            let stop = Command::new("kill")
                .args(["-STOP", &h2.0.id().to_string()])
                .status();
            assert!(stop.unwrap().success());
            (Instant::now(), None)
        }
    };
    let outcomes = loader.join().unwrap();
    assert_eq!(outcomes.len(), LOAD);
    assert_load_outcomes(&outcomes, killed, gone);
    assert_streams(streams.map(|s| s.join().unwrap()), killed);

    // After the kill: everything goes to h1, /health says one of two live, the client runs.
    for outcome in load(&router, AT_ONCE, AT_ONCE) {
        assert_complete(&outcome);
    }
    assert_eq!(live_of(&router), (Some(2), Some(1)));
    let health = get_json(&router, "/health");
    assert_eq!(replica_state(&health, "h2")["state"], "lost", "{health}");
    assert_eq!(replica_state(&health, "h1")["state"], "serving", "{health}");

    // The controller's word: the client printed the replica lost, naming the host, and runs on.
    assert_dashboard(&dashboard);
    wait_until(
        "the client printed the controller's word",
        Duration::from_secs(30),
        || {
            (client.printed.lock().unwrap().iter())
                .any(|l| l.contains("replica 1 on host `h2` was lost (1 of 2 replicas live)"))
        },
    );
    assert!(client.process.0.try_wait().unwrap().is_none(), "the client ended");

    // The last replica's host killed: the job fails, the client exits 1 naming both hosts.
    let (_, mut h1) = cluster.hosts.remove(0);
    h1.0.kill().unwrap();
    let mut status = None;
    wait_until("the client's end", Duration::from_secs(30), || {
        status = client.process.0.try_wait().unwrap();
        status.is_some()
    });
    let said = std::fs::read_to_string(cluster.dir.path().join("client.err")).unwrap();
    assert_eq!(status.unwrap().code(), Some(1), "{said}");
    assert!(
        said.contains("every replica was lost") && said.contains("host `h1`") && said.contains("host `h2`"),
        "{said}"
    );
}

/// Under the cluster's mutual TLS the replicas speak HTTPS under their hosts' identities, and
/// the router reaches them with the client's certificate.
#[test]
fn two_replicas_under_mutual_tls_answer_through_the_router() {
    let certs = tempfile::tempdir().unwrap();
    let names = ["controller", "h1", "h2", "client"].map(String::from);
    make_certs(certs.path(), &names, &[]).unwrap();
    let mut cluster = Cluster::start_tls(5.0, 5.0, certs.path());
    cluster.add_host("h1", "cpu:0");
    cluster.add_host("h2", "cpu:0");
    let model = long_context_model(cluster.dir.path());
    let mut child = serve_command(&cluster, &model, 2, "secure")
        .args(tls_flags(certs.path(), "client"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = common::wait_for_line(&mut child, "listening on http://");
    let _client = Proc(child);
    assert!(line.contains("at https://"), "{line}");
    eprintln!("{line}");
    let router = line
        .split("http://")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    for outcome in load(router, AT_ONCE, AT_ONCE) {
        assert_complete(&outcome);
    }
    assert_eq!(live_of(router), (Some(2), Some(2)));
    // The other routes, forwarded: a chat completion, the model list.
    let chat = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0});
    let (status, answer) = http(router, "POST", "/v1/chat/completions", &chat.to_string());
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 8, "{answer}");
    assert!(answer["choices"][0]["message"]["content"].is_string(), "{answer}");
    let models = get_json(router, "/v1/models");
    assert_eq!(models["data"][0]["object"], "model", "{models}");
}
