//! glibc's malloc set for tensor work: freed tensor buffers stay in the process for the next op
//! instead of going back to the kernel after every op; and the binary's allocator
//! ([`TensorAllocator`]: zeroed blocks written, large freed blocks kept for reuse).
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

/// The `archipelago` binary's `#[global_allocator]` (a library cannot register one: a program has
/// one): the system allocator, with two changes for tensor work.
///
/// **Zeroed blocks below [`MMAP_THRESHOLD`] are written with zeros**, not taken as the kernel's
/// zero pages. glibc's `calloc` does not touch fresh heap memory (it is zero already). A buffer
/// made with `vec![0.0; n]` and read before it is written — Flex's `zeros`, an optimizer's first
/// moments — then maps the kernel's shared zero page, read-only; the page stays so after the
/// buffer is freed, and the next buffer the heap puts there (any op's output) faults on its first
/// write: a copy, and a TLB shootdown — an interrupt to every other core running the process. On
/// gpt-tiny at dp=2 `perf` put 17 % of the cycles there (`do_wp_page` → `flush_tlb_mm_range`).
///
/// **Freed blocks of [`MMAP_THRESHOLD`] and more are kept** (at most [`CACHED_BLOCKS`] of them,
/// [`CACHED_BYTES`] in all) for the next allocation of the same size and alignment: glibc maps
/// each such block fresh and unmaps it when freed, so every 64 MiB tensor a process receives
/// or makes paid 16,384 first-touch page faults — two thirds of moving one between processes
/// (docs/PERFORMANCE.md). A tensor of the same size every step (activations, buckets, received
/// gradients) lands in warm pages instead, as in PyTorch's caching allocator and Ray's store.
pub struct TensorAllocator;

/// The most freed large blocks kept.
pub const CACHED_BLOCKS: usize = 8;
/// The most bytes kept in freed large blocks.
pub const CACHED_BYTES: usize = 512 << 20;

/// Freed large blocks: `(size, align, address)`, address 0 for an empty slot.
struct BlockCache {
    blocks: [(usize, usize, usize); CACHED_BLOCKS],
    bytes: usize,
}

static CACHE: std::sync::Mutex<BlockCache> = std::sync::Mutex::new(BlockCache {
    blocks: [(0, 0, 0); CACHED_BLOCKS],
    bytes: 0,
});

/// The cache, locked (taking the lock never allocates; nothing under it can panic, so a
/// poisoned lock is used as it is).
fn cache() -> std::sync::MutexGuard<'static, BlockCache> {
    CACHE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl BlockCache {
    /// A kept block of exactly this size and alignment, taken out of the cache.
    fn take(&mut self, layout: std::alloc::Layout) -> Option<*mut u8> {
        let (size, align) = (layout.size(), layout.align());
        let slot = self
            .blocks
            .iter_mut()
            .find(|b| b.2 != 0 && b.0 == size && b.1 == align)?;
        let address = std::mem::take(slot).2;
        self.bytes -= size;
        Some(address as *mut u8)
    }

    /// Keeps a freed block if there is room; whether it was kept.
    fn keep(&mut self, block: *mut u8, layout: std::alloc::Layout) -> bool {
        if self.bytes + layout.size() > CACHED_BYTES {
            return false;
        }
        let Some(slot) = self.blocks.iter_mut().find(|b| b.2 == 0) else {
            return false;
        };
        *slot = (layout.size(), layout.align(), block as usize);
        self.bytes += layout.size();
        true
    }
}

// SAFETY: every block handed out comes from `System`, directly or through the cache, which
// holds only blocks freed with their layout and hands one out again only for that same size
// and alignment (so `dealloc`/`realloc` later pass `System` the layout the block was made with).
// A kept block is owned by the cache alone — its address is in one slot, cleared when handed
// out — so no block is handed out twice. Kept blocks are never given back (they live for the
// process, a bounded amount). `alloc_zeroed` writes `layout.size()` zeros into a block it owns
// before returning it.
unsafe impl std::alloc::GlobalAlloc for TensorAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() >= MMAP_THRESHOLD
            && let Some(block) = cache().take(layout)
        {
            return block;
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        if layout.size() >= MMAP_THRESHOLD && cache().keep(ptr, layout) {
            return;
        }
        // SAFETY: `ptr` came from `System` with this layout (every block of this allocator does).
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc` (a kept block handed out again is a `System` block of this
        // layout), with the caller's guarantees on `new_size`.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let kept = if layout.size() >= MMAP_THRESHOLD {
            cache().take(layout)
        } else {
            None
        };
        // A large block not kept: a fresh mapping, zero already, given back whole when freed.
        if kept.is_none() && layout.size() >= MMAP_THRESHOLD {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { std::alloc::System.alloc_zeroed(layout) };
        }
        // SAFETY: a block of `layout.size()` bytes this allocator owns when non-null (see the
        // impl's comment).
        unsafe {
            let block = kept.unwrap_or_else(|| std::alloc::System.alloc(layout));
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
    fn zeroed_blocks_are_zeros_where_a_freed_block_was_dirty() {
        use super::{MMAP_THRESHOLD, TensorAllocator};
        use std::alloc::{GlobalAlloc, Layout};
        // The last two sizes are kept when freed and handed out again.
        for size in [8, 4096, 1 << 20, MMAP_THRESHOLD + 4096, MMAP_THRESHOLD + 4096] {
            let layout = Layout::from_size_align(size, 16).unwrap();
            // SAFETY: non-zero sizes; every block is written within its size and freed once
            // with the layout it was made with.
            unsafe {
                let dirty = TensorAllocator.alloc(layout);
                assert!(!dirty.is_null());
                std::ptr::write_bytes(dirty, 0xAB, size);
                TensorAllocator.dealloc(dirty, layout);
                let zeroed = TensorAllocator.alloc_zeroed(layout);
                assert!(!zeroed.is_null());
                let bytes = std::slice::from_raw_parts(zeroed, size);
                assert!(bytes.iter().all(|b| *b == 0), "size {size}");
                TensorAllocator.dealloc(zeroed, layout);
            }
        }
    }

    #[test]
    fn a_freed_large_block_is_handed_out_again_for_the_same_size_only() {
        use super::{MMAP_THRESHOLD, TensorAllocator};
        use std::alloc::{GlobalAlloc, Layout};
        // A size no other test of this process uses (the cache is the process's).
        let layout = Layout::from_size_align(MMAP_THRESHOLD + 12_288, 64).unwrap();
        let other = Layout::from_size_align(MMAP_THRESHOLD + 16_384, 64).unwrap();
        // SAFETY: every block is freed once with the layout it was made with.
        unsafe {
            let first = TensorAllocator.alloc(layout);
            assert!(!first.is_null());
            TensorAllocator.dealloc(first, layout);
            // Control: another size does not get it.
            let second = TensorAllocator.alloc(other);
            assert_ne!(second, first);
            let again = TensorAllocator.alloc(layout);
            assert_eq!(again, first, "the kept block");
            TensorAllocator.dealloc(again, layout);
            TensorAllocator.dealloc(second, other);
        }
    }
}
