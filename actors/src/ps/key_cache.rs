//! Key caching (Li et al., OSDI 2014, §3.5 "Key Caching"): a worker that pulls or pushes the same
//! key list again — every clock of a dense model, every epoch of a sparse one — sends the list
//! once per server and afterwards only its hash; the server keeps the lists it was sent (a bounded
//! number per worker, oldest dropped first) and answers a hash it does not hold with "unknown",
//! after which the worker sends the whole list again. A hash names a list together with its
//! length and the worker, so two lists colliding would have to collide in a 64-bit SipHash of the
//! same length from the same worker.
//!
//! A list that is part of the last one sent to that server — a push thinned by the
//! [filter](super::filter) after its pull sent the whole list — goes as that list's hash and a
//! bit mask of the keys taken (one bit per key instead of eight bytes).

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};

use serde::{Deserialize, Serialize};

use super::ring::ServerId;

/// Lists a server keeps per worker.
pub const LISTS_PER_WORKER: usize = 64;

/// How a [`Pull`](super::server::Pull)'s or [`Push`](super::server::Push)'s `keys` travel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeyList {
    /// Whole, not to be kept (caching off).
    #[default]
    Plain,
    /// Whole; the server keeps them under [`hash_keys`] of them.
    Keep,
    /// Not sent (`keys` is empty): the list the server kept under this hash.
    Hashed {
        /// [`hash_keys`] of the list.
        hash: u64,
        /// Its length.
        len: usize,
    },
    /// Not sent (`keys` is empty): the keys of a kept list whose bits are set.
    Subset(KeyMask),
}

/// A part of a kept list, in a [`KeyList`]-carrying message's `mask`: the keys of the list
/// kept under `hash` whose bits are set (bit `i % 64` of word `i / 64` for the list's `i`-th key).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyMask {
    /// [`hash_keys`] of the kept list.
    pub hash: u64,
    /// Its length.
    pub len: usize,
    /// One bit per key of the kept list.
    pub bits: Vec<u64>,
}

impl KeyList {
    /// Payload bytes of `keys` sent this way (as the figures count).
    pub fn wire_bytes(&self, keys: &[u64]) -> u64 {
        match self {
            KeyList::Hashed { .. } => 16,
            KeyList::Subset(mask) => 16 + 8 * mask.bits.len() as u64,
            _ => 8 * keys.len() as u64,
        }
    }
}

/// The hash a list is known by (SipHash with fixed keys: the same in every process).
#[allow(deprecated)] // SipHasher: fixed keys on purpose, so that every process hashes alike.
pub fn hash_keys(keys: &[u64]) -> u64 {
    let mut hasher = std::hash::SipHasher::new();
    keys.hash(&mut hasher);
    hasher.finish()
}

/// A server's kept lists, per worker.
#[derive(Debug, Default)]
pub struct ServerKeyCache {
    lists: HashMap<(usize, u64), Vec<u64>>,
    order: HashMap<usize, VecDeque<u64>>,
    forgetful: bool,
}

impl ServerKeyCache {
    /// A cache that keeps nothing, so that every hashed list is unknown (a planted fault: the
    /// resend path under test).
    pub fn forgetful() -> ServerKeyCache {
        ServerKeyCache {
            forgetful: true,
            ..ServerKeyCache::default()
        }
    }

