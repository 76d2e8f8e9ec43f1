//! A cluster job asking for more devices than the hosts offer: the client is told, every few
//! seconds while the controller waits for hosts (`--wait-for-hosts-s`), how many devices the job
//! waits for and how many the hosts offer; then the job is refused naming the shortfall — never
//! a silent wait.

mod common;

use std::process::Command;

use common::{BIN, Cluster, MLP};

#[test]
fn a_job_too_big_for_the_hosts_says_what_it_waits_for() {
    let mut cluster = Cluster::start(5.0, 7.0);
    cluster.add_host("h1", "cpu:0");
    let token = cluster.dir.path().join("token");
    let out = Command::new(BIN)
        .args([
            "train", "--model", MLP, "--dp", "2", "--batch", "4", "--steps", "1",
        ])
        .args(["--controller", &cluster.addr, "--token-file"])
        .arg(&token)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a dp=2 job ran on one device:\n{stdout}{stderr}"
    );
    assert!(
        stdout.contains("waiting for 2 devices; 1 host offers 1"),
        "no word while waiting:\n{stdout}{stderr}"
    );
    assert!(
        stderr.contains("the job needs 2 devices (dp 2 × pp 1) and the registered hosts offer 1")
            && stderr.contains("start more `archipelago host`s or lower --dp"),
        "{stderr}"
    );
}
