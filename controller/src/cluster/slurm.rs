//! What a process of a Slurm job learns from Slurm's environment, so that `archipelago
//! controller --listen auto`, `host --controller auto` and `train --controller auto` need no
//! addresses in the batch script (the way torchrun's rendezvous finds its master): the
//! controller runs on the job's first node at a port derived from the job id, every host and
//! the client find it there; each node is an island, each task a host named after its node and
//! local rank, offering the GPUs Slurm bound to it or its CPUs.
//!
//! Slurm's compressed host lists (`node[01-03,07],gpu5`) are expanded here, without calling
//! `scontrol`.

use std::net::ToSocketAddrs;

/// The value of `--controller`/`--listen`/`--fabric-listen` that asks for the Slurm-derived one.
pub const AUTO: &str = "auto";

/// Overrides the controller's port (default: 20000 + the job id modulo 10000).
pub const PORT_ENV: &str = "ARCHIPELAGO_CONTROLLER_PORT";

/// The Slurm variables a process of the job reads, by name (a test passes its own).
pub trait Env {
    /// The variable `name`, if set and not empty.
    fn var(&self, name: &str) -> Option<String>;
}

/// The process's own environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.is_empty())
    }
}

impl Env for [(&str, &str)] {
    fn var(&self, name: &str) -> Option<String> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }
}

fn required(env: &(impl Env + ?Sized), name: &str, what: &str) -> anyhow::Result<String> {
    env.var(name).ok_or_else(|| {
        anyhow::anyhow!(
            "`{what} auto` takes the address from Slurm, but {name} is not set: run it inside an \
             sbatch or srun job (examples/slurm/train.sbatch), or give the address as host:port"
        )
    })
}

/// The controller's `host:port` for this job: its first node, at `ARCHIPELAGO_CONTROLLER_PORT`
/// or 20000 + job id mod 10000 (jobs sharing a node do not collide).
pub fn controller_addr(env: &(impl Env + ?Sized)) -> anyhow::Result<String> {
    let what = "--controller";
    let job = required(env, "SLURM_JOB_ID", what)?;
    let nodes = required(env, "SLURM_JOB_NODELIST", what)?;
    let first = expand_hostlist(&nodes)
        .map_err(|e| anyhow::anyhow!("SLURM_JOB_NODELIST={nodes}: {e}"))?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("SLURM_JOB_NODELIST={nodes} names no node"))?;
    Ok(format!("{first}:{}", port(env, &job)?))
}

fn port(env: &(impl Env + ?Sized), job: &str) -> anyhow::Result<u16> {
    if let Some(port) = env.var(PORT_ENV) {
        return port
            .parse()
            .map_err(|_| anyhow::anyhow!("{PORT_ENV}={port} is not a port number"));
    }
    let job: u64 = job
        .parse()
        .map_err(|_| anyhow::anyhow!("SLURM_JOB_ID={job} is not a job number"))?;
    Ok(20_000 + (job % 10_000) as u16)
}

/// Where the controller listens for `--listen auto`: this node's address at the job's port
/// (the batch script runs on the first node, where `controller_addr` points).
pub fn controller_listen(env: &(impl Env + ?Sized)) -> anyhow::Result<String> {
    let addr = controller_addr(env)?;
    let (node, port) = addr.rsplit_once(':').expect("host:port");
    let ip = node_ip(node).map_err(|e| {
        anyhow::anyhow!(
            "{e}: the controller runs on the first node of SLURM_JOB_NODELIST, which must resolve \
             (run `archipelago controller --listen auto` in the batch script, or give --listen host:port)"
        )
    })?;
    Ok(format!("{ip}:{port}"))
}

/// Where a host's fabric listens for `--fabric-listen auto`: this node's address, any port.
pub fn fabric_listen(env: &(impl Env + ?Sized)) -> anyhow::Result<String> {
    let node = env.var("SLURMD_NODENAME").or_else(hostname).ok_or_else(|| {
        anyhow::anyhow!("--fabric-listen auto: neither SLURMD_NODENAME nor the host name is known")
    })?;
    Ok(format!("{}:0", node_ip(&node)?))
}

