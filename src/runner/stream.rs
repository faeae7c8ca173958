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
//! arrival time in memory ([`crate::source::dedup::DedupSet`]), so a poll does not query
//! bronze for duplicates; the set's size is reported with every poll. The set is
//! checkpointed every `checkpoint_every` (10 s) and when the stream stops
//! ([`crate::runner::checkpoint`]), and each checkpoint is a run-log row (kind
//! `checkpoint`: the ids and bytes the sets hold, the bytes written, how long it took —
//! what `kestrel status` shows as the job's stream state); a restart loads the checkpoint and tops it up with
//! the ids of the ingestion batches completed after it (without one, it rebuilds the set
//! from bronze).
//!
//! Stopping: [`StopFlag`] (set on SIGTERM / Ctrl-C by the CLI) ends the loop between
//! polls; a poll in progress completes its commits first.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::error::{Error, Result};
use crate::job::spec::JobSpec;
use crate::lease::Lease;
use crate::names;
use crate::runlog;
use crate::runner::batch::JobRunner;
use crate::runner::checkpoint as ckpt;
use crate::runner::ingest::{DedupLoad, Ingestor};
pub use crate::runner::StopFlag;
use crate::time::Micros;

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
    /// Time between checkpoints of the dedup set (one is also written when stopping).
    pub checkpoint_every: Duration,
    /// Compact, checkpoint and vacuum the job's tables between polls this often (None:
    /// never). `kestrel maintain` leaves a streamed job's tables to its stream.
    pub maintain: Option<(Duration, crate::ops::maintain::MaintainOptions)>,
    /// Commit the job's state output (`sku_availability`) a partition per poll, holding
    /// the rest in memory and in a file per batch ([`crate::runner::deferred`]); false:
    /// every batch MERGEs it, as `kestrel run` does.
    pub defer_state: bool,
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
            checkpoint_every: Duration::from_secs(10),
            maintain: None,
            defer_state: true,
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
    /// A checkpoint written after this poll: (milliseconds, bytes).
    pub checkpoint: Option<(u64, usize)>,
    /// Maintenance of the job's tables after this poll.
    pub maintenance: Option<crate::ops::maintain::MaintainReport>,
    /// The deferred state output's partition committed after this poll, and its rows.
    pub state_committed: Option<(i32, usize)>,
    /// State rows not committed to their table after this poll (see
    /// [`crate::runner::deferred`]).
    pub state_pending: usize,
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
    /// How each source's dedup set was loaded at start.
    pub loads: Vec<(String, DedupLoad)>,
    /// The checkpoint written when stopping: (milliseconds, bytes).
    pub final_checkpoint: Option<(u64, usize)>,
    /// Checkpoints written (the final one included).
    pub checkpoints: u64,
    /// Deferred state rows a killed stream had left and this one committed at start,
    /// and the rows committed when stopping.
    pub state_caught_up: usize,
    pub state_final: usize,
}

/// Per source: the position the in-memory set reflects, the last one checkpointed, and
/// the checkpoint chunks on storage.
struct Positions(BTreeMap<String, (i64, i64, ckpt::Written)>);

impl Positions {
    fn dirty(&self) -> bool {
        self.0.values().any(|(now, saved, _)| now != saved)
    }
}

/// Checkpoint every source's dedup set (incrementally) and log it in the run log as the
/// job's checkpoint `base + seq` (its state size and what writing it took); returns
/// (milliseconds, bytes).
async fn checkpoint(
    ing: &Ingestor,
    spec: &JobSpec,
    positions: &mut Positions,
    (base, seq): (i64, &mut u64),
) -> Result<(u64, usize)> {
    let t = Instant::now();
    let started_at_us = ing.clock().now_us();
    let mut bytes = 0;
    *seq += 1;
    for (source, (now, saved, written)) in positions.0.iter_mut() {
        let mut header = ckpt::Header {
            operator_id: ckpt::OPERATOR.into(),
            format: ckpt::FORMAT,
            job: spec.name.clone(),
            source: source.clone(),
            seq: *seq,
            created_at_us: ing.clock().now_us(),
            position: *now,
            ttl_s: 0,
        };
        // Encoded while the set is locked; written after.
        let prepared = ing
            .with_dedup_set(source, |set| {
                header.ttl_s = u64::try_from(set.ttl() / 1_000_000).unwrap_or(0);
                ckpt::prepare(&header, set, written)
            })
            .transpose()?;
        if let Some(p) = prepared {
            let (s, next) = ckpt::write(ing.warehouse(), p).await?;
            bytes += s.bytes;
            *written = next;
            *saved = *now;
        }
    }
    let ms = t.elapsed().as_millis() as u64;
    let (ids, held) = dedup_size(ing, spec);
    let entry = runlog::CheckpointEntry {
        run_id: ing.run_id().to_string(),
        job: spec.name.clone(),
        number: base + *seq as i64,
        started_at_us,
        finished_at_us: started_at_us + (ms as i64) * 1000,
        state_ids: ids as i64,
        state_bytes: held as i64,
        checkpoint_bytes: bytes as i64,
    };
    runlog::log_checkpoint(ing.warehouse(), &entry).await?;
    Ok((ms, bytes))
}

