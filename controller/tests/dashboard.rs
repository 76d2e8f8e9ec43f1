//! The dashboard in a real browser: `archipelago train --dashboard` serves the page, headless
//! Chromium (Debian's `chromium`, which `scripts/test.sh` — the README's test command — installs
//! when missing; the test prints its version; without it the test fails under CI and is skipped
//! elsewhere, saying so) loads it while the job runs and after it ends, and the DOM has the loss
//! chart with its step, loss and learning-rate axes (ticks with values) and a point per step
//! whose hover text gives the step's loss and learning rate as `/api/job` has them; the timeline
//! with one lane per actor named host/device, a legend of the colours it draws and a time axis;
//! the cluster table with each device's memory. The server-sent events and the JSON endpoints
//! carry the same state. `cluster` (in `dashboard/cluster.rs`): two host processes of a
//! controller, lanes named by each host, one host killed: it stays in the table marked lost,
//! with when, and the restart is marked on the chart. `access` (in `dashboard/access.rs`):
//! nothing listens openly (loopback open, other addresses need the token). `serving` (in
//! `dashboard/serving.rs`): a serving job placed on a host by `serve --controller`, listed with
//! its figures, stopped with its client, failed with its host.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_archipelago");

#[path = "dashboard/access.rs"]
mod access;
#[path = "dashboard/cluster.rs"]
mod cluster;
mod common;
#[path = "dashboard/dom.rs"]
mod dom;
#[path = "dashboard/serving.rs"]
mod serving;