/// The address `node` resolves to (IPv4 first), as the other nodes will reach it.
fn node_ip(node: &str) -> anyhow::Result<String> {
    let addrs: Vec<std::net::SocketAddr> = (node, 0)
        .to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("cannot resolve this node's name {node}: {e}"))?
        .collect();
    let ip = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .ok_or_else(|| anyhow::anyhow!("the node name {node} resolves to no address"))?
        .ip();
    Ok(match ip {
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    })
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

/// A host's defaults under Slurm: named `NODE-LOCALID`, on the island `NODE`.
fn host_identity(env: &(impl Env + ?Sized)) -> Option<(String, String)> {
    let node = env.var("SLURMD_NODENAME")?;
    let local = env.var("SLURM_LOCALID").unwrap_or_else(|| "0".into());
    Some((format!("{node}-{local}"), node))
}

/// Where and as what a host serves — `archipelago host` and a runtime-API program's host alike:
/// the values given, `auto` ones resolved from the Slurm job, unset name and island taken from
/// it (else `host-PID` on `default`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPlace {
    /// The devices offered, e.g. `cpu:0,cpu:1`.
    pub devices: String,
    /// Where its port listens.
    pub listen: String,
    /// The host's name.
    pub name: String,
    /// Its island.
    pub island: String,
}

impl HostPlace {
    /// Resolves the given values (`devices` and `listen` may be `auto`).
    pub fn resolve(
        env: &(impl Env + ?Sized),
        devices: &str,
        listen: &str,
        name: Option<String>,
        island: Option<String>,
    ) -> anyhow::Result<HostPlace> {
        let in_slurm = host_identity(env);
        Ok(HostPlace {
            devices: match devices {
                AUTO => self::devices(env, cfg!(feature = "cuda"))?,
                given => given.to_string(),
            },
            listen: match listen {
                AUTO => fabric_listen(env)?,
                given => given.to_string(),
            },
            name: name
                .or_else(|| in_slurm.as_ref().map(|(name, _)| name.clone()))
                .unwrap_or_else(|| format!("host-{}", std::process::id())),
            island: island
                .or_else(|| in_slurm.map(|(_, node)| node))
                .unwrap_or_else(|| "default".into()),
        })
    }
}

/// `--devices auto` under Slurm: the GPUs of this task in a build that runs them — all it sees
/// when Slurm bound GPUs per task (`--gpus-per-task`: `CUDA_VISIBLE_DEVICES` lists only its own),
/// else its share of the node's by `SLURM_LOCALID` (every task of the node sees them all: task
/// `l` of `t` takes the `l`-th of `t` equal slices, as torchrun's local rank does) — else one CPU
/// device per CPU of the task (`SLURM_CPUS_PER_TASK`, default 1).
pub fn devices(env: &(impl Env + ?Sized), cuda_build: bool) -> anyhow::Result<String> {
    if cuda_build && let Some(visible) = env.var("CUDA_VISIBLE_DEVICES") {
        let count = visible.split(',').filter(|g| !g.trim().is_empty()).count();
        let tasks = tasks_on_this_node(env)?;
        let local: usize = env.var("SLURM_LOCALID").and_then(|l| l.parse().ok()).unwrap_or(0);
        let (first, share) = if env.var("SLURM_GPUS_PER_TASK").is_none() && tasks > 1 {
            if count < tasks {
                anyhow::bail!(
                    "{tasks} tasks on this node share {count} GPU(s) (CUDA_VISIBLE_DEVICES={visible}): \
                     ask for --gpus-per-task or at most one task per GPU"
                );
            }
            (local * (count / tasks), count / tasks)
        } else {
            (0, count)
        };
        let gpus: Vec<String> = (first..first + share).map(|i| format!("cuda:{i}")).collect();
        return Ok(gpus.join(","));
    }
    let cpus = match env.var("SLURM_CPUS_PER_TASK") {
        None => 1,
        Some(n) => n
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| anyhow::anyhow!("SLURM_CPUS_PER_TASK={n} is not a CPU count"))?,
    };
    Ok((0..cpus)
        .map(|i| format!("cpu:{i}"))
        .collect::<Vec<_>>()
        .join(","))
}

