//! The guide's program (docs/GUIDE.md) and the README's Counter example: the crate
//! `examples/first_program`, which stands outside the workspace as a user's own crate would
//! (its own `Cargo.toml` with path dependencies, its own `Cargo.lock`).
//!
//! - Its two programs, built by the workspace as the examples `first_program` and
//!   `readme_counter` (the same source files), each run on this process and then as the driver
//!   of a controller with two host processes of the same binary: the outputs must agree.
//! - The crate itself is checked as its own workspace with cargo (`check --offline --locked`)
//!   into the workspace's target directory, reusing the registry dependencies the workspace
//!   compiled. Building it too (and running what it builds) is the ignored test below: cargo
//!   names a path dependency by its path relative to the root of the workspace that builds it,
//!   so for the crate's own workspace the three archipelago crates are other artifacts, compiled
//!   once more (minutes on a 2-core machine, where checking them takes seconds).

mod support {
    // This binary uses the cluster helpers only in part.
    #[allow(dead_code)]
    pub mod cluster;
}

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use archipelago_controller::runtime::{CONTROLLER_ENV, TOKEN_FILE_ENV};

use support::cluster::{TOKEN, TestCluster};

/// How long a `cargo check` or `cargo build` of the crate may take (a build compiles the three
/// archipelago crates again when cold).
const BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);
/// How long one run of a program may take (the guide's program takes a few seconds).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// The crate's directory.
fn crate_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("first_program")
}

/// The workspace's target directory and the profile directory this test was built into
/// (`target/debug/deps/guide-…` → `target`, `debug`).
fn target_and_profile() -> (PathBuf, String) {
    let exe = std::env::current_exe().expect("this test's executable");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/PROFILE/deps");
    let profile = profile_dir.file_name().unwrap().to_string_lossy().into_owned();
    (profile_dir.parent().unwrap().to_path_buf(), profile)
}

/// `(name, version)` of every package a `Cargo.lock` lists.
fn locked_packages(lock: &Path) -> BTreeSet<(String, String)> {
    let text =
        std::fs::read_to_string(lock).unwrap_or_else(|e| panic!("cannot read {}: {e}", lock.display()));
    let mut packages = BTreeSet::new();
    let mut name = None;
    for line in text.lines() {
        let value = |key: &str| {
            line.strip_prefix(key)
                .map(|v| v.trim().trim_matches('"').to_string())
        };
        if let Some(n) = value("name = ") {
            name = Some(n);
        } else if let (Some(v), Some(n)) = (value("version = "), name.take()) {
            packages.insert((n, v));
        }
    }
    packages
}

/// What one finished process printed.
struct Finished {
    stdout: String,
    stderr: String,
}

/// Runs `command` (stdout and stderr collected) to its end within `limit`; a process still
/// running then is killed, and the test fails naming `what`, with what it printed so far.
fn run(mut command: Command, what: &str, limit: Duration) -> Finished {
    let mut child: Child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child's status") {
            break Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let finished = Finished {
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    let output = || format!("stdout:\n{}\nstderr:\n{}", finished.stdout, finished.stderr);
    match status {
        None => panic!("{what} did not finish within {limit:?} (killed); {}", output()),
        Some(status) if !status.success() => panic!("{what} failed ({status}); {}", output()),
        Some(_) => finished,
    }
}

/// A cargo command on the crate as its own workspace, offline with its checked-in lock, into
/// the workspace's target directory and profile (so the registry dependencies the workspace
/// compiled are reused); after checking that the lock names the workspace's versions.
fn cargo_on_the_crate(subcommand: &str) -> Command {
    let dir = crate_dir();
    // Other versions than the workspace's would be compiled anew (and `--offline` might not
    // find them).
    let ours = locked_packages(&dir.join("Cargo.lock"));
    let workspace = locked_packages(&dir.join("../../Cargo.lock"));
    let behind: Vec<String> = (ours.iter())
        .filter(|(name, _)| name != "first-program")
        .filter(|p| !workspace.contains(*p))
        .map(|(n, v)| format!("{n} {v}"))
        .collect();
    assert!(
        behind.is_empty(),
        "examples/first_program/Cargo.lock locks versions the workspace's Cargo.lock does not ({}); {REFRESH}",
        behind.join(", ")
    );
    let (target, profile) = target_and_profile();
    let mut cargo = Command::new(env!("CARGO"));
    // What cargo set for this test process describes this package, and build scripts that
    // watch such variables (ring's does) would take a change of them for a reason to run again:
    // the inner cargo would rebuild them and what depends on them, and the workspace's next
    // build would rebuild them back. It gets this process's environment without them.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if SET_BY_CARGO_FOR_TESTS.contains(&name.as_ref())
            || name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_")
        {
            cargo.env_remove(name.as_ref());
        }
    }
    cargo
        .args([subcommand, "--offline", "--locked", "--bins", "--manifest-path"])
        .arg(dir.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cargo.arg("--release");
        }
        other => {
            cargo.args(["--profile", other]);
        }
    }
    cargo
}

/// Variables cargo sets for a test process (besides `CARGO_PKG_*` and `CARGO_BIN_EXE_*`).
const SET_BY_CARGO_FOR_TESTS: &[&str] = &[
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_MANIFEST_LINKS",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
    "OUT_DIR",
];

/// How to bring the crate's lock back in step with the workspace's.
const REFRESH: &str = "refresh it from the repository's root: cp Cargo.lock examples/first_program/ && cargo tree --offline --manifest-path examples/first_program/Cargo.toml > /dev/null";

