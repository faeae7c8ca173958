//! The late-data ledger `late/<job>`: events too late for a job's windows (event_ts
//! before the watermark at batch start minus the job's lookback), with the watermark
//! at the time and the reason. Queryable like any Delta table; partitioned by event date.

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::error::Result;
use crate::schema::{ts_type, EVENT_DATE};
use crate::time::Micros;

/// Partition column.
pub const PARTITION: &str = EVENT_DATE;

/// Schema: the bronze columns, then `_job_batch_id`, `_watermark`, `_cutoff`, `_reason`,
/// `_recorded_at`.
pub fn schema(bronze: &Schema) -> SchemaRef {
    let mut fields: Vec<Field> = bronze.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new("_job_batch_id", DataType::Int64, true));
    fields.push(Field::new("_watermark", ts_type(), true));
    fields.push(Field::new("_cutoff", ts_type(), true));
    fields.push(Field::new("_reason", DataType::Utf8, true));
    fields.push(Field::new("_recorded_at", ts_type(), true));
    Arc::new(Schema::new(fields))
}

/// Why rows were too late, in words.
pub fn reason(watermark: Micros, lookback: std::time::Duration) -> String {
    let w = crate::time::iso(watermark);
    format!(
        "event_ts before the watermark ({w}) minus lookback ({}s): its windows are closed",
        lookback.as_secs()
    )
}

/// Late-ledger rows for `late` (bronze rows conformed to the bronze schema).
pub fn rows(
    late: &RecordBatch,
    job_batch: i64,
    watermark: Micros,
    cutoff: Micros,
    why: &str,
    now_us: Micros,
) -> Result<RecordBatch> {
    let n = late.num_rows();
    let target = schema(&late.schema());
    let mut cols: Vec<ArrayRef> = late.columns().to_vec();
    let ts = |v: Micros| -> ArrayRef {
        Arc::new(TimestampMicrosecondArray::from(vec![v; n]).with_timezone("UTC"))
    };
    cols.push(Arc::new(Int64Array::from(vec![job_batch; n])));
    cols.push(ts(watermark));
    cols.push(ts(cutoff));
    cols.push(Arc::new(StringArray::from(vec![why; n])));
    cols.push(ts(now_us));
    Ok(RecordBatch::try_new(target, cols)?)
}

/// Column naming the source of a row in the late ledger of a job over several sources.
pub const SOURCE: &str = "_source";

/// The ledger's row schema for a job over several sources: every bronze column of the
/// sources (first source first, each name once, all nullable), then `_source`.
pub fn union_schema(bronzes: &[&Schema]) -> SchemaRef {
    let mut fields: Vec<Field> = Vec::new();
    for b in bronzes {
        for f in b.fields() {
            if !fields.iter().any(|x| x.name() == f.name()) {
                fields.push(f.as_ref().clone().with_nullable(true));
            }
        }
    }
    fields.push(Field::new(SOURCE, DataType::Utf8, true));
    Arc::new(Schema::new(fields))
}

/// Bronze rows of `source` conformed to `union` (see [`union_schema`]): columns the
/// source lacks are null, `_source` names it.
pub fn to_union(rows: &RecordBatch, source: &str, union: &SchemaRef) -> Result<RecordBatch> {
    let n = rows.num_rows();
    let cols = union
        .fields()
        .iter()
        .map(|f| -> Result<ArrayRef> {
            if f.name() == SOURCE {
                return Ok(Arc::new(StringArray::from(vec![source; n])));
            }
            Ok(match rows.column_by_name(f.name()) {
                Some(c) if c.data_type() == f.data_type() => c.clone(),
                Some(c) => arrow::compute::cast(c, f.data_type())?,
                None => arrow::array::new_null_array(f.data_type(), n),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(union.clone(), cols)?)
}
