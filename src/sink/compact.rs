//! Compaction of the partitions a pipeline is still writing ("open" partitions: today's
//! date in bronze, the run log, alerts…), between batches.
//!
//! Every five-minute batch adds a small file to each partition it writes. The daily
//! maintenance compacts closed days; within the day the files would pile up — 288 a day
//! per table and source — and everything that reads the open day (dedup, recomputes,
//! state reads, Delta log replay and checkpoints) would pay for each of them. So after a
//! writer's batches, any partition holding at least `min_files` files smaller than an
//! eighth of the target that a compaction would rewrite is compacted (bin-packed, in the
//! order they were written, so `_batch_id` ranges stay contiguous and incremental reads
//! keep pruning). A compaction leaves out the oldest of those files while each is larger
//! than all the files written after it together ([`settled`]): the open day's earlier
//! compaction outputs are rewritten only when as much has arrived since, so each row is
//! rewritten a logarithmic number of times over a day instead of once per compaction.
//!
//! Compaction commits change no data (`dataChange = false`): readers selecting rows by
//! ingestion batch see the same rows. A compaction that loses a race with another
//! writer's commit (Delta reports a conflict) is given up, never forced, and tried again
//! after the next batch; one killed half-way leaves only unreferenced files, which the
//! daily vacuum removes.
//!
//! Two compactions of one table never run at once: each holds the table's compaction
//! lease ([`CompactionLease`]) and re-reads the table after taking it. Delta alone does not
//! stop them — delta-rs 1.1.3's conflict checker ignores removes with `dataChange = false`
//! when it looks for a file deleted twice (`check_for_deleted_files_against_current_txn_
//! deleted_files`, with a test asserting it), so two compactions of the same files both
//! commit, both outputs stay active, and every row of the inputs is doubled. Found by the
//! S3 writers test: `_kestrel/runs`, compacted by every writer after its batches, held
//! 33 million rows for 101 batches and its compactions took minutes.

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use datafusion::common::ScalarValue;
use deltalake::kernel::schema::partitions::{FilterOp, FilterValue};
use deltalake::kernel::Action;
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::protocol::DeltaOperation;
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use deltalake::DeltaTable;
use futures::TryStreamExt;
use tracing::{debug, info};

use crate::error::{Error, Result};
use crate::lease::Lease;
use crate::sink::delta::{self, Warehouse};
use crate::sink::merge::{self, MergeSpec, Target, TargetFile};

/// How long a compaction lease lasts: far beyond any compaction (a holder killed with -9
/// is recognised as gone at once on its host; elsewhere the lease expires).
pub const COMPACTION_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(600);

/// The right to compact one table.
pub struct CompactionLease(Lease);

impl CompactionLease {
    /// Take `rel`'s compaction lease; `Err(owner)` while another process compacts it.
    /// Taking it drops `wh`'s loaded copy of the table, so the next `open` reads it
    /// afresh: a table loaded before may name files another compaction has just replaced.
    pub async fn acquire(
        wh: &Warehouse,
        rel: &str,
    ) -> Result<std::result::Result<CompactionLease, String>> {
        let name = crate::names::lease::compaction(rel);
        match Lease::acquire(wh, &name, COMPACTION_LEASE_TTL).await {
            Ok(l) => {
                wh.forget(rel);
                Ok(Ok(CompactionLease(l)))
            }
            Err(Error::LeaseHeld { owner, .. }) => Ok(Err(owner)),
            Err(e) => Err(e),
        }
    }

    /// Give the lease back (a failure to is logged: the lease then expires).
    pub async fn release(self, rel: &str) {
        if let Err(e) = self.0.release().await {
            tracing::warn!(table = rel, error = %e, "could not release the compaction lease");
        }
    }
}

/// When and how to compact open partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenCompaction {
    /// Compact a partition once it holds this many files below the target (0: never).
    pub min_files: usize,
    /// Target size of the compacted files, in bytes.
    pub target_size: u64,
}

impl Default for OpenCompaction {
    fn default() -> Self {
        OpenCompaction {
            min_files: 16,
            target_size: 32 * 1024 * 1024,
        }
    }
}

