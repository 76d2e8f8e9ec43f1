//! glibc's malloc set for tensor work: freed tensor buffers stay in the process for the next op
//! instead of going back to the kernel after every op.
//!
//! Flex allocates a fresh output buffer for every op. glibc serves buffers above its mmap
//! threshold (128 KiB at first, raised only as such buffers are freed) with a fresh `mmap` and
//! gives them back with `munmap`, and gives heap tops above 128 KiB back too; every page of a
//! fresh mapping then faults on first touch, and every unmapping in a process whose threads run
//! on several cores is a TLB shootdown — an interrupt to each of those cores. On gpt-tiny at dp=2
//! (two actor threads, 2 cores) `perf` put 18 % of the cycles in the kernel's
//! `smp_call_function_many_cond` and `native_write_msr` for that; with the settings below a
//! step took 0.29–0.37 s instead of 0.42–0.49 s (docs/PERFORMANCE.md).
//!
//! [`keep_tensor_buffers`] raises the mmap threshold to its ceiling (32 MiB on 64-bit glibc: the
//! largest buffers still map and unmap) and the trim threshold to 128 MiB. It runs once, when
//! a runtime starts; a `GLIBC_TUNABLES` that sets malloc options wins (nothing is changed), and
//! other C libraries are left alone.
#![allow(unsafe_code)]

/// The mmap threshold set: glibc's ceiling on 64-bit (`HEAP_MAX_SIZE / 2`).
pub const MMAP_THRESHOLD: usize = 32 << 20;
/// Free memory at the top of a heap beyond this goes back to the kernel.
pub const TRIM_THRESHOLD: usize = 128 << 20;

/// Sets glibc's malloc for tensor work (once per process; see the module docs). Returns whether
/// this process now runs with these settings.
pub fn keep_tensor_buffers() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        let user_chose = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."));
        !user_chose && set()
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set() -> bool {
    // SAFETY: mallopt only changes two of malloc's parameters (it takes malloc's own lock); both
    // values are within the ranges glibc accepts (it answers 0 otherwise, and nothing changes).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set() -> bool {
    false
}

/// The system allocator, except that zeroed blocks below [`MMAP_THRESHOLD`] are written with
/// zeros instead of taken as the kernel's zero pages: what the `archipelago` binary registers
/// as its `#[global_allocator]` (a library cannot: a program has one).
///
/// glibc's `calloc` does not touch fresh heap memory (it is zero already). A buffer made with
/// `vec![0.0; n]` and read before it is written — Flex's `zeros`, an optimizer's first moments —
/// then maps the kernel's shared zero page, read-only; the page stays so after the buffer is
/// freed, and the next buffer the heap puts there (any op's output) faults on its first write:
/// a copy, and a TLB shootdown — an interrupt to every other core running the process. On
/// gpt-tiny at dp=2 `perf` put 17 % of the cycles there (`do_wp_page` → `flush_tlb_mm_range`).
/// Writing the zeros costs a pass over memory that is about to be used, and the pages it faults
/// in are the process's own from then on. Larger blocks are fresh mappings given back whole
/// when freed, so they keep `calloc`'s lazy zeros.
pub struct WrittenZeros;

// SAFETY: every method forwards to `System` with the caller's layout and pointer unchanged;
// `alloc_zeroed` writes `layout.size()` zero bytes into a block `System.alloc` just returned for
// that layout (non-null), which it owns, so the block is initialised as `alloc_zeroed` promises.
unsafe impl std::alloc::GlobalAlloc for WrittenZeros {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees (see above).
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `System` with this layout (every block of this allocator does).
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc`, with the caller's guarantees on `new_size`.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() >= MMAP_THRESHOLD {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { std::alloc::System.alloc_zeroed(layout) };
        }
        // SAFETY: a fresh block of `layout.size()` bytes when non-null (see the impl's comment).
        unsafe {
            let block = std::alloc::System.alloc(layout);
            if !block.is_null() {
                std::ptr::write_bytes(block, 0, layout.size());
            }
            block
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn glibc_accepts_the_settings() {
        if cfg!(all(target_os = "linux", target_env = "gnu")) && std::env::var_os("GLIBC_TUNABLES").is_none()
        {
            assert!(super::keep_tensor_buffers());
        }
    }

    #[test]
    fn written_zeros_are_zeros_where_a_freed_block_was_dirty() {
        use super::{MMAP_THRESHOLD, WrittenZeros};
        use std::alloc::{GlobalAlloc, Layout};
        for size in [8, 4096, 1 << 20, MMAP_THRESHOLD + 4096] {
            let layout = Layout::from_size_align(size, 16).unwrap();
            // SAFETY: non-zero sizes; every block is written within its size and freed once
            // with the layout it was made with.
            unsafe {
                let dirty = WrittenZeros.alloc(layout);
                assert!(!dirty.is_null());
                std::ptr::write_bytes(dirty, 0xAB, size);
                WrittenZeros.dealloc(dirty, layout);
                let zeroed = WrittenZeros.alloc_zeroed(layout);
                assert!(!zeroed.is_null());
                let bytes = std::slice::from_raw_parts(zeroed, size);
                assert!(bytes.iter().all(|b| *b == 0), "size {size}");
                WrittenZeros.dealloc(zeroed, layout);
            }
        }
    }
}
