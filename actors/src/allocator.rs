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

#[cfg(test)]
mod tests {
    #[test]
    fn glibc_accepts_the_settings() {
        if cfg!(all(target_os = "linux", target_env = "gnu")) && std::env::var_os("GLIBC_TUNABLES").is_none()
        {
            assert!(super::keep_tensor_buffers());
        }
    }
}
