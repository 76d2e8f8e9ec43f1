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
        let tuned = !user_chose && set();
        TUNED.store(tuned, std::sync::atomic::Ordering::Release);
        tuned
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
/// **Zeroed blocks are written with zeros**, not taken as the kernel's zero pages, except those
/// glibc maps of its own and unmaps when freed (from 128 KiB to [`MMAP_THRESHOLD`] where
/// [`keep_tensor_buffers`] is not in force). glibc's `calloc` does not touch fresh heap memory (it is zero already). A buffer
/// made with `vec![0.0; n]` and read before it is written — Flex's `zeros`, an optimizer's first
/// moments — then maps the kernel's shared zero page, read-only; the page stays so after the
/// buffer is freed, and the next buffer the heap puts there (any op's output) faults on its first
/// write: a copy, and a TLB shootdown — an interrupt to every other core running the process. On
/// gpt-tiny at dp=2 `perf` put 17 % of the cycles there (`do_wp_page` → `flush_tlb_mm_range`).
///
/// **Freed blocks of [`MMAP_THRESHOLD`] and more are kept** (at most [`CACHED_BLOCKS`] of them,
/// [`CACHED_BYTES`] in all; the longest kept go back to the system to make room) for the next
/// allocation of the same size and alignment: glibc maps
/// each such block fresh and unmaps it when freed, so every 64 MiB tensor a process receives
/// or makes paid 16,384 first-touch page faults — two thirds of moving one between processes
/// (docs/PERFORMANCE.md). A tensor of the same size every step (activations, buckets, received
/// gradients) lands in warm pages instead, as in PyTorch's caching allocator and Ray's store.
pub struct TensorAllocator;

/// Whether [`keep_tensor_buffers`] is in force (the heap then serves blocks up to
/// [`MMAP_THRESHOLD`]; glibc's default maps blocks from 128 KiB on, fresh and zero).
static TUNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The size from which glibc maps a block of its own (zero already, unmapped when freed).
fn mapped_from() -> usize {
    if TUNED.load(std::sync::atomic::Ordering::Acquire) {
        MMAP_THRESHOLD
    } else {
        128 << 10
    }
}

/// The most freed large blocks kept.
pub const CACHED_BLOCKS: usize = 8;
/// The most bytes kept in freed large blocks.
pub const CACHED_BYTES: usize = 256 << 20;

/// Freed large blocks: `(size, align, address, when kept)`, address 0 for an empty slot.
struct BlockCache {
    blocks: [(usize, usize, usize, u64); CACHED_BLOCKS],
    bytes: usize,
    kept: u64,
}

static CACHE: std::sync::Mutex<BlockCache> = std::sync::Mutex::new(BlockCache {
    blocks: [(0, 0, 0, 0); CACHED_BLOCKS],
    bytes: 0,
    kept: 0,
});

/// Blocks put out of the cache to make room, to be given back to `System` once it is unlocked.
type Evicted = [(usize, std::alloc::Layout); CACHED_BLOCKS];

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

    /// Keeps a freed block, putting the longest-kept ones out until it fits (into `evicted`,
    /// count returned); `None` (nothing changed) for a block larger than the whole cache.
    fn keep(&mut self, block: *mut u8, layout: std::alloc::Layout, evicted: &mut Evicted) -> Option<usize> {
        if layout.size() > CACHED_BYTES {
            return None;
        }
        let mut count = 0;
        while self.bytes + layout.size() > CACHED_BYTES || self.blocks.iter().all(|b| b.2 != 0) {
            let oldest = (self.blocks.iter_mut())
                .filter(|b| b.2 != 0)
                .min_by_key(|b| b.3)
                .expect("a full cache has a kept block");
            let (size, align, address, _) = std::mem::take(oldest);
            self.bytes -= size;
            let layout = std::alloc::Layout::from_size_align(size, align).expect("a kept block's layout");
            evicted[count] = (address, layout);
            count += 1;
        }
        let slot = self.blocks.iter_mut().find(|b| b.2 == 0).expect("room was made");
        self.kept += 1;
        *slot = (layout.size(), layout.align(), block as usize, self.kept);
        self.bytes += layout.size();
        Some(count)
    }
}

