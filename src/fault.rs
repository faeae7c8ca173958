//! Fault injection for crash tests: `KESTREL_FAULT=<point>[,<point>…]` makes the process
//! SIGKILL itself when it reaches a named point — a real kill -9, no unwinding, no flush.
//!
//! Points of ingestion, in order: `after_plan`, `after_decode`, `after_bronze`,
//! `after_quarantine`, `after_ledger`, `after_runlog`.

/// Environment variable naming the fault points.
pub const ENV: &str = "KESTREL_FAULT";

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
