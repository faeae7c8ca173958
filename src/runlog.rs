//! The run log (`_kestrel/runs`): one row per completed batch of ingestion or of a job,
//! written with an application transaction so a replayed batch logs once. Columns only a
//! job fills (rows applied, too late, windows recomputed, corrections, watermark) are null
//! for ingestion rows and vice versa; tables written before the job columns existed gain
//! them on the next append (schema merge).

use std::sync::{Arc, LazyLock};

use arrow::array::{Date32Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use serde::Serialize;

use crate::error::Result;
use crate::job::plan::JobCounts;
use crate::names;
use crate::schema::ts_type;
use crate::sink::delta::{self, Warehouse};

/// Partition column of the run log: the UTC date the batch started. Every batch appends
/// to today's partition, so compacting it between batches keeps the table — which every
/// batch commits to and reads its positions from — a few files, however long kestrel has
/// run. (Run logs created before this column existed stay unpartitioned and gain it as a
/// plain column.)
pub const PARTITION: &str = "run_date";

/// Schema of the run log.
pub static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("run_id", DataType::Utf8, true),
        Field::new("kind", DataType::Utf8, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("batch_id", DataType::Int64, true),
        Field::new("started_at", ts_type(), true),
        Field::new("finished_at", ts_type(), true),
        Field::new("duration_ms", DataType::Int64, true),
        Field::new("files", DataType::Int64, true),
        Field::new("files_rejected", DataType::Int64, true),
        Field::new("files_changed", DataType::Int64, true),
        Field::new("rows_in", DataType::Int64, true),
        Field::new("rows_written", DataType::Int64, true),
        Field::new("duplicates", DataType::Int64, true),
        Field::new("quarantined", DataType::Int64, true),
        Field::new("bronze_version", DataType::Int64, true),
        Field::new("status", DataType::Utf8, true),
        Field::new("message", DataType::Utf8, true),
        Field::new("rows_applied", DataType::Int64, true),
        Field::new("too_late", DataType::Int64, true),
        Field::new("windows_recomputed", DataType::Int64, true),
        Field::new("windows_deleted", DataType::Int64, true),
        Field::new("corrections", DataType::Int64, true),
        Field::new("watermark", ts_type(), true),
        Field::new("landed_oldest", ts_type(), true),
        Field::new("cpu_ms", DataType::Int64, true),
        Field::new("resumed", DataType::Boolean, true),
        Field::new("state_ids", DataType::Int64, true),
        Field::new("state_bytes", DataType::Int64, true),
        Field::new("checkpoint_bytes", DataType::Int64, true),
        Field::new(PARTITION, DataType::Date32, true),
    ]))
});

/// One completed ingestion batch.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IngestEntry {
    pub run_id: String,
    pub source: String,
    pub batch_id: i64,
    pub started_at_us: i64,
    pub finished_at_us: i64,
    pub files: i64,
    pub files_rejected: i64,
    pub files_changed: i64,
    pub rows_in: i64,
    pub rows_written: i64,
    pub duplicates: i64,
    pub quarantined: i64,
    pub bronze_version: Option<i64>,
    pub status: String,
    pub message: Option<String>,
    /// Arrival time of the batch's oldest file.
    pub landed_oldest_us: Option<i64>,
    /// CPU time the process used for the batch.
    pub cpu_ms: i64,
    /// The batch's plan was found, not made: a run before was interrupted in it.
    pub resumed: bool,
}

impl IngestEntry {
    fn row(&self) -> Row<'_> {
        Row {
            run_id: &self.run_id,
            kind: "ingest",
            name: &self.source,
            batch_id: self.batch_id,
            started_at_us: self.started_at_us,
            finished_at_us: self.finished_at_us,
            status: &self.status,
            message: self.message.as_deref(),
            rows_in: Some(self.rows_in),
            rows_written: Some(self.rows_written),
            files: Some(self.files),
            files_rejected: Some(self.files_rejected),
            files_changed: Some(self.files_changed),
            duplicates: Some(self.duplicates),
            quarantined: Some(self.quarantined),
            bronze_version: self.bronze_version,
            landed_oldest: self.landed_oldest_us,
            cpu_ms: Some(self.cpu_ms),
            resumed: Some(self.resumed),
            ..Row::default()
        }
    }
}

