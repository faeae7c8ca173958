//! Service levels per job (maturity level 4 of the second seed chapter): the measures a
//! pipeline's consumers care about, read from the run log, the ledger's listing cursors,
//! the job's durable state and the landing zone, and judged against the job's `[slo]`
//! objectives. `kestrel status` (`slo` in `--json`) and the daemon's `/metrics` report
//! them; `kestrel status --check` exits 4 naming every breached objective.
//!
//! - **latency**: end-to-end, a file landed → its rows committed to gold: per job batch,
//!   its finish minus the arrival of the oldest file it read (so the batch's worst
//!   file); p50 and p99 over the last [`LATENCY_BATCHES`] batches that read rows.
//! - **consumer lag**: files of the job's sources landed and not yet ingested (after
//!   each source's listing cursor, the way the next run will find them), their bytes,
//!   and the age of the oldest.
//! - **skew**: per source, the newest minus the oldest of its partitions' greatest event
//!   times (what an idle or slow partition holds the watermark back by); the largest.
//! - **late rate**: too-late ÷ read events over the last day of the job's batches.
//! - **state**: the job's durable state bytes plus its stream's in-memory bytes.
//! - **recovery**: duration of the newest batch (the job's, or an ingestion batch of its
//!   sources) that resumed a plan an interrupted run left.
//! - **cost**: CPU seconds of the job's batches per million events they read, over the
//!   last day (process CPU time across each batch; ingestion's own is per source).

use std::collections::BTreeMap;

use datafusion::prelude::SessionContext;
use serde::Serialize;

use crate::error::Result;
use crate::job::spec::{JobSpec, Slo};
use crate::sink::delta::{self, Warehouse};
use crate::source::discover;
use crate::storage::Location;
use crate::time::Micros;

/// Batches the latency percentiles are taken over.
pub const LATENCY_BATCHES: usize = 100;

/// A job's service levels and the objectives they breach.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ServiceLevels {
    pub latency_p50_s: Option<f64>,
    pub latency_p99_s: Option<f64>,
    /// Batches the percentiles are over.
    pub latency_batches: usize,
    pub lag_files: i64,
    pub lag_bytes: i64,
    pub lag_oldest_s: Option<f64>,
    pub skew_s: Option<f64>,
    pub late_rate: Option<f64>,
    pub state_bytes: Option<i64>,
    pub recovery_s: Option<f64>,
    pub cpu_s_per_million: Option<f64>,
    /// Each breached objective: `max_latency: p99 71 s > 60 s`.
    pub breaches: Vec<String>,
}

/// One source's files landed and not yet ingested.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Pending {
    pub files: i64,
    pub bytes: i64,
    /// Arrival time of the oldest.
    pub oldest_us: Option<Micros>,
}

/// Files of `source` the next ingestion run will find: after the listing cursors of its
/// last batch (everything when it has none).
pub async fn pending(wh: &Warehouse, landing: &Location, source: &str) -> Result<Pending> {
    let last = crate::runlog::last_batch(wh, "ingest", source).await?;
    let cursors = if last > 0 {
        crate::ledger::read_plan(wh, source, last)
            .await?
            .map(|p| p.cursors_after)
            .unwrap_or_default()
    } else {
        BTreeMap::new()
    };
    let files =
        discover::list_source(landing, source, (!cursors.is_empty()).then_some(&cursors)).await?;
    Ok(Pending {
        files: files.len() as i64,
        bytes: files.iter().map(|f| f.size as i64).sum(),
        oldest_us: files.iter().map(|f| f.landed_at_us).min(),
    })
}

/// What the run log says of one job for its service levels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FromRuns {
    /// (finished, oldest file's arrival) of its last batches that read rows.
    pub latencies_s: Vec<f64>,
    /// Over the last day: events read, too late, CPU milliseconds.
    pub rows_in_day: i64,
    pub too_late_day: i64,
    pub cpu_ms_day: i64,
    /// Duration of the newest resumed batch of the job or its sources.
    pub recovery_ms: Option<i64>,
}

/// Fill `out` with what the run log says of `spec`'s latency and recovery; `ctx` has the
/// run log registered as `runs`, with the service-level columns. (The day sums come from
/// the status's run summaries, which read them in the same pass as the other counts.)
pub async fn from_runs(ctx: &SessionContext, spec: &JobSpec, out: &mut FromRuns) -> Result<()> {
    let job = spec.name.replace('\'', "''");
    let sql = format!(
        "SELECT CAST((to_unixtime(finished_at) - to_unixtime(landed_oldest)) * 1000000 AS BIGINT) \
         FROM runs WHERE kind = 'job' AND name = '{job}' AND landed_oldest IS NOT NULL \
         ORDER BY batch_id DESC LIMIT {LATENCY_BATCHES}"
    );
    for b in delta::sql(ctx, &sql).await? {
        let v = crate::columns::int64_at(&b, 0)?;
        out.latencies_s
            .extend(v.iter().flatten().map(|us| us.max(0) as f64 / 1e6));
    }
    let sources: Vec<String> = spec
        .sources
        .iter()
        .map(|s| format!("'{}'", s.replace('\'', "''")))
        .collect();
    let sql = format!(
        "SELECT duration_ms FROM runs WHERE resumed AND ((kind = 'job' AND name = '{job}') \
         OR (kind = 'ingest' AND name IN ({}))) ORDER BY finished_at DESC LIMIT 1",
        sources.join(", ")
    );
    for b in delta::sql(ctx, &sql).await? {
        let v = crate::columns::int64_at(&b, 0)?;
        if let Some(ms) = v.iter().flatten().next() {
            out.recovery_ms = Some(ms);
        }
    }
    Ok(())
}

