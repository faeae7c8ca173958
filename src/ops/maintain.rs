//! `kestrel maintain` (and the daemon's daily maintenance slot): for every table kestrel
//! writes, compact the closed date partitions, write a Delta checkpoint and vacuum files
//! unreferenced for longer than the retention.
//!
//! Five-minute commits leave one small file per batch and partition; each active file
//! costs every MERGE metadata work, so finished days are rewritten into few large files.
//! A date partition is *closed* when its date is before today (UTC, processing time): a
//! late event may still add a file to it, which the next slot compacts again. A gold
//! table clustered by hour ([`crate::sink::cluster`]) gets one file for the day too: a
//! late correction then rewrites the day's file, not only its hour's — rarer and
//! cheaper than every read and commit paying for 24 files a day (README "Gold's
//! layout"). Tables
//! without a date partition (the run log, the file ledger, `sku_availability`) are
//! compacted whole.
//!
//! Compaction commits change no data, and every reader of bronze selects rows by their
//! ingestion `_batch_id`, so the jobs' incremental reads are unaffected. A job's tables
//! are maintained under the job's lease (never while one of its batches runs); the tables
//! of a job running always-on are left to its stream, which maintains them itself between
//! polls ([`tables`]): its MERGEs every second would conflict with a compaction commit
//! from another process.

use std::num::NonZeroU64;
use std::time::{Duration, Instant};

use deltalake::kernel::schema::partitions::{FilterOp, FilterValue};
use deltalake::DeltaTable;
use serde::Serialize;
use tracing::{info, warn};

use crate::config::MaintainConfig;
use crate::error::{Error, Result};
use crate::job::spec::JobSpec;
use crate::lease::Lease;
use crate::sink::delta::Warehouse;
use crate::{ledger, runlog};

/// What was done to one table.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TableReport {
    pub table: String,
    /// Active files before and after.
    pub files_before: usize,
    pub files_after: usize,
    pub partitions_compacted: u64,
    pub files_removed: u64,
    pub files_added: u64,
    /// Table version the checkpoint was written at.
    pub checkpoint_version: Option<i64>,
    pub files_vacuumed: usize,
    /// Delta log files (commits, checkpoints) older than the retention deleted.
    pub log_files_cleaned: usize,
    /// The run log's days older than `[maintain] run_log_retention` removed, and their
    /// rows ([`runlog::expire`]).
    pub partitions_expired: usize,
    pub rows_expired: u64,
    /// Why the table was left alone (busy, streamed, failed).
    pub skipped: Option<String>,
    pub duration_ms: u64,
}

/// The whole maintenance pass.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MaintainReport {
    pub tables: Vec<TableReport>,
    /// Durable batch plans and results older than the retention that were deleted.
    pub plans_expired: usize,
}

impl MaintainReport {
    /// Tables that could not be maintained this time.
    pub fn skipped(&self) -> usize {
        self.tables.iter().filter(|t| t.skipped.is_some()).count()
    }
}

/// Options of one pass.
#[derive(Debug, Clone)]
pub struct MaintainOptions {
    pub config: MaintainConfig,
    /// Partitions dated before this day (days since the epoch) are closed.
    pub today: i32,
    /// Job leases last this long.
    pub lease_ttl: Duration,
    /// Skip compaction (checkpoint and vacuum only).
    pub no_compact: bool,
    /// Skip vacuum.
    pub no_vacuum: bool,
    /// Checked between tables: once stopped, the remaining tables are left for the next
    /// slot (the daemon's shutdown).
    pub stop: Option<crate::runner::StopFlag>,
}

impl MaintainOptions {
    /// Compaction, checkpoint and vacuum as configured, for today, under job leases of
    /// `lease_ttl`.
    pub fn from_config(cfg: &crate::config::Config) -> Self {
        MaintainOptions {
            config: cfg.maintain.clone(),
            today: today(),
            lease_ttl: cfg.ingest.lease_ttl,
            no_compact: false,
            no_vacuum: false,
            stop: None,
        }
    }
}

/// One table to maintain and the lease that guards it (None: appended to only, which
/// never conflicts with a compaction).
struct Target {
    table: String,
    lease: Option<String>,
    streamed_by: Option<String>,
}

