//! Allocator tuning at start-up.
//!
//! glibc's malloc raises its mmap threshold after each large free (up to 32 MiB), so the
//! Arrow buffers of later batches come from the heap, and what they free stays mapped:
//! a run ingesting a 1 GB backlog in 8 MiB batches grew from 118 to 500 MB resident with
//! the defaults, and to 280 MB with the thresholds fixed at 1 MiB (same wall time; 64 KiB
//! gave 250 MB at a few per cent more time). See the README's Reliability table.
//!
//! Fixed at 1 MiB, though, every buffer of a megabyte or more was a fresh mapping, and
//! every free at the top of a heap went back to the system: a batch faulted in anew what
//! the one before had just freed — 0.67–0.72M minor page faults and 2.2–2.6 s of system
//! time in a 6.0–6.5 s landing → gold run of 5M orders (`--bench jobs --
//! throughput-run`). Now the batch commands keep freed memory for reuse: an mmap
//! threshold of [`MMAP_THRESHOLD`] (16 MiB), a trim threshold of [`TRIM_THRESHOLD`] (64
//! MiB), and at most [`ARENAS_PER_CORE`] malloc arenas a core (glibc's default is 8), so
//! that what the arenas keep stays bounded; [`release`] still gives everything freed
//! back between runs and polls, and between a backlog's batches once more than
//! [`KEEP_RESIDENT_BYTES`] is resident, so a long-running process does not keep a
//! batch's peak. Side by side (same build, settings by environment, two alternating
//! runs): 6.31, 6.00 s → **5.61, 5.52 s**, page faults 0.71M, 0.67M → 0.51M, 0.50M,
//! peak RSS 460, 465 → 627, 656 MiB. Without the arena limit 5.50, 5.75 s at 706–809
//! MiB; with one or two arenas a core the small five-minute runs (`--bench jobs -- age
//! small 48`, many threads, little work) slowed from 0.49 / 0.47 s (runs 1–12 / last
//! 12) to 0.60 / 0.56 s, with four 0.53 / 0.49 s (peak RSS of a run 131 → 156 MB). The
//! always-on stream keeps the 1 MiB thresholds ([`tune_for_stream`]): its first poll (a
//! million skus' opening stock) peaked at 1,017 MiB with the batch thresholds against
//! 910 MiB — its target is 1 GiB.
//!
//! A setting in the environment (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
//! `MALLOC_ARENA_MAX`) is the user's and is left alone.
//!
//! mimalloc as the global allocator was measured against this (README, "Cost over time",
//! "The allocator"): small-drop runs 15–20 % faster, but a day at Kestrel's scale no
//! faster and its peak RSS 1,142 MB against glibc's 1,031 MB — over the 1 GiB target.

/// Allocations of at least this many bytes are mapped (and unmapped when freed), in the
/// batch commands.
pub const MMAP_THRESHOLD: i32 = 16 << 20;

/// Free memory at the top of a heap beyond this is returned to the system, in the batch
/// commands.
pub const TRIM_THRESHOLD: i32 = 64 << 20;

/// Both thresholds of the always-on stream.
pub const STREAM_THRESHOLD: i32 = 1 << 20;

/// malloc arenas at most per core.
pub const ARENAS_PER_CORE: usize = 4;

/// Set glibc's mmap and trim thresholds and its arena limit for the batch commands (a
/// no-op on other C libraries). Call once, first thing in `main`.
pub fn tune() {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let arenas = i32::try_from(cores * ARENAS_PER_CORE).unwrap_or(i32::MAX);
    set_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD);
    set("MALLOC_ARENA_MAX", Param::ArenaMax, arenas);
}

/// The thresholds of the always-on stream (1 MiB both): its first poll builds a million
/// skus' state at once, and memory kept for reuse took it over its 1 GiB target.
pub fn tune_for_stream() {
    set_thresholds(STREAM_THRESHOLD, STREAM_THRESHOLD);
}

fn set_thresholds(mmap: i32, trim: i32) {
    set("MALLOC_MMAP_THRESHOLD_", Param::MmapThreshold, mmap);
    set("MALLOC_TRIM_THRESHOLD_", Param::TrimThreshold, trim);
}

enum Param {
    MmapThreshold,
    TrimThreshold,
    ArenaMax,
}

/// `mallopt` of `param`, unless the environment variable `var` sets it.
#[allow(unused_variables)]
fn set(var: &str, param: Param, value: i32) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os(var).is_none() {
        let param = match param {
            Param::MmapThreshold => libc::M_MMAP_THRESHOLD,
            Param::TrimThreshold => libc::M_TRIM_THRESHOLD,
            Param::ArenaMax => libc::M_ARENA_MAX,
        };
        // SAFETY: mallopt only changes malloc's parameters.
        unsafe {
            libc::mallopt(param, value);
        }
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

/// Bytes resident in memory (Linux: `/proc/self/statm`); None elsewhere or when it cannot
/// be read.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system setting.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok().filter(|p| *p > 0)?)
}

/// Between the batches of a backlog, freed memory is kept for the next batch while the
/// process holds at most this much resident; above it, [`release_above`] gives it back.
/// Giving it back after every batch made the next batch fault it in anew. On 5M orders
/// in four batches (`--bench jobs -- throughput-run`, the job following the ingestion;
/// two rounds of each bound, alternating), resident between batches was 541, 769 and
/// 759 MB, and:
///
/// | kept up to | step | system time | minor faults | peak RSS |
/// | --- | --- | --- | --- | --- |
/// | nothing (before) | 3.71, 3.69 s | 1.47, 1.32 s | 447k, 497k | 773, 750 MB |
/// | 640 MiB (this) | 3.50, 3.45 s | 1.20, 1.17 s | 394k, 399k | 830, 761 MB |
/// | 768 MiB | 3.52, 3.41 s | 1.19, 1.06 s | 307k, 368k | 861, 848 MB |
/// | everything | 3.48, 3.41 s | 0.98, 0.95 s | 250k, 263k | 906, 917 MB |
pub const KEEP_RESIDENT_BYTES: u64 = 640 << 20;

/// [`release`] when more than `limit` bytes are resident (or the size is unknown).
/// Returns whether it released.
pub fn release_above(limit: u64) -> bool {
    let resident = resident_bytes();
    let over = resident.is_none_or(|r| r > limit);
    tracing::debug!(resident, limit, over, "memory between batches");
    if over {
        release();
    }
    over
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_given_back_only_above_the_bound() {
        #[cfg(target_os = "linux")]
        assert!(resident_bytes().is_some_and(|r| r > 0));
        assert!(release_above(0));
        assert_eq!(release_above(u64::MAX), resident_bytes().is_none());
    }
}
