//! Property tests (proptest) of what crosses a trust boundary and of the planner's promise:
//! - `decoder`: the plan and step-report decoders (the codec's bincode) and the session's
//!   protobuf messages never panic on arbitrary or mutated bytes, and a length that announces a
//!   terabyte is refused before any allocation (measured by this binary's counting allocator);
//! - `plans`: every model spec and layout that `plan` accepts trains a step; every one it
//!   refuses is refused with an error, never a panic.
//!
//! One binary for both (every test binary links burn again); the allocator below is why the
//! decoder tests live in a binary of their own rather than in `cli.rs`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

#[path = "properties/decoder.rs"]
mod decoder;
#[path = "properties/plans.rs"]
mod plans;

/// The system allocator, counting each thread's live bytes and their peak.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    // `try_with`: an allocation while the thread's locals are torn down is simply not counted.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded unchanged to `System`; only counters are updated beside it.
// (`unsafe` is allowed here only: a global allocator has no safe form.)
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System.alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        track(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            track(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` on this thread; returns its result and the most bytes it held allocated at once
/// (above what the thread held before).
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, (peak - base).max(0) as usize)
}

#[test]
fn the_allocation_meter_sees_a_large_allocation() {
    // The negative control of every bound below: a decoder that did allocate would be seen.
    let (v, peak) = peak_during(|| Vec::<u8>::with_capacity(1 << 30));
    drop(v);
    assert!(peak >= 1 << 30, "peak {peak}");
    let (_, small) = peak_during(|| 1 + 1);
    assert_eq!(small, 0);
}
