//! The run log (`_kestrel/runs`): one row per completed batch of ingestion or of a job,
//! written with an application transaction so a replayed batch logs once. Columns only a
//! job fills (rows applied, too late, windows recomputed, corrections, watermark) are null
//! for ingestion rows and vice versa; tables written before the job columns existed gain
//! them on the next append (schema merge).

use std::sync::{Arc, LazyLock};

use arrow::array::{Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use serde::Serialize;

use crate::error::Result;
use crate::job::plan::JobCounts;
use crate::schema::ts_type;
use crate::sink::delta::{self, Warehouse};

/// Table path of the run log.
pub const TABLE: &str = "_kestrel/runs";

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
    ]))
});

/// Application id of a run-log entry stream (`kind` + `name`, e.g. ingest/orders).
pub fn app_id(kind: &str, name: &str) -> String {
    format!("kestrel-runlog-{kind}-{name}")
}

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
}

impl IngestEntry {
    fn to_batch(&self) -> Result<RecordBatch> {
        let ts = |v: i64| Arc::new(TimestampMicrosecondArray::from(vec![v]).with_timezone("UTC"));
        let i = |v: i64| Arc::new(Int64Array::from(vec![v]));
        Ok(RecordBatch::try_new(
            SCHEMA.clone(),
            vec![
                Arc::new(StringArray::from(vec![self.run_id.as_str()])),
                Arc::new(StringArray::from(vec!["ingest"])),
                Arc::new(StringArray::from(vec![self.source.as_str()])),
                i(self.batch_id),
                ts(self.started_at_us),
                ts(self.finished_at_us),
                i((self.finished_at_us - self.started_at_us) / 1000),
                i(self.files),
                i(self.files_rejected),
                i(self.files_changed),
                i(self.rows_in),
                i(self.rows_written),
                i(self.duplicates),
                i(self.quarantined),
                Arc::new(Int64Array::from(vec![self.bronze_version])),
                Arc::new(StringArray::from(vec![self.status.as_str()])),
                Arc::new(StringArray::from(vec![self.message.as_deref()])),
                null_i64(),
                null_i64(),
                null_i64(),
                null_i64(),
                null_i64(),
                Arc::new(TimestampMicrosecondArray::from(vec![None::<i64>]).with_timezone("UTC")),
            ],
        )?)
    }
}

fn null_i64() -> Arc<Int64Array> {
    Arc::new(Int64Array::from(vec![None::<i64>]))
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
}

impl JobEntry {
    fn to_batch(&self) -> Result<RecordBatch> {
        let ts = |v: Option<i64>| {
            Arc::new(TimestampMicrosecondArray::from(vec![v]).with_timezone("UTC"))
        };
        let i = |v: i64| Arc::new(Int64Array::from(vec![v]));
        let c = &self.counts;
        Ok(RecordBatch::try_new(
            SCHEMA.clone(),
            vec![
                Arc::new(StringArray::from(vec![self.run_id.as_str()])),
                Arc::new(StringArray::from(vec!["job"])),
                Arc::new(StringArray::from(vec![self.job.as_str()])),
                i(self.batch_id),
                ts(Some(self.started_at_us)),
                ts(Some(self.finished_at_us)),
                i((self.finished_at_us - self.started_at_us) / 1000),
                null_i64(),
                null_i64(),
                null_i64(),
                i(c.rows_in),
                i(self.rows_written),
                null_i64(),
                null_i64(),
                null_i64(),
                Arc::new(StringArray::from(vec![self.status.as_str()])),
                Arc::new(StringArray::from(vec![self.message.as_deref()])),
                i(c.applied),
                i(c.too_late),
                i(c.windows_recomputed),
                i(c.deleted),
                i(c.corrections),
                ts(c.watermark_after),
            ],
        )?)
    }
}

/// Last batch id logged for (kind, name); 0 when none.
pub async fn last_batch(wh: &Warehouse, kind: &str, name: &str) -> Result<i64> {
    match wh.open(TABLE).await? {
        Some(t) => Ok(delta::txn_version(&t, &app_id(kind, name))
            .await?
            .unwrap_or(0)),
        None => Ok(0),
    }
}

/// Append an ingestion entry unless that batch is already logged. Returns true if written.
pub async fn log_ingest(wh: &Warehouse, e: &IngestEntry) -> Result<bool> {
    let table = wh.open_or_create(TABLE, &SCHEMA, &[]).await?;
    let app = app_id("ingest", &e.source);
    if delta::txn_version(&table, &app).await?.unwrap_or(0) >= e.batch_id {
        return Ok(false);
    }
    delta::append_evolving(table, vec![e.to_batch()?], &app, e.batch_id).await?;
    Ok(true)
}

/// Append a job entry unless that batch is already logged. Returns true if written.
pub async fn log_job(wh: &Warehouse, e: &JobEntry) -> Result<bool> {
    let table = wh.open_or_create(TABLE, &SCHEMA, &[]).await?;
    let app = app_id("job", &e.job);
    if delta::txn_version(&table, &app).await?.unwrap_or(0) >= e.batch_id {
        return Ok(false);
    }
    delta::append_evolving(table, vec![e.to_batch()?], &app, e.batch_id).await?;
    Ok(true)
}