/// What one compaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Compacted {
    pub partitions: usize,
    pub files_removed: u64,
    pub files_added: u64,
}

/// A file counts towards a compaction when it is smaller than the target divided by
/// this. Compaction outputs fall short of the target (a bin holds whole files up to it),
/// and counting them as small re-triggered a compaction after every batch late in the
/// day, each rewriting a near-full file to add one batch's file to it (600 ms a batch at
/// Kestrel's scale by the evening). A batch's own appends are far below an eighth.
const SMALL_FRACTION: u64 = 8;

/// An hour partition of gold (`window_hour`, `order_hour`) is compacted once it holds
/// this many small files (or `min_files`, if lower). A day has 24 of them, and a MERGE
/// that only inserts (new windows, new matches) adds a file to each hour it touches:
/// at 16 a file, `gold/payments_fast` carried ~13 files in every hour of the day and
/// its batches read them all (0.21 s → 0.46 s over 7 hours of small drops).
pub const HOUR_PARTITION_FILES: usize = 4;

/// What to compact: a partition (as `column → value` pairs), or in a clustered gold
/// table ([`crate::sink::cluster`]) the small files of one hour of a partition.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Crowded {
    /// The files at `paths`, in the order they were written, of one partition.
    Partition {
        partition: Vec<(String, String)>,
        paths: Vec<String>,
    },
    /// The files at `paths` hold `column = value` only (their partition is in their
    /// paths' actions, which is all the compaction needs).
    Hour {
        column: String,
        value: i64,
        paths: Vec<String>,
    },
}

/// Where a compaction of a partition's small files starts, given their sizes in the
/// order they were written: the first file not larger than all the files after it
/// together (`sizes.len()` when there is none). The files before it stay as they are —
/// typically earlier compaction outputs, each larger than what arrived since.
///
/// Rewriting every small file of the open day at each compaction (as until 2026-12-06)
/// rewrote the day so far every `min_files` batches: over a day of small drops each row
/// was rewritten ≈ 10 times, and a compaction late in the day cost the whole day
/// (`compact bronze/clickstream` 0.9 → 7.9 ms a run from hour 1 to hour 23 of the
/// `age small` benchmark). With this rule the outputs grow as a binary counter's digits
/// do: a row is rewritten about log₂(batches ÷ `min_files`) times at most (2.3 times on
/// average over such a day), and the partition holds that many outputs beside the
/// batches not yet compacted
/// (`tiered_compaction_rewrites_each_row_a_logarithmic_number_of_times`).
pub(crate) fn settled(sizes: &[u64]) -> usize {
    let mut after: u64 = sizes.iter().sum();
    for (i, &size) in sizes.iter().enumerate() {
        after -= size;
        if size <= after {
            return i;
        }
    }
    sizes.len()
}

