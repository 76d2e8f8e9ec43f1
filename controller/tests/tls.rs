//! Mutual TLS between real processes of the `archipelago` binary on 127.0.0.1: certificates
//! made by `archipelago certs` and by openssl (without it, that test fails under CI and is
//! skipped elsewhere); a job across two hosts over TLS trains exactly as the same job in clear;
//! hosts without a certificate of the cluster's CA, or in clear, are refused at the handshake
//! and the refusal is logged with their address.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use archipelago_actors::fabric::DataPath;
use archipelago_actors::prerequisite;
use archipelago_controller::{TrainOptions, TrainReport};

use common::{BIN, Cluster, local, plan, program, tls_flags};

/// `archipelago certs --dir DIR --name …`, as a user runs it.
fn certs(dir: &Path, names: &[&str]) {
    let mut command = Command::new(BIN);
    command.args(["certs", "--dir"]).arg(dir);
    for name in names {
        command.args(["--name", name]);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "archipelago certs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn train(cluster: &Cluster, layout: archipelago_dataflow::ParallelPlan, data_path: DataPath) -> TrainReport {
    let options = TrainOptions {
        steps: 4,
        data_path,
        ..TrainOptions::default()
    };
    cluster
        .controller()
        .train(&program(layout), &options)
        .unwrap_or_else(|e| panic!("{data_path}: {e}"))
}

/// Every step's loss and every block's norm the same (bit for bit: same layout, same order of
/// reduction; TLS changes only how the bytes travel).
fn assert_identical(a: &TrainReport, b: &TrainReport, what: &str) {
    let losses = |r: &TrainReport| {
        r.steps
            .iter()
            .map(|s| (s.step, s.loss.to_bits()))
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(a), losses(b), "{what}: losses");
    assert_eq!(a.block_l2, b.block_l2, "{what}: block norms");
}

/// Every step's loss equals the same job's in one process (the cluster tests' contract).
fn assert_equals_one_process(run: &TrainReport, layout: archipelago_dataflow::ParallelPlan, what: &str) {
    let reference = local(layout, 4);
    assert_eq!(reference.steps.len(), run.steps.len(), "{what}: steps");
    for (a, b) in reference.steps.iter().zip(&run.steps) {
        let off = ((a.loss - b.loss) / a.loss).abs();
        assert!(off < 1e-6, "{what}: step {} {} vs {}", a.step, a.loss, b.loss);
    }
}

#[test]
fn a_two_host_job_over_mutual_tls_trains_exactly_as_in_clear() {
    let certs_dir = tempfile::tempdir().unwrap();
    certs(certs_dir.path(), &["controller", "h1", "h2", "client"]);
    let mut secure = Cluster::start_tls(5.0, 30.0, certs_dir.path());
    let mut clear = Cluster::start(5.0, 30.0);
    for cluster in [&mut secure, &mut clear] {
        cluster.add_host("h1", "cpu:0,cpu:1");
        cluster.add_host("h2", "cpu:0,cpu:1");
    }
    // Raw TCP and gRPC data paths, data parallel across the hosts and a pipeline with ZeRO-3.
    for (layout, what, data_path) in [
        (plan(4, 1, 0), "dp=4", DataPath::Tcp),
        (plan(2, 2, 3), "dp=2 pp=2 zero 3", DataPath::Grpc),
    ] {
        let over_tls = train(&secure, layout.clone(), data_path);
        let in_clear = train(&clear, layout.clone(), data_path);
        assert_identical(&over_tls, &in_clear, what);
        // And both equal the job in one process (the cluster tests' contract).
        assert_equals_one_process(&over_tls, layout, what);
    }
    // Nothing was refused along the way.
    let log = secure.controller_log();
    assert!(!log.contains("refused"), "controller log: {log}");
}

/// Starts a host of `cluster` with `flags` instead of the cluster's own TLS flags.
fn intruder(cluster: &Cluster, flags: &[String]) -> common::Proc {
    let mut command = Command::new(BIN);
    command
        .args(["host", "--controller", &cluster.addr, "--token-file"])
        .arg(cluster.dir.path().join("token"))
        .args(["--devices", "cpu:0", "--name", "intruder"])
        .args(flags)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    common::Proc(command.spawn().unwrap())
}

/// Whether `host` exits with an error within `within`, and what it said.
fn fails_within(host: &mut common::Proc, within: Duration) -> (bool, String) {
    let started = Instant::now();
    while started.elapsed() < within {
        if let Some(status) = host.0.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(host.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
            return (!status.success(), stderr);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (false, "still running".into())
}

#[test]
fn hosts_without_the_clusters_certificate_are_refused_and_logged() {
    let certs_dir = tempfile::tempdir().unwrap();
    certs(certs_dir.path(), &["controller", "h1", "client"]);
    let foreign = tempfile::tempdir().unwrap();
    certs(foreign.path(), &["intruder"]);
    // The intruder trusts the cluster's CA (so it would accept the controller) but shows a
    // certificate another CA signed.
    std::fs::copy(
        certs_dir.path().join("ca.pem"),
        foreign.path().join("cluster-ca.pem"),
    )
    .unwrap();
    let mut foreign_flags = tls_flags(foreign.path(), "intruder");
    foreign_flags[5] = foreign
        .path()
        .join("cluster-ca.pem")
        .to_string_lossy()
        .into_owned();
    let mut cluster = Cluster::start_tls(5.0, 5.0, certs_dir.path());
    let mut intruders = [
        ("with a foreign certificate", intruder(&cluster, &foreign_flags)),
        ("in clear", intruder(&cluster, &[])),
    ];
    for (who, host) in &mut intruders {
        // Refused at once, not after the 30 s a host waits for a controller that is not up yet.
        let (failed, stderr) = fails_within(host, Duration::from_secs(20));
        assert!(failed, "a host {who} was not refused: {stderr}");
        assert!(
            stderr.contains("could not be reached") || stderr.contains("refused the session"),
            "a host {who} said: {stderr}"
        );
    }
    let log = cluster.controller_log();
    assert!(
        log.matches("refused a connection at the TLS handshake").count() >= 2,
        "controller log: {log}"
    );
    assert!(log.contains("127.0.0.1:"), "the refusal names no peer: {log}");
    // The negative control: a host with the cluster's certificate joins and trains.
    cluster.add_host("h1", "cpu:0");
    let report = train(&cluster, plan(1, 1, 0), DataPath::Tcp);
    assert_eq!(report.steps.len(), 4);
}

/// The PEM files of a cluster made with openssl (RSA keys, where `archipelago certs` makes
/// ECDSA ones): a CA and a certificate per name, valid for 127.0.0.1 as server and client.
fn openssl_certs(dir: &Path, names: &[&str]) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl (scripts/test.sh installs it)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=openssl test CA",
    ]);
    std::fs::write(
        dir.join("leaf.cnf"),
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
         extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    for name in names {
        let (key, csr, pem) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ]);
        run(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            "leaf.cnf",
        ]);
    }
}

