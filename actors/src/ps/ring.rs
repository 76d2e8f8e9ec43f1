//! The consistent-hash ring of the parameter server (Li et al., OSDI 2014, §4.3, after Karger
//! et al.'s consistent hashing, STOC 1997): keys and servers are hashed onto one circle of
//! `u64` positions; every server sits at `vnodes` points (virtual nodes), and the *key range*
//! of a point is the arc from the previous point (exclusive) to it (inclusive). A key belongs
//! to the server of the first point at or after its position, going round.
//!
//! Adding a server inserts its points: each splits one arc, and only the keys of the split-off
//! part move, all of them to the new server — about `1/(n+1)` of the keys for `n` servers.
//! Removing a server hands each of its arcs to the next point's server. A range is named by the
//! position of its end point, which no other server's arrival or departure changes: the next
//! slice hangs its version vector (Li et al.'s range-based vector clocks) and its replica chain
//! ([`Ring::chain`]: the range's owner, then the next distinct servers clockwise) on that name.
//!
//! ```
//! use archipelago_actors::ps::Ring;
//! let mut ring = Ring::new(0..3, 32).unwrap();
//! let before = ring.owner(42);
//! ring.add(3).unwrap();
//! assert!(ring.owner(42) == before || ring.owner(42) == 3);
//! print!("{}", ring.describe());
//! ```

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// A server of a job, by index (the server actor's index among the job's servers).
pub type ServerId = usize;

/// The ring's position of `x`: the finaliser of SplitMix64 (Steele et al. 2014), a bijection of
/// `u64` that spreads consecutive keys over the whole circle.
pub fn ring_position(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The position of virtual node `vnode` of `server`.
fn point_of(server: ServerId, vnode: usize) -> u64 {
    ring_position(ring_position(server as u64 ^ 0x5EED_0000_0000_0000) ^ vnode as u64)
}

/// One key range: the arc `(start, end]` of the ring (going round when `start ≥ end`), owned by
/// the server of the point at `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRange {
    /// The previous point's position (exclusive).
    pub start: u64,
    /// This range's point (inclusive); also the range's stable name.
    pub end: u64,
    /// The server holding it.
    pub owner: ServerId,
}

impl KeyRange {
    /// The share of the circle the arc covers (0..=1).
    pub fn share(&self) -> f64 {
        let len = self.end.wrapping_sub(self.start);
        if len == 0 { 1.0 } else { len as f64 / 2f64.powi(64) }
    }
}

/// Why a ring cannot be built or changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// No server at all.
    #[error("a ring needs at least one server")]
    Empty,
    /// Zero virtual nodes.
    #[error("a server needs at least one virtual node on the ring")]
    NoVnodes,
    /// The server is on the ring already.
    #[error("server {0} is on the ring already")]
    Present(ServerId),
    /// The server is not on the ring.
    #[error("server {0} is not on the ring")]
    Absent(ServerId),
    /// Removing the last server.
    #[error("server {0} is the last on the ring: a ring needs at least one server")]
    Last(ServerId),
}

/// The consistent-hash ring over a job's servers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ring {
    vnodes: usize,
    /// `(position, server)`, sorted by position (ties by server).
    points: Vec<(u64, ServerId)>,
}

impl Ring {
    /// A ring of `servers`, each at `vnodes` points.
    pub fn new(servers: impl IntoIterator<Item = ServerId>, vnodes: usize) -> Result<Ring, RingError> {
        if vnodes == 0 {
            return Err(RingError::NoVnodes);
        }
        let mut ring = Ring {
            vnodes,
            points: Vec::new(),
        };
        for server in servers {
            ring.add(server)?;
        }
        if ring.points.is_empty() {
            return Err(RingError::Empty);
        }
        Ok(ring)
    }

    /// Virtual nodes per server.
    pub fn vnodes(&self) -> usize {
        self.vnodes
    }

    /// The servers on the ring, ascending.
    pub fn servers(&self) -> Vec<ServerId> {
        let mut servers: Vec<ServerId> = self.points.iter().map(|p| p.1).collect();
        servers.sort_unstable();
        servers.dedup();
        servers
    }