    /// Fills `keys` from the kept list when they came [`KeyList::Hashed`] (or the marked part of
    /// it, [`KeyList::Subset`]), keeps them when
    /// [`KeyList::Keep`]; `false` for a hash not held (evicted, or this server is new to the
    /// worker since a failover).
    pub fn resolve(&mut self, worker: usize, keys: &mut Vec<u64>, list: KeyList) -> bool {
        match list {
            KeyList::Plain => true,
            KeyList::Keep if self.forgetful => true,
            KeyList::Keep => {
                let hash = hash_keys(keys);
                if self.lists.insert((worker, hash), keys.clone()).is_none() {
                    let order = self.order.entry(worker).or_default();
                    order.push_back(hash);
                    if order.len() > LISTS_PER_WORKER
                        && let Some(oldest) = order.pop_front()
                    {
                        self.lists.remove(&(worker, oldest));
                    }
                }
                true
            }
            KeyList::Hashed { hash, len } => match self.lists.get(&(worker, hash)).filter(|k| k.len() == len)
            {
                Some(kept) => {
                    keys.clone_from(kept);
                    true
                }
                None => false,
            },
            KeyList::Subset(mask) => {
                let kept = self
                    .lists
                    .get(&(worker, mask.hash))
                    .filter(|k| k.len() == mask.len);
                match kept {
                    Some(kept) if mask.bits.len() == kept.len().div_ceil(64) => {
                        keys.clear();
                        let taken = |i: usize| mask.bits[i / 64] >> (i % 64) & 1 == 1;
                        keys.extend(kept.iter().enumerate().filter(|(i, _)| taken(*i)).map(|(_, k)| k));
                        true
                    }
                    _ => false,
                }
            }
        }
    }
}

/// What a worker believes each server holds.
#[derive(Debug, Clone, Default)]
pub struct ClientKeyCache {
    held: HashMap<ServerId, HashSet<u64>>,
    /// The last list sent whole to each server (and kept there), for subsets of it.
    last: HashMap<ServerId, (u64, Vec<u64>)>,
    /// Whether lists are hashed at all (off: always whole, the figures' baseline).
    pub enabled: bool,
}

impl ClientKeyCache {
    /// How to send `keys` to `server`, and the keys to put in the message (none when hashed).
    pub fn encode(&mut self, server: ServerId, keys: &[u64]) -> (Vec<u64>, KeyList) {
        if !self.enabled || keys.is_empty() {
            return (keys.to_vec(), KeyList::Plain);
        }
        let hash = hash_keys(keys);
        let held = self.held.entry(server).or_default();
        if held.contains(&hash) {
            let len = keys.len();
            return (Vec::new(), KeyList::Hashed { hash, len });
        }
        // Part of the last list this server kept: that list's hash and a bit per key, when the
        // mask is the smaller.
        if let Some((base, base_keys)) = self.last.get(&server)
            && held.contains(base)
            && base_keys.len().div_ceil(64) < keys.len()
            && let Some(bits) = subset_bits(base_keys, keys)
        {
            let (hash, len) = (*base, base_keys.len());
            return (Vec::new(), KeyList::Subset(KeyMask { hash, len, bits }));
        }
        // Kept at the server once this call arrives; at most LISTS_PER_WORKER remembered here
        // too, so that an evicted list is more often sent whole than asked twice.
        if held.len() >= LISTS_PER_WORKER {
            held.clear();
        }
        held.insert(hash);
        self.last.insert(server, (hash, keys.to_vec()));
        (keys.to_vec(), KeyList::Keep)
    }

    /// The server did not hold `keys` (or a call failed): send them whole next time.
    pub fn forget(&mut self, server: ServerId, keys: &[u64]) {
        if let Some(held) = self.held.get_mut(&server) {
            held.remove(&hash_keys(keys));
        }
        // A subset of the last list may have been what the server did not know.
        if let Some((base, _)) = self.last.remove(&server)
            && let Some(held) = self.held.get_mut(&server)
        {
            held.remove(&base);
        }
    }

    /// A new ring: servers may be new, nothing is assumed held.
    pub fn clear(&mut self) {
        self.held.clear();
        self.last.clear();
    }
}

