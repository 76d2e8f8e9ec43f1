//! What the process tests share: a controller and hosts as processes of the `archipelago`
//! binary on 127.0.0.1, killed when dropped, and the small programs they train.
#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use archipelago_controller::{Controller, TrainOptions, TrainReport};
use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec, ParallelPlan, Program};

pub const BIN: &str = env!("CARGO_BIN_EXE_archipelago");
pub const MLP: &str = "mlp:in=24,hidden=48,layers=6,out=5";

/// A child process killed when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A controller and its hosts, each a process of the `archipelago` binary.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub addr: String,
    pub token: String,
    pub hosts: Vec<(String, Proc)>,
    pub _controller: Proc,
    /// Environment of every process started (e.g. the OTLP endpoint).
    pub env: Vec<(String, String)>,
    /// With mutual TLS: the directory of the cluster's PEM files (`ca.pem`, `NAME.pem`,
    /// `NAME.key` per process; the client is `client`).
    pub tls: Option<PathBuf>,
}

/// The TLS flags of process `name` whose PEM files are in `dir`.
pub fn tls_flags(dir: &std::path::Path, name: &str) -> Vec<String> {
    let file = |f: String| dir.join(f).to_string_lossy().into_owned();
    vec![
        "--tls-cert".into(),
        file(format!("{name}.pem")),
        "--tls-key".into(),
        file(format!("{name}.key")),
        "--tls-ca".into(),
        file("ca.pem".into()),
    ]
}

/// Reads lines of `child`'s stdout until one contains `what`; returns that line.
pub fn wait_for_line(child: &mut Child, what: &str) -> String {
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.expect("stdout line");
        if line.contains(what) {
            // Keep draining in the background so the child never blocks on a full pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return line;
        }
    }
    panic!("the process ended before printing `{what}`");
}

impl Cluster {
    pub fn start(host_timeout_s: f64, wait_for_hosts_s: f64) -> Cluster {
        Cluster::start_with(host_timeout_s, wait_for_hosts_s, &[])
    }

    /// [`Cluster::start`] with `env` set for the controller and every host.
    pub fn start_with(host_timeout_s: f64, wait_for_hosts_s: f64, env: &[(&str, &str)]) -> Cluster {
        Cluster::launch(host_timeout_s, wait_for_hosts_s, env, &[]).0
    }

    /// [`Cluster::start`] under mutual TLS with the PEM files in `certs` (the controller is
    /// `controller`, each host its name, the client `client`).
    pub fn start_tls(host_timeout_s: f64, wait_for_hosts_s: f64, certs: &std::path::Path) -> Cluster {
        let flags = tls_flags(certs, "controller");
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut cluster = Cluster::launch(host_timeout_s, wait_for_hosts_s, &[], &flags).0;
        cluster.tls = Some(certs.to_path_buf());
        cluster
    }

    /// [`Cluster::start`] with the controller serving its dashboard on a free loopback port;
    /// returns the dashboard's address too.
    pub fn start_with_dashboard(host_timeout_s: f64, wait_for_hosts_s: f64) -> (Cluster, String) {
        let (cluster, dashboard) = Cluster::launch(
            host_timeout_s,
            wait_for_hosts_s,
            &[],
            &["--dashboard", "127.0.0.1:0"],
        );
        (
            cluster,
            dashboard.expect("the controller printed no dashboard address"),
        )
    }

