//! Event-time semantics, pure (no I/O): watermarks with idleness, window assignment.
//! Shared by micro-batch, backfill and always-on runs.

pub mod watermark;
pub mod window;

/// Microseconds since the Unix epoch, UTC (the unit of every event time here).
pub type Micros = i64;