    /// Inserts `server`'s points: it takes over part of the arcs its points split.
    pub fn add(&mut self, server: ServerId) -> Result<(), RingError> {
        if self.points.iter().any(|p| p.1 == server) {
            return Err(RingError::Present(server));
        }
        self.points
            .extend((0..self.vnodes).map(|v| (point_of(server, v), server)));
        self.points.sort_unstable();
        Ok(())
    }

    /// Removes `server`'s points: each of its arcs goes to the next point's server.
    pub fn remove(&mut self, server: ServerId) -> Result<(), RingError> {
        if !self.points.iter().any(|p| p.1 == server) {
            return Err(RingError::Absent(server));
        }
        if self.points.iter().all(|p| p.1 == server) {
            return Err(RingError::Last(server));
        }
        self.points.retain(|p| p.1 != server);
        Ok(())
    }

    /// The index in `points` of the point whose range holds `key`.
    fn point_index(&self, key: u64) -> usize {
        self.index_at(ring_position(key))
    }

    /// The index in `points` of the point whose range holds ring position `at`.
    fn index_at(&self, at: u64) -> usize {
        let i = self.points.partition_point(|p| p.0 < at);
        if i == self.points.len() { 0 } else { i }
    }

    /// The chain of the range holding ring position `at` (see [`Ring::chain`]).
    pub fn chain_at(&self, at: u64, r: usize) -> Vec<ServerId> {
        self.chain_from(self.index_at(at), r)
    }

    /// The server that holds `key`.
    pub fn owner(&self, key: u64) -> ServerId {
        self.points[self.point_index(key)].1
    }

    /// The range that holds `key`.
    pub fn range_of(&self, key: u64) -> KeyRange {
        let i = self.point_index(key);
        let prev = if i == 0 { self.points.len() - 1 } else { i - 1 };
        KeyRange {
            start: self.points[prev].0,
            end: self.points[i].0,
            owner: self.points[i].1,
        }
    }

    /// The first `r` distinct servers clockwise from `key`'s range, its owner first: the chain
    /// a range is replicated on (fewer when the ring has fewer servers).
    pub fn chain(&self, key: u64, r: usize) -> Vec<ServerId> {
        self.chain_from(self.point_index(key), r)
    }

    /// The chain of `range` (a range of this ring, by its end point): its owner, then the next
    /// `r − 1` distinct servers clockwise.
    pub fn range_chain(&self, range: &KeyRange, r: usize) -> Vec<ServerId> {
        let at = self.points.partition_point(|p| p.0 < range.end);
        self.chain_from(if at == self.points.len() { 0 } else { at }, r)
    }

    fn chain_from(&self, start: usize, r: usize) -> Vec<ServerId> {
        let mut chain = Vec::with_capacity(r);
        for k in 0..self.points.len() {
            let server = self.points[(start + k) % self.points.len()].1;
            if chain.len() == r {
                break;
            }
            if !chain.contains(&server) {
                chain.push(server);
            }
        }
        chain
    }

    /// Every range, in ring order.
    pub fn ranges(&self) -> Vec<KeyRange> {
        let n = self.points.len();
        (0..n)
            .map(|i| KeyRange {
                start: self.points[(i + n - 1) % n].0,
                end: self.points[i].0,
                owner: self.points[i].1,
            })
            .collect()
    }

    /// Each server's share of the circle, by server.
    pub fn shares(&self) -> Vec<(ServerId, f64)> {
        self.servers()
            .into_iter()
            .map(|s| {
                let share = self
                    .ranges()
                    .iter()
                    .filter(|r| r.owner == s)
                    .map(KeyRange::share)
                    .sum();
                (s, share)
            })
            .collect()
    }

    /// The ring in words: servers, their points and shares, and the first ranges.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "ring: {} servers × {} virtual nodes = {} ranges\n",
            self.servers().len(),
            self.vnodes,
            self.points.len()
        );
        for (server, share) in self.shares() {
            let _ = writeln!(out, "  server {server}: {:.1}% of the key space", 100.0 * share);
        }
        for range in self.ranges().iter().take(8) {
            let _ = writeln!(
                out,
                "  range ({:#018x}, {:#018x}] → server {}",
                range.start, range.end, range.owner
            );
        }
        if self.points.len() > 8 {
            let _ = writeln!(out, "  … {} more ranges", self.points.len() - 8);
        }
        out
    }
}

