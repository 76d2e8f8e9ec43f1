//! Encoding a message only to learn whether it would cross a process (strict registration mode):
//! while [`dry_run`] runs, a `TensorRef` or an `ActorRef` serializes a placeholder, adding no
//! borrow and needing no actor port, so the check has no side effect and a program that a cluster
//! accepts is accepted in one process too.

use std::cell::Cell;

thread_local! {
    static DRY_RUN: Cell<bool> = const { Cell::new(false) };
}

/// Runs `encode` with references serializing placeholders (restored after, also on a panic).
pub(crate) fn dry_run<T>(encode: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            DRY_RUN.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DRY_RUN.with(|d| d.replace(true)));
    encode()
}

/// Whether this thread is encoding only to check.
pub(crate) fn is_dry_run() -> bool {
    DRY_RUN.with(Cell::get)
}