// SAFETY: every block handed out comes from `System`, directly or through the cache, which
// holds only blocks freed with their layout and hands one out again only for that same size
// and alignment (so `dealloc`/`realloc` later pass `System` the layout the block was made with).
// A kept block is owned by the cache alone — its address is in one slot, cleared when handed
// out or put out to make room (and then given back to `System` once, with its layout) — so no
// block is handed out or freed twice. `alloc_zeroed` writes `layout.size()` zeros into a block it owns
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
        if layout.size() >= MMAP_THRESHOLD {
            let mut evicted: Evicted = [(0, std::alloc::Layout::new::<u8>()); CACHED_BLOCKS];
            let kept = cache().keep(ptr, layout, &mut evicted);
            if let Some(count) = kept {
                for (address, layout) in &evicted[..count] {
                    // SAFETY: a block the cache owned (see the impl's comment), freed once.
                    unsafe { std::alloc::System.dealloc(*address as *mut u8, *layout) };
                }
                return;
            }
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
        let kept_when_freed = layout.size() >= MMAP_THRESHOLD;
        if !kept_when_freed && layout.size() >= mapped_from() {
            // A block glibc maps of its own: zero already, and unmapped when freed (its zero
            // pages go with it).
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { std::alloc::System.alloc_zeroed(layout) };
        }
        // SAFETY: a block of `layout.size()` bytes this allocator owns when non-null (see the
        // impl's comment): from the heap, or one the cache keeps (or will keep) when freed.
        unsafe {
            let block = kept_when_freed
                .then(|| cache().take(layout))
                .flatten()
                .unwrap_or_else(|| std::alloc::System.alloc(layout));
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

    #[test]
    fn a_full_cache_puts_out_its_longest_kept_blocks() {
        use super::{BlockCache, CACHED_BLOCKS, CACHED_BYTES, Evicted};
        use std::alloc::Layout;
        // A cache of its own, with made-up addresses (it never touches the memory).
        let mut cache = BlockCache {
            blocks: [(0, 0, 0, 0); CACHED_BLOCKS],
            bytes: 0,
            kept: 0,
        };
        let mut evicted: Evicted = [(0, Layout::new::<u8>()); CACHED_BLOCKS];
        // Blocks of just over 1 MiB: eight fit by bytes, the ninth is one too many by count.
        let layout = |extra: usize| Layout::from_size_align((1 << 20) + extra, 64).unwrap();
        for i in 0..CACHED_BLOCKS {
            assert_eq!(
                cache.keep((0x1000 * (i + 1)) as *mut u8, layout(i), &mut evicted),
                Some(0)
            );
        }
        // Full by count: the first kept goes.
        assert_eq!(
            cache.keep(0x9_0000 as *mut u8, layout(100), &mut evicted),
            Some(1)
        );
        assert_eq!(evicted[0], (0x1000, layout(0)));
        assert_eq!(cache.take(layout(0)), None);
        assert_eq!(cache.take(layout(1)), Some(0x2000 as *mut u8));
        // Full by bytes: a block of nearly the whole cache puts out all the others.
        let big = Layout::from_size_align(CACHED_BYTES - (1 << 20), 64).unwrap();
        assert_eq!(
            cache.keep(0xA_0000 as *mut u8, big, &mut evicted),
            Some(CACHED_BLOCKS - 1)
        );
        assert!(cache.bytes <= CACHED_BYTES);
        // Larger than the whole cache: not kept, nothing put out.
        let huge = Layout::from_size_align(CACHED_BYTES + 1, 64).unwrap();
        assert_eq!(cache.keep(0xB_0000 as *mut u8, huge, &mut evicted), None);
        assert_eq!(cache.take(big), Some(0xA_0000 as *mut u8));
    }
}