/// The tables of `sources` and `jobs`, each once, with the lease that guards it.
async fn targets(wh: &Warehouse, sources: &[String], jobs: &[JobSpec]) -> Result<Vec<Target>> {
    let mut out = Vec::new();
    for s in sources {
        for table in [
            crate::names::table::bronze(s),
            crate::names::table::quarantine(s),
        ] {
            out.push(Target {
                table,
                lease: None,
                streamed_by: None,
            });
        }
    }
    for spec in jobs {
        let streamed_by = Lease::stream_owner(wh, &spec.name).await?;
        for table in spec.tables() {
            out.push(Target {
                table,
                lease: Some(crate::names::lease::job(&spec.name)),
                streamed_by: streamed_by.clone(),
            });
        }
    }
    for table in [crate::names::table::RUNS, crate::names::table::LEDGER] {
        out.push(Target {
            table: table.to_string(),
            lease: None,
            streamed_by: None,
        });
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|t| seen.insert(t.table.clone()));
    Ok(out)
}

/// Maintain every table of `sources` and `jobs`; `progress` is called after each table.
pub async fn run(
    wh: &Warehouse,
    sources: &[String],
    jobs: &[JobSpec],
    opts: &MaintainOptions,
    mut progress: impl FnMut(&TableReport),
) -> Result<MaintainReport> {
    let mut report = MaintainReport::default();
    for t in targets(wh, sources, jobs).await? {
        let started = Instant::now();
        let mut r = TableReport {
            table: t.table.clone(),
            ..Default::default()
        };
        if opts.stop.as_ref().is_some_and(|s| s.stopped()) {
            r.skipped = Some("stopping; next slot".into());
        } else if let Some(owner) = &t.streamed_by {
            r.skipped = Some(format!("maintained by its running stream ({owner})"));
        } else {
            let lease = match &t.lease {
                Some(name) => match Lease::acquire(wh, name, opts.lease_ttl).await {
                    Ok(l) => Some(l),
                    Err(Error::LeaseHeld { owner, .. }) => {
                        r.skipped = Some(format!("a batch is running ({owner}); next slot"));
                        None
                    }
                    Err(e) => return Err(e),
                },
                None => None,
            };
            if r.skipped.is_none() {
                if let Err(e) = table(wh, &t.table, opts, &mut r).await {
                    warn!(table = %t.table, error = %e, "maintenance failed");
                    r.skipped = Some(format!("failed: {e}"));
                }
            }
            if let Some(l) = lease {
                if let Err(e) = l.release().await {
                    warn!(table = %t.table, error = %e, "could not release lease");
                }
            }
        }
        r.duration_ms = started.elapsed().as_millis() as u64;
        progress(&r);
        report.tables.push(r);
    }
    if !opts.no_vacuum {
        report.plans_expired = expire_plans(wh, sources, jobs, opts.config.retention).await?;
    }
    Ok(report)
}

/// Delete the durable plans (and job results) of completed batches before the last one
/// that are older than `retention`: nothing reads them again, and a pipeline writes
/// about six hundred a day.
async fn expire_plans(
    wh: &Warehouse,
    sources: &[String],
    jobs: &[JobSpec],
    retention: Duration,
) -> Result<usize> {
    let mut n = 0;
    for s in sources {
        let last = runlog::last_batch(wh, "ingest", s).await?;
        n += ledger::expire_plans(wh, s, last, retention).await?;
    }
    for spec in jobs {
        let mut last = runlog::last_batch(wh, "job", &spec.name).await?;
        // A stream's deferred state rows stay until they are committed.
        if let Some(since) = crate::runner::deferred::keep_from(wh, &spec.name).await? {
            last = last.min(since);
        }
        n += crate::job::plan::expire(wh, &spec.name, last, retention).await?;
    }
    if n > 0 {
        info!(plans = n, "expired durable plans");
    }
    Ok(n)
}

/// Maintain `tables` without taking leases: for a caller that is their only writer (the
/// always-on stream, between polls). A table that fails is reported and skipped.
pub async fn tables(
    wh: &Warehouse,
    tables: &[String],
    opts: &MaintainOptions,
) -> Result<MaintainReport> {
    let mut report = MaintainReport::default();
    for rel in tables {
        let started = Instant::now();
        let mut r = TableReport {
            table: rel.clone(),
            ..Default::default()
        };
        if let Err(e) = table(wh, rel, opts, &mut r).await {
            warn!(table = %rel, error = %e, "maintenance failed");
            r.skipped = Some(format!("failed: {e}"));
        }
        r.duration_ms = started.elapsed().as_millis() as u64;
        report.tables.push(r);
    }
    Ok(report)
}

