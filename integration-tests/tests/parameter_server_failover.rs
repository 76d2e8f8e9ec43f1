//! Chain replication and failover of the parameter server (`archipelago_actors::ps`, driven by
//! `archipelago_controller::ps_job`) across real processes: a controller and one host per
//! server and per worker, each a process of this test binary (the test that starts them, run
//! again in a child role: `archipelago_actors::prerequisite::child_of_this_test`), talking TCP
//! on 127.0.0.1. A server's host is SIGKILLed mid-run:
//!
//! - with 2 replicas the job goes on, every range is back on 2 servers (the seconds from the kill
//!   are printed as JSON), and with a plain SGD server update the final weights are exactly the
//!   initial ones (0) minus lr × the sum of the pushes the workers saw acknowledged; the same
//!   comparison against one worker's acknowledged pushes only fails (negative control);
//! - with 1 replica the same kill loses a range, and the job stops with an error naming it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use archipelago_actors::prerequisite;
use archipelago_actors::ps::checkpoint::{read_manifest, read_server_file};
use archipelago_actors::ps::server::ServerFault;
use archipelago_actors::ps::{BuiltinUpdate, Consistency, CtrSpec, Initializer};
use archipelago_controller::ps_job::{FinalModel, PsJob, PsModel, PsOutcome, run};
use archipelago_controller::runtime::{
    CONTROLLER_ENV, DEVICES_ENV, HOST_NAME_ENV, ISLAND_ENV, ROLE_ENV, TOKEN_FILE_ENV, connect,
};
use archipelago_dataflow::OptimizerSpec;

const TOKEN: &str = "ps-failover-token";
const LR: f32 = 0.5;
const SERVERS: usize = 3;
const WORKERS: usize = 2;

