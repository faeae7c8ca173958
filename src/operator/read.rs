//! How operators read rows: DataFusion plans over the tables a [`super::port::ReadPort`]
//! registered (Delta tables in the warehouse, or in-memory ones in tests). Filters name
//! the event-date partitions and event-time ranges, so reads prune to the files that can
//! hold matching rows; keyed reads are semi joins whose keys reach the scan as a list.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::compute::{cast, concat_batches};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::JoinType;
use datafusion::common::ScalarValue;
use datafusion::prelude::{col, lit, DataFrame, Expr, SessionContext};

use crate::error::{Error, Result};
use crate::job::aggregate as agg;
use crate::job::plan::{Cutoff, Input, JobState};
use crate::schema::EVENT_DATE;
use crate::time::Micros;

/// Name of a source's bronze table in a batch's session (and a backfill's).
pub fn session_table(source: &str) -> String {
    format!("bronze_{source}")
}

pub use crate::columns::{conform, keys_batch};
pub use crate::sink::delta::ts_lit;

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

/// Which bronze rows a job has applied: those ingested up to batch `upto`, except rows
/// that were too late when their batch was consumed (event_ts below the cut-off recorded
/// for their batch range).
#[derive(Debug, Clone, Copy)]
pub struct Applied<'a> {
    pub upto: i64,
    pub cutoffs: &'a [Cutoff],
}

impl Applied<'_> {
    /// Whether the row of ingestion batch `batch` at `event_ts` was applied.
    fn keeps(&self, batch: i64, event_ts: Micros) -> bool {
        if batch > self.upto {
            return false;
        }
        // Cut-offs cover ascending, disjoint batch ranges.
        let i = self.cutoffs.partition_point(|c| c.upto_batch < batch);
        match self.cutoffs.get(i) {
            Some(c) if c.after_batch < batch => event_ts >= c.cutoff,
            _ => true,
        }
    }

    /// `b` without the rows this job did not apply (`b` has `_batch_id` and `event_ts`).
    pub fn retain(&self, b: &RecordBatch) -> Result<RecordBatch> {
        use arrow::array::{AsArray, BooleanArray};
        use arrow::datatypes::{Int64Type, TimestampMicrosecondType};
        if self.cutoffs.is_empty() || b.num_rows() == 0 {
            return Ok(b.clone());
        }
        let col = |name: &str| {
            b.column_by_name(name)
                .ok_or_else(|| Error::from(crate::columns::ColumnError::Missing(name.to_string())))
        };
        let batch = cast(col(BATCH_ID)?, &DataType::Int64)?;
        let batch = batch.as_primitive::<Int64Type>();
        let ts = col("event_ts")?.as_primitive::<TimestampMicrosecondType>();
        let keep: BooleanArray = (0..b.num_rows())
            .map(|i| Some(self.keeps(batch.value(i), ts.value(i))))
            .collect();
        if keep.true_count() == b.num_rows() {
            return Ok(b.clone());
        }
        Ok(arrow::compute::filter_record_batch(b, &keep)?)
    }
}

/// Bronze column of the ingestion batch that wrote a row.
pub use crate::schema::BATCH_ID;

/// Ranges wider than this are read without an event-date list (about 3 years).
const MAX_LISTED_SPAN: Micros = 1100 * agg::DAY;

/// The filter of every ranged bronze read of a job batch: `[lo, hi)` event-time ranges,
/// restricted to their event dates, of ingestion batches up to `upto`.
pub fn in_ranges_upto(ranges: &[(Micros, Micros)], upto: i64) -> Expr {
    let lo = ranges.first().map_or(Micros::MIN, |r| r.0);
    let hi = ranges.last().map_or(Micros::MIN, |r| r.1);
    let in_time = in_ranges("event_ts", ranges).and(col(BATCH_ID).lt_eq(lit(upto)));
    // An open-ended range (everything before the first watermark) names no dates.
    if hi.saturating_sub(lo) > MAX_LISTED_SPAN {
        return in_time;
    }
    dates_in(EVENT_DATE, &agg::dates_of(ranges)).and(in_time)
}

