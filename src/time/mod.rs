//! Event-time semantics, pure (no I/O): watermarks with idleness, window assignment.
//! Shared by micro-batch, backfill and always-on runs.

pub mod clock;
pub mod watermark;
pub mod window;

/// Microseconds since the Unix epoch, UTC (the unit of every event time here).
pub type Micros = i64;

/// A duration in microseconds (saturating: a configured duration beyond 292k years is
/// "forever").
pub fn micros(d: std::time::Duration) -> Micros {
    i64::try_from(d.as_micros()).unwrap_or(Micros::MAX)
}

/// `us` as RFC 3339 in UTC to the second, e.g. `2025-11-20T12:00:00Z` (the number itself
/// if out of range).
pub fn iso(us: Micros) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_else(|| us.to_string())
}

/// A day number (days since the epoch) as `YYYY-MM-DD`.
pub fn date(days: i32) -> String {
    chrono::NaiveDate::from_num_days_from_ce_opt(days + 719_163)
        .map(|d| d.format("%Y-%m-%d").to_string())
        .unwrap_or_else(|| "1970-01-01".into())
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats() {
        assert_eq!(super::date(0), "1970-01-01");
        assert_eq!(super::date(20_000), "2024-10-04");
        assert_eq!(super::iso(1_763_640_000_000_000), "2025-11-20T12:00:00Z");
    }
}
