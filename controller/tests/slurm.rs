//! `examples/slurm/train.sbatch` on a real single-node Slurm (Debian's slurm-wlm and munge,
//! started for the test): a dp=2 job on two tasks trains as the same job in one process; a
//! killed task ends the job with the lost host named; warned before the time limit, the job
//! checkpoints, requeues itself and the requeued run resumes to the end. Under CI the Slurm must
//! start; elsewhere, without root or the packages, the tests are skipped and say why
//! (`archipelago_actors::prerequisite`, listed at the end of `scripts/test.sh`).

mod slurm_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_archipelago");
const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/slurm/train.sbatch")
}

/// The job flags both runs share.
fn job_flags(steps: u64, model: &str, report: &Path) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--model",
        model,
        "--dp",
        "2",
        "--batch",
        "24",
        "--seed",
        "7",
        "--optimizer",
        "sgd",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    flags.extend([
        "--lr".into(),
        "0.05".into(),
        "--steps".into(),
        steps.to_string(),
        "--report".into(),
    ]);
    flags.push(report.to_string_lossy().into_owned());
    flags
}

fn report(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("no report at {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The same job in this process (the embedded controller).
fn local_report(dir: &Path, steps: u64, model: &str) -> Value {
    let path = dir.join("local.json");
    let out = Command::new(BIN)
        .arg("train")
        .args(job_flags(steps, model, &path))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "local run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    report(&path)
}

/// Every step's loss (by step number) and every block's norm agree to f32 reduction order.
fn assert_equal(reference: &Value, run: &Value, what: &str) {
    let losses = |r: &Value| -> Vec<(u64, f64)> {
        r["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["step"].as_u64().unwrap(), s["loss"].as_f64().unwrap()))
            .collect()
    };
    let reference_losses = losses(reference);
    for (step, loss) in losses(run) {
        let (_, expected) = reference_losses
            .iter()
            .find(|(s, _)| *s == step)
            .unwrap_or_else(|| panic!("{what}: step {step} not in the reference"));
        assert!(
            ((loss - expected) / expected).abs() < 1e-5,
            "{what}: step {step} loss {loss} vs {expected}"
        );
    }
    let norms = |r: &Value| -> Vec<f64> {
        r["block_l2"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    for (a, b) in norms(reference).iter().zip(norms(run)) {
        assert!(((a - b) / a).abs() < 1e-5, "{what}: block norm {a} vs {b}");
    }
}

/// A test's directory and in it: the job directory, the job's output, the report `NAME.json`.
fn job_paths(report: &str) -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let (job_dir, out) = (dir.path().join("job"), dir.path().join("out.txt"));
    let report = dir.path().join(format!("{report}.json"));
    (dir, job_dir, out, report)
}

fn job_env(job_dir: &Path) -> Vec<(&'static str, PathBuf)> {
    vec![
        ("ARCHIPELAGO", PathBuf::from(BIN)),
        ("ARCHIPELAGO_JOB_DIR", job_dir.to_path_buf()),
    ]
}

fn submit(slurm: &slurm_support::LocalSlurm, job_dir: &Path, out: &Path, args: &[String]) -> String {
    submit_with(slurm, job_dir, out, args, &[], false)
}

fn submit_with(
    slurm: &slurm_support::LocalSlurm,
    job_dir: &Path,
    out: &Path,
    args: &[String],
    extra_env: &[(&'static str, PathBuf)],
    wait: bool,
) -> String {
    let mut env = job_env(job_dir);
    env.extend(extra_env.iter().cloned());
    let env: Vec<(&str, &Path)> = env.iter().map(|(k, v)| (*k, v.as_path())).collect();
    let output = format!("--output={}", out.display());
    let mut flags = vec!["--ntasks=2", "--ntasks-per-node=2", &output];
    if wait {
        flags.push("--wait");
    }
    slurm.submit(&flags, &script(), args, &env)
}

fn wait_for_text(path: &Path, text: &str, within: Duration) {
    let started = Instant::now();
    while !std::fs::read_to_string(path).unwrap_or_default().contains(text) {
        assert!(
            started.elapsed() < within,
            "`{text}` not in {} after {within:?}: {}",
            path.display(),
            std::fs::read_to_string(path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_dp2_job_on_two_slurm_tasks_trains_as_the_same_job_here() {
    let Some(slurm) = slurm_support::start() else {
        return;
    };
    let (dir, job_dir, out, report_path) = job_paths("slurm");
    // `sbatch --wait`, as a user scripting a run would.
    let job = submit_with(
        &slurm,
        &job_dir,
        &out,
        &job_flags(6, MLP, &report_path),
        &[],
        true,
    );
    let state = slurm.wait_done(&job, Duration::from_secs(120));
    let said = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(
        state,
        "COMPLETED",
        "job output:\n{said}\nhosts:\n{}",
        std::fs::read_to_string(job_dir.join("hosts.log")).unwrap_or_default()
    );
    let run = report(&report_path);
    assert_eq!(run["steps"].as_array().unwrap().len(), 6);
    assert_equal(&local_report(dir.path(), 6, MLP), &run, "slurm dp=2");
    // Two hosts, each named after the node and its task, each on the node's island.
    let hosts = std::fs::read_to_string(job_dir.join("hosts.log")).unwrap();
    for local_id in 0..2 {
        assert!(
            hosts.contains(&format!("{}-{local_id}", slurm.node)),
            "hosts log: {hosts}"
        );
    }
    // The token was made for the job, readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(job_dir.join("token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "token mode {mode:o}");
}

/// The pids of the `archipelago host` processes of the job whose directory is `job_dir` (unique
/// per test: job ids repeat across the tests' Slurms).
fn host_pids(job_dir: &Path) -> Vec<u32> {
    job_pids(job_dir, &["host"])
}

/// The pids of the job's `archipelago` processes whose subcommand is one of `roles`.
fn job_pids(job_dir: &Path, roles: &[&str]) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let mine = environ
            .split(|&b| b == 0)
            .any(|v| v == format!("ARCHIPELAGO_JOB_DIR={}", job_dir.display()).as_bytes());
        let role = cmdline.split(|&b| b == 0).nth(1).unwrap_or_default();
        if mine && roles.iter().any(|r| r.as_bytes() == role) {
            pids.push(pid);
        }
    }
    pids
}

/// A job of many steps submitted and past its first step: the test's directory, the job
/// directory, the job's output and its id.
fn running_job(slurm: &slurm_support::LocalSlurm) -> (tempfile::TempDir, PathBuf, PathBuf, String) {
    let (dir, job_dir, out, report_path) = job_paths("slurm");
    let job = submit(slurm, &job_dir, &out, &job_flags(100_000, MLP, &report_path));
    wait_for_text(&out, "step     1/", Duration::from_secs(60));
    (dir, job_dir, out, job)
}

#[test]
fn a_killed_task_ends_the_job_naming_the_lost_host() {
    let Some(slurm) = slurm_support::start() else {
        return;
    };
    let (_dir, job_dir, out, job) = running_job(&slurm);
    let pids = host_pids(&job_dir);
    assert_eq!(pids.len(), 2, "host processes of job {job}: {pids:?}");
    let killed = Command::new("kill")
        .args(["-9", &pids[1].to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let state = slurm.wait_done(&job, Duration::from_secs(60));
    let said = std::fs::read_to_string(&out).unwrap();
    assert_ne!(state, "COMPLETED", "{said}");
    assert!(
        said.contains("is lost") && said.contains(&format!("host `{}-", slurm.node)),
        "job output:\n{said}"
    );
    // Every process of the job is gone.
    std::thread::sleep(Duration::from_secs(1));
    assert!(host_pids(&job_dir).is_empty(), "hosts of job {job} still running");
}

#[test]
fn warned_before_the_time_limit_the_job_checkpoints_requeues_and_resumes() {
    let Some(slurm) = slurm_support::start() else {
        return;
    };
    let (dir, job_dir, out, report_path) = job_paths("slurm");
    // mlp-8x1024: a step takes long enough (tens of ms) for the warning to land mid-run.
    let steps = 120;
    let job = submit(
        &slurm,
        &job_dir,
        &out,
        &job_flags(steps, "mlp-8x1024", &report_path),
    );
    wait_for_text(&out, "step    12/", Duration::from_secs(120));
    // What Slurm does at `--signal=B:USR1@120`: USR1 to the batch shell.
    let signalled = slurm
        .command("scancel")
        .args(["--signal=USR1", "--batch", &job])
        .status()
        .unwrap();
    assert!(signalled.success());
    wait_for_text(&out, "requeueing job", Duration::from_secs(60));
    // Slurm makes a requeued job eligible once the old run's credentials expire: the test's
    // Slurm sets `cred_expire=5` (120 s by default). Forcing `StartTime=now` instead races the
    // old run's teardown ("Job credential revoked": the requeued run is killed at once).
    let started = Instant::now();
    let mut pending = false;
    loop {
        match slurm.state(&job).as_str() {
            "PENDING" => pending = true,
            "RUNNING" if pending => break,
            "COMPLETED" | "FAILED" | "CANCELLED" => break,
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(100),
            "job {job} was not requeued and started again"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let state = slurm.wait_done(&job, Duration::from_secs(300));
    let said = std::fs::read_to_string(&out).unwrap();
    assert_eq!(state, "COMPLETED", "job output:\n{said}");
    assert!(said.contains("stopped after step"), "job output:\n{said}");
    let run = report(&report_path);
    let run_steps = run["steps"].as_array().unwrap();
    let first = run_steps.first().unwrap()["step"].as_u64().unwrap();
    assert!(
        first > 1,
        "the requeued run started from step 1, not from the checkpoint"
    );
    assert_eq!(run_steps.last().unwrap()["step"].as_u64(), Some(steps));
    assert_equal(&local_report(dir.path(), steps, "mlp-8x1024"), &run, "requeued");
}

/// A program written on the runtime API (here `archipelago ps`, a parameter-server job whose
/// own binary serves as its hosts) runs under the same script with ARCHIPELAGO_PROGRAM — here
/// with `ARCHIPELAGO_TLS=1`, the script's per-job certificates, on every connection — and
/// trains as the same job in one process.
#[test]
fn a_runtime_api_program_runs_on_slurm_tasks_as_it_runs_here() {
    let Some(slurm) = slurm_support::start() else {
        return;
    };
    let (dir, job_dir, out, report_path) = job_paths("ps");
    let flags = |report: &Path| -> Vec<String> {
        let mut flags: Vec<String> = [
            "--model",
            MLP,
            "--servers",
            "1",
            "--replicas",
            "1",
            "--workers",
            "1",
            "--staleness",
            "0",
            "--steps",
            "6",
            "--report",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        flags.push(report.to_string_lossy().into_owned());
        flags
    };
    let program = PathBuf::from(format!("{BIN} ps"));
    let job = submit_with(
        &slurm,
        &job_dir,
        &out,
        &flags(&report_path),
        &[
            ("ARCHIPELAGO_PROGRAM", program),
            ("ARCHIPELAGO_TLS", PathBuf::from("1")),
        ],
        true,
    );
    let state = slurm.wait_done(&job, Duration::from_secs(120));
    let said = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(state, "COMPLETED", "job output:\n{said}");
    let hosts = std::fs::read_to_string(job_dir.join("hosts.log")).unwrap();
    assert!(
        hosts.contains(&format!("host `{}-0`", slurm.node)),
        "hosts log: {hosts}"
    );
    let local_path = dir.path().join("local.json");
    let local = Command::new(BIN)
        .arg("ps")
        .args(flags(&local_path))
        .output()
        .unwrap();
    assert!(
        local.status.success(),
        "{}",
        String::from_utf8_lossy(&local.stderr)
    );
    assert_equal(&report(&local_path), &report(&report_path), "ps on slurm");
}

/// Bad input, no Slurm needed: the script outside a Slurm job, `auto` without Slurm's
/// variables, a node list whose first node does not resolve — each stops naming the variable
/// and the fix.
#[test]
fn outside_slurm_or_with_a_node_list_that_does_not_resolve_auto_names_the_variable() {
    let clean = |command: &mut Command| {
        for var in [
            "SLURM_JOB_ID",
            "SLURM_JOB_NODELIST",
            "SLURMD_NODENAME",
            "ARCHIPELAGO_CONTROLLER",
        ] {
            command.env_remove(var);
        }
    };
    let mut script_run = Command::new("bash");
    script_run.arg(script()).args(["--model", MLP]);
    clean(&mut script_run);
    let out = script_run.output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("SLURM_JOB_ID") && said.contains("sbatch"), "{said}");

    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token.path(), "t").unwrap();
    let mut host = Command::new(BIN);
    host.args(["host", "--controller", "auto", "--token-file"])
        .arg(token.path());
    clean(&mut host);
    let out = host.output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("SLURM_JOB_ID") && said.contains("sbatch"),
        "{said}"
    );

    let mut controller = Command::new(BIN);
    controller
        .args(["controller", "--listen", "auto", "--token-file"])
        .arg(token.path());
    clean(&mut controller);
    controller
        .env("SLURM_JOB_ID", "12")
        .env("SLURM_JOB_NODELIST", "no-such-node-[1-2].invalid");
    let out = controller.output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && said.contains("no-such-node-1.invalid")
            && said.contains("SLURM_JOB_NODELIST"),
        "{said}"
    );
}

/// `scancel` ends every process of the job: controller, hosts and client.
#[test]
fn scancel_ends_every_process_of_the_job() {
    let Some(slurm) = slurm_support::start() else {
        return;
    };
    let (_dir, job_dir, _out, job) = running_job(&slurm);
    let roles = ["controller", "host", "train"];
    assert_eq!(
        job_pids(&job_dir, &roles).len(),
        4,
        "controller, two hosts and the client"
    );
    assert!(slurm.command("scancel").arg(&job).status().unwrap().success());
    assert_eq!(slurm.wait_done(&job, Duration::from_secs(60)), "CANCELLED");
    let started = Instant::now();
    while !job_pids(&job_dir, &roles).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "still running after scancel: {:?}",
            job_pids(&job_dir, &roles)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