/// Partitions holding at least `min_files` small files (see [`SMALL_FRACTION`]) that a
/// compaction would rewrite (see [`settled`]), among those matching every
/// `(column, value)` of `only`; in a clustered table, hours of a partition holding
/// [`HOUR_PARTITION_FILES`] such files of that hour (or `min_files`, if lower) — never
/// the partition as a whole, which would mix its hours in one file (a small file
/// holding several hours is left to the daily maintenance).
fn crowded(
    table: &DeltaTable,
    opts: &OpenCompaction,
    only: &[(&str, &str)],
) -> Result<Vec<Crowded>> {
    let snap = table
        .snapshot()
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    let cluster = crate::sink::cluster::column_of(table)?;
    type Key = (Vec<(String, String)>, Option<i64>);
    // (written at, path, size) of each small file, by partition (and hour).
    let mut count: BTreeMap<Key, Vec<(i64, String, u64)>> = BTreeMap::new();
    for f in snap.log_data().iter() {
        if f.size() as u64 >= opts.target_size / SMALL_FRACTION {
            continue;
        }
        let mut parts: Vec<(String, String)> = Vec::new();
        let mut null = false;
        for (k, v) in f.partition_values_map() {
            match v {
                Some(v) => parts.push((k, v)),
                None => null = true,
            }
        }
        if null {
            continue; // no equality filter names a null partition; left to maintenance
        }
        if !only
            .iter()
            .all(|(c, v)| parts.iter().any(|(pc, pv)| pc == c && pv == v))
        {
            continue;
        }
        parts.sort();
        let hour = match &cluster {
            Some(c) => match crate::sink::cluster::single_value(f.stats().as_deref(), c) {
                Some(h) => Some(h),
                None => continue,
            },
            None => None,
        };
        count.entry((parts, hour)).or_default().push((
            f.modification_time(),
            f.object_store_path().to_string(),
            f.size() as u64,
        ));
    }
    Ok(count
        .into_iter()
        .map(|(key, mut files)| {
            files.sort();
            let sizes: Vec<u64> = files.iter().map(|f| f.2).collect();
            let paths = files
                .into_iter()
                .skip(settled(&sizes))
                .map(|f| f.1)
                .collect::<Vec<_>>();
            (key, paths)
        })
        .filter(|((p, hour), files)| {
            let hourly = hour.is_some() || p.iter().any(|(c, _)| c.ends_with("_hour"));
            files.len()
                >= if hourly {
                    opts.min_files.min(HOUR_PARTITION_FILES)
                } else {
                    opts.min_files
                }
        })
        .map(|((partition, hour), paths)| match (hour, &cluster) {
            (Some(value), Some(column)) => Crowded::Hour {
                column: column.clone(),
                value,
                paths,
            },
            _ => Crowded::Partition { partition, paths },
        })
        .collect())
}

/// Compact the files at `paths` (in the order they were written) of one partition
/// (`column → value` pairs), bin-packed in that order into files of up to the target,
/// as delta-rs's optimize does,
/// but written and committed by kestrel ([`rewrite`]). delta-rs's optimize runs its
/// commit's post-commit hook with the table's defaults, whatever the caller asks, and
/// with `delta.enableExpiredLogCleanup` (on by default) that hook lists the table's
/// whole `_delta_log` after every compaction — a listing that grows with every commit
/// the log keeps (a week of them: ~2,400 for a bronze table of small drops, a
/// multi-page LIST on S3). Tables kestrel cannot rewrite itself (deletion vectors,
/// column mapping) are left to delta-rs. Returns the table and the files removed and
/// added.
async fn compact_partition(
    table: &DeltaTable,
    part: &[(String, String)],
    paths: &[String],
    opts: &OpenCompaction,
    props: &Option<WriterProperties>,
) -> Result<(DeltaTable, u64, u64)> {
    let url = table.table_url().to_string();
    let partitions = part
        .iter()
        .map(|(c, v)| (c.as_str(), vec![ScalarValue::Utf8(Some(v.clone()))]))
        .collect();
    let mut target = match files_of(table, partitions, None) {
        Ok(Ok(t)) => t,
        Ok(Err(why)) => {
            debug!(table = %delta::shown(url), why, "compacted by delta-rs");
            return optimize_partition(table, part, opts, props).await;
        }
        Err(e) => {
            debug!(table = %delta::shown(url), error = %e, "compacted by delta-rs");
            return optimize_partition(table, part, opts, props).await;
        }
    };
    // The chosen files, in the order they were written.
    let order: std::collections::HashMap<&str, usize> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| (p.as_str(), i))
        .collect();
    target.files.retain(|f| order.contains_key(f.path.as_ref()));
    target
        .files
        .sort_by_key(|f| order.get(f.path.as_ref()).copied());
    let props = props
        .clone()
        .unwrap_or_else(|| delta::writer_properties(&[]));
    let predicate = part
        .iter()
        .map(|(c, v)| format!("{c} = '{v}'"))
        .collect::<Vec<_>>()
        .join(" AND ");
    let (t, done) = rewrite(
        table.clone(),
        target,
        props,
        opts.target_size,
        opts.target_size,
        predicate,
    )
    .await?;
    Ok((t, done.files_removed, done.files_added))
}