use common::{chromium, dump_dom};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The body of `GET path` from `addr`.
fn get(addr: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// The first server-sent event's data from `/events`.
fn first_event(addr: &str) -> serde_json::Value {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(stream, "GET /events HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    for line in BufReader::new(stream).lines() {
        let line = line.unwrap();
        if let Some(data) = line.strip_prefix("data:") {
            return serde_json::from_str(data.trim()).unwrap();
        }
    }
    panic!("the event stream ended without an event");
}

fn job_state(addr: &str) -> serde_json::Value {
    serde_json::from_str(&get(addr, "/api/job")).unwrap()
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn assert_rendered(dom: &str, state: &str, when: &str) {
    for actor in 0..4 {
        assert!(
            dom.contains(&format!("class=\"lane\" data-actor=\"{actor}\"")),
            "{when}: no lane for actor {actor}"
        );
    }
    assert!(
        dom.contains("class=\"span cat-forward\""),
        "{when}: no forward spans on the lanes"
    );
    let points = dom
        .split("id=\"loss-curve\"")
        .nth(1)
        .and_then(|rest| rest.split("points=\"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_default();
    assert!(
        points.split(' ').count() >= 2,
        "{when}: the loss curve has no line ({points:?})"
    );
    assert!(
        dom.contains(&format!("class=\"state-{state}\">{state}")),
        "{when}: the page does not say `{state}`"
    );
    assert!(
        dom.contains("<td>cpu:0, cpu:1, cpu:2, cpu:3</td>"),
        "{when}: no cluster table"
    );
    let lanes = dom::lane_names(dom);
    assert_eq!(
        lanes,
        ["local/cpu:0", "local/cpu:1", "local/cpu:2", "local/cpu:3"],
        "{when}: the lanes are not named host/device"
    );
    let legend = dom::legend(dom);
    for cat in ["forward", "backward", "send", "recv", "all-reduce", "optimizer"] {
        assert!(
            legend.iter().any(|c| c == cat),
            "{when}: no {cat} in the legend {legend:?}"
        );
    }
    let ms = dom::ticks(dom, "timeline-axis");
    assert_eq!(ms[0], 0.0, "{when}: the time axis starts at {}", ms[0]);
    assert!(
        dom::part(dom, "id=\"timeline-axis\"", "</g>").contains("(ms)"),
        "{when}: the time axis does not say its unit"
    );
    let memory = dom::host_row(dom, "local");
    for device in 0..4 {
        assert!(
            memory.contains(&format!("data-device=\"cpu:{device}\">cpu:{device}: ")),
            "{when}: no memory for cpu:{device} in {memory}"
        );
    }
}

/// Whether `a` and `b` agree to the 5 significant digits the page prints.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-4 * b.abs().max(1e-12)
}

/// The loss chart has step, loss and learning-rate axes with ticks, and its points' hover texts
/// give `job`'s (`/api/job`, read after the page) losses and learning rates, inside the axes.
fn assert_chart(dom: &str, job: &serde_json::Value, when: &str) {
    let steps = dom::ticks(dom, "loss-x-axis");
    let total = job["steps"].as_f64().unwrap();
    assert!(
        steps[0] <= 1.0 && *steps.last().unwrap() >= total,
        "{when}: the step axis {steps:?} does not span the job's {total} steps"
    );
    let loss_axis = dom::ticks(dom, "loss-y-axis");
    let lr_axis = dom::ticks(dom, "lr-axis");
    let points = dom::points(dom);
    assert!(points.len() >= 3, "{when}: {} points on the chart", points.len());
    let losses = job["losses"].as_array().unwrap();
    let lrs = job["lrs"].as_array().unwrap();
    for p in &points {
        let i = losses
            .iter()
            .position(|l| l[0].as_u64() == Some(p.step))
            .unwrap_or_else(|| panic!("{when}: step {} is on the chart, not in /api/job", p.step));
        let (loss, lr) = (losses[i][1].as_f64().unwrap(), lrs[i].as_f64().unwrap());
        assert!(
            close(p.loss, loss),
            "{when}: step {}: loss {} on the chart, {loss} in /api/job",
            p.step,
            p.loss
        );
        assert!(
            p.lr.is_some_and(|v| close(v, lr)),
            "{when}: step {}: lr {:?}, {lr} in /api/job",
            p.step,
            p.lr
        );
        let inside = |v: f64, axis: &[f64]| axis[0] <= v && v <= axis[axis.len() - 1];
        assert!(
            inside(p.loss, &loss_axis),
            "{when}: loss {} outside the axis {loss_axis:?}",
            p.loss
        );
        assert!(
            inside(lr, &lr_axis),
            "{when}: lr {lr} outside the axis {lr_axis:?}"
        );
    }
    assert!(
        (points.windows(2)).any(|w| w[0].lr != w[1].lr),
        "{when}: the cosine schedule's learning rate does not change along the chart"
    );
}

#[test]
fn the_dashboard_renders_lanes_and_the_loss_curve_while_the_job_runs_and_after() {
    let Some(browser) = chromium() else {
        return;
    };
    let mut child = Command::new(BIN)
        .args([
            "train",
            "--model",
            "mlp:in=64,hidden=256,layers=6,out=10",
            "--dp",
            "2",
            "--pp",
            "2",
        ])
        .args(["--microbatches", "4", "--steps", "300", "--quiet"])
        .args(["--lr-schedule", "cosine", "--warmup-steps", "10"])
        .args(["--dashboard", "127.0.0.1:0", "--dashboard-linger-s", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _job = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    let addr = lines
        .by_ref()
        .map(|l| l.unwrap())
        .find_map(|l| {
            l.strip_prefix("dashboard at http://")
                .map(|a| a.trim_end_matches('/').to_string())
        })
        .expect("the dashboard address");
    std::thread::spawn(move || lines.for_each(drop));
    let url = format!("http://{addr}/");

    wait_until("step 3", Duration::from_secs(60), || {
        job_state(&addr)["step"].as_u64() >= Some(3)
    });
    let event = first_event(&addr);
    assert!(event["job"]["step"].as_u64() >= Some(3), "event: {event}");
    assert_eq!(event["timeline"]["lanes"].as_array().map(Vec::len), Some(4));
    let running = dump_dom(&browser, &url);
    assert_rendered(&running, "running", "while running");
    assert_chart(&running, &job_state(&addr), "while running");

    wait_until("the end of the job", Duration::from_secs(240), || {
        job_state(&addr)["state"] == "finished"
    });
    let finished = dump_dom(&browser, &url);
    assert_rendered(&finished, "finished", "after the end");
    let job = job_state(&addr);
    assert_chart(&finished, &job, "after the end");
    assert_eq!(
        dom::points(&finished).len(),
        300,
        "after the end: a point per step"
    );
    assert!(
        finished.contains("step 300 / 300"),
        "after the end: the last step is not shown"
    );
    let cluster: serde_json::Value = serde_json::from_str(&get(&addr, "/api/cluster")).unwrap();
    assert_eq!(cluster[0]["devices"].as_array().map(Vec::len), Some(4));
    let timeline: serde_json::Value = serde_json::from_str(&get(&addr, "/api/timeline")).unwrap();
    assert_eq!(timeline["steps"], serde_json::json!([298, 299, 300]));
}

mod runtime_actors {
    //! The dashboard of a program on the runtime API: its actors with their message rates, a
    //! panic among the failures, the table rendered by headless Chromium.

    use std::time::Duration;

    use archipelago_controller::prelude::*;
    use archipelago_controller::runtime::serve_dashboard;
    use serde::{Deserialize, Serialize};

    use super::{chromium, dump_dom, get, wait_until};

    struct Pinger;
    impl Actor for Pinger {
        type Params = ();
        async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
            Ok(Pinger)
        }
    }
    #[derive(Serialize, Deserialize)]
    struct Ping(u64);
    impl Message for Ping {
        type Reply = u64;
    }
    impl Handler<Ping> for Pinger {
        async fn handle(&mut self, Ping(n): Ping, _ctx: &Context<Self>) -> u64 {
            n
        }
    }
    #[derive(Serialize, Deserialize)]
    struct Crash;
    impl Message for Crash {
        type Reply = ();
    }
    impl Handler<Crash> for Pinger {
        async fn handle(&mut self, _: Crash, _ctx: &Context<Self>) {
            panic!("told to crash");
        }
    }

    #[test]
    fn the_dashboard_lists_user_actors_with_rates_and_failures() {
        let Some(browser) = chromium() else {
            return;
        };
        // The program's types, as a cluster needs them (strict registration mode checks them).
        Registry::new()
            .actor::<Pinger>()
            .handles::<Pinger, Ping>()
            .handles::<Pinger, Crash>()
            .install();
        let runtime = Runtime::local(DeviceSpec::cpus(2));
        let busy = runtime
            .spawn_with::<Pinger>(DeviceSpec::Cpu(0), (), SpawnOptions::named("busy").restarts(1))
            .get()
            .unwrap();
        let _idle = runtime.spawn::<Pinger>(DeviceSpec::Cpu(1), ()).get().unwrap();
        let (addr, _dashboard) = serve_dashboard(&runtime, "127.0.0.1:0").unwrap();
        let addr = addr.to_string();
        assert!(busy.call(Crash).get().is_err());
        let actors = || -> serde_json::Value { serde_json::from_str(&get(&addr, "/api/actors")).unwrap() };
        // The dashboard serves sampled figures: a sample taken while the crash was being handled
        // shows the call but not yet the failure, so wait for a sample that has both.
        wait_until(
            "a call rate and the failure on the busy actor",
            Duration::from_secs(20),
            || {
                for n in 0..200 {
                    busy.call(Ping(n)).get().unwrap();
                }
                let view = actors();
                view.as_array().is_some_and(|a| {
                    a.len() == 2
                        && a[0]["name"] == "busy"
                        && a[0]["calls_per_s"].as_f64().unwrap_or(0.0) > 0.0
                        && a[0]["failures"] == 1
                })
            },
        );
        let view = actors();
        assert_eq!(view[0]["failures"], 1, "{view}");
        assert_eq!(view[0]["restarts"], 1, "{view}");
        assert_eq!(view[0]["state"], "running", "{view}");
        assert_eq!(view[1]["calls_per_s"], 0.0, "{view}");
        let failures = get(&addr, "/api/failures");
        assert!(
            failures.contains("\\\"busy\\\" (`Pinger`)") && failures.contains("panicked"),
            "{failures}"
        );
        let dom = dump_dom(&browser, &format!("http://{addr}/"));
        assert_eq!(dom.matches("class=\"actor\"").count(), 2, "{dom}");
        assert!(
            dom.contains("<td>busy</td><td>Pinger</td><td>local</td><td>cpu:0</td>"),
            "{dom}"
        );
    }
}
