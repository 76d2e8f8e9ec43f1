//! A real single-node Slurm for the tests: munge with its own key and socket, `slurmctld` and
//! `slurmd` configured in a temporary directory for this machine's host name, on free ports,
//! stopped by their process ids when dropped. Debian's `slurm-wlm` and `munge` (the README's
//! test command installs them); the daemons run as root. Without root or the packages the tests
//! fail under CI and are skipped elsewhere (`archipelago_actors::prerequisite`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use archipelago_actors::prerequisite;

/// The daemons of one local Slurm and the configuration its clients read (`SLURM_CONF`).
pub struct LocalSlurm {
    pub dir: tempfile::TempDir,
    pub conf: PathBuf,
    pub node: String,
    daemons: Vec<Child>,
}

impl Drop for LocalSlurm {
    fn drop(&mut self) {
        // Jobs first (their tasks are children of slurmd), then the daemons by pid.
        let _ = self.command("scancel").arg("--full").arg("--user=root").output();
        for daemon in self.daemons.iter_mut().rev() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// What keeps a local Slurm from starting here, with what to do about it: root first (the
/// daemons are in /usr/sbin, on root's `PATH`), then the daemons' and clients' binaries.
fn what_is_missing() -> Option<(String, String)> {
    if !is_root() {
        return Some((
            "a local Slurm needs root (slurmd runs jobs as their users)".to_string(),
            "run the tests as root".to_string(),
        ));
    }
    let missing: Vec<&str> = ["munged", "slurmctld", "slurmd", "sbatch"]
        .into_iter()
        .filter(|b| prerequisite::on_path(b).is_err())
        .collect();
    (!missing.is_empty()).then(|| {
        (
            format!("{} not on PATH", missing.join(", ")),
            "install Debian's slurm-wlm and munge (scripts/test.sh does)".to_string(),
        )
    })
}

/// A local Slurm, or `None` where it cannot start here and the test is skipped: the rule of
/// `archipelago_actors::prerequisite` (under CI it fails the test instead, saying why).
pub fn start() -> Option<LocalSlurm> {
    if let Some((why, fix)) = what_is_missing() {
        prerequisite::missing(&why, &fix);
        return None;
    }
    Some(LocalSlurm::start())
}

impl LocalSlurm {
    fn start() -> LocalSlurm {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in ["state", "spool"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let node = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim()
            .to_string();
        let key: Vec<u8> = (0..1024u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ std::process::id() as u8)
            .collect();
        let key_path = d.join("munge.key");
        std::fs::write(&key_path, key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o400)).unwrap();
        let socket = d.join("munge.sock");
        let mut daemons = Vec::new();
        let log = |name: &str| std::fs::File::create(d.join(name)).unwrap();
        daemons.push(
            Command::new("munged")
                .args(["-F", "-f", "--key-file"])
                .arg(&key_path)
                .arg("--socket")
                .arg(&socket)
                .arg("--pid-file")
                .arg(d.join("munged.pid"))
                .arg("--log-file")
                .arg(d.join("munged.log"))
                .arg("--seed-file")
                .arg(d.join("munge.seed"))
                .stdout(Stdio::null())
                .stderr(log("munged.out"))
                .spawn()
                .expect("munged"),
        );
        wait_for(|| socket.exists(), "munge's socket", d);
        // Job ids (hence the controllers' ports, 20000 + id mod 10000) distinct across the
        // Slurms of one test run, as two jobs sharing a node have distinct ids.
        static INSTANCES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let first_job = 1000 * (1 + INSTANCES.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % 9);
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let conf = d.join("slurm.conf");
        let p = |f: &str| d.join(f).to_string_lossy().into_owned();
        std::fs::write(
            &conf,
            format!(
                "ClusterName=archtest\nSlurmctldHost={node}\nSlurmUser=root\nSlurmdUser=root\n\
                 FirstJobId={first_job}\n\
                 SlurmctldPort={}\nSlurmdPort={}\nAuthType=auth/munge\nCredType=cred/munge\n\
                 AuthInfo=socket={},cred_expire=5\nStateSaveLocation={}\nSlurmdSpoolDir={}\n\
                 SlurmctldPidFile={}\nSlurmdPidFile={}\nProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
                 JobCompType=jobcomp/none\nMpiDefault=none\nReturnToService=2\nKillWait=5\n\
                 SlurmctldLogFile={}\nSlurmdLogFile={}\n\
                 NodeName={node} CPUs={cpus} State=UNKNOWN\n\
                 PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n",
                free_port(),
                free_port(),
                socket.display(),
                p("state"),
                p("spool"),
                p("slurmctld.pid"),
                p("slurmd.pid"),
                p("slurmctld.log"),
                p("slurmd.log"),
            ),
        )
        .unwrap();
        for (daemon, extra) in [("slurmctld", &["-i"][..]), ("slurmd", &[][..])] {
            daemons.push(
                Command::new(daemon)
                    .arg("-D")
                    .args(extra)
                    .arg("-f")
                    .arg(&conf)
                    .env("SLURM_CONF", &conf)
                    .stdout(Stdio::null())
                    .stderr(log(&format!("{daemon}.out")))
                    .spawn()
                    .unwrap_or_else(|e| panic!("{daemon}: {e}")),
            );
        }
        let slurm = LocalSlurm {
            dir,
            conf,
            node,
            daemons,
        };
        wait_for(
            || {
                slurm
                    .command("sinfo")
                    .args(["-h", "-o", "%T"])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("idle"))
            },
            "the node to be idle",
            slurm.dir.path(),
        );
        slurm
    }

    /// A Slurm client command (`sbatch`, `scontrol`, …) of this Slurm.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.env("SLURM_CONF", &self.conf);
        command
    }

