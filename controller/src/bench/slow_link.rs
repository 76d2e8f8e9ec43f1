//! A slow link (issue 43): a controller, two host processes and the `train` client run inside a
//! network namespace of their own (`unshare -n`), talking over that namespace's loopback shaped
//! by `tc`'s token bucket filter (`tbf`: this kernel has no netem) to a given rate, with
//! `--data-path tcp` forced — `auto` would pick shared memory between processes of one kernel,
//! which no qdisc sees. Both directions of the loopback pass the one qdisc, so they share the
//! rate (a half-duplex link: stricter than a switched port). The namespace goes when its last
//! process ends.
//!
//! [`run`] starts `unshare -n ARCHIPELAGO bench-slow-link …`; the hidden `bench-slow-link`
//! subcommand ([`inner_main`]) is the part inside: it shapes the loopback, starts the processes,
//! trains, and writes `report.json` (the job's report) and `link.json` (the qdisc's counters:
//! bytes sent through it and how often the bucket held packets back, [`LinkStats`]) into
//! `--dir`. The bench (`--slow-link-only`) and `controller/tests/slow_link.rs` both use it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};
use clap::Args;
use serde::{Deserialize, Serialize};

use archipelago_actors::fabric::DataPath;

use crate::TrainReport;

/// The token bucket's default burst, KiB: above 64 KiB, since a loopback packet (with TCP
/// segmentation offload) carries up to 64 KiB and a bucket smaller than one packet passes
/// nothing.
pub const DEFAULT_BURST_KIB: u32 = 256;

/// Flags of the hidden `bench-slow-link` subcommand (run inside a fresh network namespace).
#[derive(Debug, Clone, Args)]
pub struct SlowLinkArgs {
    /// The link's rate in Mbit/s (both directions share it).
    #[arg(long)]
    pub rate_mbit: u32,
    /// The token bucket's burst in KiB (above 64).
    #[arg(long, default_value_t = DEFAULT_BURST_KIB)]
    pub burst_kib: u32,
    /// Directory for the token, the processes' logs, `report.json` and `link.json`.
    #[arg(long)]
    pub dir: PathBuf,
    /// The hosts' data path: `tcp` (what the link carries) or, as the slow-link test's negative
    /// control, `shm` (which passes no qdisc).
    #[arg(long, default_value = "tcp")]
    pub data_path: DataPath,
    /// Flags of `archipelago train` (after `--`; `--controller`, `--token-file`, `--data-path`,
    /// `--quiet` and `--report` are added).
    #[arg(last = true)]
    pub train: Vec<String>,
}

/// What the shaped loopback's qdisc counted over the whole run (controller traffic included).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkStats {
    /// The rate it was shaped to, Mbit/s.
    pub rate_mbit: u32,
    /// Its burst, KiB.
    pub burst_kib: u32,
    /// Bytes that passed it.
    pub sent_bytes: u64,
    /// Times the bucket was empty and a packet waited (the link did limit).
    pub overlimits: u64,
    /// Packets dropped (a full queue; TCP sends them again).
    pub dropped: u64,
}

/// One training run over the slow link.
#[derive(Debug, Clone)]
pub struct SlowLinkRun {
    /// The job's report (`train --report`).
    pub report: TrainReport,
    /// What the link's qdisc counted.
    pub link: LinkStats,
}