/// The rows of table `name` in `ctx` (None: no table yet, no rows) that the job applied
/// in event-time `ranges`, with the columns of `target`; restricted to rows whose `key`
/// column is in a [`keys_batch`] when `keys` is given. Cut-offs are applied to the rows
/// read, not spelled out in the filter: a job keeps one per batch within the lookback
/// (hundreds), and a filter of that size costs every row and every file.
pub async fn read_applied(
    ctx: Option<&SessionContext>,
    name: &str,
    ranges: &[(Micros, Micros)],
    applied: Applied<'_>,
    keys: Option<(&str, &RecordBatch)>,
    target: &SchemaRef,
) -> Result<RecordBatch> {
    let parts = read_applied_parts(ctx, name, ranges, applied, keys, target).await?;
    Ok(concat_batches(target, &parts)?)
}

/// [`read_applied`] as the batches the read produced, each conformed to `target`, not
/// concatenated: for a caller that copies the rows once more anyway (a recompute takes
/// the rows of its windows out of them).
pub async fn read_applied_parts(
    ctx: Option<&SessionContext>,
    name: &str,
    ranges: &[(Micros, Micros)],
    applied: Applied<'_>,
    keys: Option<(&str, &RecordBatch)>,
    target: &SchemaRef,
) -> Result<Vec<RecordBatch>> {
    let Some(ctx) = ctx else {
        return Ok(Vec::new());
    };
    let filter = in_ranges_upto(ranges, applied.upto);
    // Read the columns the cut-offs need too, then drop them again.
    let mut fields: Vec<Field> = target.fields().iter().map(|f| f.as_ref().clone()).collect();
    for (name, ty) in [
        (BATCH_ID, DataType::Int64),
        ("event_ts", crate::schema::ts_type()),
    ] {
        if target.field_with_name(name).is_err() && !applied.cutoffs.is_empty() {
            fields.push(Field::new(name, ty, true));
        }
    }
    let wide = Arc::new(Schema::new(fields));
    let parts = match keys {
        Some((key, keys)) => {
            let (what, df) = keyed_read(ctx, name, filter, key, keys).await?;
            collect_parts(df, &what, &wide).await?
        }
        None => {
            let (what, df) = filtered(ctx, name, filter).await?;
            collect_parts(df, &what, &wide).await?
        }
    };
    let narrow = wide.fields().len() != target.fields().len();
    parts
        .iter()
        .map(|p| {
            let rows = applied.retain(p)?;
            match narrow {
                true => conform(&rows, target),
                false => Ok(rows),
            }
        })
        .filter(|r| r.as_ref().map_or(true, |b| b.num_rows() > 0))
        .collect()
}

/// Run `filter` over table `name` of `ctx` and return one batch conformed to `target`
/// (columns by name, cast to the target types: the provider may hand back view types).
pub async fn read(
    ctx: &SessionContext,
    name: &str,
    filter: Expr,
    target: &SchemaRef,
) -> Result<RecordBatch> {
    let (what, df) = filtered(ctx, name, filter).await?;
    collect(df, &what, target).await
}

/// Table `name` of `ctx` filtered by `filter`, and how a read of it is named in errors.
async fn filtered(ctx: &SessionContext, name: &str, filter: Expr) -> Result<(String, DataFrame)> {
    let what = format!("read {name} where {filter}");
    let df = ctx
        .table(name)
        .await
        .map_err(|e| Error::query(&what, e))?
        .filter(filter)
        .map_err(|e| Error::query(&what, e))?;
    Ok((what, df))
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
    let (what, df) = keyed_read(ctx, name, filter, key, keys).await?;
    collect(df, &what, target).await
}

/// [`keyed`], and how a read of it is named in errors.
async fn keyed_read(
    ctx: &SessionContext,
    name: &str,
    filter: Expr,
    key: &str,
    keys: &RecordBatch,
) -> Result<(String, DataFrame)> {
    let what = format!(
        "read {name} where {filter} and {key} in {} keys",
        keys.num_rows()
    );
    let df = keyed(ctx, name, filter, key, keys)
        .await
        .map_err(|e| Error::query(&what, e))?;
    Ok((what, df))
}

