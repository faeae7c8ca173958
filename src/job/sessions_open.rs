//! State as data: the sessions still open at a session job's watermark, kept as a table
//! (`<table>_open`, e.g. `gold/sessions_open`) replaced every batch — so "what is in
//! flight" is a query, not a guess from `is_final`.
//!
//! A session is open while its last event + gap is after W; the job's gold table marks
//! it `is_final = false`. A batch rewrites every session whose state changed (touched by
//! new events, merged away by a late one, or turned final by W moving), so the open
//! sessions after it are those open before it that it did not rewrite, plus the ones it
//! rewrote that are still not final. Pure: no I/O.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Int64Array, RecordBatch, TimestampMicrosecondArray,
};
use arrow::compute::{concat_batches, filter_record_batch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::columns::{conform, formatters, row_string};
use crate::error::Result;
use crate::job::aggregate::{OP, WINDOW_HOUR};
use crate::schema::ts_type;
use crate::time::Micros;

/// Column of the watermark the sessions are open at.
pub const AS_OF: &str = "watermark";

/// Gold columns the open-sessions table does not carry.
const DROPPED: [&str; 5] = [
    "is_final",
    "window_date",
    WINDOW_HOUR,
    "_updated_at",
    "_batch_id",
];

/// The open-sessions table of gold schema `gold`: the keys, `session_start`,
/// `session_end` (the last event so far), the aggregates so far, then `watermark` (W
/// after the batch) and `_batch_id` (the batch that wrote the table).
pub fn schema(gold: &Schema) -> SchemaRef {
    let mut fields: Vec<Field> = data_fields(gold);
    fields.push(Field::new(AS_OF, ts_type(), true));
    fields.push(Field::new("_batch_id", DataType::Int64, true));
    Arc::new(Schema::new(fields))
}

fn data_fields(gold: &Schema) -> Vec<Field> {
    gold.fields()
        .iter()
        .filter(|f| !DROPPED.contains(&f.name().as_str()))
        .map(|f| f.as_ref().clone())
        .collect()
}

/// The sessions open after a batch: `before` (the table's rows, or the gold rows that
/// were not final, any superset of columns) minus every session `rows` (the batch's gold
/// merge rows, upserts and tombstones) rewrote, plus the rewritten ones not final; all
/// stamped with `w_after` and `batch_id`. Sessions are identified by `keys` and
/// `session_start`.
pub fn after_batch(
    before: &RecordBatch,
    rows: &[RecordBatch],
    keys: &[String],
    open: &SchemaRef,
    w_after: Option<Micros>,
    batch_id: i64,
) -> Result<RecordBatch> {
    let mut ident: Vec<String> = keys.to_vec();
    ident.push("session_start".to_string());
    let data = Arc::new(Schema::new(
        open.fields()[..open.fields().len() - 2]
            .iter()
            .map(|f| f.as_ref().clone())
            .collect::<Vec<_>>(),
    ));
    let mut rewritten = HashSet::new();
    let mut parts = Vec::new();
    for b in rows {
        let f = formatters(b, &ident)?;
        rewritten.extend((0..b.num_rows()).map(|i| row_string(&f, i)));
        let ops = crate::columns::string(b, OP)?;
        let fin = b
            .column_by_name("is_final")
            .and_then(|c| c.as_any().downcast_ref::<BooleanArray>());
        let still_open: BooleanArray = (0..b.num_rows())
            .map(|i| {
                let upsert = ops.is_valid(i) && ops.value(i) == "upsert";
                let final_ = fin.is_some_and(|f| f.is_valid(i) && f.value(i));
                Some(upsert && !final_)
            })
            .collect();
        parts.push(conform(&filter_record_batch(b, &still_open)?, &data)?);
    }
    let kept = {
        let f = formatters(before, &ident)?;
        let keep: BooleanArray = (0..before.num_rows())
            .map(|i| Some(!rewritten.contains(&row_string(&f, i))))
            .collect();
        conform(&filter_record_batch(before, &keep)?, &data)?
    };
    parts.insert(0, kept);
    let all = concat_batches(&data, &parts)?;
    let n = all.num_rows();
    let mut cols: Vec<ArrayRef> = all.columns().to_vec();
    cols.push(Arc::new(
        TimestampMicrosecondArray::from(vec![w_after; n]).with_timezone("UTC"),
    ));
    cols.push(Arc::new(Int64Array::from(vec![batch_id; n])));
    Ok(RecordBatch::try_new(open.clone(), cols)?)
}