/// The share of `keys` whose server differs between placements `before` and `after`.
pub fn moved_fraction(
    keys: impl IntoIterator<Item = u64>,
    before: impl Fn(u64) -> ServerId,
    after: impl Fn(u64) -> ServerId,
) -> f64 {
    let (mut moved, mut total) = (0usize, 0usize);
    for key in keys {
        total += 1;
        moved += usize::from(before(key) != after(key));
    }
    moved as f64 / total.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: u64 = 200_000;

    /// Whether a placement change that added one server to `n` moved about `1/(n+1)` of the keys
    /// (within half of it either way), else the figure.
    fn moved_about_one_share(n: usize, moved: f64) -> Result<(), String> {
        let expected = 1.0 / (n as f64 + 1.0);
        if (0.5 * expected..=1.5 * expected).contains(&moved) {
            Ok(())
        } else {
            Err(format!(
                "moved {moved:.3} of the keys, expected about {expected:.3}"
            ))
        }
    }

    #[test]
    fn adding_a_server_moves_about_one_share_and_only_to_it() {
        for n in [1usize, 3, 4, 8] {
            let before = Ring::new(0..n, 64).unwrap();
            let mut after = before.clone();
            after.add(n).unwrap();
            let moved = moved_fraction(0..KEYS, |k| before.owner(k), |k| after.owner(k));
            println!(
                "ring: {n} → {} servers moved {moved:.4} of {KEYS} keys (1/(n+1) = {:.4})",
                n + 1,
                1.0 / (n as f64 + 1.0)
            );
            moved_about_one_share(n, moved).unwrap();
            // Only the ranges the new server gains move.
            for k in (0..KEYS).step_by(97) {
                if before.owner(k) != after.owner(k) {
                    assert_eq!(after.owner(k), n);
                }
            }
            // Removing it again restores every key's owner.
            after.remove(n).unwrap();
            assert_eq!(after, before);
        }
    }

    #[test]
    fn modulo_placement_moves_most_keys_and_the_same_check_rejects_it() {
        let n = 4;
        let moved = moved_fraction(
            0..KEYS,
            |k| (k % n as u64) as usize,
            |k| (k % (n as u64 + 1)) as usize,
        );
        println!("modulo placement: 4 → 5 servers moved {moved:.4} of the keys");
        let error = moved_about_one_share(n, moved).unwrap_err();
        assert!(error.contains("expected about 0.200"), "{error}");
        assert!(moved > 0.7);
    }

    #[test]
    fn removing_a_server_moves_only_its_keys_and_shares_cover_the_circle() {
        let before = Ring::new(0..5, 48).unwrap();
        let mut after = before.clone();
        after.remove(2).unwrap();
        for k in 0..20_000u64 {
            if before.owner(k) != 2 {
                assert_eq!(before.owner(k), after.owner(k));
            }
            assert_ne!(after.owner(k), 2);
        }
        let total: f64 = before.shares().iter().map(|s| s.1).sum();
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        for (server, share) in before.shares() {
            assert!((0.1..0.3).contains(&share), "server {server}: {share}");
        }
        assert_eq!(before.ranges().len(), 5 * 48);
        let text = before.describe();
        assert!(text.contains("5 servers × 48 virtual nodes"), "{text}");
    }

    #[test]
    fn a_chain_starts_at_the_owner_and_names_distinct_servers() {
        let ring = Ring::new(0..4, 16).unwrap();
        for key in 0..1000u64 {
            let chain = ring.chain(key, 3);
            assert_eq!(chain[0], ring.owner(key));
            assert_eq!(chain.len(), 3);
            let mut sorted = chain.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 3);
            assert_eq!(ring.range_of(key).owner, chain[0]);
        }
        assert_eq!(ring.chain(7, 9).len(), 4);
    }

    #[test]
    fn bad_rings_are_refused_with_the_reason() {
        assert_eq!(Ring::new(0..0, 4), Err(RingError::Empty));
        assert_eq!(Ring::new(0..2, 0), Err(RingError::NoVnodes));
        let mut ring = Ring::new(0..1, 4).unwrap();
        assert_eq!(ring.add(0), Err(RingError::Present(0)));
        assert_eq!(ring.remove(5), Err(RingError::Absent(5)));
        assert_eq!(ring.remove(0), Err(RingError::Last(0)));
    }
}