/// The plan of [`read_keys`]. DataFusion hands the join's keys to the scan as a list
/// (see [`crate::sink::delta::session`] for how many), which skips row groups by bloom
/// filter (bronze's [`crate::sink::delta::LOOKUP_KEYS`] carry one) and by statistics;
/// the join itself keeps the read exact whatever the list's fate.
async fn keyed(
    ctx: &SessionContext,
    name: &str,
    filter: Expr,
    key: &str,
    keys: &RecordBatch,
) -> datafusion::error::Result<DataFrame> {
    let keys_df = ctx.read_batch(keys.clone())?;
    ctx.table(name).await?.filter(filter)?.join(
        keys_df,
        JoinType::LeftSemi,
        &[key],
        &["_key"],
        None,
    )
}

async fn collect(df: DataFrame, what: &str, target: &SchemaRef) -> Result<RecordBatch> {
    let parts = collect_parts(df, what, target).await?;
    Ok(concat_batches(target, &parts)?)
}

/// `df`'s batches, each conformed to `target` (in the order the plan produced them).
async fn collect_parts(df: DataFrame, what: &str, target: &SchemaRef) -> Result<Vec<RecordBatch>> {
    let t = std::time::Instant::now();
    let r = collect_inner(df, what, target).await;
    crate::sink::timings::record(
        format!("read {}", what.split(' ').nth(1).unwrap_or("")),
        t.elapsed(),
    );
    r
}

async fn collect_inner(df: DataFrame, what: &str, target: &SchemaRef) -> Result<Vec<RecordBatch>> {
    let names: Vec<&str> = target.fields().iter().map(|f| f.name().as_str()).collect();
    let df = df
        .select_columns(&names)
        .map_err(|e| Error::query(what, e))?;
    let batches = if tracing::enabled!(target: "kestrel::read::plan", tracing::Level::TRACE) {
        collect_traced(df, what).await?
    } else {
        df.collect().await.map_err(|e| Error::query(what, e))?
    };
    batches
        .iter()
        .filter(|b| b.num_rows() > 0)
        .map(|b| conform(b, target))
        .collect()
}

/// `df` collected, then its plan with each operator's metrics (files, row groups pruned
/// by statistics and bloom filter, pages, bytes scanned, rows) logged at trace level
/// (`RUST_LOG=kestrel::read::plan=trace`): where a read's time went.
async fn collect_traced(df: DataFrame, what: &str) -> Result<Vec<RecordBatch>> {
    let task = Arc::new(df.task_ctx());
    let plan = df
        .create_physical_plan()
        .await
        .map_err(|e| Error::query(what, e))?;
    let batches = datafusion::physical_plan::collect(plan.clone(), task)
        .await
        .map_err(|e| Error::query(what, e))?;
    let shown =
        datafusion::physical_plan::display::DisplayableExecutionPlan::with_metrics(plan.as_ref())
            .indent(true)
            .to_string();
    tracing::trace!(target: "kestrel::read::plan", read = what, "plan with metrics:\n{shown}");
    Ok(batches)
}

/// Consumed bronze rows (ingestion batches up to `position`, too-late ones included) of
/// event times `[from, to)`, restricted to their event dates.
pub(crate) fn consumed_in(
    (from, to): (Micros, Micros),
    position: i64,
) -> datafusion::prelude::Expr {
    dates_in(crate::schema::EVENT_DATE, &agg::dates_of(&[(from, to)]))
        .and(in_ranges("event_ts", &[(from, to)]))
        .and(col("_batch_id").lt_eq(lit(position)))
}

/// One source's new rows in a job batch.
pub struct NewRows {
    /// Every new row, with the columns asked for.
    pub(crate) new: RecordBatch,
    /// The rows applied to the job (not too late).
    pub(crate) applied: RecordBatch,
    /// The too-late rows with every bronze column (for the late ledger).
    pub(crate) too_late: RecordBatch,
    /// Arrival time of the oldest file among the new rows.
    pub(crate) oldest_landed: Option<Micros>,
}