/// Files of `sizes` (in order) packed into runs of at most `limit` bytes each (a file
/// larger than the limit is a run of its own), keeping only runs of two or more files:
/// rewriting one file alone gains nothing.
fn bins(sizes: &[u64], limit: u64) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<(std::ops::Range<usize>, u64)> = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        match out.last_mut() {
            Some((run, bytes)) if bytes.saturating_add(size) <= limit => {
                run.end = i + 1;
                *bytes += size;
            }
            _ => out.push((i..i + 1, size)),
        }
    }
    out.into_iter()
        .map(|(run, _)| run)
        .filter(|run| run.len() > 1)
        .collect()
}

/// The files of `table` holding `partitions` (see [`MergeSpec::partitions`], with
/// `cluster`), as a [`Target`] to [`rewrite`]; `Err(why)` when kestrel cannot rewrite
/// the table's files itself.
pub(crate) fn files_of(
    table: &DeltaTable,
    partitions: Vec<(&str, Vec<ScalarValue>)>,
    cluster: Option<&str>,
) -> Result<std::result::Result<Target, String>> {
    let url = table.table_url().to_string();
    let snap = table.snapshot().map_err(|e| Error::delta(&url, e))?;
    let columns = snap
        .snapshot()
        .arrow_schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    let spec = MergeSpec {
        keys: &[],
        partitions,
        columns,
        op_column: "",
        cluster,
    };
    Target::of(table, &spec)
}

/// Rewrite `target`'s files into files of up to `bin_bytes` each (their sizes as
/// written, bin-packed in order; a bin of one file is left as it is), in one commit
/// that changes no data (`dataChange = false`, an `OPTIMIZE` of `predicate`):
/// incremental readers skip it. Delta's conflict checks apply as to delta-rs's
/// optimize: a writer that removed one of the files first makes this commit fail with
/// a conflict (the caller gives up; the next batch tries again); one that commits
/// after it sees the files it added and is planned again. A bin's rows are streamed
/// from its files into one writer, which holds them encoded, not decoded.
pub(crate) async fn rewrite(
    table: DeltaTable,
    target: Target,
    props: WriterProperties,
    bin_bytes: u64,
    target_size: u64,
    predicate: String,
) -> Result<(DeltaTable, Compacted)> {
    let url = table.table_url().to_string();
    let sizes: Vec<u64> = target.files.iter().map(|f| f.size).collect();
    let bins: Vec<&[TargetFile]> = bins(&sizes, bin_bytes)
        .into_iter()
        .map(|r| &target.files[r])
        .collect();
    if bins.is_empty() {
        return Ok((table, Compacted::default()));
    }
    let store = table.log_store().object_store(None);
    let mut actions: Vec<Action> = Vec::new();
    let mut done = Compacted {
        partitions: 1,
        ..Compacted::default()
    };
    for files in bins {
        let mut w = RecordBatchWriter::for_table(&table)
            .map_err(|e| Error::delta(&url, e))?
            .with_writer_properties(props.clone());
        for f in files {
            let mut rows = merge::file_rows(store.clone(), f, &target, &url).await?;
            while let Some(b) = rows.try_next().await? {
                DeltaWriter::write(&mut w, b)
                    .await
                    .map_err(|e| Error::delta(&url, e))?;
            }
        }
        let adds = DeltaWriter::flush(&mut w)
            .await
            .map_err(|e| Error::delta(&url, e))?;
        done.files_removed += files.len() as u64;
        done.files_added += adds.len() as u64;
        for f in files {
            let mut r = f.remove.clone();
            r.data_change = false;
            actions.push(Action::Remove(r));
        }
        actions.extend(adds.into_iter().map(|mut a| {
            a.data_change = false;
            Action::Add(a)
        }));
    }
    let operation = DeltaOperation::Optimize {
        predicate: Some(predicate),
        target_size: i64::try_from(target_size).unwrap_or(i64::MAX),
    };
    let table = delta::commit_actions(table, actions, delta::commit_props(), operation).await?;
    Ok((table, done))
}

