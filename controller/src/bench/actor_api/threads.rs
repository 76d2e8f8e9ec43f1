//! What the threads of the chain's processes did during a round, from Linux's per-thread
//! `schedstat` and `sched`: CPU time, times scheduled in and CPU migrations, summed and by
//! thread (process role and thread name), so a figure shows which thread a hop wakes.

use std::collections::BTreeMap;

/// What some threads used so far (zeros where unknown).
#[derive(Default, Clone, Copy)]
pub(super) struct Use {
    /// On-CPU nanoseconds.
    pub(super) ns: u64,
    /// Times a thread was scheduled in.
    pub(super) runs: u64,
    /// Times a thread moved to another CPU.
    pub(super) migrations: u64,
}

impl Use {
    fn plus(self, other: Use) -> Use {
        Use {
            ns: self.ns + other.ns,
            runs: self.runs + other.runs,
            migrations: self.migrations + other.migrations,
        }
    }

    fn thread(task: &std::path::Path) -> Use {
        let schedstat = std::fs::read_to_string(task.join("schedstat")).unwrap_or_default();
        let fields: Vec<u64> = schedstat
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        let sched = std::fs::read_to_string(task.join("sched")).unwrap_or_default();
        let migrations = (sched.lines())
            .find(|l| l.starts_with("se.nr_migrations"))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.trim().parse().ok());
        Use {
            ns: fields.first().copied().unwrap_or(0),
            runs: fields.get(2).copied().unwrap_or(0),
            migrations: migrations.unwrap_or(0),
        }
    }
}

/// The use of every thread of some processes at one moment, by `role/thread name` (threads of
/// one name in one process summed).
#[derive(Default)]
pub(super) struct Snapshot(BTreeMap<String, Use>);

impl Snapshot {
    /// Every thread of the processes `pids`, the first named `driver`, the others `host{n}`.
    pub(super) fn of(pids: &[u32]) -> Snapshot {
        let mut by_thread = BTreeMap::new();
        for (n, pid) in pids.iter().enumerate() {
            let role = if n == 0 {
                "driver".to_string()
            } else {
                format!("host{n}")
            };
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for task in tasks.filter_map(|t| t.ok()).map(|t| t.path()) {
                let name = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
                let key = format!("{role}/{}", name.trim());
                let sum: &mut Use = by_thread.entry(key).or_default();
                *sum = sum.plus(Use::thread(&task));
            }
        }
        Snapshot(by_thread)
    }

    /// Summed over every thread.
    pub(super) fn total(&self) -> Use {
        self.0.values().fold(Use::default(), |sum, t| sum.plus(*t))
    }

    /// Each thread's times scheduled in and µs on a CPU since `before`, per iteration of `n`.
    pub(super) fn since(&self, before: &Snapshot, n: f64) -> BTreeMap<String, [f64; 2]> {
        (self.0.iter())
            .map(|(key, now)| {
                let then = before.0.get(key).copied().unwrap_or_default();
                let runs = now.runs.saturating_sub(then.runs) as f64 / n;
                let cpu_us = now.ns.saturating_sub(then.ns) as f64 / n / 1e3;
                (key.clone(), [runs, cpu_us])
            })
            .collect()
    }
}