/// The first `run_date` the run log keeps (days since the epoch): its retention in
/// whole days, rounded up, before today; None when it is kept forever (a zero retention).
fn run_log_cutoff(opts: &MaintainOptions) -> Option<i32> {
    let secs = opts.config.run_log_retention.as_secs_f64();
    if secs <= 0.0 {
        return None;
    }
    let days = (secs / 86_400.0).ceil().min(f64::from(i32::MAX / 2)) as i32;
    Some(opts.today.saturating_sub(days))
}

/// Today as days since the epoch (UTC).
pub fn today() -> i32 {
    chrono::Utc::now().timestamp().div_euclid(86_400) as i32
}

fn file_count(t: &DeltaTable) -> Result<usize> {
    let snap = t
        .snapshot()
        .map_err(|e| Error::delta(t.table_url().as_str(), e))?;
    Ok(snap.log_data().num_files())
}

/// The first partition column that is a date, else None.
fn date_partition(t: &DeltaTable) -> Result<Option<String>> {
    let snap = t
        .snapshot()
        .map_err(|e| Error::delta(t.table_url().as_str(), e))?;
    let meta = snap.metadata();
    let schema = snap.schema();
    Ok(meta
        .partition_columns()
        .iter()
        .find(|c| {
            schema
                .field(c.as_str())
                .is_some_and(|f| f.data_type() == &deltalake::kernel::DataType::DATE)
        })
        .cloned())
}

async fn table(
    wh: &Warehouse,
    rel: &str,
    opts: &MaintainOptions,
    r: &mut TableReport,
) -> Result<()> {
    if wh.open(rel).await?.is_none() {
        r.skipped = Some("not written yet".into());
        return Ok(());
    }
    let lease = match crate::sink::compact::CompactionLease::acquire(wh, rel).await? {
        Ok(l) => l,
        Err(owner) => {
            r.skipped = Some(format!("being compacted by {owner}; next slot"));
            return Ok(());
        }
    };
    let outcome = table_under_lease(wh, rel, opts, r).await;
    lease.release(rel).await;
    outcome
}

