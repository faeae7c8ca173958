//! Reading bronze (and gold) rows for jobs with DataFusion over the Delta table provider:
//! filters name the event-date partitions and event-time ranges, so reads prune to the
//! files that can hold matching rows.

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray};
use arrow::compute::{cast, concat_batches};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::JoinType;
use datafusion::common::ScalarValue;
use datafusion::prelude::{col, lit, DataFrame, Expr, SessionContext};

use crate::error::{Error, Result};
use crate::job::plan::Cutoff;
use crate::schema::EVENT_DATE;
use crate::time::Micros;

/// A timestamp literal (micros, UTC).
pub fn ts_lit(v: Micros) -> Expr {
    lit(ScalarValue::TimestampMicrosecond(
        Some(v),
        Some(Arc::from("UTC")),
    ))
}

/// `column IN (dates)` over a Date32 partition column (days since the epoch).
pub fn dates_in(column: &str, days: &[i32]) -> Expr {
    col(column).in_list(
        days.iter()
            .map(|d| lit(ScalarValue::Date32(Some(*d))))
            .collect(),
        false,
    )
}

/// Rows of ingestion batches `(after, upto]`.
pub fn batches_between(after: i64, upto: i64) -> Expr {
    col("_batch_id")
        .gt(lit(after))
        .and(col("_batch_id").lt_eq(lit(upto)))
}

/// `column` in any of the `[lo, hi)` ranges (false when there are none).
pub fn in_ranges(column: &str, ranges: &[(Micros, Micros)]) -> Expr {
    ranges
        .iter()
        .map(|&(lo, hi)| {
            col(column)
                .gt_eq(ts_lit(lo))
                .and(col(column).lt(ts_lit(hi)))
        })
        .reduce(Expr::or)
        .unwrap_or(lit(false))
}

/// Rows applied to the job: ingested up to `upto` and not too late when consumed. Only
/// cut-offs above `lo` (the lowest event time read) can exclude anything, so only those
/// are spelled out.
pub fn applied_rows(upto: i64, cutoffs: &[Cutoff], lo: Micros) -> Expr {
    let mut e = col("_batch_id").lt_eq(lit(upto));
    for c in cutoffs.iter().filter(|c| c.cutoff > lo) {
        let late =
            batches_between(c.after_batch, c.upto_batch).and(col("event_ts").lt(ts_lit(c.cutoff)));
        e = e.and(datafusion::prelude::not(late));
    }
    e
}

/// Ranges wider than this are read without an event-date list (about 3 years).
const MAX_LISTED_SPAN: Micros = 1100 * crate::job::aggregate::DAY;

/// Every bronze read of a job batch: the applied rows of `[lo, hi)` ranges, restricted to
/// their event dates.
pub fn applied_in_ranges(ranges: &[(Micros, Micros)], upto: i64, cutoffs: &[Cutoff]) -> Expr {
    let lo = ranges.first().map_or(Micros::MIN, |r| r.0);
    let hi = ranges.last().map_or(Micros::MIN, |r| r.1);
    let in_time = in_ranges("event_ts", ranges).and(applied_rows(upto, cutoffs, lo));
    // An open-ended range (everything before the first watermark) names no dates.
    if hi.saturating_sub(lo) > MAX_LISTED_SPAN {
        return in_time;
    }
    dates_in(EVENT_DATE, &crate::job::aggregate::dates_of(ranges)).and(in_time)
}

/// Run `filter` over table `name` of `ctx` and return one batch conformed to `target`
/// (columns by name, cast to the target types: the provider may hand back view types).
pub async fn read(
    ctx: &SessionContext,
    name: &str,
    filter: Expr,
    target: &SchemaRef,
) -> Result<RecordBatch> {
    let what = format!("read {name} where {filter}");
    let df = ctx
        .table(name)
        .await
        .map_err(|e| Error::query(&what, e))?
        .filter(filter)
        .map_err(|e| Error::query(&what, e))?;
    collect(df, &what, target).await
}

/// A one-column batch `_key` of `keys`, for [`read_keys`].
pub fn keys_batch<'a>(keys: impl Iterator<Item = &'a str>) -> Result<RecordBatch> {
    let schema = Arc::new(Schema::new(vec![Field::new("_key", DataType::Utf8, false)]));
    let arr: ArrayRef = Arc::new(StringArray::from_iter_values(keys));
    Ok(RecordBatch::try_new(schema, vec![arr])?)
}

/// Like [`read`], restricted to rows whose `key` column is one of `keys` (a batch made by
/// [`keys_batch`]): a semi join in the same plan, so the filter prunes files first.
pub async fn read_keys(
    ctx: &SessionContext,
    name: &str,
    filter: Expr,
    key: &str,
    keys: &RecordBatch,
    target: &SchemaRef,
) -> Result<RecordBatch> {
    let what = format!(
        "read {name} where {filter} and {key} in {} keys",
        keys.num_rows()
    );
    let keys_df = ctx
        .read_batch(keys.clone())
        .map_err(|e| Error::query(&what, e))?;
    let df = ctx
        .table(name)
        .await
        .map_err(|e| Error::query(&what, e))?
        .filter(filter)
        .map_err(|e| Error::query(&what, e))?
        .join(keys_df, JoinType::LeftSemi, &[key], &["_key"], None)
        .map_err(|e| Error::query(&what, e))?;
    collect(df, &what, target).await
}

async fn collect(df: DataFrame, what: &str, target: &SchemaRef) -> Result<RecordBatch> {
    let names: Vec<&str> = target.fields().iter().map(|f| f.name().as_str()).collect();
    let df = df
        .select_columns(&names)
        .map_err(|e| Error::query(what, e))?;
    let batches = df.collect().await.map_err(|e| Error::query(what, e))?;
    let conformed = batches
        .iter()
        .map(|b| conform(b, target))
        .collect::<Result<Vec<_>>>()?;
    Ok(concat_batches(target, &conformed)?)
}

/// `b` with the columns of `target`, by name, cast to the target types.
pub fn conform(b: &RecordBatch, target: &SchemaRef) -> Result<RecordBatch> {
    let cols = target
        .fields()
        .iter()
        .map(|f| {
            let c = b
                .column_by_name(f.name())
                .ok_or_else(|| Error::Other(format!("query result lacks column {}", f.name())))?;
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                Ok(cast(c, f.data_type())?)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(target.clone(), cols)?)
}
