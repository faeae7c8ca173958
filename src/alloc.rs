//! Allocator tuning at start-up.
//!
//! glibc's malloc raises its mmap threshold after each large free (up to 32 MiB), so the
//! Arrow buffers of later batches come from the heap, and what they free stays mapped:
//! a run ingesting a 1 GB backlog in 8 MiB batches grew from 118 to 500 MB resident with
//! the defaults, and to 280 MB with the thresholds fixed at 1 MiB (same wall time; 64 KiB
//! gave 250 MB at a few per cent more time). See the README's Reliability table.
//! A threshold set in the environment (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`)
//! is the user's and is left alone.
//!
//! mimalloc as the global allocator was measured against this (README, "Cost over time",
//! "The allocator"): small-drop runs 15–20 % faster, but a day at Kestrel's scale no
//! faster and its peak RSS 1,142 MB against glibc's 1,031 MB — over the 1 GiB target.

/// Allocations of at least this many bytes are mapped (and unmapped when freed).
pub const MMAP_THRESHOLD: i32 = 1 << 20;

/// Free memory at the top of the heap beyond this is returned to the system.
pub const TRIM_THRESHOLD: i32 = 1 << 20;

/// Fix glibc's mmap and trim thresholds (a no-op on other C libraries). Call once, first
/// thing in `main`.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |var: &str, param: libc::c_int, value: i32| {
            if std::env::var_os(var).is_none() {
                // SAFETY: mallopt only changes malloc's parameters; called at start-up.
                unsafe {
                    libc::mallopt(param, value);
                }
            }
        };
        set(
            "MALLOC_MMAP_THRESHOLD_",
            libc::M_MMAP_THRESHOLD,
            MMAP_THRESHOLD,
        );
        set(
            "MALLOC_TRIM_THRESHOLD_",
            libc::M_TRIM_THRESHOLD,
            TRIM_THRESHOLD,
        );
    }
}

/// Give memory freed by the last piece of work back to the system (a no-op on other C
/// libraries). glibc returns only the top of its heap by itself; the small allocations
/// of a large batch (a string per key in the operators' maps) free chunks all through
/// it, and a long-running process would keep the batch's peak resident for good. The
/// always-on stream calls this after each poll that did work, the daemon after each
/// run: after the stream's first poll over a million skus it stayed at ~860 MiB
/// resident without it, ~200 MiB with it (`--bench jobs -- stream 60 1000000`). Takes a
/// few milliseconds.
pub fn release() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free memory to the system.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}