/// Tasks of this step on this node: `SLURM_STEP_TASKS_PER_NODE` (or the job's
/// `SLURM_TASKS_PER_NODE`), Slurm's `2(x3),1` form, at index `SLURM_NODEID`; 1 when unset.
fn tasks_on_this_node(env: &(impl Env + ?Sized)) -> anyhow::Result<usize> {
    let Some(spec) = env
        .var("SLURM_STEP_TASKS_PER_NODE")
        .or_else(|| env.var("SLURM_TASKS_PER_NODE"))
    else {
        return Ok(1);
    };
    let node: usize = env.var("SLURM_NODEID").and_then(|n| n.parse().ok()).unwrap_or(0);
    let mut per_node = Vec::new();
    for group in spec.split(',') {
        let (tasks, repeat) = match group.split_once("(x") {
            Some((tasks, rest)) => (tasks, rest.trim_end_matches(')')),
            None => (group, "1"),
        };
        let bad = || anyhow::anyhow!("SLURM_TASKS_PER_NODE={spec}: `{group}` is not Slurm's N or N(xM)");
        let (tasks, repeat): (usize, usize) = (
            tasks.parse().map_err(|_| bad())?,
            repeat.parse().map_err(|_| bad())?,
        );
        per_node.extend(std::iter::repeat_n(tasks, repeat.min(100_000)));
    }
    per_node
        .get(node)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("SLURM_TASKS_PER_NODE={spec} has no entry for SLURM_NODEID={node}"))
}