/// One completed job batch.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobEntry {
    pub run_id: String,
    pub job: String,
    pub batch_id: i64,
    pub started_at_us: i64,
    pub finished_at_us: i64,
    pub counts: JobCounts,
    /// Gold rows merged (upserts + tombstones).
    pub rows_written: i64,
    pub status: String,
    pub message: Option<String>,
    /// The operator's own metrics by name (not a run-log column: the run log keeps
    /// `counts`, one shape for every operator).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub metrics: std::collections::BTreeMap<String, i64>,
    /// CPU time the process used for the batch.
    pub cpu_ms: i64,
    /// The batch's plan was found, not made: a run before was interrupted in it.
    pub resumed: bool,
}

impl JobEntry {
    fn row(&self) -> Row<'_> {
        let c = &self.counts;
        Row {
            run_id: &self.run_id,
            kind: "job",
            name: &self.job,
            batch_id: self.batch_id,
            started_at_us: self.started_at_us,
            finished_at_us: self.finished_at_us,
            status: &self.status,
            message: self.message.as_deref(),
            rows_in: Some(c.rows_in),
            rows_written: Some(self.rows_written),
            rows_applied: Some(c.applied),
            too_late: Some(c.too_late),
            windows_recomputed: Some(c.windows_recomputed),
            windows_deleted: Some(c.deleted),
            corrections: Some(c.corrections),
            watermark: c.watermark_after,
            landed_oldest: c.oldest_landed,
            cpu_ms: Some(self.cpu_ms),
            resumed: Some(self.resumed),
            ..Row::default()
        }
    }
}

/// One checkpoint of an always-on stream's state: what it held and what writing it took
/// (kind `checkpoint`, name = the job, batch id = the job's checkpoint count).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckpointEntry {
    pub run_id: String,
    pub job: String,
    /// The job's checkpoints so far, this one included (across restarts).
    pub number: i64,
    pub started_at_us: i64,
    pub finished_at_us: i64,
    /// Event ids held by the stream's in-memory dedup sets, and their bytes.
    pub state_ids: i64,
    pub state_bytes: i64,
    /// Bytes this (incremental) checkpoint wrote.
    pub checkpoint_bytes: i64,
}

impl CheckpointEntry {
    fn row(&self) -> Row<'_> {
        Row {
            run_id: &self.run_id,
            kind: "checkpoint",
            name: &self.job,
            batch_id: self.number,
            started_at_us: self.started_at_us,
            finished_at_us: self.finished_at_us,
            status: "ok",
            state_ids: Some(self.state_ids),
            state_bytes: Some(self.state_bytes),
            checkpoint_bytes: Some(self.checkpoint_bytes),
            ..Row::default()
        }
    }
}

/// One run-log row: the columns every kind fills, then the kind-specific ones (None is
/// written as null). The column order is [`SCHEMA`]'s.
#[derive(Default)]
struct Row<'a> {
    run_id: &'a str,
    kind: &'a str,
    name: &'a str,
    batch_id: i64,
    started_at_us: i64,
    finished_at_us: i64,
    status: &'a str,
    message: Option<&'a str>,
    rows_in: Option<i64>,
    rows_written: Option<i64>,
    // ingestion
    files: Option<i64>,
    files_rejected: Option<i64>,
    files_changed: Option<i64>,
    duplicates: Option<i64>,
    quarantined: Option<i64>,
    bronze_version: Option<i64>,
    // jobs
    rows_applied: Option<i64>,
    too_late: Option<i64>,
    windows_recomputed: Option<i64>,
    windows_deleted: Option<i64>,
    corrections: Option<i64>,
    watermark: Option<i64>,
    // service levels
    landed_oldest: Option<i64>,
    cpu_ms: Option<i64>,
    resumed: Option<bool>,
    // stream checkpoints
    state_ids: Option<i64>,
    state_bytes: Option<i64>,
    checkpoint_bytes: Option<i64>,
}

impl Row<'_> {
    fn to_batch(&self) -> Result<RecordBatch> {
        let ts = |v: Option<i64>| {
            Arc::new(TimestampMicrosecondArray::from(vec![v]).with_timezone("UTC"))
        };
        let i = |v: Option<i64>| Arc::new(Int64Array::from(vec![v]));
        let s = |v: Option<&str>| Arc::new(StringArray::from(vec![v]));
        Ok(RecordBatch::try_new(
            SCHEMA.clone(),
            vec![
                s(Some(self.run_id)),
                s(Some(self.kind)),
                s(Some(self.name)),
                i(Some(self.batch_id)),
                ts(Some(self.started_at_us)),
                ts(Some(self.finished_at_us)),
                i(Some((self.finished_at_us - self.started_at_us) / 1000)),
                i(self.files),
                i(self.files_rejected),
                i(self.files_changed),
                i(self.rows_in),
                i(self.rows_written),
                i(self.duplicates),
                i(self.quarantined),
                i(self.bronze_version),
                s(Some(self.status)),
                s(self.message),
                i(self.rows_applied),
                i(self.too_late),
                i(self.windows_recomputed),
                i(self.windows_deleted),
                i(self.corrections),
                ts(self.watermark),
                ts(self.landed_oldest),
                i(self.cpu_ms),
                Arc::new(arrow::array::BooleanArray::from(vec![self.resumed])),
                i(self.state_ids),
                i(self.state_bytes),
                i(self.checkpoint_bytes),
                Arc::new(Date32Array::from(vec![Some(
                    self.started_at_us.div_euclid(86_400_000_000) as i32,
                )])),
            ],
        )?)
    }
}