#[test]
fn certificates_made_by_openssl_work_the_same() {
    let fix = "install Debian's openssl (scripts/test.sh does, as root or with sudo)";
    if prerequisite::require(prerequisite::on_path("openssl"), fix).is_none() {
        return;
    }
    let certs_dir = tempfile::tempdir().unwrap();
    openssl_certs(certs_dir.path(), &["controller", "h1", "h2", "client"]);
    let mut cluster = Cluster::start_tls(5.0, 30.0, certs_dir.path());
    cluster.add_host("h1", "cpu:0");
    cluster.add_host("h2", "cpu:0");
    let run = train(&cluster, plan(2, 1, 0), DataPath::Tcp);
    assert_equals_one_process(&run, plan(2, 1, 0), "dp=2");
}

/// Hosts that advertise a DNS name (`--advertise localhost`, which every certificate of
/// `archipelago certs` names) are dialled by it, and TLS checks the name: the job trains as in
/// one process, and the controller shows the advertised addresses.
#[test]
fn hosts_advertising_a_name_are_dialled_and_verified_by_it() {
    let certs_dir = tempfile::tempdir().unwrap();
    certs(certs_dir.path(), &["controller", "h1", "h2", "client"]);
    let mut cluster = Cluster::start_tls(5.0, 30.0, certs_dir.path());
    for name in ["h1", "h2"] {
        let mut host = cluster
            .host_command(name, "cpu:0", cluster.dir.path().join("token"))
            .args(["--advertise", "localhost"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let line = common::wait_for_line(&mut host, "registered with the controller");
        assert!(line.contains("(fabric localhost:"), "{line}");
        cluster.hosts.push((name.to_string(), common::Proc(host)));
    }
    let run = train(&cluster, plan(2, 1, 0), DataPath::Tcp);
    assert_equals_one_process(&run, plan(2, 1, 0), "dp=2");
}