/// Ids held by the job's in-memory dedup sets, and their bytes.
fn dedup_size(ing: &Ingestor, spec: &JobSpec) -> (usize, usize) {
    spec.sources
        .iter()
        .filter_map(|s| ing.dedup_set_size(s))
        .fold((0, 0), |(i, b), (n, m)| (i + n, b + m))
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
    // Memory freed goes back at once: the first poll's million skus peak otherwise.
    crate::alloc::tune_for_stream();
    let wh = ing.warehouse();
    let mut lease = Lease::acquire(wh, &names::lease::stream(&spec.name), opts.lease_ttl).await?;
    let result = async {
        let mut loads = Vec::new();
        let mut positions = Positions(BTreeMap::new());
        for s in &spec.sources {
            let loaded = ckpt::load(wh, &spec.name, s, opts.dedup_ttl).await?;
            let (from, saved, written) = match loaded {
                Some(c) => (
                    Some((c.dedup, c.header.position)),
                    c.header.position,
                    c.written,
                ),
                None => (None, -1, ckpt::Written::new()),
            };
            let load = ing.keep_dedup_set(s, opts.dedup_ttl, from).await?;
            positions
                .0
                .insert(s.clone(), (load.position, saved, written));
            loads.push((s.clone(), load));
        }
        // State a killed stream deferred first; then defer this one's.
        let caught_up = crate::runner::deferred::catch_up(runner, spec).await?;
        let deferral = match opts.defer_state {
            true => crate::runner::deferred::Deferral::start(runner, spec).await?,
            false => None,
        };
        let deferring = deferral
            .as_ref()
            .map(|d| runner.deferring(d.pending.clone()));
        let parts = Parts {
            ing,
            runner: deferring.as_ref().unwrap_or(runner),
            deferral: deferral.as_ref(),
            spec,
            opts,
            stop,
            logged: runlog::last_batch(wh, "checkpoint", &spec.name).await?,
        };
        let mut summary = poll_loop(&parts, &mut lease, &mut positions, &mut report).await?;
        summary.loads = loads;
        summary.state_caught_up = caught_up;
        crate::fault::point("stream_before_finish");
        if let Some(d) = &deferral {
            summary.state_final = d.finish(parts.runner, spec).await?;
        }
        // The final checkpoint: a restart then reads only what lands after it.
        let mut seq = summary.checkpoints;
        summary.final_checkpoint =
            Some(checkpoint(ing, spec, &mut positions, (parts.logged, &mut seq)).await?);
        summary.checkpoints = seq;
        Ok(summary)
    }
    .await;
    if let Err(e) = lease.release().await {
        warn!(job = %spec.name, error = %e, "could not release the stream lease");
    }
    result
}

/// What a stream works with.
struct Parts<'a> {
    ing: &'a Ingestor,
    runner: &'a JobRunner,
    /// The job's deferred state output, committed a partition per poll.
    deferral: Option<&'a crate::runner::deferred::Deferral>,
    spec: &'a JobSpec,
    opts: &'a StreamOptions,
    stop: &'a StopFlag,
    /// The job's checkpoints in the run log before this run.
    logged: i64,
}

async fn poll_loop(
    parts: &Parts<'_>,
    lease: &mut Lease,
    positions: &mut Positions,
    report: &mut impl FnMut(&PollReport),
) -> Result<StreamSummary> {
    let mut summary = StreamSummary::default();
    let mut idle = 0u64;
    let mut renewed = Instant::now();
    let mut checkpointed = Instant::now();
    let mut maintained = Instant::now();
    let mut seq = 0u64;
    let Parts {
        ing,
        runner,
        deferral,
        spec,
        opts,
        stop,
        logged,
    } = *parts;
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
                    if let (Some(last), Some(p)) = (rep.batches.last(), positions.0.get_mut(s)) {
                        p.0 = last.batch_id;
                    }
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
                        .map(|l| (ing.clock().now_us() - l) as f64 / 1e6);
                }
            }
            Err(e @ Error::LeaseHeld { .. }) => warnings.push(e.to_string()),
            Err(e) => return Err(e),
        }
        if let Some(d) = deferral {
            // One partition a poll (also when idle: the table completes within a poll
            // per partition).
            r.state_committed = d.commit_oldest(runner, spec).await?;
            r.state_pending = d.pending.size().0;
            crate::fault::point("stream_after_state_commit");
        }
        if let Some(lag) = r.lag_s {
            if lag > opts.max_lag.as_secs_f64() {
                warnings.push(format!(
                    "falling behind: the newest file consumed landed {lag:.0} s ago (> {} s)",
                    opts.max_lag.as_secs()
                ));
            }
        }
        (r.dedup_ids, r.dedup_bytes) = dedup_size(ing, spec);
        if checkpointed.elapsed() >= opts.checkpoint_every && positions.dirty() {
            r.checkpoint = Some(checkpoint(ing, spec, positions, (logged, &mut seq)).await?);
            summary.checkpoints = seq;
            checkpointed = Instant::now();
        }
        if let Some((every, m)) = &opts.maintain {
            if maintained.elapsed() >= *every {
                // Between polls the stream is its tables' only writer.
                let mut m = m.clone();
                m.today = crate::ops::maintain::today();
                let tables = spec.tables();
                r.maintenance =
                    Some(crate::ops::maintain::tables(runner.warehouse(), &tables, &m).await?);
                maintained = Instant::now();
            }
        }
        if r.files > 0 || r.job_batches > 0 {
            crate::alloc::release();
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
