//! `archipelago serve --controller` (issue 41): a serving job placed on a host process of a
//! controller, as a user runs it. The client prints where the service listens on the host; the
//! fixture's GPT-2 answers there with `transformers`' greedy continuation; the controller's
//! dashboard lists the job (`/api/serving`, and the page's serving table in headless Chromium)
//! with its host, address and its replicas' figures (tokens generated, requests finished, cache
//! blocks). The client going away stops the job (the dashboard says stopped, the host's port
//! closes); a second job's host killed ends it with an error naming the host (the client exits
//! 1) and the dashboard marks it failed with why.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use archipelago_actors::text_tokens::codec;

use super::common::{BIN, Cluster, Proc, fixture, post_json as post, wait_for_line};
use super::{chromium, dump_dom, get, wait_until};

/// Starts `serve --controller` for job `job`; the client and the address its service listens on.
fn start_job(cluster: &Cluster, job: &str) -> (Child, String) {
    let log = std::fs::File::create(cluster.dir.path().join(format!("{job}.err"))).unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--controller", &cluster.addr, "--token-file"])
        .arg(cluster.dir.path().join("token"))
        .args(["--init", &fixture("gpt2/model.safetensors")])
        .args(["--tokenizer", &fixture("tokenizer/tokenizer.json")])
        .args(["--listen", "127.0.0.1:0", "--cache-tokens", "256", "--job", job])
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let line = wait_for_line(&mut child, "listening on http://");
    assert!(line.contains("on host `server`"), "{line}");
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    (child, addr.to_string())
}

/// The dashboard's entry for serving job `job`.
fn listed(dashboard: &str, job: &str) -> Value {
    let jobs: Vec<Value> = serde_json::from_str(&get(dashboard, "/api/serving")).unwrap();
    jobs.into_iter().find(|s| s["job"] == job).unwrap_or(Value::Null)
}

fn ids(value: &Value) -> Vec<u32> {
    (value.as_array().unwrap().iter())
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn a_serving_job_runs_on_a_host_and_the_dashboard_lists_it() {
    let (mut cluster, dashboard) = Cluster::start_with_dashboard(1.0, 30.0);
    cluster.add_host("server", "cpu:0");
    let (client, addr) = start_job(&cluster, "gpt2-tiny");
    let client = Proc(client);

    // The service on the host answers with transformers' greedy continuation.
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gpt2/expected.json")).unwrap()).unwrap();
    let (prompt, greedy) = (ids(&expected["prompt"]), ids(&expected["greedy"]));
    let (_, decode) = codec(Some(&fixture("tokenizer/tokenizer.json")), 320).unwrap();
    let request = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let (status, answer) = post(&addr, "/v1/completions", &request);
    assert_eq!(status, 200, "{answer}");
    let continuation = decode(&greedy[prompt.len()..]).unwrap();
    assert_eq!(answer["choices"][0]["text"], continuation.as_str());

    // The dashboard lists it: host, address, the replicas' figures.
    wait_until(
        "the dashboard's figures of the job",
        Duration::from_secs(30),
        || listed(&dashboard, "gpt2-tiny")["generated_tokens"] == 8,
    );
    let entry = listed(&dashboard, "gpt2-tiny");
    assert_eq!(entry["state"], "serving", "{entry}");
    assert_eq!(entry["host"], "server", "{entry}");
    assert_eq!(entry["url"], format!("http://{addr}"), "{entry}");
    assert_eq!(
        (entry["finished"].as_u64(), entry["blocks_total"].as_u64()),
        (Some(1), Some(16))
    );
    assert_eq!(entry["blocks_used"], 0, "{entry}");
    if let Some(browser) = chromium() {
        let dom = dump_dom(&browser, &format!("http://{dashboard}/"));
        let row = dom
            .split("data-job=\"gpt2-tiny\"")
            .nth(1)
            .expect("a serving row for the job");
        let row = row.split("</tr>").next().unwrap();
        for cell in ["server", &format!("http://{addr}"), "serving", "0 / 16"] {
            assert!(
                row.contains(&format!("<td>{cell}</td>")),
                "no `{cell}` in the row: {row}"
            );
        }
    }

    // A second job of the same name is refused while the first runs.
    let out = Command::new(BIN)
        .args(["serve", "--controller", &cluster.addr, "--token-file"])
        .arg(cluster.dir.path().join("token"))
        .args(["--init", &fixture("gpt2/model.safetensors"), "--job", "gpt2-tiny"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("`gpt2-tiny` already runs"),
        "{said}"
    );

    // The client goes away: the job stops and its port closes.
    drop(client);
    wait_until("the job stopped", Duration::from_secs(30), || {
        listed(&dashboard, "gpt2-tiny")["state"] == "stopped"
    });
    wait_until("the service's port closed", Duration::from_secs(30), || {
        TcpStream::connect(&addr).is_err()
    });

    // A second job loses its host: the client hears it, naming the host; the dashboard too.
    let (mut client, _) = start_job(&cluster, "second");
    let (_, mut host) = cluster.hosts.pop().unwrap();
    host.0.kill().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = client.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the client did not end after its host was killed"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = std::fs::read_to_string(cluster.dir.path().join("second.err")).unwrap();
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(said.contains("host `server`") && said.contains("lost"), "{said}");
    let entry = listed(&dashboard, "second");
    assert_eq!(entry["state"], "failed", "{entry}");
    assert!(
        entry["reason"].as_str().unwrap().contains("host `server`"),
        "{entry}"
    );
}