/// Where a job batch's new rows of a source may be before it reads them from bronze
/// ([`super::Context::given_rows`]).
pub struct Given<'a> {
    /// The bronze rows this process's ingestion committed, per source's latest batch.
    pub fresh: Option<&'a super::fresh::FreshRows>,
    /// The job's read-ahead of its batches' new rows.
    pub prefetch: Option<&'a super::prefetch::Prefetch>,
}

/// Read `source`'s new rows of `input` (columns of `target`) from table `table` of `ctx`,
/// split them against `cutoff` (W at batch start − lookback), read the too-late ones
/// whole, and record the batch in `state`: watermark observed (not advanced), position
/// moved, cut-off kept while later reads can reach `reach` below it. A source with no
/// new ingestion batch, or no bronze table (`ctx` None), has no rows. `given`: the
/// input's bronze rows as this process's ingestion committed them
/// ([`super::Context::given_rows`]), taken instead of reading them, or the read started
/// ahead ([`super::prefetch`]); once this batch has its rows, the next batch's read is
/// started ahead.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn take_new_rows(
    given: Given<'_>,
    ctx: Option<&SessionContext>,
    table: &str,
    source: &str,
    input: &Input,
    target: &SchemaRef,
    bronze: &SchemaRef,
    cutoff: Option<Micros>,
    reach: Micros,
    state: &mut JobState,
) -> Result<NewRows> {
    let empty = || NewRows {
        new: RecordBatch::new_empty(target.clone()),
        applied: RecordBatch::new_empty(target.clone()),
        too_late: RecordBatch::new_empty(bronze.clone()),
        oldest_landed: None,
    };
    if input.upto_batch <= input.after_batch {
        return Ok(empty());
    }
    let Given { fresh, prefetch } = given;
    let held = fresh.and_then(|f| f.take(source, input, target));
    let between = batches_between(input.after_batch, input.upto_batch);
    let rows = match (held, ctx) {
        (Some(held), _) => {
            let t = std::time::Instant::now();
            let mut rows = held_rows(&held, target, bronze, cutoff)?;
            // Rows held with the jobs' columns only: the too-late ones, with every bronze
            // column, are read as the bronze path reads them.
            if let (None, Some(c)) = (&rows.too_late, cutoff) {
                let filter = between.and(col("event_ts").lt(ts_lit(c)));
                let Some(ctx) = ctx else {
                    return Err(Error::Plan {
                        path: table.to_string(),
                        reason: format!("{source}'s too-late rows held without bronze"),
                    });
                };
                let late = read(ctx, table, filter, bronze).await?;
                tracing::debug!(
                    source,
                    batch = input.upto_batch,
                    rows = late.num_rows(),
                    "too-late rows of held rows read from bronze"
                );
                rows.too_late = Some(late);
            }
            let rows = rows.done(bronze);
            crate::sink::timings::record("read new rows in memory".into(), t.elapsed());
            tracing::debug!(
                source,
                batch = input.upto_batch,
                rows = rows.new.num_rows(),
                "new rows taken in memory from this process's ingestion"
            );
            rows
        }
        (None, None) => empty(),
        (None, Some(ctx)) => {
            let ahead = match prefetch {
                Some(p) => p.take(source, table, input, target).await,
                None => None,
            };
            let new = match ahead {
                Some(rows) => {
                    tracing::debug!(source, batch = input.upto_batch, "new rows read ahead");
                    rows?
                }
                None => read(ctx, table, between.clone(), target).await?,
            };
            let (applied, too_late) = agg::split_late(&new, cutoff)?;
            let too_late = match cutoff {
                Some(c) if too_late.num_rows() > 0 => {
                    let filter = between.and(col("event_ts").lt(ts_lit(c)));
                    read(ctx, table, filter, bronze).await?
                }
                _ => RecordBatch::new_empty(bronze.clone()),
            };
            NewRows {
                oldest_landed: oldest_landed(&new),
                new,
                applied,
                too_late,
            }
        }
    };
    if let (Some(p), Some(ctx)) = (prefetch, ctx) {
        let (ctx, table_name, to) = (ctx.clone(), table.to_string(), target.clone());
        p.plan_next(
            source,
            table,
            input,
            target,
            |next| fresh.is_some_and(|f| f.holds(source, next)),
            move |next| super::prefetch::read_new(ctx, table_name, next, to),
        );
    }
    agg::observe(&mut state.watermark, source, &rows.new)?;
    state.positions.insert(source.to_string(), input.upto_batch);
    if let Some(c) = cutoff {
        state.push_cutoff(source, input, c, c - reach);
    }
    Ok(rows)
}

