//! Byte counters per link: how many payload bytes each `(from, to)` pair of actors moved. The
//! fabrics count every tensor they carry, and the runtime counts every tensor reference it
//! resolves, so a test (or a report) can show where bytes went — and where they did not.

use std::collections::BTreeMap;
use std::sync::Mutex;

use archipelago_dataflow::ActorId;

/// The id standing for the driver (the program's own thread) on a link.
pub const DRIVER: ActorId = ActorId::MAX;

/// The id standing for a consumer in another process (an owner's count of bytes served out).
pub const OTHER_PROCESS: ActorId = ActorId::MAX - 1;

/// Bytes moved per `(from, to)` link.
#[derive(Debug, Default)]
pub struct LinkBytes {
    links: Mutex<BTreeMap<(ActorId, ActorId), u64>>,
}

impl LinkBytes {
    /// Counts `bytes` moved from `from` to `to`.
    pub fn record(&self, from: ActorId, to: ActorId, bytes: u64) {
        *self
            .links
            .lock()
            .expect("link bytes")
            .entry((from, to))
            .or_default() += bytes;
    }

    /// Bytes moved from `from` to `to` so far.
    pub fn between(&self, from: ActorId, to: ActorId) -> u64 {
        self.links
            .lock()
            .expect("link bytes")
            .get(&(from, to))
            .copied()
            .unwrap_or(0)
    }

    /// Bytes that `actor` sent or received on any link.
    pub fn touching(&self, actor: ActorId) -> u64 {
        let links = self.links.lock().expect("link bytes");
        links
            .iter()
            .filter(|((from, to), _)| *from == actor || *to == actor)
            .map(|(_, b)| b)
            .sum()
    }

    /// Every link with its bytes, ordered by `(from, to)`.
    pub fn snapshot(&self) -> Vec<((ActorId, ActorId), u64)> {
        self.links
            .lock()
            .expect("link bytes")
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    /// Bytes over all links.
    pub fn total(&self) -> u64 {
        self.links.lock().expect("link bytes").values().sum()
    }
}