    /// `sbatch --parsable` of `script` with `args`; returns the job id. With `--wait` among
    /// `sbatch_flags` it returns when the job ended (its state tells how).
    pub fn submit(
        &self,
        sbatch_flags: &[&str],
        script: &Path,
        args: &[String],
        env: &[(&str, &Path)],
    ) -> String {
        let out = self
            .command("sbatch")
            .arg("--parsable")
            .args(sbatch_flags)
            .arg(script)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .output()
            .unwrap();
        let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
        // `--wait` exits with the job's status; the caller reads the state. Otherwise sbatch
        // itself must have succeeded.
        assert!(
            !id.is_empty() && (out.status.success() || sbatch_flags.contains(&"--wait")),
            "sbatch: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        id
    }

    /// The job's state as `scontrol show job` says it (`RUNNING`, `COMPLETED`, `FAILED`, …).
    pub fn state(&self, job: &str) -> String {
        let out: Output = self
            .command("scontrol")
            .args(["show", "job", job])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .find_map(|w| w.strip_prefix("JobState="))
            .unwrap_or("UNKNOWN")
            .to_string()
    }

    /// Waits until the job is in a state that ends it, and returns that state.
    pub fn wait_done(&self, job: &str, within: Duration) -> String {
        let started = Instant::now();
        loop {
            let state = self.state(job);
            if [
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
                "BOOT_FAIL",
            ]
            .contains(&state.as_str())
            {
                return state;
            }
            assert!(
                started.elapsed() < within,
                "job {job} still {state} after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

fn wait_for(mut ready: impl FnMut() -> bool, what: &str, dir: &Path) {
    let started = Instant::now();
    while !ready() {
        if started.elapsed() > Duration::from_secs(30) {
            let logs: String = [
                "munged.out",
                "slurmctld.log",
                "slurmctld.out",
                "slurmd.log",
                "slurmd.out",
            ]
            .iter()
            .map(|f| {
                format!(
                    "--- {f}\n{}\n",
                    std::fs::read_to_string(dir.join(f)).unwrap_or_default()
                )
            })
            .collect();
            panic!("the local Slurm did not start ({what} after 30 s):\n{logs}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