/// The nearest-rank percentile `p` (0–1) of `v`.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len());
    Some(s[rank - 1])
}

/// Inputs of [`levels`] besides the run log's.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// Summed over the job's sources.
    pub pending: Pending,
    pub skew_s: Option<f64>,
    pub state_bytes: Option<i64>,
}

/// The service levels of a job at `now`, judged against `slo`.
pub fn levels(slo: &Slo, runs: &FromRuns, m: &Measured, now: Micros) -> ServiceLevels {
    let mut l = ServiceLevels {
        latency_p50_s: percentile(&runs.latencies_s, 0.5),
        latency_p99_s: percentile(&runs.latencies_s, 0.99),
        latency_batches: runs.latencies_s.len(),
        lag_files: m.pending.files,
        lag_bytes: m.pending.bytes,
        lag_oldest_s: m.pending.oldest_us.map(|o| (now - o).max(0) as f64 / 1e6),
        skew_s: m.skew_s,
        late_rate: (runs.rows_in_day > 0)
            .then(|| runs.too_late_day as f64 / runs.rows_in_day as f64),
        state_bytes: m.state_bytes,
        recovery_s: runs.recovery_ms.map(|ms| ms as f64 / 1e3),
        cpu_s_per_million: (runs.rows_in_day > 0)
            .then(|| runs.cpu_ms_day as f64 / 1e3 / (runs.rows_in_day as f64 / 1e6)),
        breaches: Vec::new(),
    };
    let mut breach = |name: &str, what: &str, got: Option<f64>, max: Option<f64>, unit: &str| {
        if let (Some(g), Some(m)) = (got, max) {
            if g > m {
                l.breaches
                    .push(format!("{name}: {what}{g:.3}{unit} > {m}{unit}"));
            }
        }
    };
    let secs = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64());
    breach(
        "max_latency",
        "p99 ",
        l.latency_p99_s,
        secs(slo.max_latency),
        " s",
    );
    breach(
        "max_consumer_lag",
        "oldest unread file ",
        l.lag_oldest_s,
        secs(slo.max_consumer_lag),
        " s",
    );
    breach("max_skew", "", l.skew_s, secs(slo.max_skew), " s");
    breach("max_late_rate", "", l.late_rate, slo.max_late_rate, "");
    breach(
        "max_state_bytes",
        "",
        l.state_bytes.map(|b| b as f64),
        slo.max_state_bytes.map(|b| b as f64),
        " B",
    );
    breach(
        "max_recovery",
        "",
        l.recovery_s,
        secs(slo.max_recovery),
        " s",
    );
    breach(
        "max_cpu_s_per_million",
        "",
        l.cpu_s_per_million,
        slo.max_cpu_s_per_million,
        " CPU s",
    );
    l
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every measure from known inputs, and each objective breached or not.
    #[test]
    fn service_levels_from_known_values() {
        let runs = FromRuns {
            latencies_s: (1..=100).map(f64::from).collect(),
            rows_in_day: 2_000_000,
            too_late_day: 20_000,
            cpu_ms_day: 30_000,
            recovery_ms: Some(4_500),
        };
        let now = 1_000_000_000;
        let m = Measured {
            pending: Pending {
                files: 3,
                bytes: 300,
                oldest_us: Some(now - 90_000_000),
            },
            skew_s: Some(600.0),
            state_bytes: Some(2048),
        };
        let slo = Slo {
            max_latency: Some(Duration::from_secs(60)),
            max_consumer_lag: Some(Duration::from_secs(120)),
            max_skew: Some(Duration::from_secs(300)),
            max_late_rate: Some(0.001),
            max_state_bytes: Some(4096),
            max_recovery: Some(Duration::from_secs(10)),
            max_cpu_s_per_million: Some(10.0),
        };
        let l = levels(&slo, &runs, &m, now);
        assert_eq!((l.latency_p50_s, l.latency_p99_s), (Some(50.0), Some(99.0)));
        assert_eq!(
            (l.lag_files, l.lag_bytes, l.lag_oldest_s),
            (3, 300, Some(90.0))
        );
        assert_eq!(l.late_rate, Some(0.01));
        assert_eq!(l.cpu_s_per_million, Some(15.0));
        assert_eq!(l.recovery_s, Some(4.5));
        let names: Vec<&str> = l
            .breaches
            .iter()
            .map(|b| b.split(':').next().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "max_latency",
                "max_skew",
                "max_late_rate",
                "max_cpu_s_per_million"
            ]
        );
        assert_eq!(l.breaches[0], "max_latency: p99 99.000 s > 60 s");
        // No objectives: measures only.
        let l = levels(&Slo::default(), &runs, &m, now);
        assert!(l.breaches.is_empty());
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
    }
}