/// The work of [`table`], under the table's compaction lease.
async fn table_under_lease(
    wh: &Warehouse,
    rel: &str,
    opts: &MaintainOptions,
    r: &mut TableReport,
) -> Result<()> {
    let Some(mut t) = wh.open(rel).await? else {
        r.skipped = Some("not written yet".into());
        return Ok(());
    };
    let url = t.table_url().to_string();
    r.files_before = file_count(&t)?;
    if rel == crate::names::table::RUNS {
        if let Some(before) = run_log_cutoff(opts) {
            let (nt, e) = runlog::expire(t, before).await?;
            t = nt;
            r.partitions_expired = e.partitions;
            r.rows_expired = e.rows;
            if e.partitions > 0 {
                info!(
                    partitions = e.partitions,
                    rows = e.rows,
                    "expired run log days older than the retention"
                );
            }
        }
    }
    if !opts.no_compact && file_count(&t)? > 1 {
        let today = crate::time::date(opts.today);
        let filters = match date_partition(&t)? {
            Some(col) => vec![(col, today)],
            None => Vec::new(),
        };
        let literals: Vec<_> = filters
            .iter()
            .map(|(c, v)| (c.as_str(), FilterOp::Lt, FilterValue::Scalar(v.as_str())))
            .collect();
        let target = NonZeroU64::new(opts.config.target_file_size).unwrap_or(NonZeroU64::MIN);
        let columns = crate::sink::delta::table_columns(&t)?;
        let mut op = t
            .optimize()
            .with_filters(&literals)
            .with_target_size(target)
            .with_max_concurrent_tasks(2)
            .with_session_state(crate::sink::delta::rewrite_session());
        if rel.starts_with("bronze/") {
            // Compacted bronze keeps the event-id bloom filters dedup relies on.
            op = op.with_writer_properties(crate::sink::delta::bronze_writer_properties(
                columns.iter().map(String::as_str),
            ));
        } else if rel == crate::names::table::LEDGER {
            // …and the ledger its path filters (full listings probe them).
            op = op.with_writer_properties(crate::ledger::writer_properties());
        }
        let (nt, m) = op.await.map_err(|e| Error::delta(&url, e))?;
        t = nt;
        r.partitions_compacted = m.partitions_optimized;
        r.files_removed = m.num_files_removed;
        r.files_added = m.num_files_added;
    }
    r.files_after = file_count(&t)?;
    deltalake::checkpoints::create_checkpoint(&t, None)
        .await
        .map_err(|e| Error::delta(&url, e))?;
    r.checkpoint_version = t.version().map(|v| v as i64);
    if !opts.no_vacuum {
        let retention =
            chrono::Duration::from_std(opts.config.retention).unwrap_or(chrono::Duration::days(7));
        let (nt, m) = t
            .vacuum()
            .with_retention_period(retention)
            // Full: every unreferenced file older than the retention, not only those whose
            // remove action is still in the log. Tables drop remove actions from their
            // checkpoints after `delta.deletedFileRetentionDuration` (7 days, like the
            // default retention), so the log alone would forget most compacted-away files
            // before they are old enough; and a compaction killed half-way leaves files
            // no remove action names.
            .with_mode(deltalake::operations::vacuum::VacuumMode::Full)
            // The retention is the operator's explicit choice (kestrel.toml), not the
            // table's one-week default.
            .with_enforce_retention_duration(false)
            .await
            .map_err(|e| Error::delta(&url, e))?;
        r.files_vacuumed = m.files_deleted.len();
        t = nt;
        // The log, too, keeps what the retention promises and no more: every commit
        // costs in proportion to the files its log holds.
        if let Some(v) = t.version() {
            r.log_files_cleaned = crate::sink::compact::cleanup_log(&t, v, retention).await?;
        }
    }
    if r.log_files_cleaned > 0 {
        // The loaded table may still name deleted log files: load it afresh next time.
        wh.forget(rel);
    } else {
        crate::sink::tables::keep(&t);
    }
    info!(
        table = rel,
        files_before = r.files_before,
        files_after = r.files_after,
        vacuumed = r.files_vacuumed,
        "maintained"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(today: i32, run_log_retention: Duration) -> MaintainOptions {
        MaintainOptions {
            config: crate::config::MaintainConfig {
                run_log_retention,
                ..Default::default()
            },
            today,
            lease_ttl: Duration::from_secs(60),
            no_compact: false,
            no_vacuum: true,
            stop: None,
        }
    }

    #[test]
    fn the_run_log_keeps_its_retention_in_whole_days() {
        let day = Duration::from_secs(86_400);
        assert_eq!(run_log_cutoff(&opts(100, 30 * day)), Some(70));
        assert_eq!(run_log_cutoff(&opts(100, day / 2)), Some(99));
        assert_eq!(run_log_cutoff(&opts(100, Duration::ZERO)), None);
    }

    /// The maintenance slot removes the run log's days beyond its retention, reports
    /// them, and compacts what is left; positions stay.
    #[tokio::test]
    async fn maintenance_expires_old_run_log_days() {
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let day_us = 86_400_000_000i64;
        for (b, day) in [(1i64, 100i64), (2, 100), (3, 104), (4, 109), (5, 110)] {
            let e = runlog::IngestEntry {
                run_id: format!("r{b}"),
                source: "orders".into(),
                batch_id: b,
                started_at_us: day * day_us,
                finished_at_us: day * day_us + 1_000,
                status: "ok".into(),
                ..Default::default()
            };
            assert!(runlog::log_ingest(&wh, &e).await.unwrap());
        }
        let runs = crate::names::table::RUNS.to_string();
        // Today is day 110; five days kept: days 105–110.
        let day = Duration::from_secs(86_400);
        let report = tables(&wh, std::slice::from_ref(&runs), &opts(110, 5 * day))
            .await
            .unwrap();
        let r = &report.tables[0];
        assert_eq!(r.skipped, None, "{r:?}");
        assert_eq!((r.partitions_expired, r.rows_expired), (2, 3), "{r:?}");
        assert_eq!(r.files_before, 5);
        // Day 109 (closed) compacted alone, day 110 (today) left: two files.
        assert_eq!(r.files_after, 2, "{r:?}");
        assert_eq!(
            runlog::last_batch(&wh, "ingest", "orders").await.unwrap(),
            5
        );
        // Kept forever with a zero retention.
        let report = tables(&wh, &[runs], &opts(200, Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(report.tables[0].partitions_expired, 0);
        assert_eq!(report.tables[0].files_after, 2);
    }
}
