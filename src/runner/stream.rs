//! The always-on mode of a job (`kestrel stream --job stockout`): poll the landing zone
//! every `interval` and push what landed through the same code as `kestrel run` — one
//! ingestion batch of the job's source (discovery, decoding, validation, quarantine,
//! dedup, bronze append), then one or more job batches of the same operator, each with
//! the exactly-once protocol — so alerts are MERGEd within a poll of a file landing.
//!
//! Ownership: the stream holds the lease `stream-<job>` while it runs. `kestrel run`
//! sees it and leaves the job and its sources to the stream (it reports them as owned,
//! not as failures), so every event is ingested once and processed once whichever
//! process picks it up. A killed stream's lease expires (or is taken over at once on
//! the same host), and a restart resumes from the durable plans and results: there is
//! no state that only the dead process held.
//!
//! Dedup: the stream keeps each source's event ids of the last `dedup_ttl` (26 h) of
//! arrival time in memory ([`crate::source::dedup::DedupSet`], loaded from bronze at
//! start), so a poll does not query bronze for duplicates; the set's size is reported
//! with every poll.
//!
//! Stopping: [`StopFlag`] (set on SIGTERM / Ctrl-C by the CLI) ends the loop between
//! polls; a poll in progress completes its commits first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::error::{Error, Result};
use crate::job::spec::JobSpec;
use crate::lease::Lease;
use crate::runner::batch::JobRunner;
use crate::runner::ingest::Ingestor;
use crate::time::Micros;

/// Name of the lease a stream holds for `job`.
pub fn lease_name(job: &str) -> String {
    format!("stream-{job}")
}

/// Shared flag: set it to stop the stream after the current poll.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// How the stream runs.
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// Time between the starts of two polls.
    pub interval: Duration,
    /// Stop after this many polls (None: run until stopped).
    pub max_polls: Option<u64>,
    /// Stop after this many consecutive polls that found nothing (None: never).
    pub idle_polls: Option<u64>,
    /// Warn when the newest landed file the job has consumed is older than this while
    /// polls keep finding work (the stream is falling behind).
    pub max_lag: Duration,
    pub lease_ttl: Duration,
    /// Duplicate deliveries are removed within this much arrival time (in memory).
    pub dedup_ttl: Duration,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            interval: Duration::from_secs(1),
            max_polls: None,
            idle_polls: None,
            max_lag: Duration::from_secs(60),
            lease_ttl: Duration::from_secs(600),
            dedup_ttl: Duration::from_secs(26 * 3600),
        }
    }
}

/// What one poll did.
#[derive(Debug, Clone, Default)]
pub struct PollReport {
    pub poll: u64,
    pub files: i64,
    pub events: i64,
    pub job_batches: usize,
    pub alerts_written: i64,
    pub alerts_deleted: i64,
    pub watermark: Option<Micros>,
    /// Processing time minus the arrival time of the newest file consumed, in seconds:
    /// how far the gold tables lag the landing zone right after this poll.
    pub lag_s: Option<f64>,
    /// Ids held by the in-memory dedup set(s) and their bytes.
    pub dedup_ids: usize,
    pub dedup_bytes: usize,
    /// Something went wrong but the stream goes on (e.g. a busy lease).
    pub warning: Option<String>,
    pub duration_ms: u64,
}

/// What a whole stream run did.
#[derive(Debug, Clone, Default)]
pub struct StreamSummary {
    pub polls: u64,
    pub files: i64,
    pub events: i64,
    pub job_batches: usize,
}

/// Run `spec` always-on until stopped (or the options' limits).
pub async fn run(
    ing: &Ingestor,
    runner: &JobRunner,
    spec: &JobSpec,
    opts: &StreamOptions,
    stop: &StopFlag,
    mut report: impl FnMut(&PollReport),
) -> Result<StreamSummary> {
    let wh = ing.warehouse();
    let mut lease = Lease::acquire(wh, &lease_name(&spec.name), opts.lease_ttl).await?;
    for s in &spec.sources {
        if let Err(e) = ing.keep_dedup_set(s, opts.dedup_ttl).await {
            let _ = lease.release().await;
            return Err(e);
        }
    }
    let result = poll_loop(ing, runner, spec, opts, stop, &mut lease, &mut report).await;
    if let Err(e) = lease.release().await {
        warn!(job = %spec.name, error = %e, "could not release the stream lease");
    }
    result
}

async fn poll_loop(
    ing: &Ingestor,
    runner: &JobRunner,
    spec: &JobSpec,
    opts: &StreamOptions,
    stop: &StopFlag,
    lease: &mut Lease,
    report: &mut impl FnMut(&PollReport),
) -> Result<StreamSummary> {
    let mut summary = StreamSummary::default();
    let mut idle = 0u64;
    let mut renewed = Instant::now();
    while !stop.stopped() && opts.max_polls.is_none_or(|m| summary.polls < m) {
        let t = Instant::now();
        if renewed.elapsed() > opts.lease_ttl / 3 {
            lease.renew(opts.lease_ttl).await?;
            renewed = Instant::now();
        }
        summary.polls += 1;
        let mut r = PollReport {
            poll: summary.polls,
            ..Default::default()
        };
        let mut warnings = Vec::new();
        for s in &spec.sources {
            match ing.ingest_source(s).await {
                Ok(rep) => {
                    r.files += rep.files();
                    r.events += rep.rows_written();
                }
                Err(e @ Error::LeaseHeld { .. }) => warnings.push(e.to_string()),
                Err(e) => return Err(e),
            }
        }
        match runner.run_job(spec).await {
            Ok(j) => {
                r.job_batches = j.batches.len();
                r.alerts_written = j.windows_recomputed();
                r.alerts_deleted = j.batches.iter().map(|b| b.counts.deleted).sum();
                r.watermark = j.watermark;
                if r.job_batches > 0 {
                    r.lag_s = j
                        .newest_landed
                        .map(|l| (chrono::Utc::now().timestamp_micros() - l) as f64 / 1e6);
                }
            }
            Err(e @ Error::LeaseHeld { .. }) => warnings.push(e.to_string()),
            Err(e) => return Err(e),
        }
        if let Some(lag) = r.lag_s {
            if lag > opts.max_lag.as_secs_f64() {
                warnings.push(format!(
                    "falling behind: the newest file consumed landed {lag:.0} s ago (> {} s)",
                    opts.max_lag.as_secs()
                ));
            }
        }
        for s in &spec.sources {
            if let Some((ids, bytes)) = ing.dedup_set_size(s) {
                r.dedup_ids += ids;
                r.dedup_bytes += bytes;
            }
        }
        r.warning = (!warnings.is_empty()).then(|| warnings.join("; "));
        r.duration_ms = t.elapsed().as_millis() as u64;
        summary.files += r.files;
        summary.events += r.events;
        summary.job_batches += r.job_batches;
        report(&r);
        if r.files == 0 && r.job_batches == 0 {
            idle += 1;
            if opts.idle_polls.is_some_and(|n| idle >= n) {
                break;
            }
        } else {
            idle = 0;
        }
        // Sleep out the interval, waking early to stop.
        let deadline = t + opts.interval;
        while !stop.stopped() && Instant::now() < deadline {
            tokio::time::sleep(
                deadline
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(100)),
            )
            .await;
        }
    }
    Ok(summary)
}
