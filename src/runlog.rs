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

/// Append `row` unless its batch is already logged (txn per kind and name). Returns true
/// if written.
async fn append(wh: &Warehouse, row: &Row<'_>) -> Result<bool> {
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
    match wh.open(names::table::RUNS).await? {
        Some(t) => Ok(delta::txn_version(&t, &names::app::runlog(kind, name))
            .await?
            .unwrap_or(0)),
        None => Ok(0),
    }
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
