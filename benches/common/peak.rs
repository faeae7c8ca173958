//! Peak resident memory of a process, for the benchmarks (Linux `/proc`).

/// Reset this process's peak RSS (VmHWM) so the next reading is the next phase's own.
#[allow(dead_code)]
pub fn reset_peak() {
    // Linux: writing 5 resets the peak RSS (VmHWM) of the process.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak RSS (VmHWM) of process `pid` ("self" for this one), MiB; NaN when unknown.
pub fn peak_mib(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<f64>().ok())
            })
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}
