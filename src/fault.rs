//! Fault injection for crash tests: `KESTREL_FAULT=<point>[,<point>…]` makes the process
//! SIGKILL itself when it reaches a named point — a real kill -9, no unwinding, no flush.
//!
//! Points of ingestion, in order: `after_plan`, `after_decode`, `after_bronze`,
//! `after_quarantine`, `after_ledger`, `after_runlog`. Of a job batch: `job_after_plan`,
//! `job_after_compute`, `job_after_late`, `job_between_merges`, `job_after_gold`,
//! `job_after_runlog`. Of a backfill: `backfill_after_day`.

/// Environment variable naming the fault points.
pub const ENV: &str = "KESTREL_FAULT";

/// Environment variable naming points to pause at: `KESTREL_DELAY=<point>:<ms>[,…]`
/// (tests of overlapping runs and of shutdown in the middle of a batch).
pub const DELAY_ENV: &str = "KESTREL_DELAY";

/// Pause (without blocking the thread) if `point` is named in `KESTREL_DELAY`.
pub async fn pause(point: &str) {
    let Ok(v) = std::env::var(DELAY_ENV) else {
        return;
    };
    for d in v.split(',') {
        if let Some((p, ms)) = d.split_once(':') {
            if p.trim() == point {
                let ms = ms.trim().parse::<u64>().unwrap_or(0);
                tracing::info!(point, ms, "fault injection: pausing");
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
        }
    }
}

/// Kill the process with SIGKILL if `point` is named in `KESTREL_FAULT`.
pub fn point(point: &str) {
    let Ok(v) = std::env::var(ENV) else { return };
    if v.split(',').any(|p| p.trim() == point) {
        eprintln!("kestrel: fault injection: SIGKILL at {point}");
        // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        // SIGKILL cannot be caught; if kill failed, abort is the next best crash.
        std::process::abort();
    }
}