/// Compact one partition (`column → value` pairs) with delta-rs's optimize: files up to
/// the target size, bin-packed in log order. Returns the table and the files removed
/// and added.
async fn optimize_partition(
    table: &DeltaTable,
    part: &[(String, String)],
    opts: &OpenCompaction,
    props: &Option<WriterProperties>,
) -> Result<(DeltaTable, u64, u64)> {
    let filters: Vec<_> = part
        .iter()
        .map(|(c, v)| (c.as_str(), FilterOp::Eq, FilterValue::Scalar(v.as_str())))
        .collect();
    let target = NonZeroU64::new(opts.target_size).unwrap_or(NonZeroU64::MIN);
    let mut op = table
        .clone()
        .optimize()
        .with_filters(&filters)
        .with_target_size(target)
        .with_max_concurrent_tasks(2)
        .with_session_state(delta::rewrite_session());
    if let Some(p) = props {
        op = op.with_writer_properties(p.clone());
    }
    let (t, m) = op
        .await
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    Ok((t, m.num_files_removed, m.num_files_added))
}

/// Commits a bookkeeping table (the run log, the file ledger) keeps in its log after a
/// compaction; older ones are deleted back to a checkpoint. Every kestrel batch commits
/// to these tables, and a commit costs ~3 µs for every file its log still holds (delta-rs
/// lists the log), so their logs are kept short; nobody time-travels them.
pub const BOOKKEEPING_LOG_VERSIONS: u64 = 200;

/// …and never a log file younger than this (a reader may be replaying it).
const BOOKKEEPING_LOG_MIN_AGE: chrono::Duration = chrono::Duration::seconds(60);

/// Delete `table`'s log files (commits, checkpoints) written more than `min_age` ago and
/// older than the newest checkpoint at or before version `keep_from`: the table's state
/// from that checkpoint on stays readable (and so do its application transactions,
/// which checkpoints carry). Returns how many files were deleted.
pub async fn cleanup_log(
    table: &DeltaTable,
    keep_from: u64,
    min_age: chrono::Duration,
) -> Result<usize> {
    let cutoff = (chrono::Utc::now() - min_age).timestamp_millis();
    deltalake::checkpoints::cleanup_expired_logs_for(
        keep_from,
        table.log_store().as_ref(),
        cutoff,
        None,
    )
    .await
    .map_err(|e| Error::delta(table.table_url().as_str(), e))
}

/// Compact the crowded partitions of `rel` (see the module docs) among those matching
/// `only` (e.g. one source's part of the file ledger); for a `bookkeeping` table, then
/// shorten its log to [`BOOKKEEPING_LOG_VERSIONS`]. Returns None when nothing needed it,
/// or when it lost a race with another writer (logged; the next batch tries again).
pub async fn open_partitions(
    wh: &Warehouse,
    rel: &str,
    opts: &OpenCompaction,
    only: &[(&str, &str)],
    props: Option<WriterProperties>,
    bookkeeping: bool,
) -> Result<Option<Compacted>> {
    if opts.min_files == 0 {
        return Ok(None);
    }
    let Some(table) = wh.open(rel).await? else {
        return Ok(None);
    };
    if crowded(&table, opts, only)?.is_empty() {
        return Ok(None);
    }
    let lease = match CompactionLease::acquire(wh, rel).await? {
        Ok(l) => l,
        Err(owner) => {
            info!(
                table = rel,
                owner, "open-partition compaction: another process is compacting; next batch"
            );
            return Ok(None);
        }
    };
    let outcome = compact_crowded(wh, rel, opts, only, props, bookkeeping).await;
    lease.release(rel).await;
    outcome
}

