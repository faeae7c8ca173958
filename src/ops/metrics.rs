//! Prometheus metrics of the daemon (`GET /metrics`, text exposition format 0.0.4).
//!
//! Counters and the batch-duration histogram are kept in process since the daemon
//! started; the gauges (watermark lag per job, freshness per gold table) are read from
//! the warehouse at scrape time with [`crate::ops::status`], so they are right even for
//! work another process (`kestrel run`, a stream) did.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use crate::ops::status::Status;
use crate::runlog::{IngestEntry, JobEntry};

/// Upper bounds (seconds) of the batch-duration histogram's buckets.
pub const BUCKETS: [f64; 11] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// (task, result) → runs; result is ok, failed or skipped.
    runs: BTreeMap<(String, &'static str), u64>,
    rows: BTreeMap<String, u64>,
    quarantined: BTreeMap<String, u64>,
    applied: BTreeMap<String, u64>,
    late: BTreeMap<String, u64>,
    corrections: BTreeMap<String, u64>,
    /// (kind, name) → batch durations.
    durations: BTreeMap<(&'static str, String), Histogram>,
}

/// The daemon's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

/// How a scheduled run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Failed,
    /// Not started: the previous run of the same task was still going.
    Skipped,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed => "failed",
            Outcome::Skipped => "skipped",
        }
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn secs(from_us: i64, to_us: i64) -> f64 {
    (to_us - from_us).max(0) as f64 / 1e6
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = match self.inner.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut g)
    }

    /// Count a run of `task`.
    pub fn run(&self, task: &str, outcome: Outcome) {
        self.with(|m| {
            *m.runs
                .entry((task.to_string(), outcome.label()))
                .or_default() += 1
        });
    }

    /// Runs of `task` that ended with `outcome` so far.
    pub fn runs(&self, task: &str, outcome: Outcome) -> u64 {
        self.with(|m| {
            m.runs
                .get(&(task.to_string(), outcome.label()))
                .copied()
                .unwrap_or(0)
        })
    }

    /// Record ingestion batches.
    pub fn ingested(&self, batches: &[IngestEntry]) {
        self.with(|m| {
            for b in batches {
                *m.rows.entry(b.source.clone()).or_default() += b.rows_written.max(0) as u64;
                *m.quarantined.entry(b.source.clone()).or_default() += b.quarantined.max(0) as u64;
                m.durations
                    .entry(("ingest", b.source.clone()))
                    .or_default()
                    .observe(secs(b.started_at_us, b.finished_at_us));
            }
        })
    }

    /// Record job batches.
    pub fn job_batches(&self, batches: &[JobEntry]) {
        self.with(|m| {
            for b in batches {
                let c = &b.counts;
                *m.applied.entry(b.job.clone()).or_default() += c.applied.max(0) as u64;
                *m.late.entry(b.job.clone()).or_default() += c.too_late.max(0) as u64;
                *m.corrections.entry(b.job.clone()).or_default() += c.corrections.max(0) as u64;
                m.durations
                    .entry(("job", b.job.clone()))
                    .or_default()
                    .observe(secs(b.started_at_us, b.finished_at_us));
            }
        })
    }

    /// The text exposition of every metric; gauges from `status` when given.
    pub fn render(&self, status: Option<&Status>) -> String {
        let mut out = String::new();
        self.with(|m| {
            counter(
                &mut out,
                "kestrel_runs_total",
                "Scheduled runs by task and result (ok, failed, skipped: the previous run was still going).",
                m.runs
                    .iter()
                    .map(|((t, r), v)| (format!("task=\"{}\",result=\"{r}\"", escape(t)), *v)),
            );
            counter(
                &mut out,
                "kestrel_run_failures_total",
                "Scheduled runs that failed (retried at the next tick).",
                m.runs
                    .iter()
                    .filter(|((_, r), _)| *r == "failed")
                    .map(|((t, _), v)| (format!("task=\"{}\"", escape(t)), *v)),
            );
            let by = |name: &str, map: &BTreeMap<String, u64>| -> Vec<(String, u64)> {
                map.iter()
                    .map(|(k, v)| (format!("{name}=\"{}\"", escape(k)), *v))
                    .collect()
            };
            counter(
                &mut out,
                "kestrel_rows_ingested_total",
                "Rows written to bronze.",
                by("source", &m.rows),
            );
            counter(
                &mut out,
                "kestrel_rows_quarantined_total",
                "Records quarantined with a reason.",
                by("source", &m.quarantined),
            );
            counter(
                &mut out,
                "kestrel_rows_applied_total",
                "Rows applied to a job's windows.",
                by("job", &m.applied),
            );
            counter(
                &mut out,
                "kestrel_rows_late_total",
                "Rows too late for a job (beyond its lookback; in late/<job>).",
                by("job", &m.late),
            );
            counter(
                &mut out,
                "kestrel_corrections_total",
                "Windows recomputed after they were final.",
                by("job", &m.corrections),
            );
            let _ = writeln!(
                out,
                "# HELP kestrel_batch_duration_seconds Duration of one ingestion or job batch.\n# TYPE kestrel_batch_duration_seconds histogram"
            );
            for ((kind, name), h) in &m.durations {
                let labels = format!("kind=\"{kind}\",name=\"{}\"", escape(name));
                for (i, b) in BUCKETS.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "kestrel_batch_duration_seconds_bucket{{{labels},le=\"{b}\"}} {}",
                        h.counts[i]
                    );
                }
                let _ = writeln!(
                    out,
                    "kestrel_batch_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                    h.count
                );
                let _ = writeln!(out, "kestrel_batch_duration_seconds_sum{{{labels}}} {}", h.sum);
                let _ = writeln!(out, "kestrel_batch_duration_seconds_count{{{labels}}} {}", h.count);
            }
        });
        if let Some(st) = status {
            gauge(
                &mut out,
                "kestrel_watermark_lag_seconds",
                "Event time between the newest event a job has seen and its watermark.",
                st.jobs.iter().filter_map(|j| {
                    j.watermark_lag_s
                        .map(|l| (format!("job=\"{}\"", escape(&j.job)), l))
                }),
            );
            let job = |j: &crate::ops::status::JobStatus| format!("job=\"{}\"", escape(&j.job));
            let per_job =
                |out: &mut String,
                 name: &str,
                 help: &str,
                 f: &dyn Fn(&crate::ops::slo::ServiceLevels) -> Option<f64>| {
                    gauge(
                        out,
                        name,
                        help,
                        st.jobs
                            .iter()
                            .filter_map(|j| f(&j.slo).map(|v| (job(j), v))),
                    );
                };
            gauge(
                &mut out,
                "kestrel_e2e_latency_seconds",
                "End-to-end latency (file landed to rows in gold) over the last batches.",
                st.jobs.iter().flat_map(|j| {
                    [("0.5", j.slo.latency_p50_s), ("0.99", j.slo.latency_p99_s)]
                        .into_iter()
                        .filter_map(move |(q, v)| {
                            v.map(|v| (format!("{},quantile=\"{q}\"", job(j)), v))
                        })
                }),
            );
            per_job(
                &mut out,
                "kestrel_consumer_lag_files",
                "Files of the job's sources landed and not yet ingested.",
                &|l| Some(l.lag_files as f64),
            );
            per_job(
                &mut out,
                "kestrel_consumer_lag_bytes",
                "Bytes of the files landed and not yet ingested.",
                &|l| Some(l.lag_bytes as f64),
            );
            per_job(
                &mut out,
                "kestrel_consumer_lag_oldest_seconds",
                "Age of the oldest file landed and not yet ingested.",
                &|l| l.lag_oldest_s,
            );
            per_job(
                &mut out,
                "kestrel_event_time_skew_seconds",
                "Greatest event-time spread between the partitions of one source.",
                &|l| l.skew_s,
            );
            per_job(
                &mut out,
                "kestrel_late_event_ratio",
                "Too-late events over events read, last day.",
                &|l| l.late_rate,
            );
            per_job(
                &mut out,
                "kestrel_state_bytes",
                "The job's durable state plus its stream's in-memory state.",
                &|l| l.state_bytes.map(|b| b as f64),
            );
            per_job(
                &mut out,
                "kestrel_recovery_seconds",
                "Duration of the newest batch that resumed an interrupted run.",
                &|l| l.recovery_s,
            );
            per_job(
                &mut out,
                "kestrel_cpu_seconds_per_million_events",
                "CPU seconds of the job's batches per million events read, last day.",
                &|l| l.cpu_s_per_million,
            );
            per_job(
                &mut out,
                "kestrel_slo_breaches",
                "Service-level objectives of the job breached now.",
                &|l| Some(l.breaches.len() as f64),
            );
            gauge(
                &mut out,
                "kestrel_gold_freshness_seconds",
                "Age of the newest data commit of a gold table.",
                st.tables.iter().filter_map(|t| {
                    t.age_s.map(|a| {
                        (
                            format!("table=\"{}\",job=\"{}\"", escape(&t.table), escape(&t.job)),
                            a,
                        )
                    })
                }),
            );
        }
        out
    }
}