/// Expands a Slurm host list: `a,b[1-3,07],c[01-02]x` → `a, b1, b2, b3, b07, c01x, c02x`
/// (ranges keep their zero padding; one bracket group per name, as Slurm writes them).
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    let mut rest = list.trim();
    while !rest.is_empty() {
        // A name ends at the first comma outside brackets.
        let mut depth = 0i32;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '[' => 1,
                    ']' => -1,
                    _ => 0,
                };
                c == ',' && depth == 0
            })
            .map(|(i, _)| i)
            .unwrap_or(rest.len());
        let item = &rest[..end];
        rest = rest[end..].trim_start_matches(',');
        match item.split_once('[') {
            None if item.contains(']') => return Err(format!("`{item}`: `]` without `[`")),
            None => names.push(item.to_string()),
            Some((prefix, tail)) => {
                let (ranges, suffix) = tail
                    .split_once(']')
                    .ok_or_else(|| format!("`{item}`: `[` without `]`"))?;
                if suffix.contains(['[', ']']) {
                    return Err(format!("`{item}`: one bracket group per name"));
                }
                for range in ranges.split(',') {
                    let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                    let width = lo.len();
                    let parse = |s: &str| {
                        s.parse::<u64>()
                            .map_err(|_| format!("`{item}`: `{range}` is not a number range"))
                    };
                    let (lo, hi) = (parse(lo)?, parse(hi)?);
                    if hi < lo || hi - lo > 100_000 {
                        return Err(format!("`{item}`: the range `{range}` is empty or too large"));
                    }
                    names.extend((lo..=hi).map(|n| format!("{prefix}{n:0width$}{suffix}")));
                }
            }
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists_expand_as_slurm_writes_them() {
        let names = |s: &str| expand_hostlist(s).unwrap();
        assert_eq!(names("vm"), ["vm"]);
        assert_eq!(names("a,b"), ["a", "b"]);
        assert_eq!(names("node[01-03,07]"), ["node01", "node02", "node03", "node07"]);
        assert_eq!(names("gpu[8-10]x,cpu1"), ["gpu8x", "gpu9x", "gpu10x", "cpu1"]);
        assert_eq!(names("n[1,3],m[09-11]"), ["n1", "n3", "m09", "m10", "m11"]);
        for bad in ["n[1-", "n]1", "n[a-b]", "n[3-1]", "n[1-2][3]", "n[0-9999999]"] {
            assert!(expand_hostlist(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn the_controller_is_found_on_the_first_node_at_the_jobs_port() {
        let env: &[(&str, &str)] = &[("SLURM_JOB_ID", "4711"), ("SLURM_JOB_NODELIST", "node[03-04]")];
        assert_eq!(controller_addr(env).unwrap(), "node03:24711");
        let env: &[(&str, &str)] = &[
            ("SLURM_JOB_ID", "4711"),
            ("SLURM_JOB_NODELIST", "node[03-04]"),
            (PORT_ENV, "7070"),
        ];
        assert_eq!(controller_addr(env).unwrap(), "node03:7070");
    }

    #[test]
    fn outside_slurm_auto_names_the_variable_and_the_fix() {
        let error = controller_addr(&[][..]).unwrap_err().to_string();
        assert!(
            error.contains("SLURM_JOB_ID") && error.contains("sbatch"),
            "{error}"
        );
        let env: &[(&str, &str)] = &[("SLURM_JOB_ID", "1")];
        let error = controller_addr(env).unwrap_err().to_string();
        assert!(error.contains("SLURM_JOB_NODELIST"), "{error}");
        let env: &[(&str, &str)] = &[("SLURM_JOB_ID", "1"), ("SLURM_JOB_NODELIST", "n[1-")];
        let error = controller_addr(env).unwrap_err().to_string();
        assert!(error.contains("SLURM_JOB_NODELIST=n[1-"), "{error}");
    }

    #[test]
    fn hosts_take_their_name_island_and_devices_from_the_task() {
        let env: &[(&str, &str)] = &[
            ("SLURMD_NODENAME", "node07"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_CPUS_PER_TASK", "2"),
            ("CUDA_VISIBLE_DEVICES", "2,3"),
        ];
        let place = HostPlace::resolve(env, "cpu:3", "127.0.0.1:0", None, None).unwrap();
        assert_eq!(
            (place.name.as_str(), place.island.as_str()),
            ("node07-1", "node07")
        );
        let given =
            HostPlace::resolve(env, "cpu:3", "127.0.0.1:0", Some("h".into()), Some("i".into())).unwrap();
        assert_eq!(
            (given.devices.as_str(), given.name.as_str(), given.island.as_str()),
            ("cpu:3", "h", "i")
        );
        let outside = HostPlace::resolve(&[][..], "cpu:0", "127.0.0.1:0", None, None).unwrap();
        assert_eq!(outside.island, "default");
        assert_eq!(devices(env, false).unwrap(), "cpu:0,cpu:1");
        assert_eq!(devices(env, true).unwrap(), "cuda:0,cuda:1");
        assert_eq!(devices(&[][..], false).unwrap(), "cpu:0");
        // Four tasks on a node that all see its 8 GPUs: task 2 takes GPUs 4 and 5.
        let shared: &[(&str, &str)] = &[
            ("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "2,4(x2)"),
        ];
        assert_eq!(devices(shared, true).unwrap(), "cuda:4,cuda:5");
        // Bound per task by Slurm: all it sees is its own.
        let bound: &[(&str, &str)] = &[
            ("CUDA_VISIBLE_DEVICES", "5"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_GPUS_PER_TASK", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "4"),
        ];
        assert_eq!(devices(bound, true).unwrap(), "cuda:0");
        let crowded: &[(&str, &str)] = &[("CUDA_VISIBLE_DEVICES", "0"), ("SLURM_STEP_TASKS_PER_NODE", "2")];
        assert!(
            devices(crowded, true)
                .unwrap_err()
                .to_string()
                .contains("--gpus-per-task")
        );
        let env: &[(&str, &str)] = &[("SLURM_CPUS_PER_TASK", "none")];
        assert!(devices(env, false).is_err());
    }
}