/// The work of [`open_partitions`], under the table's compaction lease.
async fn compact_crowded(
    wh: &Warehouse,
    rel: &str,
    opts: &OpenCompaction,
    only: &[(&str, &str)],
    props: Option<WriterProperties>,
    bookkeeping: bool,
) -> Result<Option<Compacted>> {
    let Some(table) = wh.open(rel).await? else {
        return Ok(None);
    };
    let mut done = Compacted::default();
    let mut table = table;
    for part in crowded(&table, opts, only)? {
        let compacting = crate::fault::compacting();
        let started = std::time::Instant::now();
        let outcome = match part {
            Crowded::Partition { partition, paths } => {
                compact_partition(&table, &partition, &paths, opts, &props).await
            }
            Crowded::Hour {
                column,
                value,
                paths,
            } => {
                let paths = paths.into_iter().collect();
                let props = props
                    .clone()
                    .unwrap_or_else(|| delta::writer_properties(&[]));
                crate::sink::cluster::compact_hour(
                    table.clone(),
                    &column,
                    value,
                    &paths,
                    props,
                    opts.target_size,
                )
                .await
                .map(|(t, m)| (t, m.files_removed, m.files_added))
            }
        };
        drop(compacting);
        crate::sink::timings::record(format!("compact {rel}"), started.elapsed());
        match outcome {
            Ok((t, removed, added)) => {
                table = t;
                done.partitions += 1;
                done.files_removed += removed;
                done.files_added += added;
            }
            Err(e) if e.is_commit_conflict() => {
                info!(table = rel, error = %e, "open-partition compaction lost a race with another writer; next batch");
                wh.forget(rel);
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
    }
    if done.partitions == 0 {
        return Ok(None);
    }
    crate::sink::tables::keep(&table);
    if bookkeeping {
        if let Some(v) = table.version() {
            let keep_from = v.saturating_sub(BOOKKEEPING_LOG_VERSIONS);
            let n = cleanup_log(&table, keep_from, BOOKKEEPING_LOG_MIN_AGE).await?;
            if n > 0 {
                // The loaded table may still name deleted log files.
                wh.forget(rel);
            }
            debug!(table = rel, log_files = n, "bookkeeping log shortened");
        }
    }
    debug!(
        table = rel,
        partitions = done.partitions,
        removed = done.files_removed,
        added = done.files_added,
        "open partitions compacted"
    );
    Ok(Some(done))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::delta::{append, local_warehouse, session_with};
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    /// The open day of small drops: 288 batches of 9–11 units each (uneven, as drops
    /// are), compacted as `crowded` chooses once 16 files are due, with [`settled`] and
    /// with every small file rewritten at each compaction (the rule before it). Returns
    /// units rewritten, units written, the most files the partition held and the
    /// compactions.
    fn open_day(tiered: bool) -> (u64, u64, usize, usize) {
        let mut files: Vec<u64> = Vec::new();
        let (mut rewritten, mut written, mut most, mut compactions) = (0, 0, 0, 0);
        for batch in 0..288u64 {
            let size = 9 + (batch * 7919) % 3;
            files.push(size);
            written += size;
            let from = if tiered { settled(&files) } else { 0 };
            if files.len() - from >= 16 {
                let out: u64 = files[from..].iter().sum();
                rewritten += out;
                files.truncate(from);
                files.push(out);
                compactions += 1;
            }
            most = most.max(files.len());
            if tiered {
                assert!(
                    files.len() - settled(&files) < 16,
                    "batch {batch}: {files:?}"
                );
            }
        }
        (rewritten, written, most, compactions)
    }

    /// Under [`settled`] a day of small drops is rewritten 2.3 times over (every small
    /// file at each compaction: 10 times, the last compaction the whole day), the
    /// partition holds at most 18 files (15 before), and a compaction still follows every
    /// 16 batches: no batch waits behind a larger file for its compaction.
    #[test]
    fn tiered_compaction_rewrites_each_row_a_logarithmic_number_of_times() {
        let (tiered, written, most, compactions) = open_day(true);
        let (every, _, most_before, compactions_before) = open_day(false);
        assert!(
            tiered * 10 <= written * 25,
            "{tiered} units rewritten of {written}"
        );
        assert!(
            every >= 9 * written,
            "{every} units rewritten of {written} before"
        );
        assert!(
            most <= 16 + 3,
            "at most {most} files (before: {most_before})"
        );
        assert_eq!((compactions, compactions_before), (18, 19));
        // The rule itself: older files larger than everything after them stay.
        assert_eq!(settled(&[64, 32, 16, 1, 1]), 3);
        assert_eq!(settled(&[100, 30, 20, 10, 10]), 1);
        assert_eq!(settled(&[10, 11, 9, 10]), 0);
        assert_eq!(settled(&[5]), 1);
        assert_eq!(settled(&[]), 0);
    }

    /// Writers compacting one table at once (as every writer compacts the run log after
    /// its batches) leave every row once: one compacts, the others see its lease and
    /// leave it to the next batch. Without the lease delta-rs let them all commit, and
    /// each compaction's output doubled the table's rows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_compactions_of_one_table_leave_every_row_once() {
        let dir = tempfile::tempdir().unwrap();
        let open_wh = || local_warehouse(dir.path());
        let wh = open_wh();
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let mut t = wh.open_or_create("t", &schema, &[]).await.unwrap();
        for v in 0..8i64 {
            let rows = vec![Arc::new(Int64Array::from_iter_values(v * 10..v * 10 + 10)) as _];
            let b = RecordBatch::try_new(schema.clone(), rows).unwrap();
            t = append(t, vec![b], &[], "w", v + 1).await.unwrap();
        }
        let opts = OpenCompaction {
            min_files: 4,
            target_size: 32 << 20,
        };
        let compactors: Vec<_> = (0..4)
            .map(|_| {
                let wh = open_wh();
                tokio::spawn(async move {
                    open_partitions(&wh, "t", &opts, &[], None, false)
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut compacted = 0;
        for c in compactors {
            compacted += usize::from(c.await.unwrap().is_some());
        }
        assert!(compacted >= 1, "someone compacted");
        let wh = open_wh();
        let (n, d) = rows_and_keys(&wh).await;
        assert_eq!((n, d), (80, 80), "{compacted} compactions committed");
    }

    /// Rows and distinct `k`s of table `t` in `wh`.
    async fn rows_and_keys(wh: &Warehouse) -> (i64, i64) {
        let t = wh.open("t").await.unwrap().unwrap();
        let ctx = session_with(&t, "t").await.unwrap();
        let b = ctx
            .sql("SELECT count(*) AS n, count(DISTINCT k) AS d FROM t")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let col = |i| crate::columns::int64_at(&b[0], i).unwrap().value(0);
        (col(0), col(1))
    }

    #[test]
    fn bins_pack_in_order_and_skip_lone_files() {
        assert_eq!(bins(&[1, 1, 1, 1], 10), vec![0..4]);
        assert_eq!(bins(&[4, 4, 4, 4, 4], 8), vec![0..2, 2..4]);
        // A large file (over the limit) stands alone, and so does a lone remainder.
        assert_eq!(bins(&[3, 20, 3, 3, 9], 8), vec![2..4]);
        assert_eq!(bins(&[5], 8), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(bins(&[], 8), Vec::<std::ops::Range<usize>>::new());
    }

    /// A compaction leaves an earlier output that is larger than everything written
    /// after it: 3 appends of 2,000 rows are compacted into one file, then 2 appends of
    /// 10 rows are compacted without it (2 files removed, 1 added), and the partition
    /// holds every row once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compaction_leaves_an_earlier_output_larger_than_what_came_after() {
        use arrow::array::Date32Array;
        let dir = tempfile::tempdir().unwrap();
        let wh = local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("d", DataType::Date32, true),
        ]));
        let mut t = wh.open_or_create("t", &schema, &["d"]).await.unwrap();
        let rows = |from: i64, n: usize| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from_iter_values(from..from + n as i64)) as _,
                    Arc::new(Date32Array::from(vec![20_605; n])) as _,
                ],
            )
            .unwrap()
        };
        let opts = OpenCompaction {
            min_files: 2,
            target_size: 32 << 20,
        };
        for v in 0..3i64 {
            t = append(t, vec![rows(v * 2_000, 2_000)], &["d"], "w", v + 1)
                .await
                .unwrap();
        }
        crate::sink::tables::keep(&t);
        let done = open_partitions(&wh, "t", &opts, &[], None, false)
            .await
            .unwrap()
            .expect("compacted");
        assert_eq!((done.files_removed, done.files_added), (3, 1));
        let mut t = wh.open("t").await.unwrap().unwrap();
        for v in 0..2i64 {
            t = append(t, vec![rows(6_000 + v * 10, 10)], &["d"], "w", v + 4)
                .await
                .unwrap();
        }
        crate::sink::tables::keep(&t);
        let done = open_partitions(&wh, "t", &opts, &[], None, false)
            .await
            .unwrap()
            .expect("compacted");
        assert_eq!(
            (done.files_removed, done.files_added),
            (2, 1),
            "the 6,000-row output stays"
        );
        let t = wh.open("t").await.unwrap().unwrap();
        let snap = t.snapshot().unwrap();
        let mut counts: Vec<i64> = snap
            .log_data()
            .iter()
            .map(|f| f.num_records().unwrap_or(0) as i64)
            .collect();
        counts.sort();
        assert_eq!(counts, vec![20, 6_000]);
        assert_eq!(rows_and_keys(&wh).await, (6_020, 6_020));
        // Nothing left to compact: one small file stays one file.
        assert!(open_partitions(&wh, "t", &opts, &[], None, false)
            .await
            .unwrap()
            .is_none());
    }

    /// A crowded partition of a table partitioned by a date and a string is rewritten by
    /// kestrel (no `operationMetrics` in the commit: delta-rs's optimize writes them,
    /// and its post-commit hook lists the whole log) into one file holding its rows with
    /// their partition values, in a commit that changes no data; a partition below the
    /// threshold is left alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crowded_partition_is_rewritten_by_kestrel_without_changing_data() {
        use arrow::array::{Date32Array, StringArray};
        let dir = tempfile::tempdir().unwrap();
        let wh = local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("d", DataType::Date32, true),
            Field::new("s", DataType::Utf8, true),
        ]));
        let mut t = wh.open_or_create("t", &schema, &["d", "s"]).await.unwrap();
        let batch = |v: i64, d: i32, s: &str| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from_iter_values(v * 10..v * 10 + 10)) as _,
                    Arc::new(Date32Array::from(vec![d; 10])) as _,
                    Arc::new(StringArray::from(vec![s; 10])) as _,
                ],
            )
            .unwrap()
        };
        for v in 0..6i64 {
            let (d, s) = if v < 5 {
                (20_605, "a b")
            } else {
                (20_604, "c")
            };
            t = append(t, vec![batch(v, d, s)], &["d", "s"], "w", v + 1)
                .await
                .unwrap();
        }
        let opts = OpenCompaction {
            min_files: 4,
            target_size: 32 << 20,
        };
        let done = open_partitions(&wh, "t", &opts, &[], None, false)
            .await
            .unwrap()
            .expect("compacted");
        assert_eq!((done.files_removed, done.files_added), (5, 1));
        let t = wh.open("t").await.unwrap().unwrap();
        let snap = t.snapshot().unwrap();
        let files: Vec<_> = snap.log_data().iter().collect();
        assert_eq!(files.len(), 2, "one compacted file and the untouched one");
        let ctx = session_with(&t, "t").await.unwrap();
        let b = ctx
            .sql(
                "SELECT count(*) AS n, count(DISTINCT k) AS dk, \
                 sum(CASE WHEN d = DATE '2026-06-01' AND s = 'a b' THEN 1 ELSE 0 END) AS a \
                 FROM t",
            )
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let col = |i| crate::columns::int64_at(&b[0], i).unwrap().value(0);
        assert_eq!((col(0), col(1), col(2)), (60, 60, 50));
        let mut history = t.history(Some(1));
        let last = futures::StreamExt::next(&mut history)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(last.operation.as_deref(), Some("OPTIMIZE"));
        assert!(
            !last.info.contains_key("operationMetrics"),
            "{:?}",
            last.info
        );
        let version = t.version().unwrap();
        let commit = std::fs::read_to_string(
            dir.path()
                .join("t/_delta_log")
                .join(format!("{version:020}.json")),
        )
        .unwrap();
        assert!(!commit.contains("\"dataChange\":true"), "{commit}");
    }
}