/// One run-log append at a time in a process. A run's sources and jobs log their batches
/// from tasks of their own, and concurrent blind appends to one table each retry
/// against every commit that beat them: with `parallel_jobs = 8`, seven jobs and four
/// sources under a loaded machine, one append used up delta-rs's 15 attempts and failed
/// its ingestion ("Failed to commit transaction: 15"). In turn, each append opens the
/// table at the version the one before it wrote and commits without a conflict; only
/// another process's appends still race it (and retry).
static APPENDS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Append `row` unless its batch is already logged (txn per kind and name). Returns true
/// if written.
async fn append(wh: &Warehouse, row: &Row<'_>) -> Result<bool> {
    let _one = APPENDS.lock().await;
    let table = wh
        .open_or_create(names::table::RUNS, &SCHEMA, &[PARTITION])
        .await?;
    let app = names::app::runlog(row.kind, row.name);
    let parts = delta::partition_columns(&table)?;
    let rows = vec![row.to_batch()?];
    let written = delta::commit_once(table, &app, row.batch_id, |t| {
        delta::append_evolving(t, rows, &parts, &app, row.batch_id, None)
    })
    .await?;
    Ok(written.is_some())
}

/// Last batch id logged for (kind, name); 0 when none.
pub async fn last_batch(wh: &Warehouse, kind: &str, name: &str) -> Result<i64> {
    Ok(last_batches(wh, &[(kind, name)]).await?[0])
}

/// Last batch ids logged for each (kind, name), in order (0 when none), from one look
/// at the run log: one open of it, where as many [`last_batch`]es open it as many times
/// (each open of a kept table lists the commits since, ≈ 2 ms).
pub async fn last_batches(wh: &Warehouse, of: &[(&str, &str)]) -> Result<Vec<i64>> {
    let Some(t) = wh.open(names::table::RUNS).await? else {
        return Ok(vec![0; of.len()]);
    };
    let mut out = Vec::with_capacity(of.len());
    for (kind, name) in of {
        let app = names::app::runlog(kind, name);
        out.push(delta::txn_version(&t, &app).await?.unwrap_or(0));
    }
    Ok(out)
}

/// Append an ingestion entry unless that batch is already logged. Returns true if written.
pub async fn log_ingest(wh: &Warehouse, e: &IngestEntry) -> Result<bool> {
    append(wh, &e.row()).await
}

/// Append a stream checkpoint entry unless that number is already logged.
pub async fn log_checkpoint(wh: &Warehouse, e: &CheckpointEntry) -> Result<bool> {
    append(wh, &e.row()).await
}

/// Append a job entry unless that batch is already logged. Returns true if written.
pub async fn log_job(wh: &Warehouse, e: &JobEntry) -> Result<bool> {
    append(wh, &e.row()).await
}

/// What [`expire`] removed from the run log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Expired {
    /// `run_date` partitions removed.
    pub partitions: usize,
    /// Their files.
    pub files: usize,
    /// Their rows (from the files' statistics).
    pub rows: u64,
}