/// In a controller or host process that [`helper`] started (this test binary again, running
/// only the test that started it), plays that part and says so; in the test itself, `false`.
/// Every test that starts a [`Cluster`] asks it first.
fn played_a_helper_role() -> bool {
    let Some(role) = prerequisite::child_role() else {
        return false;
    };
    match role.as_str() {
        "controller" => {
            let args = archipelago_controller::cluster::commands::ControllerArgs {
                listen: "127.0.0.1:0".into(),
                token_file: std::env::var(TOKEN_FILE_ENV).unwrap().into(),
                host_timeout_s: 2.0,
                wait_for_hosts_s: 20.0,
                dashboard: None,
                health: None,
                tls: Default::default(),
            };
            archipelago_controller::cluster::commands::controller(&args).unwrap();
        }
        "host" => {
            let registry = archipelago_controller::ps_job::cli::registry();
            archipelago_controller::runtime::init(registry, Vec::new()).unwrap();
        }
        other => panic!("no helper role `{other}` in this test binary"),
    }
    true
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A controller and one single-device host per name, all processes of this binary.
struct Cluster {
    dir: tempfile::TempDir,
    addr: String,
    hosts: Vec<(String, Proc)>,
    _controller: Proc,
}

/// The calling test again in a child process playing `role` (`controller` or `host`).
fn helper(role: &str, dir: &std::path::Path, log: &str) -> Command {
    let mut command = prerequisite::child_of_this_test(role);
    command
        .env(TOKEN_FILE_ENV, dir.join("token"))
        .stderr(std::fs::File::create(dir.join(log)).unwrap());
    command
}

impl Cluster {
    fn start(hosts: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), TOKEN).unwrap();
        let mut controller = helper("controller", dir.path(), "controller.log")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(controller.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("the controller printed its address").unwrap();
            // libtest's "test <name> ... " may come first on the line.
            if let Some((_, addr)) = line.split_once("controller listening on ") {
                break addr.trim().to_string();
            }
        };
        std::thread::spawn(move || lines.for_each(drop));
        let hosts = hosts
            .iter()
            .map(|name| {
                let child = helper("host", dir.path(), &format!("{name}.log"))
                    .env(ROLE_ENV, "host")
                    .env(CONTROLLER_ENV, &addr)
                    .env(DEVICES_ENV, "cpu:0")
                    .env(HOST_NAME_ENV, name)
                    .env(ISLAND_ENV, "island-a")
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap();
                (name.to_string(), Proc(child))
            })
            .collect();
        Cluster {
            dir,
            addr,
            hosts,
            _controller: Proc(controller),
        }
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn job(replicas: usize, clocks: u64) -> PsJob<BuiltinUpdate> {
    job_under(replicas, clocks, Consistency::Eventual)
}

fn job_under(replicas: usize, clocks: u64, consistency: Consistency) -> PsJob<BuiltinUpdate> {
    PsJob {
        model: PsModel::SparseLr(CtrSpec {
            seed: 5,
            features: 20_000,
            draws: 20,
            support: 50,
        }),
        update: BuiltinUpdate::from_spec(OptimizerSpec::sgd(LR), 0.0, Initializer::Zeros).unwrap(),
        servers: SERVERS,
        workers: WORKERS,
        replicas,
        vnodes: 16,
        consistency,
        local_batch: 32,
        clocks,
        delay_ms: vec![4; WORKERS],
        checkpoint_dir: None,
        resume: None,
        // Also makes every worker log the sum of its acknowledged pushes.
        log_clocks: true,
        key_caching: true,
        filter: None,
        fault: ServerFault::None,
        fail_at: None,
    }
}

/// Runs `job` on the cluster's hosts (servers on the first three slots, workers on the next),
/// SIGKILLs the host of server 1 while it runs; returns the outcome, the killed host and when.
fn run_and_kill(
    cluster: &mut Cluster,
    job: &PsJob<BuiltinUpdate>,
) -> (anyhow::Result<PsOutcome>, String, f64) {
    archipelago_controller::ps_job::cli::registry().install();
    let runtime = connect(&cluster.addr, TOKEN, job.devices()).unwrap();
    let slots = runtime.slots();
    let victim = slots[1].host.clone();
    assert!(
        slots.iter().filter(|s| s.host == victim).count() == 1,
        "server 1's host runs nothing else: {slots:?}"
    );
    let at = cluster.hosts.iter().position(|(n, _)| *n == victim).unwrap();
    let mut host = cluster.hosts.remove(at).1;
    let done = Arc::new(AtomicBool::new(false));
    let killer = {
        let done = done.clone();
        std::thread::spawn(move || {
            // Mid-run: the job is hundreds of clocks of at least 4 ms each.
            std::thread::sleep(Duration::from_millis(1500));
            if done.load(Ordering::SeqCst) {
                return None;
            }
            host.0.kill().unwrap();
            let killed_at = unix_now();
            drop(host);
            Some(killed_at)
        })
    };
    let outcome = run(&runtime, job);
    done.store(true, Ordering::SeqCst);
    let Some(killed_at) = killer.join().unwrap() else {
        let summary = outcome.map(|ps| ps.losses.len());
        panic!("the job ended before the kill ({summary:?}): give it more clocks");
    };
    (outcome, victim, killed_at)
}

/// Compares the final weights with 0 − lr × Σ `acked`; the largest difference, or what is off.
/// How far the servers' weights lie from plain SGD over the acknowledged pushes: the worst
/// key's excess over the tolerance `1e-4·(1 + |w|)` (at most 1 passes) and its values.
#[derive(Debug, Default)]
struct SgdCheck {
    excess: f32,
    max_abs_diff: f32,
    worst: String,
}

fn check_sgd(weights: &HashMap<u64, f32>, acked: &[&[(u64, Vec<f32>)]]) -> SgdCheck {
    let mut expected: HashMap<u64, f32> = HashMap::new();
    for run in acked {
        for (key, sum) in run.iter() {
            *expected.entry(*key).or_default() -= LR * sum[0];
        }
    }
    let mut check = SgdCheck::default();
    for key in weights.keys().chain(expected.keys()) {
        let (got, want) = (
            weights.get(key).copied().unwrap_or(0.0),
            expected.get(key).copied().unwrap_or(0.0),
        );
        let d = (got - want).abs();
        let excess = d / (1e-4 * (1.0 + want.abs()));
        if excess > check.excess {
            check.excess = excess;
            check.worst = format!("key {key}: {got} on the servers, {want} from the acknowledged pushes");
        }
        check.max_abs_diff = check.max_abs_diff.max(d);
    }
    check
}

#[test]
fn a_server_host_sigkilled_mid_run_fails_over_and_loses_no_acknowledged_push() {
    if played_a_helper_role() {
        return;
    }
    fails_over_and_loses_no_acknowledged_push(Consistency::Eventual);
}

/// Under bounded delay the servers keep the pushes of clocks not yet applied: a failover hands
/// them over with their ranges, and a range applies a clock once every worker's push reached it.
#[test]
fn under_bounded_delay_the_same_kill_loses_no_acknowledged_push_and_keeps_the_bound() {
    if played_a_helper_role() {
        return;
    }
    fails_over_and_loses_no_acknowledged_push(Consistency::BoundedDelay(2));
}

#[test]
fn under_sequential_consistency_the_same_kill_loses_no_acknowledged_push() {
    if played_a_helper_role() {
        return;
    }
    fails_over_and_loses_no_acknowledged_push(Consistency::Sequential);
}

fn fails_over_and_loses_no_acknowledged_push(consistency: Consistency) {
    let names = ["s0", "s1", "s2", "w0", "w1"];
    let mut cluster = Cluster::start(&names);
    let checkpoint = tempfile::tempdir().unwrap();
    let job = PsJob {
        checkpoint_dir: Some(checkpoint.path().to_path_buf()),
        ..job_under(2, 600, consistency)
    };
    let (outcome, victim, killed_at) = run_and_kill(&mut cluster, &job);
    let ps = outcome.unwrap_or_else(|e| {
        let log = std::fs::read_to_string(cluster.log(&victim)).unwrap_or_default();
        panic!("the job did not survive the kill: {e:#}\n{victim}'s log: {log}")
    });
    assert_eq!(ps.losses.len(), 600, "the job went on to its last clock");
    if let Some(k) = consistency.bound() {
        assert!(
            ps.max_lead() <= k,
            "a worker ran {} clocks ahead under {consistency}",
            ps.max_lead()
        );
    }
    assert_eq!(ps.failovers.len(), 1, "{:?}", ps.failovers);
    let failover = &ps.failovers[0];
    assert_eq!((failover.server, failover.host.as_str()), (1, victim.as_str()));
    assert!(
        ps.ring.servers() == [0, 2],
        "server 1 left the ring: {:?}",
        ps.ring.servers()
    );
    let replication = ps.replication.unwrap();
    assert_eq!(
        (replication.min_copies, replication.max_copies),
        (2, 2),
        "{replication:?}"
    );
    assert_eq!(
        replication.version_mismatches, 0,
        "every copy of a range says it holds the same pushes: {replication:?}"
    );
    // The same pushes, perhaps in another order between workers: equal up to f32 rounding.
    assert!(
        replication.max_diff <= 1e-4,
        "replicas hold the same values: {replication:?}"
    );
    assert!(
        ps.workers.iter().any(|w| w.figures.failovers >= 1),
        "a worker adopted the new ring"
    );
    let FinalModel::Sparse(weights) = &ps.model else {
        panic!("a sparse model")
    };
    let acked: Vec<&[(u64, Vec<f32>)]> = ps.workers.iter().map(|w| w.acked.as_slice()).collect();
    let check = check_sgd(weights, &acked);
    assert!(
        check.excess <= 1.0,
        "an acknowledged push was lost: {}",
        check.worst
    );
    let worst = check.max_abs_diff;
    resumes_from_the_checkpoint_after_the_failover(checkpoint.path(), &job, weights);
    // Negative control: one worker's acknowledged pushes alone do not explain the weights.
    let control = check_sgd(weights, &acked[..1]);
    assert!(
        control.excess >= 10.0,
        "the comparison missed worker 1's pushes: {control:?} (10× the tolerance needed)"
    );
    println!(
        "{}",
        serde_json::json!({
            "figure": "parameter-server failover",
            "consistency": consistency.to_string(),
            "replicas": 2,
            "kill_to_r_copies_s": failover.restored_unix_s - killed_at,
            "loss_seen_to_r_copies_s": failover.restore_s,
            "keys_copied": failover.keys_copied,
            "keys_on_2_servers": replication.keys,
            "max_abs_diff_vs_acked_sgd": worst,
            "negative_control": control.worst,
            "negative_control_excess": control.excess,
        })
    );
}

#[test]
fn with_one_replica_the_same_kill_loses_a_range_and_the_job_stops_naming_it() {
    if played_a_helper_role() {
        return;
    }
    let names = ["s0", "s1", "s2", "w0", "w1"];
    let mut cluster = Cluster::start(&names);
    let (outcome, victim, _) = run_and_kill(&mut cluster, &job(1, 600));
    let error = format!("{:#}", outcome.expect_err("a range with no replica left"));
    println!("with --replicas 1, after SIGKILL of {victim}: {error}");
    assert!(
        error.contains("key range (0x") && error.contains("is lost") && error.contains("--replicas 2"),
        "{error}"
    );
}

/// The checkpoint written after the failover: the live servers' files hold every key with its
/// final value, the manifest names only them, and a job resumes from it here, on 2 servers.
fn resumes_from_the_checkpoint_after_the_failover(
    dir: &std::path::Path,
    job: &PsJob<BuiltinUpdate>,
    weights: &HashMap<u64, f32>,
) {
    let manifest = read_manifest(dir).unwrap();
    assert_eq!(
        (manifest.clock, &manifest.files[..]),
        (600, &[0, 2][..]),
        "{manifest:?}"
    );
    let mut saved: HashMap<u64, f32> = HashMap::new();
    for s in &manifest.files {
        let file = read_server_file(dir, *s, 0).unwrap();
        for (key, values, _) in file.entries() {
            saved.insert(key, values[0]);
        }
    }
    assert_eq!(saved.len(), weights.len(), "every key is in the checkpoint");
    // Replicas under eventual consistency apply the same pushes in their own order: equal up
    // to f32 rounding, as the replication check allows.
    let off = saved.iter().find(|(k, v)| {
        weights
            .get(k)
            .is_none_or(|w| (*v - w).abs() > 1e-4 * (1.0 + w.abs()))
    });
    assert!(off.is_none(), "the checkpoint holds the final values: {off:?}");
    let resumed = PsJob {
        servers: 2,
        clocks: 3,
        checkpoint_dir: None,
        resume: Some(dir.to_path_buf()),
        delay_ms: vec![0; WORKERS],
        ..job.clone()
    };
    let runtime =
        archipelago_actors::runtime::Runtime::local(archipelago_dataflow::DeviceSpec::cpus(2 + WORKERS));
    let outcome = run(&runtime, &resumed).unwrap();
    assert_eq!((outcome.first_clock, outcome.losses.len()), (600, 3));
}

/// Key caching measured on the wire between processes (each worker a host of its own, so the
/// process's actor-port byte count is the worker's): the same job with and without it, the
/// same final weights bit for bit, fewer bytes written by the workers.
#[test]
fn key_caching_cuts_the_bytes_the_workers_write_on_the_wire() {
    if played_a_helper_role() {
        return;
    }
    let names = ["s0", "s1", "s2", "w0", "w1"];
    let cluster = Cluster::start(&names);
    archipelago_controller::ps_job::cli::registry().install();
    let mut runs = Vec::new();
    for caching in [true, false] {
        let job = PsJob {
            key_caching: caching,
            delay_ms: vec![0; WORKERS],
            ..job_under(2, 40, Consistency::Sequential)
        };
        let runtime = connect(&cluster.addr, TOKEN, job.devices()).unwrap();
        let ps = run(&runtime, &job).unwrap();
        let wire: u64 = ps.workers.iter().map(|w| w.figures.wire_bytes_out).sum();
        let payload: u64 = ps.workers.iter().map(|w| w.figures.bytes_out).sum();
        let FinalModel::Sparse(weights) = ps.model else {
            panic!("a sparse model")
        };
        let mut weights: Vec<(u64, f32)> = weights.into_iter().collect();
        weights.sort_by_key(|(k, _)| *k);
        runs.push((wire, payload, weights));
    }
    let ((with, with_payload, a), (without, without_payload, b)) = (&runs[0], &runs[1]);
    println!(
        "{}",
        serde_json::json!({
            "figure": "key caching on the wire (2 workers, 3 servers, R = 2, 40 clocks, 20 000 features)",
            "wire_bytes_out_with": with,
            "wire_bytes_out_without": without,
            "payload_bytes_out_with": with_payload,
            "payload_bytes_out_without": without_payload,
        })
    );
    assert!(*with > 0 && *without > 0, "the workers' hosts wrote on the wire");
    assert!(
        with < without,
        "key caching cut the wire bytes: {with} vs {without}"
    );
    assert!(with_payload < without_payload);
    assert_eq!(a, b, "the same weights with and without key caching");
}