    /// Starts the controller with `env` and the extra `args`; returns the cluster and the
    /// dashboard address it printed, if it serves one (its line comes before the controller's).
    fn launch(
        host_timeout_s: f64,
        wait_for_hosts_s: f64,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> (Cluster, Option<String>) {
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let dir = tempfile::tempdir().unwrap();
        let token = "test-token-4711".to_string();
        std::fs::write(dir.path().join("token"), &token).unwrap();
        let log = std::fs::File::create(dir.path().join("controller.log")).unwrap();
        let mut child = Command::new(BIN)
            .args(["controller", "--listen", "127.0.0.1:0", "--token-file"])
            .arg(dir.path().join("token"))
            .args(["--host-timeout-s", &host_timeout_s.to_string()])
            .args(["--wait-for-hosts-s", &wait_for_hosts_s.to_string()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(log)
            .envs(env.clone())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let mut dashboard = None;
        let addr = loop {
            let line = lines
                .next()
                .expect("the controller ended before listening")
                .expect("stdout line");
            if let Some(url) = line.split("dashboard at http://").nth(1) {
                dashboard = Some(url.trim_end_matches('/').to_string());
            }
            if line.contains("controller listening on") {
                break line.rsplit(' ').next().unwrap().to_string();
            }
        };
        // Keep draining in the background so the child never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        let cluster = Cluster {
            dir,
            addr,
            token,
            hosts: Vec::new(),
            _controller: Proc(child),
            env,
            tls: None,
        };
        (cluster, dashboard)
    }

    pub fn host_command(&self, name: &str, devices: &str, token_file: PathBuf) -> Command {
        let mut command = Command::new(BIN);
        command
            .args(["host", "--controller", &self.addr, "--token-file"])
            .arg(token_file)
            .args(["--devices", devices, "--name", name, "--heartbeat-ms", "200"])
            .args(["--island", &format!("island-{name}")])
            .envs(self.env.clone());
        if let Some(certs) = &self.tls {
            command.args(tls_flags(certs, name));
        }
        command
    }

    pub fn add_host(&mut self, name: &str, devices: &str) -> u32 {
        let log = std::fs::File::create(self.dir.path().join(format!("{name}.log"))).unwrap();
        let mut child = self
            .host_command(name, devices, self.dir.path().join("token"))
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap();
        wait_for_line(&mut child, "registered with the controller");
        let pid = child.id();
        self.hosts.push((name.to_string(), Proc(child)));
        pid
    }

    pub fn controller(&self) -> Controller {
        match &self.tls {
            None => Controller::connect(&self.addr, &self.token),
            Some(certs) => {
                let files = archipelago_actors::trust::TlsFiles {
                    cert: certs.join("client.pem"),
                    key: certs.join("client.key"),
                    ca: certs.join("ca.pem"),
                };
                let tls = archipelago_actors::trust::Tls::load(&files).unwrap();
                let credentials =
                    archipelago_actors::trust::Credentials::new(&self.token).with_tls(tls.into());
                Controller::connect(&self.addr, credentials)
            }
        }
    }

    pub fn controller_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap()
    }
}

pub fn program(plan: ParallelPlan) -> Program {
    Program::new(ModelSpec::parse(MLP).unwrap())
        .with_seed(7)
        .with_optimizer(OptimizerSpec::adam(1e-2))
        .with_plan(plan)
}

pub fn plan(dp: usize, pp: usize, zero: u8) -> ParallelPlan {
    ParallelPlan {
        dp,
        pp,
        zero,
        microbatches: if pp > 1 { 2 } else { 1 },
        batch: 24,
        bucket_bytes: 8 << 10,
        ..ParallelPlan::default()
    }
}

pub fn local(plan: ParallelPlan, steps: u64) -> TrainReport {
    let actors = plan.actors();
    Controller::local(DeviceSpec::cpus(actors))
        .train(
            &program(plan),
            &TrainOptions {
                steps,
                keep_params: true,
                ..TrainOptions::default()
            },
        )
        .unwrap()
}

/// Debian's `chromium` (the README's test command installs it), its version printed; missing,
/// the rule of `archipelago_actors::prerequisite`: the test fails under CI and is skipped
/// elsewhere (`None`), saying so.
pub fn chromium() -> Option<String> {
    let runs = |candidate: &&str| {
        Command::new(candidate)
            .arg("--version")
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let found = ["chromium", "chromium-browser", "/usr/bin/chromium"]
        .iter()
        .find_map(|candidate| Some((candidate.to_string(), runs(candidate)?)))
        .ok_or("no `chromium` (nor `chromium-browser`) runs here");
    let fix = "install Debian's chromium (scripts/test.sh does, as root or with sudo)";
    let (browser, version) = archipelago_actors::prerequisite::require(found, fix)?;
    eprintln!("dashboard test browser: {version}");
    Some(browser)
}

/// The DOM of `url` after Chromium ran its scripts (headless).
pub fn dump_dom(browser: &str, url: &str) -> String {
    let out = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "chromium failed: {:?}", out.status);
    String::from_utf8(out.stdout).unwrap()
}

/// Runs the `archipelago` binary with `args`: whether it succeeded, and its stdout and stderr.
pub fn archipelago(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).output().expect("run archipelago");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs `archipelago args` and asserts it fails saying every one of `needles`.
pub fn refused(args: &[&str], needles: &[&str]) {
    let (ok, text) = archipelago(args);
    assert!(!ok, "{args:?} was accepted: {text}");
    for needle in needles {
        assert!(text.contains(needle), "{args:?}: `{needle}` not in: {text}");
    }
}

/// A file of `integration-tests/fixtures/` (e.g. `gpt2/model.safetensors`).
pub fn fixture(name: &str) -> String {
    format!(
        "{}/../integration-tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// The loss `archipelago eval` printed.
pub fn eval_loss(out: &str) -> f64 {
    let rest = out
        .split("loss ")
        .nth(1)
        .unwrap_or_else(|| panic!("no loss in {out}"));
    rest.split(',').next().unwrap().trim().parse().unwrap()
}

/// `POST path` to `addr` with a JSON body over HTTP/1.0; the status and the JSON answer.
pub fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    (
        status,
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}
