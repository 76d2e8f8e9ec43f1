//! Consistency per task and the workers' clocks (Li et al., OSDI 2014, §3.3; Ho et al.'s stale
//! synchronous parallel, NIPS 2013).
//!
//! A worker's *clock* is the number of clocks it has pushed, i.e. the clock it works on next.
//! Every worker pushes to every server at every clock (an empty push where it touched none of
//! the server's keys), so each server knows every worker's clock.
//!
//! - [`Consistency::Sequential`] (`K = 0`): a worker starts clock `c` only once every worker
//!   has pushed clock `c − 1`, and a server applies clock `c` as *the sum of all `W` pushes of
//!   `c`*, at once, in worker order; every pull of `c` sees exactly clocks `0..c`. With SGD this
//!   is synchronous data parallelism.
//! - [`Consistency::BoundedDelay`]`(K)`: a worker starts clock `c` once the slowest worker has
//!   pushed at least `c − K` clocks (its pull waits only while the slowest is more than `K`
//!   behind). Clocks are still applied whole (the sum of their `W` pushes, once the last is in),
//!   so a pull of `c` sees every clock `< c − K` and possibly later ones.
//! - [`Consistency::Eventual`] (`K = ∞`, Hogwild-like): pulls never wait and a push is applied
//!   when it arrives, alone.

use serde::{Deserialize, Serialize};

/// The consistency model of a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// `K = 0`: each clock applied as the sum of all pushes, every worker in lockstep.
    Sequential,
    /// A worker may start up to `K` clocks ahead of the slowest worker.
    BoundedDelay(u64),
    /// No bound: pushes applied as they arrive, pulls never wait.
    Eventual,
}

impl Consistency {
    /// The model of staleness `k` (`None`: eventual).
    pub fn with_staleness(k: Option<u64>) -> Consistency {
        match k {
            Some(0) => Consistency::Sequential,
            Some(k) => Consistency::BoundedDelay(k),
            None => Consistency::Eventual,
        }
    }

    /// The bound `K` (`None` for eventual).
    pub fn bound(&self) -> Option<u64> {
        match self {
            Consistency::Sequential => Some(0),
            Consistency::BoundedDelay(k) => Some(*k),
            Consistency::Eventual => None,
        }
    }

    /// Whether clocks are applied whole (the sum of their pushes), not push by push.
    pub fn aggregates(&self) -> bool {
        self.bound().is_some()
    }
}

impl std::fmt::Display for Consistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Consistency::Sequential => write!(f, "sequential (K = 0)"),
            Consistency::BoundedDelay(k) => write!(f, "bounded delay K = {k}"),
            Consistency::Eventual => write!(f, "eventual (K = ∞)"),
        }
    }
}

impl std::str::FromStr for Consistency {
    type Err = String;

    /// `0`, a positive integer `K`, or `inf` / `eventual`.
    fn from_str(s: &str) -> Result<Consistency, String> {
        let s = s.trim();
        if s == "inf" || s == "eventual" || s == "∞" {
            return Ok(Consistency::Eventual);
        }
        match s.parse::<i64>() {
            Ok(k) if k < 0 => Err(format!(
                "--staleness {k}: a bounded delay is at least 0 (0 = sequential, K > 0 = bounded delay, inf = eventual)"
            )),
            Ok(k) => Ok(Consistency::with_staleness(Some(k as u64))),
            Err(_) => Err(format!(
                "--staleness `{s}`: give 0 (sequential), a bound K > 0, or inf (eventual)"
            )),
        }
    }
}

/// What a server logs about the workers' clocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ClockEvent {
    /// `worker` was allowed to start `clock`; `pushed[v]` is worker `v`'s clock then.
    Granted {
        /// The worker.
        worker: usize,
        /// The clock it starts.
        clock: u64,
        /// Every worker's clock (clocks pushed) at that moment.
        pushed: Vec<u64>,
    },
    /// Clock `clock` was applied (the sum of its pushes; under eventual consistency, one push).
    Applied {
        /// The clock.
        clock: u64,
        /// Every worker's clock at that moment.
        pushed: Vec<u64>,
    },
}

/// Every worker's clock as one server sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerClocks {
    pushed: Vec<u64>,
}

impl WorkerClocks {
    /// `workers` workers, all at clock `start`.
    pub fn new(workers: usize, start: u64) -> WorkerClocks {
        WorkerClocks {
            pushed: vec![start; workers],
        }
    }

    /// From a checkpoint's clocks.
    pub fn from_clocks(pushed: Vec<u64>) -> WorkerClocks {
        WorkerClocks { pushed }
    }

    /// Each worker's clock.
    pub fn clocks(&self) -> &[u64] {
        &self.pushed
    }

    /// The slowest worker's clock.
    pub fn slowest(&self) -> u64 {
        self.pushed.iter().copied().min().unwrap_or(0)
    }

    /// Whether a worker may start `clock` under `consistency`.
    pub fn may_start(&self, clock: u64, consistency: Consistency) -> bool {
        consistency
            .bound()
            .is_none_or(|k| clock <= self.slowest().saturating_add(k))
    }

    /// Checks that `worker` exists and is at `clock` (a pull or push of another clock is a bug
    /// or a hostile peer).
    pub fn check(&self, worker: usize, clock: u64, what: &str) -> Result<(), String> {
        match self.pushed.get(worker) {
            None => Err(format!(
                "{what} from worker {worker}, but the job has {} workers",
                self.pushed.len()
            )),
            Some(&at) if at != clock => Err(format!(
                "a {what} of clock {clock} from worker {worker}, which is at clock {at}"
            )),
            Some(_) => Ok(()),
        }
    }

    /// `worker` has pushed its clock.
    pub fn advance(&mut self, worker: usize) {
        self.pushed[worker] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_parses_with_the_fix_named() {
        assert_eq!("0".parse(), Ok(Consistency::Sequential));
        assert_eq!("2".parse(), Ok(Consistency::BoundedDelay(2)));
        assert_eq!("inf".parse(), Ok(Consistency::Eventual));
        let e = "-1".parse::<Consistency>().unwrap_err();
        assert!(e.contains("at least 0") && e.contains("inf = eventual"), "{e}");
        assert!("x".parse::<Consistency>().is_err());
    }

    #[test]
    fn the_bound_holds_on_the_slowest_worker() {
        let mut clocks = WorkerClocks::new(3, 0);
        assert!(clocks.may_start(0, Consistency::Sequential));
        clocks.advance(0);
        assert!(!clocks.may_start(1, Consistency::Sequential));
        assert!(clocks.may_start(1, Consistency::BoundedDelay(1)));
        assert!(!clocks.may_start(2, Consistency::BoundedDelay(1)));
        assert!(clocks.may_start(1000, Consistency::Eventual));
        assert!(clocks.check(0, 1, "push").is_ok());
        assert!(clocks.check(0, 0, "push").unwrap_err().contains("at clock 1"));
        assert!(clocks.check(3, 0, "pull").unwrap_err().contains("3 workers"));
    }
}
