//! Watermarks (DESIGN.md, Time semantics).
//!
//! Per source partition: max event time seen minus the job's `watermark_delay`. A source's
//! watermark is the minimum over its non-idle partitions; a partition is idle when its
//! newest file landed more than `idle_timeout` before the newest file of the source
//! (arrival time, so a replay answers the same). A partition that never had a file does
//! not count. A job over several sources takes the minimum over its non-idle sources (the
//! same rule, on each source's newest arrival) and has no watermark until every source has
//! data. Watermarks never move backwards.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Micros;

/// What is known about one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionState {
    /// Greatest event time seen.
    pub max_event_ts: Micros,
    /// Arrival time of the newest file.
    pub newest_landed: Micros,
}

/// Watermark of one source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceWatermark {
    pub partitions: BTreeMap<String, PartitionState>,
}

impl SourceWatermark {
    /// Record a file's events: its partition, max event time and arrival time.
    pub fn observe(&mut self, partition: &str, max_event_ts: Micros, landed: Micros) {
        let p = self
            .partitions
            .entry(partition.to_string())
            .or_insert(PartitionState {
                max_event_ts,
                newest_landed: landed,
            });
        p.max_event_ts = p.max_event_ts.max(max_event_ts);
        p.newest_landed = p.newest_landed.max(landed);
    }

    /// Newest arrival over all partitions (None before any data).
    pub fn newest_landed(&self) -> Option<Micros> {
        self.partitions.values().map(|p| p.newest_landed).max()
    }

    /// Candidate watermark: min over non-idle partitions of (max event time − delay).
    pub fn candidate(&self, delay: Micros, idle_timeout: Micros) -> Option<Micros> {
        let newest = self.newest_landed()?;
        self.partitions
            .values()
            .filter(|p| p.newest_landed >= newest - idle_timeout)
            .map(|p| p.max_event_ts - delay)
            .min()
    }
}

/// A job's watermark over one or more sources; monotonic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watermark {
    pub delay: Micros,
    pub idle_timeout: Micros,
    pub sources: BTreeMap<String, SourceWatermark>,
    /// The current watermark (None until every source has data).
    pub current: Option<Micros>,
}

impl Watermark {
    /// A watermark over `sources` (names) with the job's delay and idle timeout.
    pub fn new(sources: &[&str], delay: Micros, idle_timeout: Micros) -> Self {
        Watermark {
            delay,
            idle_timeout,
            sources: sources
                .iter()
                .map(|s| (s.to_string(), SourceWatermark::default()))
                .collect(),
            current: None,
        }
    }

    /// Record a file's events for `source`.
    pub fn observe(&mut self, source: &str, partition: &str, max_event_ts: Micros, landed: Micros) {
        self.sources.entry(source.to_string()).or_default().observe(
            partition,
            max_event_ts,
            landed,
        );
    }

    /// Recompute from what was observed; never moves backwards. Returns the watermark.
    pub fn advance(&mut self) -> Option<Micros> {
        let mut newest_per_source = Vec::with_capacity(self.sources.len());
        for s in self.sources.values() {
            match s.newest_landed() {
                Some(n) => newest_per_source.push(n),
                None => return self.current, // a source without data: no watermark yet
            }
        }
        let newest = newest_per_source.iter().copied().max();
        let candidate = self
            .sources
            .values()
            .filter(|s| match (s.newest_landed(), newest) {
                (Some(n), Some(all)) => n >= all - self.idle_timeout,
                _ => false,
            })
            .filter_map(|s| s.candidate(self.delay, self.idle_timeout))
            .min();
        if let Some(c) = candidate {
            self.current = Some(self.current.map_or(c, |w| w.max(c)));
        }
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;

    #[test]
    fn min_over_partitions_minus_delay_and_monotonic() {
        let mut w = Watermark::new(&["orders"], 30 * S, 300 * S);
        assert_eq!(w.advance(), None);
        w.observe("orders", "0", 1000 * S, 1000 * S);
        w.observe("orders", "1", 900 * S, 1000 * S);
        assert_eq!(w.advance(), Some(870 * S));
        // an out-of-order file does not move it back
        w.observe("orders", "1", 500 * S, 1010 * S);
        assert_eq!(w.advance(), Some(870 * S));
        w.observe("orders", "1", 1100 * S, 1020 * S);
        assert_eq!(w.advance(), Some(970 * S));
    }

    #[test]
    fn an_idle_partition_stops_holding_the_watermark_back() {
        let mut w = Watermark::new(&["orders"], 0, 300 * S);
        w.observe("orders", "0", 100 * S, 100 * S);
        w.observe("orders", "1", 100 * S, 100 * S);
        // partition 0 keeps receiving, partition 1 goes quiet
        w.observe("orders", "0", 350 * S, 350 * S);
        assert_eq!(w.advance(), Some(100 * S), "still within the idle timeout");
        w.observe("orders", "0", 500 * S, 500 * S);
        assert_eq!(
            w.advance(),
            Some(500 * S),
            "partition 1 is idle: its newest file is > 5 min older"
        );
        // without the idleness rule it would stall at 100 s forever
        let stalled = SourceWatermark {
            partitions: w.sources["orders"].partitions.clone(),
        }
        .candidate(0, Micros::MAX / 4);
        assert_eq!(stalled, Some(100 * S));
    }

    #[test]
    fn several_sources_need_data_from_each_and_take_the_min() {
        let mut w = Watermark::new(&["orders", "payments"], 0, 300 * S);
        w.observe("orders", "0", 1000 * S, 1000 * S);
        assert_eq!(
            w.advance(),
            None,
            "no watermark until every source has data"
        );
        w.observe("payments", "0", 800 * S, 1000 * S);
        assert_eq!(w.advance(), Some(800 * S));
        // payments goes idle (no file for > idle_timeout of arrival time)
        w.observe("orders", "0", 2000 * S, 2000 * S);
        assert_eq!(w.advance(), Some(2000 * S));
    }
}
