//! A slow link (issue 43): a controller, two host processes and the `train` client inside a
//! network namespace of their own (`unshare -n`), over its loopback shaped by `tc tbf` to
//! 100 Mbit/s, `--data-path tcp` (`bench::slow_link`). A dp=2 job there equals the same job
//! embedded in one process (every loss and block norm, bit for bit); every fabric byte the
//! report measured passed the shaped qdisc, which held packets back; with `--compress topk:0.01`
//! the fabric moves ≥ 25× fewer gradient bytes and the link carries ≥ 10× fewer. The negative
//! control: the same job with `--data-path shm` (what `auto` picks between processes of one
//! kernel) passes far fewer bytes through the qdisc than the fabric moved, and the check that
//! the fabric's bytes crossed the link catches it. Steps per second are the bench's
//! (`bench --slow-link-only`), not asserted here.
//!
//! Needs root and iproute2 (`scripts/test.sh` installs it): under CI it runs and fails if it
//! cannot; elsewhere it is skipped, saying why.

use std::process::Command;

use archipelago_actors::fabric::DataPath;
use archipelago_actors::prerequisite;
use archipelago_controller::TrainReport;
use archipelago_controller::bench::slow_link::{self, SlowLinkRun};

const BIN: &str = env!("CARGO_BIN_EXE_archipelago");
/// Big enough that a step's gradients (0.86 MB per replica) overflow the 256 KiB bucket.
const JOB: &[&str] = &[
    "--model",
    "mlp:in=64,hidden=256,layers=4,out=8",
    "--dp",
    "2",
    "--steps",
    "4",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
];
const RATE_MBIT: u32 = 100;

fn job(extra: &[&str]) -> Vec<String> {
    JOB.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// The job over the slow link with the hosts' `data_path`.
fn over_link(extra: &[&str], data_path: DataPath, dir: &std::path::Path) -> SlowLinkRun {
    slow_link::run(std::path::Path::new(BIN), RATE_MBIT, data_path, &job(extra), dir)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// The same job embedded in one process.
fn embedded(extra: &[&str], dir: &std::path::Path) -> TrainReport {
    let report = dir.join("embedded.json");
    let status = Command::new(BIN)
        .arg("train")
        .args(job(extra))
        .args(["--quiet", "--report"])
        .arg(&report)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the embedded run failed");
    serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap()
}

/// Gradient bytes the report's actors moved over the fabric in the whole run.
fn fabric_bytes(report: &TrainReport) -> u64 {
    let per_step: u64 = report
        .actors
        .iter()
        .map(|a| a.fabric_bytes_per_step.gradients)
        .sum();
    per_step * report.steps.len() as u64
}

/// Whether every fabric byte of `run` crossed the shaped link (the qdisc counts controller
/// traffic too, so it sees at least as many).
fn crossed_the_link(run: &SlowLinkRun) -> Result<(), String> {
    let fabric = fabric_bytes(&run.report);
    if run.link.sent_bytes >= fabric {
        Ok(())
    } else {
        Err(format!(
            "the fabric moved {fabric} bytes but only {} passed the link's qdisc",
            run.link.sent_bytes
        ))
    }
}

fn assert_same_run(reference: &TrainReport, run: &TrainReport, what: &str) {
    let losses = |r: &TrainReport| r.steps.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(losses(reference), losses(run), "{what}: losses differ");
    let norms = |r: &TrainReport| r.block_l2.iter().map(|n| n.to_bits()).collect::<Vec<_>>();
    assert_eq!(norms(reference), norms(run), "{what}: block norms differ");
}

#[test]
fn a_job_over_a_100_mbit_link_equals_one_process_and_top_k_crosses_it_in_fewer_bytes() {
    if prerequisite::require(
        slow_link::available(),
        "run as root with iproute2 installed (scripts/test.sh installs it)",
    )
    .is_none()
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();

    let dense = over_link(&[], DataPath::Tcp, &dir.path().join("dense"));
    assert_same_run(
        &embedded(&[], dir.path()),
        &dense.report,
        "uncompressed over the link",
    );
    crossed_the_link(&dense).unwrap();
    assert!(
        dense.link.overlimits > 0,
        "the bucket never held a packet back: {:?}",
        dense.link
    );

    let topk = over_link(
        &["--compress", "topk:0.01"],
        DataPath::Tcp,
        &dir.path().join("topk"),
    );
    assert_same_run(
        &embedded(&["--compress", "topk:0.01"], dir.path()),
        &topk.report,
        "top-k over the link",
    );
    crossed_the_link(&topk).unwrap();
    let fewer = fabric_bytes(&dense.report) as f64 / fabric_bytes(&topk.report) as f64;
    assert!(
        fewer >= 25.0,
        "top-k 1% moved only {fewer:.1}x fewer gradient bytes"
    );
    let lighter = dense.link.sent_bytes as f64 / topk.link.sent_bytes as f64;
    assert!(
        lighter >= 10.0,
        "the link carried only {lighter:.1}x fewer bytes under top-k"
    );
    eprintln!(
        "over {RATE_MBIT} Mbit/s: uncompressed {:?}, top-k 1% {:?}; {fewer:.1}x fewer fabric bytes, \
         {lighter:.1}x fewer on the link",
        dense.link, topk.link
    );

    // The negative control: shared memory bypasses the qdisc, and the check sees it.
    let shm = over_link(&[], DataPath::Shm, &dir.path().join("shm"));
    assert_same_run(&dense.report, &shm.report, "shared memory");
    let caught = crossed_the_link(&shm).expect_err("shared memory passed no qdisc: the check must catch it");
    eprintln!("negative control caught: {caught}");
}

/// `bench-slow-link` shapes the loopback of its namespace: outside one of its own (here, the
/// machine's) it refuses before touching anything.
#[test]
fn the_inner_part_refuses_the_machines_own_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["bench-slow-link", "--rate-mbit", "100", "--dir"])
        .arg(dir.path())
        .args(["--", "--model", "mlp-8x1024"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("unshare -n archipelago bench-slow-link"),
        "{stderr}"
    );
    if let Ok(qdisc) = Command::new("tc").args(["qdisc", "show", "dev", "lo"]).output() {
        let qdisc = String::from_utf8_lossy(&qdisc.stdout);
        assert!(
            !qdisc.contains("tbf"),
            "the machine's loopback was shaped: {qdisc}"
        );
    }
}