/// Runs `cargo` (see [`cargo_on_the_crate`]) and says how long it took.
fn cargo_run(cargo: Command, what: &str) {
    let started = Instant::now();
    let done = run(
        cargo,
        &format!(
            "`{what}` of examples/first_program (if it says the lock file needs to be updated, {REFRESH})"
        ),
        BUILD_LIMIT,
    );
    eprintln!(
        "`{what}` of examples/first_program took {:.1} s:\n{}",
        started.elapsed().as_secs_f64(),
        done.stderr.trim_end()
    );
}

/// The runs (and the check) of this file take turns: the guide's program times its calls (a
/// `wait` with a timeout), which a compiler or another run beside it on a small machine could
/// upset.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `binary` with none of the cluster variables this test's environment may carry, and short
/// panic reports (the guide's program panics on purpose).
fn program(binary: &Path) -> Command {
    let mut command = Command::new(binary);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("ARCHIPELAGO_") {
            command.env_remove(name);
        }
    }
    command.env("RUST_BACKTRACE", "0");
    command
}

/// Runs `binary` on this process, then as the driver of a controller with hosts `h1` and `h2`
/// (processes of the same binary, two CPU devices each); returns both runs.
fn local_and_on_two_hosts(binary: &Path, name: &str) -> (Finished, Finished) {
    assert!(
        binary.exists(),
        "{} is missing: `cargo test -p archipelago-examples` builds the examples (`--test guide` alone does not: `cargo build -p archipelago-examples --examples` first)",
        binary.display()
    );
    let _turn = one_at_a_time();
    let local = run(program(binary), &format!("{name} on this process"), RUN_LIMIT);
    let hosts = TestCluster::start_binary(binary, &["h1", "h2"], "cpu:0,cpu:1", &[("RUST_BACKTRACE", "0")]);
    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token.path(), TOKEN).unwrap();
    let mut driver = program(binary);
    driver
        .env(CONTROLLER_ENV, &hosts.addr)
        .env(TOKEN_FILE_ENV, token.path());
    let cluster = run(
        driver,
        &format!("{name} as the driver of a controller with two hosts of its binary"),
        RUN_LIMIT,
    );
    drop(hosts);
    (local, cluster)
}

/// The lines the guide's program must print (beyond printing the same in both runs).
const GUIDE_LINES: &[&str] = &[
    "worker 0 · worker 2 = 1430083072 (4096 bytes fetched from worker 2)",
    "tensor bytes that reached this program: 4096",
    "wait: ready 0 (worker 0), 1 (worker 1), 2 (worker 2); pending [3]",
    "the slow call: timeout: no reply to `Work` within 100ms",
    "worker 3 finished its Work anyway: 1 done",
    "flaky: failed: panicked: the second call of its first life",
    "flaky after its restart (calls, restarts): (1, 1)",
    "flaky ended: failed (panicked: Explode always panics)",
    "chain(3) = 75",
    "worker 3 ended: stopped (the program is done)",
    "a call to a stopped worker: stopped: the program is done",
    "worker 0's tensor is gone: stopped: the program is done",
];

/// The guide's program (`binary`) prints the same on this process and on two hosts, the lines
/// it should, and its mesh spans both hosts.
fn check_the_guides_program(binary: &Path) {
    let (local, cluster) = local_and_on_two_hosts(binary, "the guide's program");
    assert_eq!(
        local.stdout, cluster.stdout,
        "the guide's program printed differently on two hosts (right) than on this process (left); the cluster run's stderr:\n{}",
        cluster.stderr
    );
    for line in GUIDE_LINES {
        assert!(
            local.stdout.lines().any(|l| l == *line),
            "`{line}` missing from the guide's program's output:\n{}",
            local.stdout
        );
    }
    // Member r on slot r: two workers on each host.
    for host in ["h1", "h2"] {
        assert_eq!(
            cluster.stderr.matches(&format!(" of {host}\n")).count(),
            2,
            "two workers on {host}:\n{}",
            cluster.stderr
        );
    }
}

/// The README's Counter (`binary`) prints 13 on this process and on two hosts.
fn check_the_readme_counter(binary: &Path) {
    let (local, cluster) = local_and_on_two_hosts(binary, "the README's Counter");
    assert_eq!(local.stdout, "13\n", "stderr:\n{}", local.stderr);
    assert_eq!(cluster.stdout, "13\n", "stderr:\n{}", cluster.stderr);
}

#[test]
fn the_guides_program_prints_the_same_on_this_process_and_on_two_host_processes() {
    check_the_guides_program(&support::cluster::example_binary("first_program"));
}

#[test]
fn the_readme_counter_prints_13_on_this_process_and_on_two_host_processes() {
    check_the_readme_counter(&support::cluster::example_binary("readme_counter"));
}

#[test]
fn the_guides_crate_compiles_on_its_own_with_its_lock_and_the_workspaces_dependencies() {
    let _turn = one_at_a_time();
    cargo_run(cargo_on_the_crate("check"), "cargo check");
}

/// The guide's steps as a user takes them: `cargo build` in the crate, then its binaries run
/// locally and on two hosts. Ignored by default: it compiles the archipelago crates once more
/// (see the module docs); `cargo test -p archipelago-examples --test guide -- --ignored`.
#[test]
#[ignore = "compiles the archipelago crates once more for the crate's own workspace (minutes)"]
fn the_guides_crate_built_on_its_own_runs_the_same() {
    cargo_run(cargo_on_the_crate("build"), "cargo build");
    let (target, profile) = target_and_profile();
    let binary = |name: &str| {
        target
            .join(&profile)
            .join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
    };
    check_the_guides_program(&binary("first-program"));
    check_the_readme_counter(&binary("counter"));
}
