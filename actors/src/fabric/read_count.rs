//! The bytes this thread read from its peers on the training fabric since it last asked: every
//! message a receive hands over (the one place where every data path — in-process, shared
//! memory, raw TCP, gRPC — delivers, `InProcessFabric::recv`) and what the shared-buffer
//! collectives read from their peers' buffers. An executor thread asks around each receive; the
//! collective worker around each collective (both run on one thread each), so each figure is
//! the fabric's own count and not a size the plan expects
//! (`archipelago_dataflow::fabric_bytes` predicts those).
//!
//! Of those, the bytes read from peers on another island are counted apart ("crossing"): the
//! thread is told which peers are far ([`set_far`]: the executor at each step, the collective
//! worker at each collective), and each count names the peer it read from ([`count_from`]).

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use archipelago_dataflow::ActorId;

thread_local! {
    static READ: Cell<u64> = const { Cell::new(0) };
    static CROSSING: Cell<u64> = const { Cell::new(0) };
    static FAR: RefCell<Arc<[bool]>> = RefCell::new(Arc::from(Vec::new()));
}

/// Bytes read from peers: all of them, and those from peers on another island.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Read {
    /// Every byte read.
    pub bytes: u64,
    /// Of which read from peers on another island.
    pub crossing: u64,
}

/// Which actors are on another island than this thread's actor (by actor id; none when empty).
pub fn set_far(far: Arc<[bool]>) {
    FAR.with(|f| *f.borrow_mut() = far);
}

/// Counts `bytes` read by this thread from a peer it does not name (never counted as crossing).
pub fn count(bytes: u64) {
    READ.with(|r| r.set(r.get() + bytes));
}

/// Counts `bytes` read by this thread from `peer`.
pub fn count_from(peer: ActorId, bytes: u64) {
    count(bytes);
    if FAR.with(|f| f.borrow().get(peer).copied().unwrap_or(false)) {
        CROSSING.with(|c| c.set(c.get() + bytes));
    }
}

/// The bytes this thread read since the last call, and starts again from zero.
pub fn take() -> u64 {
    take_read().bytes
}

/// The bytes this thread read since the last call (and of them those from far peers), and
/// starts again from zero.
pub fn take_read() -> Read {
    Read {
        bytes: READ.with(|r| r.replace(0)),
        crossing: CROSSING.with(|c| c.replace(0)),
    }
}

#[cfg(test)]
mod tests {
    /// Counts add up per thread and start again after `take`; another thread's reads are its own.
    #[test]
    fn counts_are_per_thread_and_taken_once() {
        super::take();
        super::count(10);
        super::count(6);
        std::thread::spawn(|| super::count(1000)).join().unwrap();
        assert_eq!(super::take(), 16);
        assert_eq!(super::take(), 0);
    }

    /// Reads from a far peer count as crossing too; from a near one, or an unnamed one, not.
    #[test]
    fn reads_from_far_peers_are_counted_apart() {
        super::take_read();
        super::set_far(std::sync::Arc::from(vec![false, true]));
        super::count_from(0, 5);
        super::count_from(1, 7);
        super::count(3);
        let read = super::take_read();
        assert_eq!((read.bytes, read.crossing), (15, 7));
        super::set_far(std::sync::Arc::from(Vec::new()));
        super::count_from(1, 7);
        assert_eq!(super::take_read().crossing, 0);
    }
}