/// Remove the run log's rows of `run_date`s before `before` (days since the epoch): whole
/// partitions, by remove actions in one commit (a Delta `DELETE` of
/// `run_date < 'before'`), nothing rewritten. Every partition is one file once the daily
/// maintenance has compacted it, and every commit to a Delta table costs in proportion
/// to its active files, so a run log kept forever makes each of a run's dozen appends
/// slower by a file a day (README "Cost over time"). Positions are not rows: a source's
/// or job's last batch is the application transaction of its last append
/// ([`last_batch`]), which the table's log keeps whatever rows are removed. A run log
/// not partitioned by `run_date` (an older release's) is left as it is. Returns the
/// table (at its new version when something was removed).
pub async fn expire(
    table: deltalake::DeltaTable,
    before: i32,
) -> Result<(deltalake::DeltaTable, Expired)> {
    let url = table.table_url().to_string();
    if !delta::partition_columns(&table)?
        .iter()
        .any(|c| c == PARTITION)
    {
        return Ok((table, Expired::default()));
    }
    // Delta keeps a date partition value as `YYYY-MM-DD`, which orders as the date does.
    let cutoff = crate::time::date(before);
    let mut dates = std::collections::BTreeSet::new();
    let mut expired = Expired::default();
    let mut actions = Vec::new();
    {
        let snap = table
            .snapshot()
            .map_err(|e| crate::error::Error::delta(&url, e))?;
        for f in snap.log_data().iter() {
            let values = f.partition_values_map();
            let Some(Some(date)) = values.get(PARTITION) else {
                continue;
            };
            if date.as_str() < cutoff.as_str() {
                dates.insert(date.clone());
                expired.files += 1;
                expired.rows += f.num_records().unwrap_or(0) as u64;
                actions.push(deltalake::kernel::Action::Remove(f.remove_action(true)));
            }
        }
    }
    if actions.is_empty() {
        return Ok((table, Expired::default()));
    }
    expired.partitions = dates.len();
    let operation = deltalake::protocol::DeltaOperation::Delete {
        predicate: Some(format!("{PARTITION} < '{cutoff}'")),
    };
    let table = delta::commit_actions(table, actions, delta::commit_props(), operation).await?;
    Ok((table, expired))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY_US: i64 = 86_400_000_000;

    fn entry(source: &str, batch_id: i64, day: i64) -> IngestEntry {
        IngestEntry {
            run_id: format!("r{batch_id}"),
            source: source.into(),
            batch_id,
            started_at_us: day * DAY_US + 3_600_000_000,
            finished_at_us: day * DAY_US + 3_601_000_000,
            rows_in: 10,
            status: "ok".into(),
            ..IngestEntry::default()
        }
    }

    async fn rows(wh: &Warehouse) -> Vec<(i64, String)> {
        let t = wh.open(names::table::RUNS).await.unwrap().unwrap();
        let ctx = delta::session_with(&t, "runs").await.unwrap();
        let b = delta::sql(
            &ctx,
            "SELECT batch_id, name FROM runs ORDER BY name, batch_id",
        )
        .await
        .unwrap();
        let mut out = Vec::new();
        for b in b {
            let ids = crate::columns::int64_at(&b, 0).unwrap();
            let names = crate::columns::string_at(&b, 1).unwrap();
            for r in 0..b.num_rows() {
                out.push((ids.value(r), names.value(r).to_string()));
            }
        }
        out
    }

    /// Expiring removes the old days' rows and keeps the newer ones; the positions
    /// (application transactions) stay, and a batch already logged still logs once.
    #[tokio::test]
    async fn expire_removes_old_days_and_keeps_positions() {
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        // orders: batches 1–3 on days 100–102; clickstream: batch 1 on day 100 only.
        for (b, day) in [(1, 100), (2, 101), (3, 102)] {
            assert!(log_ingest(&wh, &entry("orders", b, day)).await.unwrap());
        }
        assert!(log_ingest(&wh, &entry("clickstream", 1, 100))
            .await
            .unwrap());
        let t = wh.open(names::table::RUNS).await.unwrap().unwrap();

        // Nothing before day 100: nothing to do, no commit.
        let v = t.version();
        let (t, none) = expire(t, 100).await.unwrap();
        assert_eq!(none, Expired::default());
        assert_eq!(t.version(), v);

        let (t, e) = expire(t, 102).await.unwrap();
        assert_eq!(
            e,
            Expired {
                partitions: 2,
                files: 3,
                rows: 3
            }
        );
        assert_eq!(t.version(), v.map(|v| v + 1));
        assert_eq!(rows(&wh).await, vec![(3, "orders".to_string())]);
        // Positions are the transactions, not the rows.
        assert_eq!(last_batch(&wh, "ingest", "orders").await.unwrap(), 3);
        assert_eq!(last_batch(&wh, "ingest", "clickstream").await.unwrap(), 1);
        let of = [
            ("ingest", "clickstream"),
            ("job", "none"),
            ("ingest", "orders"),
        ];
        assert_eq!(last_batches(&wh, &of).await.unwrap(), [1, 0, 3]);
        // A replayed batch whose row was expired is still known: it does not log again.
        assert!(!log_ingest(&wh, &entry("clickstream", 1, 100))
            .await
            .unwrap());
        assert!(!log_ingest(&wh, &entry("orders", 2, 101)).await.unwrap());
        assert!(log_ingest(&wh, &entry("orders", 4, 103)).await.unwrap());
        assert_eq!(
            rows(&wh).await,
            vec![(3, "orders".to_string()), (4, "orders".to_string())]
        );
    }
}
