//! Metrics of the daemon (`GET /metrics`), kept and encoded with the `prometheus-client`
//! crate: OpenMetrics types, a registry, the OpenMetrics text encoder (which Prometheus
//! scrapes; counters are exposed with their `_total` suffix).
//!
//! Counters and the batch-duration histogram are kept in process since the daemon
//! started; the gauges (watermark lag per job, freshness per gold table, each job's
//! service levels) are read from the warehouse at scrape time with
//! [`crate::ops::status`], so they are right even for work another process (`kestrel
//! run`, a stream) did.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::ops::slo::ServiceLevels;
use crate::ops::status::Status;
use crate::runlog::{IngestEntry, JobEntry};

/// Upper bounds (seconds) of the batch-duration histogram's buckets.
pub const BUCKETS: [f64; 11] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A metric's labels.
type Labels = Vec<(&'static str, String)>;
type Counters = Family<Labels, Counter>;
type Gauges = Family<Labels, Gauge<f64, AtomicU64>>;

fn durations() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The daemon's metrics.
#[derive(Debug)]
pub struct Metrics {
    runs: Counters,
    failures: Counters,
    rows: Counters,
    quarantined: Counters,
    applied: Counters,
    late: Counters,
    corrections: Counters,
    /// Batch durations by kind (ingest, job) and name.
    durations: Family<Labels, Histogram, fn() -> Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            runs: Counters::default(),
            failures: Counters::default(),
            rows: Counters::default(),
            quarantined: Counters::default(),
            applied: Counters::default(),
            late: Counters::default(),
            corrections: Counters::default(),
            durations: Family::new_with_constructor(durations),
        }
    }
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

fn secs(from_us: i64, to_us: i64) -> f64 {
    (to_us - from_us).max(0) as f64 / 1e6
}

fn one(name: &'static str, value: &str) -> Labels {
    vec![(name, value.to_string())]
}

fn add(c: &Counters, labels: Labels, v: i64) {
    c.get_or_create(&labels).inc_by(v.max(0) as u64);
}

fn run_labels(task: &str, outcome: Outcome) -> Labels {
    vec![
        ("task", task.to_string()),
        ("result", outcome.label().into()),
    ]
}

impl Metrics {
    /// Count a run of `task`.
    pub fn run(&self, task: &str, outcome: Outcome) {
        self.runs.get_or_create(&run_labels(task, outcome)).inc();
        if outcome == Outcome::Failed {
            self.failures.get_or_create(&one("task", task)).inc();
        }
    }

    /// Runs of `task` that ended with `outcome` so far.
    pub fn runs(&self, task: &str, outcome: Outcome) -> u64 {
        self.runs
            .get(&run_labels(task, outcome))
            .map_or(0, |c| c.get())
    }

    /// Observe a batch of `kind` (ingest, job) and `name` in the duration histogram.
    fn batch_took(&self, kind: &str, name: &str, started_us: i64, finished_us: i64) {
        let labels = vec![("kind", kind.to_string()), ("name", name.to_string())];
        self.durations
            .get_or_create(&labels)
            .observe(secs(started_us, finished_us));
    }

    /// Record ingestion batches.
    pub fn ingested(&self, batches: &[IngestEntry]) {
        for b in batches {
            add(&self.rows, one("source", &b.source), b.rows_written);
            add(&self.quarantined, one("source", &b.source), b.quarantined);
            self.batch_took("ingest", &b.source, b.started_at_us, b.finished_at_us);
        }
    }

    /// Record job batches.
    pub fn job_batches(&self, batches: &[JobEntry]) {
        for b in batches {
            let c = &b.counts;
            add(&self.applied, one("job", &b.job), c.applied);
            add(&self.late, one("job", &b.job), c.too_late);
            add(&self.corrections, one("job", &b.job), c.corrections);
            self.batch_took("job", &b.job, b.started_at_us, b.finished_at_us);
        }
    }

    /// The OpenMetrics text exposition of every metric; gauges from `status` when given,
    /// and `kestrel_up` (whether the daemon holds its lease and runs).
    pub fn render(&self, status: Option<&Status>, up: bool) -> String {
        let mut r = Registry::default();
        let counters: [(&str, &str, &Counters); 7] = [
            ("kestrel_runs", "Scheduled runs by task and result (ok, failed, skipped: the previous run was still going).", &self.runs),
            ("kestrel_run_failures", "Scheduled runs that failed (retried at the next tick).", &self.failures),
            ("kestrel_rows_ingested", "Rows written to bronze.", &self.rows),
            ("kestrel_rows_quarantined", "Records quarantined with a reason.", &self.quarantined),
            ("kestrel_rows_applied", "Rows applied to a job's windows.", &self.applied),
            ("kestrel_rows_late", "Rows too late for a job (beyond its lookback; in late/<job>).", &self.late),
            ("kestrel_corrections", "Windows recomputed after they were final.", &self.corrections),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "kestrel_batch_duration_seconds",
            "Duration of one ingestion or job batch.",
            self.durations.clone(),
        );
        if let Some(st) = status {
            status_gauges(&mut r, st);
        }
        let g = Gauge::<f64, AtomicU64>::default();
        g.set(f64::from(u8::from(up)));
        r.register(
            "kestrel_up",
            "Whether the daemon holds its lease and runs.",
            g,
        );
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &r);
        out
    }
}

