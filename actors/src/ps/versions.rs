//! Version vectors per key range (Li et al., OSDI 2014, §4.1 "Vector Clocks"): a server keeps,
//! for every arc of the ring it holds, the next clock of each worker whose push has not reached
//! that arc yet. Every push of a clock covers whole ranges (a worker sends every part to every
//! server every clock, with no keys where it touched none), so the vectors of the keys of one
//! range are equal and one vector per range replaces one per key — the paper's point: a few
//! vectors per server instead of one per key.
//!
//! They serve three ends: a retried push (after a failover) that already reached an arc is
//! applied once; a pull can ask for "at least version `v`" of its keys' ranges (every worker's
//! pushes of clocks below `v` applied there); and a failover hands the new chain members the
//! vectors of the ranges they take, so recovery knows what each replica holds.
//!
//! Arcs are kept as a refinement of the current ring's ranges: removing a server merges its
//! ranges into the next ones, and the arcs of the merged pieces stay apart (their vectors may
//! differ while a push is in flight), each one inside exactly one range of the new ring.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ring::{Ring, ServerId, ring_position};

/// One arc `(start, end]` of the ring (going round when `start ≥ end`) and its version vector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeVersion {
    /// The previous point's position (exclusive).
    pub start: u64,
    /// The arc's last position (inclusive); its name.
    pub end: u64,
    /// Per worker, the next clock whose push has not reached the arc.
    pub next: Vec<u64>,
    /// The next clock to apply to the arc (aggregating models: a clock is applied to an arc
    /// once every worker's push of it reached the arc).
    #[serde(default)]
    pub applied: u64,
}

impl RangeVersion {
    /// Whether ring position `at` is on the arc.
    pub fn contains(&self, at: u64) -> bool {
        if self.start < self.end {
            self.start < at && at <= self.end
        } else {
            at > self.start || at <= self.end
        }
    }

    /// The arc's version: the clock below which every worker's pushes have reached it.
    pub fn version(&self) -> u64 {
        self.next.iter().copied().min().unwrap_or(0)
    }
}

/// A server's version vectors, one per arc it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeVersions {
    workers: usize,
    /// By end position.
    arcs: BTreeMap<u64, RangeVersion>,
    /// This server's chain position at each arc on the current ring, by end position (see
    /// [`RangeVersions::place`]).
    positions: BTreeMap<u64, Option<usize>>,
}

impl RangeVersions {
    /// The vectors of server `me` on `ring` with `replicas` copies of each range: every range
    /// whose chain holds it, every worker at `first_clock`.
    pub fn new(
        ring: &Ring,
        me: ServerId,
        replicas: usize,
        workers: usize,
        first_clock: u64,
    ) -> RangeVersions {
        let arcs = (ring.ranges().into_iter())
            .filter(|range| ring.range_chain(range, replicas).contains(&me))
            .map(|range| {
                let arc = RangeVersion {
                    start: range.start,
                    end: range.end,
                    next: vec![first_clock; workers],
                    applied: first_clock,
                };
                (range.end, arc)
            })
            .collect();
        let mut versions = RangeVersions {
            workers,
            arcs,
            positions: BTreeMap::new(),
        };
        versions.place(ring, me, replicas);
        versions
    }

    /// Learns this server's (`me`) chain position at every arc on `ring` (after a new ring or
    /// new arcs).
    pub fn place(&mut self, ring: &Ring, me: ServerId, replicas: usize) {
        self.positions = (self.arcs.keys())
            .map(|&end| (end, ring.chain_at(end, replicas).iter().position(|&s| s == me)))
            .collect();
    }

