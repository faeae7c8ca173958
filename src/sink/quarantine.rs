//! `quarantine/<source>`: rejected records with the raw text, file, line and reason.
//! A file rejected whole has one row with no line and no raw text.

use std::sync::{Arc, LazyLock};

use arrow::array::{Int64Builder, RecordBatch, StringBuilder, TimestampMicrosecondBuilder};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::error::Result;
use crate::schema::ts_type;
use crate::source::decode::Rejected;

/// Schema of every quarantine table.
pub static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("source_file", DataType::Utf8, true),
        Field::new("line", DataType::Int64, true),
        Field::new("raw", DataType::Utf8, true),
        Field::new("reason", DataType::Utf8, true),
        Field::new("_source_partition", DataType::Utf8, true),
        Field::new("_landed_at", ts_type(), true),
        Field::new("_batch_id", DataType::Int64, true),
        Field::new("_ingested_at", ts_type(), true),
    ]))
});

/// Collects quarantine rows for one batch.
#[derive(Default)]
pub struct QuarantineBuilder {
    file: StringBuilder,
    line: Int64Builder,
    raw: StringBuilder,
    reason: StringBuilder,
    partition: StringBuilder,
    landed: TimestampMicrosecondBuilder,
    batch: Int64Builder,
    ingested: TimestampMicrosecondBuilder,
    rows: usize,
}

impl QuarantineBuilder {
    /// Add one rejected record (or a whole-file rejection).
    pub fn push(
        &mut self,
        file: &str,
        partition: &str,
        landed_at_us: i64,
        batch_id: i64,
        ingested_at_us: i64,
        r: &Rejected,
    ) {
        self.file.append_value(file);
        self.line.append_option(r.line);
        self.raw.append_option(r.raw.as_deref());
        self.reason.append_value(&r.reason);
        self.partition.append_value(partition);
        self.landed.append_value(landed_at_us);
        self.batch.append_value(batch_id);
        self.ingested.append_value(ingested_at_us);
        self.rows += 1;
    }

    /// Rows collected.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// True when nothing was rejected.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The batch (None when empty).
    pub fn finish(mut self) -> Result<Option<RecordBatch>> {
        if self.rows == 0 {
            return Ok(None);
        }
        Ok(Some(RecordBatch::try_new(
            SCHEMA.clone(),
            vec![
                Arc::new(self.file.finish()),
                Arc::new(self.line.finish()),
                Arc::new(self.raw.finish()),
                Arc::new(self.reason.finish()),
                Arc::new(self.partition.finish()),
                Arc::new(self.landed.finish().with_timezone("UTC")),
                Arc::new(self.batch.finish()),
                Arc::new(self.ingested.finish().with_timezone("UTC")),
            ],
        )?))
    }
}