/// Whether this machine can make a network namespace with a shaped loopback: `unshare`, `ip`
/// and `tc` present and `unshare -n` permitted (root). `Err` says what is missing.
pub fn available() -> Result<(), String> {
    for tool in ["unshare", "ip", "tc"] {
        let found = Command::new("sh")
            .args(["-c", &format!("PATH=\"$PATH:/usr/sbin:/sbin\" command -v {tool}")])
            .output()
            .map_err(|e| format!("cannot run sh: {e}"))?;
        if !found.status.success() {
            return Err(format!(
                "`{tool}` is not installed (Debian: iproute2, util-linux)"
            ));
        }
    }
    let probe = Command::new("unshare")
        .args(["-n", "true"])
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    if !probe.status.success() {
        return Err(format!(
            "`unshare -n` is not permitted here (needs root or CAP_SYS_ADMIN): {}",
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }
    Ok(())
}

/// Trains with `train` (flags of `archipelago train`) over a loopback shaped to `rate_mbit`,
/// in a fresh network namespace, with the binary `exe` and the hosts' `data_path`; `dir` keeps
/// the logs and reports.
pub fn run(
    exe: &Path,
    rate_mbit: u32,
    data_path: DataPath,
    train: &[String],
    dir: &Path,
) -> anyhow::Result<SlowLinkRun> {
    std::fs::create_dir_all(dir)?;
    let output = Command::new("unshare")
        .arg("-n")
        .arg(exe)
        .args(["bench-slow-link", "--rate-mbit", &rate_mbit.to_string()])
        .args(["--data-path", &data_path.to_string(), "--dir"])
        .arg(dir)
        .arg("--")
        .args(train)
        .output()
        .context("starting `unshare -n archipelago bench-slow-link`")?;
    if !output.status.success() {
        bail!(
            "the run over a {rate_mbit} Mbit/s link failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let read = |name: &str| {
        std::fs::read(dir.join(name)).with_context(|| format!("reading {}", dir.join(name).display()))
    };
    Ok(SlowLinkRun {
        report: serde_json::from_slice(&read("report.json")?)?,
        link: serde_json::from_slice(&read("link.json")?)?,
    })
}

/// A child process killed when dropped (the namespace's processes end with the run).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The part inside the namespace: shape the loopback, start a controller and two hosts (one
/// device, one island each), train over raw TCP, write the reports.
pub fn inner_main(args: &SlowLinkArgs) -> anyhow::Result<()> {
    own_namespace()?;
    if args.burst_kib <= 64 {
        bail!(
            "--burst-kib {} passes no 64 KiB loopback packet: use more than 64",
            args.burst_kib
        );
    }
    shell("ip", &["link", "set", "lo", "up"])?;
    let (rate, burst) = (format!("{}mbit", args.rate_mbit), format!("{}kb", args.burst_kib));
    let tbf = [
        "qdisc", "add", "dev", "lo", "root", "tbf", "rate", &rate, "burst", &burst,
    ];
    shell("tc", &[&tbf[..], &["latency", "200ms"]].concat())?;
    let exe = std::env::current_exe()?;
    let token = args.dir.join("token");
    std::fs::write(&token, "slow-link")?;
    let log = |name: &str| std::fs::File::create(args.dir.join(format!("{name}.log")));
    let mut controller = Command::new(&exe)
        .args(["controller", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&token)
        .stdout(Stdio::piped())
        .stderr(log("controller")?)
        .spawn()?;
    let addr = wait_for_line(&mut controller, "controller listening on")?
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .to_string();
    let _controller = Proc(controller);
    let mut hosts = Vec::new();
    for name in ["a", "b"] {
        let mut host = Command::new(&exe)
            .args(["host", "--controller", &addr, "--token-file"])
            .arg(&token)
            .args([
                "--devices",
                "cpu:0",
                "--name",
                name,
                "--island",
                &format!("island-{name}"),
            ])
            .stdout(Stdio::piped())
            .stderr(log(name)?)
            .spawn()?;
        wait_for_line(&mut host, "registered with the controller")?;
        hosts.push(Proc(host));
    }
    let train = Command::new(&exe)
        .arg("train")
        .args(&args.train)
        .args(["--controller", &addr, "--token-file"])
        .arg(&token)
        .args(["--data-path", &args.data_path.to_string(), "--quiet", "--report"])
        .arg(args.dir.join("report.json"))
        .stderr(Stdio::piped())
        .output()?;
    if !train.status.success() {
        bail!(
            "`archipelago train {}` failed over the slow link: {}",
            args.train.join(" "),
            String::from_utf8_lossy(&train.stderr).trim()
        );
    }
    let stats = link_stats(args.rate_mbit, args.burst_kib)?;
    std::fs::write(args.dir.join("link.json"), serde_json::to_vec_pretty(&stats)?)?;
    Ok(())
}

/// Refuses to shape a loopback this process shares with the machine: the namespace must be a
/// fresh one of its own (`unshare -n`), where `ip` sees one interface, `lo`, still down. (The
/// namespace files of other processes are not always readable, as `/proc/1/ns/net` in a
/// container: a comparison with them could not tell.)
fn own_namespace() -> anyhow::Result<()> {
    let links = shell("ip", &["-o", "link", "show"])?;
    if !is_fresh_namespace(&links) {
        bail!(
            "bench-slow-link shapes the loopback of its network namespace and runs only in a fresh \
             one of its own (only `lo`, down); start it as `unshare -n archipelago bench-slow-link …` \
             (this namespace has: {})",
            links
                .lines()
                .map(|l| l.split(':').nth(1).unwrap_or("").trim())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// Whether `ip -o link show`'s output is a fresh namespace's: one interface, `lo`, not up.
fn is_fresh_namespace(links: &str) -> bool {
    let lines: Vec<&str> = links.lines().filter(|l| !l.trim().is_empty()).collect();
    let [only] = lines[..] else { return false };
    let mut fields = only.split(':').skip(1);
    let name = fields.next().map(str::trim);
    let flags = fields.next().unwrap_or("");
    name == Some("lo") && !flags.contains("UP") && only.contains("state DOWN")
}

/// Runs `tool args` (from iproute2), failing with its stderr.
fn shell(tool: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("sh")
        .args(["-c", "PATH=\"$PATH:/usr/sbin:/sbin\" exec \"$0\" \"$@\"", tool])
        .args(args)
        .output()?;
    if !out.status.success() {
        bail!(
            "`{tool} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The loopback qdisc's counters (`tc -s qdisc show dev lo`).
fn link_stats(rate_mbit: u32, burst_kib: u32) -> anyhow::Result<LinkStats> {
    let text = shell("tc", &["-s", "qdisc", "show", "dev", "lo"])?;
    let (sent_bytes, overlimits, dropped) = parse_tc_stats(&text)
        .with_context(|| format!("no tbf counters in `tc -s qdisc show dev lo`: {text}"))?;
    Ok(LinkStats {
        rate_mbit,
        burst_kib,
        sent_bytes,
        overlimits,
        dropped,
    })
}

/// `(sent bytes, overlimits, dropped)` from `tc -s` output's ` Sent N bytes M pkt (dropped D,
/// overlimits O requeues R)` line.
fn parse_tc_stats(text: &str) -> Option<(u64, u64, u64)> {
    let line = text.lines().find(|l| l.trim_start().starts_with("Sent "))?;
    let words: Vec<&str> = line
        .split(|c: char| c.is_whitespace() || c == ',' || c == '(' || c == ')')
        .filter(|w| !w.is_empty())
        .collect();
    let after = |key: &str| {
        let at = words.iter().position(|w| *w == key)?;
        words.get(at + 1)?.parse().ok()
    };
    Some((after("Sent")?, after("overlimits")?, after("dropped")?))
}

/// Reads `child`'s stdout until a line contains `what`, then drains the rest in the background.
fn wait_for_line(child: &mut Child, what: &str) -> anyhow::Result<String> {
    let stdout = child.stdout.take().context("piped stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line?;
        if line.contains(what) {
            std::thread::spawn(move || lines.for_each(drop));
            return Ok(line);
        }
    }
    bail!("the process ended before printing `{what}` (see its log)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_counters_of_tc_s() {
        let text = "qdisc tbf 8001: root refcnt 2 rate 100Mbit burst 256Kb lat 50ms \n \
                    Sent 52510393 bytes 1236 pkt (dropped 19, overlimits 1230 requeues 0) \n \
                    backlog 0b 0p requeues 0\n";
        assert_eq!(parse_tc_stats(text), Some((52510393, 1230, 19)));
        assert_eq!(parse_tc_stats("qdisc noqueue 0: root refcnt 2\n"), None);
    }

    #[test]
    fn only_a_fresh_namespace_is_shaped() {
        let fresh = "1: lo: <LOOPBACK> mtu 65536 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00\n";
        assert!(is_fresh_namespace(fresh));
        let up = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT\n";
        assert!(!is_fresh_namespace(up));
        let machine = format!(
            "{fresh}2: eth0@if7: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc pfifo_fast state UP\n"
        );
        assert!(!is_fresh_namespace(&machine));
        assert!(!is_fresh_namespace(""));
    }
}