/// Arrival time of the oldest file among `new` rows (when they carry `_landed_at`).
fn oldest_landed(new: &RecordBatch) -> Option<Micros> {
    new.column_by_name("_landed_at")
        .and_then(|c| {
            c.as_any()
                .downcast_ref::<arrow::array::TimestampMicrosecondArray>()
        })
        .and_then(arrow::compute::min)
}

/// [`NewRows`] of bronze rows held in memory, where the too-late rows may be left to read.
struct HeldRows {
    new: RecordBatch,
    applied: RecordBatch,
    /// None: some are too late, and the held rows lack bronze columns they need.
    too_late: Option<RecordBatch>,
}

impl HeldRows {
    fn done(self, bronze: &SchemaRef) -> NewRows {
        NewRows {
            oldest_landed: oldest_landed(&self.new),
            too_late: self
                .too_late
                .unwrap_or_else(|| RecordBatch::new_empty(bronze.clone())),
            new: self.new,
            applied: self.applied,
        }
    }
}

/// The rows of bronze held in memory (`held`: at least the `target` columns): what the
/// reads of [`take_new_rows`] return for them — the `target` columns of every row, and
/// the rows before `cutoff` with every `bronze` column when `held` has them all.
fn held_rows(
    held: &[RecordBatch],
    target: &SchemaRef,
    bronze: &SchemaRef,
    cutoff: Option<Micros>,
) -> Result<HeldRows> {
    let projected = held
        .iter()
        .map(|b| conform(b, target))
        .collect::<Result<Vec<_>>>()?;
    let new = concat_batches(target, &projected)?;
    let (applied, too_late) = agg::split_late(&new, cutoff)?;
    let whole = held.iter().all(|b| crate::columns::has_columns(b, bronze));
    // The too-late rows with every bronze column: the same split, over the whole rows.
    let too_late = if too_late.num_rows() == 0 {
        Some(RecordBatch::new_empty(bronze.clone()))
    } else if whole {
        let whole = held
            .iter()
            .map(|b| conform(b, bronze))
            .collect::<Result<Vec<_>>>()?;
        Some(agg::split_late(&concat_batches(bronze, &whole)?, cutoff)?.1)
    } else {
        None
    };
    Ok(HeldRows {
        new,
        applied,
        too_late,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray, TimestampMicrosecondArray};

    /// New rows held with a job's columns only give what a bronze read gives: the
    /// applied rows from memory, and the too-late ones — which the late ledger keeps
    /// with every bronze column — read from bronze.
    #[tokio::test]
    async fn held_rows_without_every_column_read_their_too_late_rows_from_bronze() {
        use crate::schema::ts_type;
        let bronze = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, false),
            Field::new("event_ts", ts_type(), false),
            Field::new("sku", DataType::Utf8, true),
            Field::new("_source_partition", DataType::Utf8, true),
            Field::new("_landed_at", ts_type(), true),
            Field::new("_batch_id", DataType::Int64, false),
            Field::new("event_date", DataType::Date32, false),
        ]));
        let ts = [1_000_000i64, 9_000_000, 2_000_000, 8_000_000];
        let rows = RecordBatch::try_new(
            bronze.clone(),
            vec![
                Arc::new(StringArray::from(vec!["a", "b", "c", "d"])),
                Arc::new(TimestampMicrosecondArray::from(ts.to_vec()).with_timezone("UTC")),
                Arc::new(StringArray::from(vec!["s1", "s2", "s1", "s2"])),
                Arc::new(StringArray::from(vec!["p"; 4])),
                Arc::new(
                    TimestampMicrosecondArray::from(vec![10_000_000i64; 4]).with_timezone("UTC"),
                ),
                Arc::new(Int64Array::from(vec![1i64; 4])),
                Arc::new(arrow::array::Date32Array::from(vec![0; 4])),
            ],
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::Warehouse::new(
            crate::storage::Location::open(dir.path().to_str().unwrap(), &Default::default(), true)
                .unwrap(),
        );
        let t = wh
            .open_or_create("bronze/orders", &bronze, &["event_date"])
            .await
            .unwrap();
        let t = crate::sink::delta::append(t, vec![rows.clone()], &["event_date"], "i", 1)
            .await
            .unwrap();
        let ctx = crate::sink::delta::session_with(&t, "bronze")
            .await
            .unwrap();
        let target = Arc::new(Schema::new(vec![
            Field::new("event_ts", ts_type(), false),
            Field::new("sku", DataType::Utf8, true),
            Field::new("_source_partition", DataType::Utf8, true),
            Field::new("_landed_at", ts_type(), true),
            Field::new("_batch_id", DataType::Int64, false),
        ]));
        let input = Input {
            after_batch: 0,
            upto_batch: 1,
            bronze_version: None,
        };
        let take = |fresh: Option<&'static super::super::fresh::FreshRows>| {
            let (ctx, target, bronze, input) = (&ctx, &target, &bronze, &input);
            async move {
                let mut state = JobState::initial(&["orders".to_string()], 0, 0);
                let given = Given {
                    fresh,
                    prefetch: None,
                };
                let r = take_new_rows(
                    given,
                    Some(ctx),
                    "bronze",
                    "orders",
                    input,
                    target,
                    bronze,
                    Some(5_000_000),
                    0,
                    &mut state,
                )
                .await
                .unwrap();
                let sorted = |b: &RecordBatch, by: &str| {
                    let c = b.column(b.schema().index_of(by).unwrap()).clone();
                    let i = arrow::compute::sort_to_indices(&c, None, None).unwrap();
                    arrow::compute::take_record_batch(b, &i).unwrap()
                };
                (
                    sorted(&r.applied, "event_ts"),
                    sorted(&r.too_late, "event_id"),
                )
            }
        };
        let from_bronze = take(None).await;
        // Held with the target's columns only (as a writer keeps them).
        let fresh: &'static super::super::fresh::FreshRows =
            Box::leak(Box::new(super::super::fresh::FreshRows::default()));
        let ix: Vec<usize> = target
            .fields()
            .iter()
            .map(|f| bronze.index_of(f.name()).unwrap())
            .collect();
        fresh.hand_over("orders", 1, vec![rows.project(&ix).unwrap()]);
        let held = take(Some(fresh)).await;
        assert_eq!(fresh.taken(), 1, "the held rows were taken");
        assert_eq!(held, from_bronze);
        assert_eq!(held.0.num_rows(), 2);
        assert_eq!(held.1.num_rows(), 2);
        assert_eq!(
            held.1.schema(),
            bronze,
            "too-late rows keep every bronze column"
        );
        let ids = held
            .1
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        assert_eq!((ids.value(0), ids.value(1)), ("a", "c"));
    }

    #[test]
    fn applied_rows_drop_what_was_too_late_for_its_batch() {
        let cutoffs = [
            Cutoff {
                after_batch: 0,
                upto_batch: 2,
                cutoff: 100,
            },
            Cutoff {
                after_batch: 4,
                upto_batch: 5,
                cutoff: 300,
            },
        ];
        let a = Applied {
            upto: 6,
            cutoffs: &cutoffs,
        };
        // (batch, event_ts, applied?)
        let rows = [
            (1, 99, false),
            (2, 100, true),
            (3, 50, true), // batch 3 had no cut-off
            (5, 299, false),
            (5, 300, true),
            (6, 1, true),
            (7, 500, false), // not consumed yet
        ];
        for (b, ts, want) in rows {
            assert_eq!(a.keeps(b, ts), want, "batch {b} at {ts}");
        }
        let schema = Arc::new(Schema::new(vec![
            Field::new(BATCH_ID, DataType::Int64, false),
            Field::new("event_ts", crate::schema::ts_type(), false),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(rows.iter().map(|r| r.1))
                        .with_timezone("UTC"),
                ),
            ],
        )
        .unwrap();
        let kept = a.retain(&batch).unwrap();
        assert_eq!(kept.num_rows(), rows.iter().filter(|r| r.2).count());
    }

    /// Bronze files with order_id bloom filters: a keyed read of one file's orders skips
    /// the other files' row groups by their filters (random ids, so statistics cannot)
    /// and returns exactly the matching rows.
    #[tokio::test]
    async fn keyed_reads_skip_row_groups_by_bloom_filter() {
        use crate::sink::delta;
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("order_id", DataType::Utf8, true),
            Field::new("n", DataType::Int64, true),
        ]));
        let mut table = wh
            .open_or_create("bronze/orders", &schema, &[])
            .await
            .unwrap();
        // UUID-sized ids, 5,000 a file: more keys than DataFusion's defaults hand from
        // a join to its scan as a list (150 values, 128 KiB).
        let ids = |file: i64| -> Vec<String> {
            (0..5_000)
                .map(|i| {
                    let h = ((file * 7_919 + i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    format!("{h:016x}-{:019x}", h.rotate_left(17))
                })
                .collect()
        };
        for file in 0..6 {
            let o = ids(file);
            let b = RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from_iter_values(
                        o.iter().map(|x| format!("e{x}")),
                    )),
                    Arc::new(StringArray::from(o.clone())),
                    Arc::new(Int64Array::from(vec![file; o.len()])),
                ],
            )
            .unwrap();
            let props = delta::bronze_writer_properties(["event_id", "order_id", "n"]);
            table = delta::append_with(table, vec![b], &[], "t", file + 1, Some(props))
                .await
                .unwrap();
        }
        let ctx = delta::session_with(&table, "orders").await.unwrap();
        let wanted: Vec<String> = ids(3);
        let keys = keys_batch(wanted.iter().map(String::as_str)).unwrap();
        let (rows, seen) = keyed_with_pruning(&ctx, lit(true), &keys).await;
        assert_eq!(
            rows.iter().map(|b| b.num_rows()).sum::<usize>(),
            wanted.len()
        );
        assert_eq!(seen, (5, 1), "row groups (pruned, matched) by bloom filter");
        let target = Arc::new(Schema::new(vec![
            Field::new("order_id", DataType::Utf8, true),
            Field::new("n", DataType::Int64, true),
        ]));
        let rows = read_keys(&ctx, "orders", lit(true), "order_id", &keys, &target)
            .await
            .unwrap();
        assert_eq!(rows.num_rows(), wanted.len());
        let n = rows
            .column(1)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert!(n.iter().all(|v| v == Some(3)));
    }

    /// A warehouse in local directory `dir`.
    /// The keyed read of `keys` by `order_id` from table `orders` of `ctx` under `filter`:
    /// its rows, and the row groups (pruned, matched) by the scan's bloom filters.
    async fn keyed_with_pruning(
        ctx: &SessionContext,
        filter: Expr,
        keys: &RecordBatch,
    ) -> (Vec<RecordBatch>, (usize, usize)) {
        let df = keyed(ctx, "orders", filter, "order_id", keys)
            .await
            .unwrap();
        let plan = df.create_physical_plan().await.unwrap();
        let rows = datafusion::physical_plan::collect(plan.clone(), ctx.task_ctx())
            .await
            .unwrap();
        let mut seen = (0, 0);
        bloom_pruning(plan.as_ref(), &mut seen);
        (rows, seen)
    }

    /// Row groups (pruned, matched) by the bloom filters of `plan`'s scans, as DataFusion
    /// counts them.
    fn bloom_pruning(
        plan: &dyn datafusion::physical_plan::ExecutionPlan,
        out: &mut (usize, usize),
    ) {
        use datafusion::physical_plan::metrics::MetricValue;
        for m in plan
            .metrics()
            .iter()
            .flat_map(|s| s.iter().cloned().collect::<Vec<_>>())
        {
            if let MetricValue::PruningMetrics {
                name,
                pruning_metrics,
            } = m.value()
            {
                if name == "row_groups_pruned_bloom_filter" {
                    out.0 += pruning_metrics.pruned();
                    out.1 += pruning_metrics.matched();
                }
            }
        }
        for c in plan.children() {
            bloom_pruning(c.as_ref(), out);
        }
    }

    /// A bronze file of orders compacted between batches is cut into row groups of
    /// [`delta::LOOKUP_ROW_GROUP_ROWS`] and keeps plain strings in its Arrow schema (not
    /// delta-rs's view types, which hid the keys from the bloom filters), so a payments
    /// job's keyed read — event dates, event-time ranges and ingestion batches as well
    /// as the keys — reads only the row group holding its few late orders, not the
    /// day's file whole.
    #[tokio::test]
    async fn keyed_reads_of_orders_read_small_row_groups() {
        use crate::sink::delta;
        use arrow::array::Date32Array;
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new(
                "event_ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
            Field::new("order_id", DataType::Utf8, true),
            Field::new(BATCH_ID, DataType::Int64, true),
            Field::new(EVENT_DATE, DataType::Date32, true),
        ]));
        let mut table = wh
            .open_or_create("bronze/orders", &schema, &[EVENT_DATE])
            .await
            .unwrap();
        let n = 3 * delta::LOOKUP_ROW_GROUP_ROWS;
        let day = 20_605; // 2026-06-01
        let midnight = day as i64 * 86_400_000_000;
        let order = |i: usize| {
            let h = (i as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
            format!("ord-{h:032x}")
        };
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter_values(
                    (0..n).map(|i| format!("e{i}")),
                )),
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        (0..n).map(|i| midnight + i as i64 * 1_000_000),
                    )
                    .with_timezone("UTC"),
                ),
                Arc::new(StringArray::from_iter_values((0..n).map(order))),
                Arc::new(Int64Array::from_iter_values(
                    (0..n).map(|i| 1 + i as i64 / 1_000),
                )),
                Arc::new(Date32Array::from(vec![day; n])),
            ],
        )
        .unwrap();
        let props = delta::bronze_writer_properties(["event_id", "event_ts", "order_id", BATCH_ID]);
        // Appended in six batches, then compacted as the open day is between batches.
        let piece = n / 6;
        for i in 0..6 {
            let rows = b.slice(i * piece, if i == 5 { n - 5 * piece } else { piece });
            table = delta::append_with(
                table,
                vec![rows],
                &[EVENT_DATE],
                "t",
                i as i64 + 1,
                Some(props.clone()),
            )
            .await
            .unwrap();
        }
        crate::sink::tables::keep(&table);
        let opts = crate::sink::compact::OpenCompaction {
            min_files: 2,
            ..Default::default()
        };
        let done = crate::sink::compact::open_partitions(
            &wh,
            "bronze/orders",
            &opts,
            &[],
            Some(props),
            false,
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!((done.files_removed, done.files_added), (6, 1));
        let table = wh.open("bronze/orders").await.unwrap().unwrap();
        let ctx = delta::session_with(&table, "orders").await.unwrap();
        // Three late orders a few hundred rows apart (one row group, whichever order the
        // compaction wrote the appends in), read as a payments job does: a week around
        // them, every batch so far.
        let at = delta::LOOKUP_ROW_GROUP_ROWS + 17;
        let wanted: Vec<String> = [at, at + 150, at + 300].map(order).to_vec();
        let keys = keys_batch(wanted.iter().map(String::as_str)).unwrap();
        let week = 7 * 86_400_000_000;
        let t = midnight + at as i64 * 1_000_000;
        let filter = in_ranges_upto(&[(t - week, t + week)], 1_000);
        let (rows, seen) = keyed_with_pruning(&ctx, filter, &keys).await;
        let mut got: Vec<String> = rows
            .iter()
            .flat_map(|b| {
                let ids = crate::columns::string(b, "order_id").unwrap();
                ids.iter().flatten().map(str::to_string).collect::<Vec<_>>()
            })
            .collect();
        got.sort();
        let mut want = wanted.clone();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(seen, (2, 1), "row groups (pruned, matched) by bloom filter");
    }
}