    /// The arcs at chain position `part`, by end position.
    fn at_position(&self, part: usize) -> impl Iterator<Item = u64> + '_ {
        (self.positions.iter())
            .filter(move |(_, p)| **p == Some(part))
            .map(|(&end, _)| end)
    }

    /// Whether no key at chain position `part` has `worker`'s push of `clock` (the common case,
    /// answered without looking keys up).
    pub fn none_has(&self, part: usize, worker: usize, clock: u64) -> bool {
        self.at_position(part)
            .filter_map(|end| self.arcs.get(&end)?.next.get(worker))
            .all(|&next| next <= clock)
    }

    /// Whether every arc at chain position `part` that has not had `clock` applied is in `ends`.
    pub fn all_at_position_in(&self, part: usize, clock: u64, ends: &std::collections::HashSet<u64>) -> bool {
        self.at_position(part)
            .all(|end| ends.contains(&end) || self.arcs.get(&end).is_none_or(|a| a.applied > clock))
    }

    /// The arc holding ring position `at`, when this server holds it.
    fn arc_at(&self, at: u64) -> Option<&RangeVersion> {
        let candidate = (self.arcs.range(at..).next())
            .or_else(|| self.arcs.iter().next())
            .map(|(_, arc)| arc)?;
        candidate.contains(at).then_some(candidate)
    }

    /// The arc of `key` among `arcs` (a server's [`RangeVersions::arcs`], as its reports carry
    /// them).
    pub fn find(arcs: &[RangeVersion], key: u64) -> Option<&RangeVersion> {
        let at = ring_position(key);
        arcs.iter().find(|arc| arc.contains(at))
    }

    /// The version vector of `key`'s arc, when this server holds it.
    pub fn of_key(&self, key: u64) -> Option<&RangeVersion> {
        self.arc_at(ring_position(key))
    }

    /// Whether `worker`'s push of `clock` has reached `key`'s arc already.
    pub fn has(&self, key: u64, worker: usize, clock: u64) -> bool {
        self.of_key(key)
            .and_then(|arc| arc.next.get(worker))
            .is_some_and(|&next| next > clock)
    }

    /// Records that `worker`'s push of `clock` reached every arc at which this server is at
    /// chain position `part` of the ring it was last [placed](RangeVersions::place) on.
    pub fn record(&mut self, part: usize, worker: usize, clock: u64) {
        for (end, position) in &self.positions {
            if *position == Some(part)
                && let Some(next) = self.arcs.get_mut(end).and_then(|a| a.next.get_mut(worker))
            {
                *next = (*next).max(clock + 1);
            }
        }
    }

    /// The end of `key`'s arc, when this server holds it.
    pub fn arc_end_of(&self, key: u64) -> Option<u64> {
        self.of_key(key).map(|arc| arc.end)
    }

    /// The lowest applied clock of the arcs of `keys` (`None` when none is held here).
    pub fn applied_of(&self, keys: &[u64]) -> Option<u64> {
        keys.iter()
            .filter_map(|&k| self.of_key(k).map(|a| a.applied))
            .min()
    }

    /// The lowest version over every arc held.
    pub fn min_version(&self) -> u64 {
        self.arcs.values().map(RangeVersion::version).min().unwrap_or(0)
    }

    /// The lowest applied clock over every arc held.
    pub fn min_applied(&self) -> Option<u64> {
        self.arcs.values().map(|a| a.applied).min()
    }

    /// The arcs every worker's push of their next clock to apply has reached, by that clock:
    /// `(clock, arc ends)`, clocks ascending.
    pub fn ready(&self) -> BTreeMap<u64, Vec<u64>> {
        let mut ready: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for arc in self.arcs.values().filter(|a| a.version() > a.applied) {
            ready.entry(arc.applied).or_default().push(arc.end);
        }
        ready
    }

    /// The arcs `ends` had `clock` applied.
    pub fn mark_applied(&mut self, ends: &[u64], clock: u64) {
        for end in ends {
            if let Some(arc) = self.arcs.get_mut(end) {
                arc.applied = arc.applied.max(clock + 1);
            }
        }
    }

    /// The lowest version of the arcs of `keys` (`None` when none is held here).
    pub fn version_of(&self, keys: &[u64]) -> Option<u64> {
        keys.iter()
            .filter_map(|&k| self.of_key(k).map(RangeVersion::version))
            .min()
    }

    /// The arcs server `me` hands over when the ring goes from `old` to `new`: for every arc
    /// whose new chain has members its old chain lacked, a copy for each of them — sent by the
    /// first member of the new chain that held it, as the keys are.
    pub fn handover(
        &self,
        old: &Ring,
        new: &Ring,
        me: ServerId,
        replicas: usize,
    ) -> Vec<(ServerId, RangeVersion)> {
        let mut out = Vec::new();
        for arc in self.arcs.values() {
            let before = old.chain_at(arc.end, replicas);
            let after = new.chain_at(arc.end, replicas);
            if after.iter().find(|&&s| before.contains(&s)) != Some(&me) {
                continue;
            }
            for &target in after.iter().filter(|&&s| !before.contains(&s)) {
                out.push((target, arc.clone()));
            }
        }
        out
    }

    /// Takes arcs handed over by a failover.
    pub fn install(&mut self, arcs: Vec<RangeVersion>) -> Result<(), String> {
        for arc in arcs {
            if arc.next.len() != self.workers {
                return Err(format!(
                    "a version vector of {} workers for a job of {}",
                    arc.next.len(),
                    self.workers
                ));
            }
            if let Some(held) = self.arcs.get(&arc.end)
                && held != &arc
            {
                return Err(format!(
                    "arc ..{} handed over as {:?}, but held here as {:?}",
                    arc.end, arc.next, held.next
                ));
            }
            self.arcs.insert(arc.end, arc);
        }
        Ok(())
    }

    /// Every arc held, in ring order.
    pub fn arcs(&self) -> Vec<RangeVersion> {
        self.arcs.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring() -> Ring {
        Ring::new(0..3, 8).unwrap()
    }

    /// Keys spread over the whole circle.
    fn keys() -> Vec<u64> {
        (0..2000u64).map(|k| k * 7919).collect()
    }

    #[test]
    fn each_server_holds_the_arcs_of_exactly_the_keys_its_chains_give_it() {
        let ring = ring();
        for me in 0..3 {
            let versions = RangeVersions::new(&ring, me, 2, 2, 0);
            for key in keys() {
                let held = ring.chain(key, 2).contains(&me);
                assert_eq!(versions.of_key(key).is_some(), held, "server {me}, key {key}");
            }
        }
    }

    #[test]
    fn a_push_reaches_only_the_arcs_at_its_chain_position() {
        let ring = ring();
        let mut versions = RangeVersions::new(&ring, 1, 2, 2, 0);
        versions.record(0, 1, 0);
        for key in keys() {
            let chain = ring.chain(key, 2);
            match chain.iter().position(|&s| s == 1) {
                Some(0) => {
                    assert!(versions.has(key, 1, 0));
                    assert!(!versions.has(key, 0, 0), "worker 0 pushed nothing");
                }
                Some(_) => assert!(!versions.has(key, 1, 0), "part 1 has not come"),
                None => assert!(!versions.has(key, 1, 0)),
            }
        }
        versions.record(1, 1, 0);
        versions.record(0, 0, 0);
        versions.record(1, 0, 0);
        let held: Vec<u64> = keys()
            .into_iter()
            .filter(|&k| ring.chain(k, 2).contains(&1))
            .collect();
        assert_eq!(
            versions.version_of(&held),
            Some(1),
            "every worker's clock 0 is everywhere"
        );
        assert!(
            held.iter()
                .all(|&k| versions.has(k, 0, 0) && !versions.has(k, 0, 1))
        );
    }

    #[test]
    fn after_a_failover_every_new_member_learns_what_its_new_ranges_hold() {
        let old = ring();
        let mut new = old.clone();
        new.remove(1).unwrap();
        let mut servers: Vec<RangeVersions> =
            (0..3).map(|me| RangeVersions::new(&old, me, 2, 2, 0)).collect();
        // Worker 0's clock 0 reached everything; worker 1's clock 0 reached the heads only.
        for v in servers.iter_mut() {
            for part in 0..2 {
                v.record(part, 0, 0);
            }
            v.record(0, 1, 0);
        }
        let handed: Vec<(ServerId, RangeVersion)> = [0, 2]
            .iter()
            .flat_map(|&me| servers[me].handover(&old, &new, me, 2))
            .collect();
        assert!(
            handed.iter().all(|(to, _)| *to != 1),
            "nothing goes to the lost server"
        );
        for target in [0, 2] {
            let arcs: Vec<RangeVersion> = (handed.iter())
                .filter(|(to, _)| *to == target)
                .map(|(_, arc)| arc.clone())
                .collect();
            servers[target].install(arcs).unwrap();
        }
        for key in keys() {
            let old_chain = old.chain(key, 2);
            for &me in &new.chain(key, 2) {
                let arc = servers[me]
                    .of_key(key)
                    .unwrap_or_else(|| panic!("server {me} holds key {key} but no version of it"));
                assert_eq!(arc.next[0], 1, "worker 0's push is everywhere");
                // Worker 1's reached the old head only: its copy says so wherever it went.
                let at_head = arc.next[1] == 1;
                let from_head = old_chain.first() == Some(&me)
                    || (!old_chain.contains(&me)
                        && new.chain(key, 2).iter().find(|s| old_chain.contains(s)) == old_chain.first());
                assert_eq!(
                    at_head, from_head,
                    "server {me}, key {key}, old chain {old_chain:?}"
                );
            }
        }
        // A copy that disagrees with what a server holds is refused, not merged.
        let mut wrong = servers[0].arcs()[0].clone();
        wrong.next[0] += 5;
        assert!(servers[0].install(vec![wrong]).is_err());
        assert!(
            servers[0]
                .install(vec![RangeVersion {
                    start: 0,
                    end: 1,
                    next: vec![0],
                    applied: 0,
                }])
                .is_err()
        );
    }
}