/// The gauges read from the warehouse: watermark lag, freshness, service levels.
fn status_gauges(r: &mut Registry, st: &Status) {
    let job = |j: &crate::ops::status::JobStatus| one("job", &j.job);
    let lag = Gauges::default();
    for j in &st.jobs {
        if let Some(l) = j.watermark_lag_s {
            lag.get_or_create(&job(j)).set(l);
        }
    }
    r.register(
        "kestrel_watermark_lag_seconds",
        "Event time between the newest event a job has seen and its watermark.",
        lag,
    );
    let latency = Gauges::default();
    for j in &st.jobs {
        for (q, v) in [("0.5", j.slo.latency_p50_s), ("0.99", j.slo.latency_p99_s)] {
            if let Some(v) = v {
                let mut labels = job(j);
                labels.push(("quantile", q.to_string()));
                latency.get_or_create(&labels).set(v);
            }
        }
    }
    r.register(
        "kestrel_e2e_latency_seconds",
        "End-to-end latency (file landed to rows in gold) over the last batches.",
        latency,
    );
    type Measure = fn(&ServiceLevels) -> Option<f64>;
    let per_job: [(&str, &str, Measure); 9] = [
        (
            "kestrel_consumer_lag_files",
            "Files of the job's sources landed and not yet ingested.",
            |l| Some(l.lag_files as f64),
        ),
        (
            "kestrel_consumer_lag_bytes",
            "Bytes of the files landed and not yet ingested.",
            |l| Some(l.lag_bytes as f64),
        ),
        (
            "kestrel_consumer_lag_oldest_seconds",
            "Age of the oldest file landed and not yet ingested.",
            |l| l.lag_oldest_s,
        ),
        (
            "kestrel_event_time_skew_seconds",
            "Greatest event-time spread between the partitions of one source.",
            |l| l.skew_s,
        ),
        (
            "kestrel_late_event_ratio",
            "Too-late events over events read, last day.",
            |l| l.late_rate,
        ),
        (
            "kestrel_state_bytes",
            "The job's durable state plus its stream's in-memory state.",
            |l| l.state_bytes.map(|b| b as f64),
        ),
        (
            "kestrel_recovery_seconds",
            "Duration of the newest batch that resumed an interrupted run.",
            |l| l.recovery_s,
        ),
        (
            "kestrel_cpu_seconds_per_million_events",
            "CPU seconds of the job's batches per million events read, last day.",
            |l| l.cpu_s_per_million,
        ),
        (
            "kestrel_slo_breaches",
            "Service-level objectives of the job breached now.",
            |l| Some(l.breaches.len() as f64),
        ),
    ];
    for (name, help, f) in per_job {
        let g = Gauges::default();
        for j in &st.jobs {
            if let Some(v) = f(&j.slo) {
                g.get_or_create(&job(j)).set(v);
            }
        }
        r.register(name, help, g);
    }
    let fresh = Gauges::default();
    for t in &st.tables {
        if let Some(a) = t.age_s {
            let labels = vec![("table", t.table.clone()), ("job", t.job.clone())];
            fresh.get_or_create(&labels).set(a);
        }
    }
    r.register(
        "kestrel_gold_freshness_seconds",
        "Age of the newest data commit of a gold table.",
        fresh,
    );
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
        m.run("j", Outcome::Failed);
        let text = m.render(None, true);
        for want in [
            "kestrel_batch_duration_seconds_bucket{le=\"0.25\",kind=\"job\",name=\"j\"} 0",
            "kestrel_batch_duration_seconds_bucket{le=\"0.5\",kind=\"job\",name=\"j\"} 1",
            "kestrel_batch_duration_seconds_bucket{le=\"5.0\",kind=\"job\",name=\"j\"} 2",
            "kestrel_batch_duration_seconds_count{kind=\"job\",name=\"j\"} 2",
            "kestrel_runs_total{task=\"j\",result=\"skipped\"} 1",
            "kestrel_run_failures_total{task=\"j\"} 1",
            "kestrel_up 1.0",
        ] {
            assert!(text.contains(want), "{want}\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(m.runs("j", Outcome::Skipped), 1);
    }
}
