//! The bytes this thread read from its peers on the training fabric since it last asked: every
//! message a receive hands over (the one place where every data path — in-process, shared
//! memory, raw TCP, gRPC — delivers, `InProcessFabric::recv`) and what the shared-buffer
//! collectives read from their peers' buffers. An executor thread asks around each receive; the
//! collective worker around each collective (both run on one thread each), so each figure is
//! the fabric's own count and not a size the plan expects
//! (`archipelago_dataflow::fabric_bytes` predicts those).

use std::cell::Cell;

thread_local! {
    static READ: Cell<u64> = const { Cell::new(0) };
}

/// Counts `bytes` read by this thread.
pub fn count(bytes: u64) {
    READ.with(|r| r.set(r.get() + bytes));
}

/// The bytes this thread read since the last call, and starts again from zero.
pub fn take() -> u64 {
    READ.with(|r| r.replace(0))
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
}