/// The bits of `part`'s keys in `whole`, when `part` is a subsequence of it (both in the order
/// sent); `None` otherwise.
fn subset_bits(whole: &[u64], part: &[u64]) -> Option<Vec<u64>> {
    let mut bits = vec![0u64; whole.len().div_ceil(64)];
    let mut at = 0;
    for key in part {
        let found = whole[at..].iter().position(|k| k == key)?;
        at += found;
        bits[at / 64] |= 1 << (at % 64);
        at += 1;
    }
    Some(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_sent_whole_once_then_by_hash_and_again_whole_when_forgotten() {
        let mut client = ClientKeyCache {
            enabled: true,
            ..Default::default()
        };
        let mut server = ServerKeyCache::default();
        let keys = vec![3u64, 17, 4_000_000_000];
        let (mut sent, list) = client.encode(0, &keys);
        assert_eq!((&sent, &list), (&keys, &KeyList::Keep));
        assert!(server.resolve(7, &mut sent, list));
        let (mut sent, list) = client.encode(0, &keys);
        assert!(sent.is_empty() && matches!(list, KeyList::Hashed { len: 3, .. }));
        assert_eq!(list.wire_bytes(&sent), 16);
        assert!(server.resolve(7, &mut sent, list.clone()));
        assert_eq!(sent, keys);
        // Another worker's hash is not this worker's; a new server holds nothing.
        assert!(!server.resolve(8, &mut Vec::new(), list.clone()));
        assert!(!ServerKeyCache::default().resolve(7, &mut Vec::new(), list));
        client.forget(0, &keys);
        assert_eq!(client.encode(0, &keys).1, KeyList::Keep);
        // Off: always whole, never kept.
        let mut off = ClientKeyCache::default();
        off.encode(0, &keys);
        assert_eq!(off.encode(0, &keys), (keys, KeyList::Plain));
    }

    #[test]
    fn part_of_the_last_list_goes_as_its_hash_and_a_mask() {
        let mut client = ClientKeyCache {
            enabled: true,
            ..Default::default()
        };
        let mut server = ServerKeyCache::default();
        let pulled: Vec<u64> = (0..200).map(|k| k * 7).collect();
        let (mut sent, list) = client.encode(3, &pulled);
        assert!(server.resolve(0, &mut sent, list));
        let pushed: Vec<u64> = pulled.iter().copied().filter(|k| k % 3 == 0).collect();
        let (mut sent, list) = client.encode(3, &pushed);
        let KeyList::Subset(mask) = &list else {
            panic!("{list:?}")
        };
        assert_eq!((mask.len, mask.bits.len()), (200, 4));
        assert_eq!(list.wire_bytes(&sent), 16 + 32);
        assert!(server.resolve(0, &mut sent, list));
        assert_eq!(sent, pushed);
        // A server that lost the base answers unknown; forgetting drops the base too, so the
        // same part then goes whole.
        let half: Vec<u64> = pulled.iter().copied().filter(|k| k % 2 == 0).collect();
        let (_, list) = client.encode(3, &half);
        assert!(matches!(list, KeyList::Subset(_)));
        assert!(!ServerKeyCache::default().resolve(0, &mut Vec::new(), list));
        client.forget(3, &half);
        assert_eq!(client.encode(3, &half).1, KeyList::Keep);
        // Not a subsequence (out of order, or a key not in the list): sent whole.
        assert_eq!(client.encode(3, &[14, 7]).1, KeyList::Keep);
        assert_eq!(client.encode(3, &[1]).1, KeyList::Keep);
    }

    #[test]
    fn a_server_keeps_a_bounded_number_of_lists_per_worker() {
        let mut server = ServerKeyCache::default();
        for i in 0..(LISTS_PER_WORKER as u64 + 10) {
            server.resolve(0, &mut vec![i], KeyList::Keep);
        }
        assert_eq!(server.lists.len(), LISTS_PER_WORKER);
        let hashed = |k: u64| KeyList::Hashed {
            hash: hash_keys(&[k]),
            len: 1,
        };
        assert!(!server.resolve(0, &mut Vec::new(), hashed(0)));
        assert!(server.resolve(0, &mut Vec::new(), hashed(LISTS_PER_WORKER as u64 + 9)));
    }
}