fn counter(
    out: &mut String,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (String, u64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (labels, v) in rows {
        let _ = writeln!(out, "{name}{{{labels}}} {v}");
    }
}

fn gauge(out: &mut String, name: &str, help: &str, rows: impl IntoIterator<Item = (String, f64)>) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    for (labels, v) in rows {
        let _ = writeln!(out, "{name}{{{labels}}} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        let entry = |ms: i64| JobEntry {
            job: "j".into(),
            started_at_us: 0,
            finished_at_us: ms * 1000,
            ..Default::default()
        };
        m.job_batches(&[entry(300), entry(3000)]);
        m.run("j", Outcome::Skipped);
        let text = m.render(None);
        assert!(
            text.contains(
                "kestrel_batch_duration_seconds_bucket{kind=\"job\",name=\"j\",le=\"0.25\"} 0"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "kestrel_batch_duration_seconds_bucket{kind=\"job\",name=\"j\",le=\"0.5\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "kestrel_batch_duration_seconds_bucket{kind=\"job\",name=\"j\",le=\"5\"} 2"
            ),
            "{text}"
        );
        assert!(
            text.contains("kestrel_batch_duration_seconds_count{kind=\"job\",name=\"j\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kestrel_runs_total{task=\"j\",result=\"skipped\"} 1"),
            "{text}"
        );
        assert_eq!(m.runs("j", Outcome::Skipped), 1);
    }
}
