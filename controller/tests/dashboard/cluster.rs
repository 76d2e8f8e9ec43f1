//! The controller's dashboard over two host processes (`h1`, `h2`, each offering `cpu:0`), in
//! headless Chromium: a dp=2 job's timeline names its lanes `h1/cpu:0` and `h2/cpu:0`; then a
//! job restarting on failure loses `h2` to SIGKILL mid-run: `h2` stays in the cluster table
//! marked lost, with when (and in `/api/cluster` with the time and the reason), the restart is
//! marked on the loss chart, and the job goes on to the end on `h1`.

use std::process::Command;
use std::sync::Arc;

use archipelago_controller::{StepProgress, TrainOptions};

use super::common::{Cluster, plan, program};
use super::{chromium, dom, dump_dom, get};

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Options of a job of `steps` that checkpoints every 2 steps into `dir`, restarts on a lost
/// host and SIGKILLs process `pid` after step `kill_at`.
fn killing(job: &str, steps: u64, dir: std::path::PathBuf, kill_at: u64, pid: u32) -> TrainOptions {
    let on_step = Arc::new(move |p: &StepProgress| {
        if p.step == kill_at {
            let killed = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status()
                .unwrap();
            assert!(killed.success(), "the kill of pid {pid} failed");
        }
    });
    TrainOptions {
        steps,
        job: job.into(),
        on_step: Some(on_step),
        checkpoint_dir: Some(dir),
        checkpoint_every: 2,
        restart_on_failure: true,
        ..TrainOptions::default()
    }
}

#[test]
fn lanes_are_named_by_host_and_a_lost_host_stays_marked_lost() {
    let Some(browser) = chromium() else {
        return;
    };
    let (mut cluster, dashboard) = Cluster::start_with_dashboard(5.0, 1.0);
    let url = format!("http://{dashboard}/");
    cluster.add_host("h1", "cpu:0");
    let pid = cluster.add_host("h2", "cpu:0");
    let both = TrainOptions {
        steps: 3,
        job: "two-hosts".into(),
        ..TrainOptions::default()
    };
    cluster
        .controller()
        .train(&program(plan(2, 1, 0)), &both)
        .unwrap();
    let dom = dump_dom(&browser, &url);
    assert_eq!(
        dom::lane_names(&dom),
        ["h1/cpu:0", "h2/cpu:0"],
        "the lanes are not named by host"
    );
    let legend = dom::legend(&dom);
    assert!(
        legend.iter().any(|c| c == "all-reduce"),
        "no all-reduce in the legend {legend:?}"
    );
    assert!(
        dom::host_row(&dom, "h2").contains("class=\"host-state\">live"),
        "h2 is not live"
    );

    let before_kill = unix_now();
    let options = killing("loses-h2", 40, cluster.dir.path().join("checkpoints"), 3, pid);
    let run = cluster
        .controller()
        .train(&program(plan(2, 1, 0)), &options)
        .unwrap();
    assert_eq!(run.restarts.len(), 1, "{:?}", run.restarts);
    let dom = dump_dom(&browser, &url);
    let h2 = dom::host_row(&dom, "h2");
    assert!(
        h2.starts_with("class=\"host host-lost\""),
        "h2 is not marked lost: {h2}"
    );
    assert!(
        dom::has_clock_after(h2, "lost at "),
        "h2 does not say when it was lost: {h2}"
    );
    assert!(
        h2.contains("host `h2`"),
        "h2's row does not say why it was lost: {h2}"
    );
    let h1 = dom::host_row(&dom, "h1");
    assert!(h1.starts_with("class=\"host\""), "h1 is not live: {h1}");
    assert!(
        h1.contains("data-device=\"cpu:0\">cpu:0: "),
        "no memory for h1's cpu:0: {h1}"
    );
    assert_eq!(
        dom::lane_names(&dom),
        ["h1/cpu:0"],
        "after the restart the job runs on h1 alone"
    );
    let marker = dom::part(&dom, "class=\"restart-marker\"", "</g>");
    assert!(
        marker.contains("restart 1 after step"),
        "no restart on the chart: {marker}"
    );
    assert!(
        dom.contains("class=\"state-finished\">finished"),
        "the job did not finish"
    );

    let hosts: serde_json::Value = serde_json::from_str(&get(&dashboard, "/api/cluster")).unwrap();
    let lost = (hosts.as_array().unwrap().iter())
        .find(|h| h["name"] == "h2")
        .expect("h2 in /api/cluster");
    assert_eq!(lost["state"], "lost", "{lost}");
    let at = lost["lost_unix_s"].as_f64().unwrap();
    assert!(
        at >= before_kill && at <= unix_now(),
        "lost at {at}, killed after {before_kill}"
    );
    assert!(lost["lost_reason"].as_str().unwrap().contains("lost"), "{lost}");
    let job: serde_json::Value = serde_json::from_str(&get(&dashboard, "/api/job")).unwrap();
    assert_eq!(job["restarts"].as_array().map(Vec::len), Some(1), "{job}");
}
