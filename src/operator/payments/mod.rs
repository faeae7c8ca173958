//! One batch of a payments job (`payments_fast`, `payment_reconciliation`): the reads
//! around the pure operator in [`crate::operator::payments::matching`]. The exactly-once protocol
//! (plan, durable result, late ledger, gold MERGE, run log) is the windowed jobs' one in
//! [`super::batch`]; only the compute step differs.
//!
//! Reads are bounded by event time, never by history: new rows by ingestion batch, the
//! deadline candidates by the event-time range the watermark crossed, and the touched
//! orders' lines and payments by `horizon` around the touching events, each restricted
//! to its event-date partitions and to applied rows (recorded cut-offs exclude rows that
//! were too late when consumed).

pub mod matching;

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{AsArray, BooleanArray, RecordBatch};
use arrow::compute::filter_record_batch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::prelude::{col, lit, SessionContext};

use crate::error::{Error, Result};
use crate::job::aggregate::{self as agg, DAY};
use crate::job::plan::{JobPlan, JobState};
use crate::job::spec::{check_columns, Fields};
use crate::job::spec::{JobSpec, PaymentMode, PaymentParams};
use crate::operator::metrics::{InputCounts, Metrics};
use crate::operator::payments::matching::{self as pay, Stamp, Touches};
use crate::operator::read::{self, consumed_in, take_new_rows};
use crate::operator::{Computed, Context, DayInput, Operator, Restated};
use crate::schema::SourceSchema;
use crate::sink::late;
use crate::time::{date, micros, Micros};
use std::collections::BTreeMap;
use std::time::Duration;

fn columns(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Order/payment matching: `payments_fast` (first capture within `fast_within`) or
/// `payment_reconciliation` (lines against captures and refunds within the business
/// window), per `order_id`, re-evaluated when a late line or payment touches an order.
#[derive(Debug, Clone, PartialEq)]
pub struct Payments {
    pub mode: PaymentMode,
    pub params: PaymentParams,
}

/// What one batch of a payments job did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PaymentMetrics {
    pub input: InputCounts,
    /// Orders re-evaluated: touched by a new line or payment, or (reconciliation) whose
    /// deadline the watermark crossed.
    pub orders_touched: i64,
    /// Order rows upserted.
    pub upserts: i64,
    /// Order rows deleted (an orphan payment's row once its order arrived).
    pub tombstones: i64,
    /// Changes to rows that were already final.
    pub corrections: i64,
}

impl Metrics for PaymentMetrics {
    fn input(&self) -> InputCounts {
        self.input
    }
    fn outputs(&self) -> (i64, i64, i64) {
        (self.upserts, self.tombstones, self.corrections)
    }
}

/// Columns (and types) the payments operators need from their two sources.
const ORDER_COLUMNS: [(&str, crate::schema::FieldType); 3] = [
    ("order_id", crate::schema::FieldType::String),
    ("event_ts", crate::schema::FieldType::Timestamp),
    ("amount_cents", crate::schema::FieldType::Int64),
];
const PAYMENT_COLUMNS: [(&str, crate::schema::FieldType); 4] = [
    ("order_id", crate::schema::FieldType::String),
    ("event_ts", crate::schema::FieldType::Timestamp),
    ("amount_cents", crate::schema::FieldType::Int64),
    ("status", crate::schema::FieldType::String),
];

/// `payments_fast`'s parser: two sources (order lines, then payments) with the columns
/// it reads, and its `[params]`.
pub(crate) fn parse_fast(
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    parse(top, PaymentMode::Fast, sources, schemas)
}

/// `payment_reconciliation`'s parser (see [`parse`]).
pub(crate) fn parse_reconciliation(
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    parse(top, PaymentMode::Reconcile, sources, schemas)
}

fn parse(
    top: &Fields<'_>,
    mode: PaymentMode,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    if sources.len() != 2 {
        return Err(top.err(
            "sources",
            "two sources: order lines, then payments (e.g. [\"orders\", \"payments\"])",
        ));
    }
    check_columns(top, &sources[0], &ORDER_COLUMNS, schemas)?;
    check_columns(top, &sources[1], &PAYMENT_COLUMNS, schemas)?;
    let mut params = PaymentParams::default();
    if let Some(p) = top.sub("params")? {
        let known: &[&str] = match mode {
            PaymentMode::Fast => &["business_window", "horizon", "fast_within"],
            PaymentMode::Reconcile => &["business_window", "horizon"],
        };
        p.only(known)?;
        let positive = |key: &str, default: Duration| -> Result<Duration> {
            let d = p.duration(key, default)?;
            if d.is_zero() {
                return Err(p.err(key, "a positive duration"));
            }
            Ok(d)
        };
        params.business_window = positive("business_window", params.business_window)?;
        params.horizon = positive("horizon", params.horizon)?;
        params.fast_within = positive("fast_within", params.fast_within)?;
        if params.horizon < params.business_window {
            return Err(p.err("horizon", "a duration at least as long as business_window"));
        }
    }
    Ok(Arc::new(Payments { mode, params }))
}

#[async_trait::async_trait]
impl Operator for Payments {
    fn merge_keys(&self, given: Option<Vec<String>>) -> std::result::Result<Vec<String>, String> {
        crate::operator::natural_keys(given, &[pay::ORDER_ID], "the payments operators' key")
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    async fn process(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        plan: &JobPlan,
        before: JobState,
    ) -> Result<Computed> {
        let (mode, params, mut state) = (self.mode, &self.params, before);
        let ctx = cx.sources_session(spec).await?;
        let lookback = micros(spec.time.lookback);
        let window = micros(params.business_window);
        let horizon = micros(params.horizon);
        let w_before = state.watermark.current;
        let cutoff = w_before.map(|w| w - lookback);
        let now = cx.now_us();
        let touch_cols = columns(&["order_id", "event_ts", "_source_partition", "_landed_at"]);

        // 1. New rows per source: too-late ones aside, applied ones touch their orders.
        let mut touches = Touches::default();
        let mut late_parts: Vec<(&str, RecordBatch)> = Vec::new();
        let (mut rows_in, mut applied_n, mut late_n) = (0i64, 0i64, 0i64);
        let mut oldest_landed: Option<crate::time::Micros> = None;
        for s in &spec.sources {
            let bronze = cx.source_schema(s)?.bronze.clone();
            let target = agg::project(&bronze, &touch_cols)?;
            // Reads reach back at most business window + horizon before a cut-off.
            let rows = take_new_rows(
                cx.given_rows(),
                Some(&ctx),
                &read::session_table(s),
                s,
                plan.input(s)?,
                &target,
                &bronze,
                cutoff,
                window + horizon,
                &mut state,
            )
            .await?;
            touches.add(&rows.applied)?;
            oldest_landed = oldest_landed.into_iter().chain(rows.oldest_landed).min();
            rows_in += rows.new.num_rows() as i64;
            applied_n += rows.applied.num_rows() as i64;
            late_n += rows.too_late.num_rows() as i64;
            if rows.too_late.num_rows() > 0 {
                late_parts.push((s.as_str(), rows.too_late));
            }
        }
        // 2. Advance the watermark (min over both sources).
        let w_after = state.watermark.advance();

        // 3. Orders and orphan candidates whose deadline W crossed in this batch.
        if mode == PaymentMode::Reconcile {
            if let Some(range) = pay::deadline_range(w_before, w_after, window) {
                for s in &spec.sources {
                    let bronze = &cx.source_schema(s)?.bronze;
                    let target = agg::project(bronze, &columns(&["order_id", "event_ts"]))?;
                    let applied = read::Applied {
                        upto: upto(&state, s),
                        cutoffs: cutoffs(&state, s),
                    };
                    let rows = read::read_applied(
                        Some(&ctx),
                        &read::session_table(s),
                        &[range],
                        applied,
                        None,
                        &target,
                    )
                    .await?;
                    touches.add(&rows)?;
                }
            }
        }
        let re_evaluated = touches.len();

        // 4. The touched orders' lines and payments within the horizon, joined.
        let (facts, days, hours) =
            order_facts(cx, &ctx, spec, params, &state, &touches, horizon).await?;
        let stamp = Stamp {
            w_before,
            w_after,
            batch_id: plan.batch_id,
            now_us: now,
        };
        let (out, schema) = match mode {
            PaymentMode::Fast => {
                let existing = existing_keys(cx, spec, &touches, &days, &hours).await?;
                (
                    pay::fast_rows(&facts, params, stamp, &existing)?,
                    pay::fast_schema(),
                )
            }
            PaymentMode::Reconcile => (
                pay::reconciliation_rows(&facts, params, stamp)?,
                pay::reconciliation_schema(),
            ),
        };

        let late = match (cutoff, w_before) {
            (Some(c), Some(w)) if !late_parts.is_empty() => {
                let bronzes = spec
                    .sources
                    .iter()
                    .map(|s| cx.source_schema(s).map(|x| x.bronze.clone()))
                    .collect::<Result<Vec<SchemaRef>>>()?;
                let refs: Vec<&arrow::datatypes::Schema> =
                    bronzes.iter().map(|b| b.as_ref()).collect();
                let union = late::union_schema(&refs);
                let parts = late_parts
                    .iter()
                    .map(|(s, b)| late::to_union(b, s, &union))
                    .collect::<Result<Vec<_>>>()?;
                let rows = arrow::compute::concat_batches(&union, &parts)?;
                let why = late::reason(w, spec.time.lookback);
                Some(late::rows(&rows, plan.batch_id, w, c, &why, now)?)
            }
            _ => None,
        };
        let metrics = PaymentMetrics {
            input: InputCounts {
                rows_in,
                applied: applied_n,
                too_late: late_n,
                watermark_before: w_before,
                watermark_after: w_after,
                oldest_landed,
            },
            orders_touched: re_evaluated as i64,
            upserts: out.upserts as i64,
            tombstones: out.tombstones as i64,
            corrections: out.corrections as i64,
        };
        Computed::new(
            plan,
            state,
            &metrics,
            late,
            vec![cx.gold_output(
                spec,
                schema,
                vec![out.rows],
                &[pay::ORDER_DATE, pay::ORDER_HOUR],
                vec![
                    days.into_iter()
                        .map(|d| ScalarValue::Date32(Some(d)))
                        .collect(),
                    hours
                        .into_iter()
                        .map(|h| ScalarValue::Int32(Some(h)))
                        .collect(),
                ],
            )],
        )
    }

    /// A payments job's rows anchored on `day` (orders by order_ts, orphan payments by
    /// their first payment): every order_id with a line or payment that day, evaluated
    /// from all its consumed lines and payments within `horizon` of the day.
    async fn restate(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        day: i32,
        input: &DayInput,
    ) -> Result<Restated> {
        let (mode, params) = (self.mode, &self.params);
        let (ctx, late_ctx) = (&input.ctx, input.late.as_ref());
        let (lo, hi) = (day as Micros * DAY, (day as Micros + 1) * DAY);
        let horizon = micros(params.horizon);
        let mut touches = Touches::default();
        let touch_cols: Vec<String> = vec![pay::ORDER_ID.into(), "event_ts".into()];
        for s in &spec.sources {
            let target = agg::project(&cx.source_schema(s)?.bronze, &touch_cols)?;
            let rows = read::read(
                ctx,
                &read::session_table(s),
                consumed_in((lo, hi), input.position(s)),
                &target,
            )
            .await?;
            touches.add(&rows)?;
        }
        let keys = touches.keys_batch()?;
        let read_side = |source: String, cols: &'static [&'static str]| {
            let keys = &keys;
            async move {
                let cols: Vec<String> = cols.iter().map(|c| c.to_string()).collect();
                let target = agg::project(&cx.source_schema(&source)?.bronze, &cols)?;
                if keys.num_rows() == 0 {
                    return Ok::<_, Error>(RecordBatch::new_empty(target));
                }
                let filter = consumed_in((lo - horizon, hi + horizon), input.position(&source));
                let table = read::session_table(&source);
                read::read_keys(ctx, &table, filter, pay::ORDER_ID, keys, &target).await
            }
        };
        let o = read_side(spec.sources[0].clone(), &pay::ORDER_INPUT).await?;
        let p = read_side(spec.sources[1].clone(), &pay::PAYMENT_INPUT).await?;
        let facts = pay::facts(o, p, params.business_window).await?;
        let stamp = pay::Stamp {
            w_before: None,
            w_after: input.watermark,
            batch_id: input.as_of_batch,
            now_us: cx.now_us(),
        };
        let (out, gold_schema) = match mode {
            PaymentMode::Fast => (
                pay::fast_rows(&facts, params, stamp, &std::collections::HashSet::new())?,
                pay::fast_schema(),
            ),
            PaymentMode::Reconcile => (
                pay::reconciliation_rows(&facts, params, stamp)?,
                pay::reconciliation_schema(),
            ),
        };
        // Only rows anchored on this day; the others belong to their own day.
        let dates = out
            .rows
            .column_by_name(pay::ORDER_DATE)
            .and_then(|c| c.as_any().downcast_ref::<arrow::array::Date32Array>())
            .ok_or_else(|| crate::columns::ColumnError::Missing(pay::ORDER_DATE.into()))?;
        let keep: BooleanArray = dates.iter().map(|d| Some(d == Some(day))).collect();
        let rows = filter_record_batch(&out.rows, &keep)?;
        let with_too_late = match late_ctx {
            Some(lctx) => too_late_orders(lctx, &rows, (lo - horizon, hi + horizon), day).await?,
            None => Vec::new(),
        };
        Ok(Restated {
            rows,
            gold_schema,
            ident: vec![pay::ORDER_ID.to_string()],
            partition: pay::ORDER_DATE,
            partitions: &[pay::ORDER_DATE, pay::ORDER_HOUR],
            with_too_late,
        })
    }
}

/// The touched order_ids that have a gold row in the partitions of `days` and
/// `hours` — those the batch's MERGE names (a gold table without the hour column:
/// every hour of those days).
async fn existing_keys(
    cx: &Context<'_>,
    spec: &JobSpec,
    touches: &Touches,
    days: &[i32],
    hours: &[i32],
) -> Result<HashSet<String>> {
    if touches.is_empty() || days.is_empty() {
        return Ok(HashSet::new());
    }
    let Some(ctx) = cx.open(&spec.table, "gold").await? else {
        return Ok(HashSet::new());
    };
    let target = Arc::new(Schema::new(vec![Field::new(
        pay::ORDER_ID,
        DataType::Utf8,
        false,
    )]));
    let mut partitions = read::dates_in(pay::ORDER_DATE, days);
    let has_hour = ctx
        .table("gold")
        .await
        .map_err(|e| Error::query("gold columns", e))?
        .schema()
        .has_column_with_unqualified_name(pay::ORDER_HOUR);
    if has_hour {
        let hours = hours.iter().map(|h| lit(ScalarValue::Int32(Some(*h))));
        partitions = partitions.and(col(pay::ORDER_HOUR).in_list(hours.collect(), false));
    }
    let found = read::read_keys(
        &ctx,
        "gold",
        partitions,
        pay::ORDER_ID,
        &touches.keys_batch()?,
        &target,
    )
    .await?;
    let ids = found.column(0).as_string::<i32>();
    Ok(ids.iter().flatten().map(str::to_string).collect())
}

/// Facts of the touched orders (see [`pay::facts`]) and the event days and hours of
/// the rows they were computed from.
async fn order_facts(
    cx: &Context<'_>,
    ctx: &SessionContext,
    spec: &JobSpec,
    params: &PaymentParams,
    state: &JobState,
    touches: &Touches,
    horizon: i64,
) -> Result<(RecordBatch, Vec<i32>, Vec<i32>)> {
    let (orders, payments) = (&spec.sources[0], &spec.sources[1]);
    // Ranges and keys are the same for both sources.
    let ranges = touches.ranges(horizon);
    let keys = touches.keys_batch()?;
    let read_side = |source: &str, cols: &[&str]| {
        let source = source.to_string();
        let cols = columns(cols);
        let (ranges, keys) = (&ranges, &keys);
        async move {
            let bronze = cx.source_schema(&source)?.bronze.clone();
            let target = agg::project(&bronze, &cols)?;
            if touches.is_empty() {
                return Ok::<_, Error>(RecordBatch::new_empty(target));
            }
            let applied = read::Applied {
                upto: upto(state, &source),
                cutoffs: cutoffs(state, &source),
            };
            let keys = Some(("order_id", keys));
            read::read_applied(
                Some(ctx),
                &read::session_table(&source),
                ranges,
                applied,
                keys,
                &target,
            )
            .await
        }
    };
    let o = read_side(orders, &pay::ORDER_INPUT).await?;
    let p = read_side(payments, &pay::PAYMENT_INPUT).await?;
    let mut days = pay::event_days(&o)?;
    days.extend(pay::event_days(&p)?);
    days.sort_unstable();
    days.dedup();
    let mut hours = pay::event_hours(&o)?;
    hours.extend(pay::event_hours(&p)?);
    hours.sort_unstable();
    hours.dedup();
    let facts = pay::facts(o, p, params.business_window).await?;
    Ok((facts, days, hours))
}

/// The last ingestion batch of `source` the job has consumed (including this batch).
fn upto(state: &JobState, source: &str) -> i64 {
    state.positions.get(source).copied().unwrap_or(0)
}

fn cutoffs<'a>(state: &'a JobState, source: &str) -> &'a [crate::job::plan::Cutoff] {
    state.cutoffs.get(source).map_or(&[], |c| c.as_slice())
}

/// The restated orders (`rows`) with a row in the late ledger, as `order_id @ date`.
async fn too_late_orders(
    lctx: &SessionContext,
    rows: &RecordBatch,
    (from, to): (Micros, Micros),
    day: i32,
) -> Result<Vec<String>> {
    if rows.num_rows() == 0 {
        return Ok(Vec::new());
    }
    let ids = crate::columns::string(rows, pay::ORDER_ID)?;
    let keys = read::keys_batch(ids.iter().flatten())?;
    let target: SchemaRef = std::sync::Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new(pay::ORDER_ID, arrow::datatypes::DataType::Utf8, true),
    ]));
    let filter = read::dates_in(late::PARTITION, &agg::dates_of(&[(from, to)]))
        .and(read::in_ranges("event_ts", &[(from, to)]));
    let found = read::read_keys(lctx, "late", filter, pay::ORDER_ID, &keys, &target).await?;
    let found = crate::columns::string(&found, pay::ORDER_ID)?;
    let mut out: Vec<String> = found
        .iter()
        .flatten()
        .map(|id| format!("{id} @ {}", date(day)))
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::operator::testing::Harness;

    const JOB: &str = r#"
name = "rec"
schedule = "0 0 * * * *"
sources = ["orders", "payments"]
operator = "payment_reconciliation"
[time]
watermark_delay = "30s"
idle_timeout = "1h"
lookback = "30m"
late_policy = "side_output"
[sink]
merge_keys = ["order_id"]
[params]
business_window = "1h"
horizon = "2h"
"#;

    fn order(id: &str, ts: &str, cents: i64) -> String {
        format!(
            r#"{{"event_id":"e-{id}","event_ts":"2026-12-01T{ts}Z","order_id":"{id}","sku":"s","quantity":1,"amount_cents":{cents}}}"#
        )
    }

    fn payment(id: &str, order: &str, ts: &str, cents: i64) -> String {
        format!(
            r#"{{"event_id":"p-{id}","event_ts":"2026-12-01T{ts}Z","payment_id":"{id}","order_id":"{order}","amount_cents":{cents},"status":"captured"}}"#
        )
    }

    const GOLD: &str = "SELECT order_id, amount_cents, captured_cents, status, is_final FROM t \
                        ORDER BY order_id";

    /// Reconciliation over in-memory tables: statuses follow the watermark through the
    /// business window, a late payment inside the lookback matches its order, one
    /// outside it goes to the late ledger and the counter, and a restart between batches.
    #[tokio::test]
    async fn orders_and_payments_match_in_memory() {
        let mut h = Harness::new("2026-12-01T12:00:00Z");
        let job = h.job(JOB).await;
        let landed = "2026-12-01T10:11:00Z";
        h.land(
            "orders",
            landed,
            &[
                order("o1", "10:00:00", 500),
                order("o2", "10:05:00", 300),
                order("o3", "10:10:00", 200),
            ],
        );
        h.land("payments", landed, &[payment("p1", "o1", "10:02:00", 500)]);
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["orders_touched"], m["upserts"]), (4, 3, 3));
        assert_eq!(
            h.rows("gold/rec", GOLD).await,
            [
                "o1|500|500|matched|false",
                "o2|300|0|pending|false",
                "o3|200|0|pending|false",
            ]
        );
        h.restart();
        // W was 10:01:30 (the payments' newest event − 30 s): the cut-off is 09:31:30.
        let landed = "2026-12-01T11:21:00Z";
        h.land("orders", landed, &[order("o4", "11:20:00", 100)]);
        h.land(
            "payments",
            landed,
            &[
                payment("p2", "o2", "10:06:00", 300),
                payment("p9", "o9", "09:00:00", 10),
                payment("p4", "o4", "11:20:30", 100),
            ],
        );
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["applied"], m["too_late"]), (4, 3, 1));
        // o2 matched by its late payment; o1's and o3's deadlines passed (o3 unmatched).
        assert_eq!(
            h.rows("gold/rec", GOLD).await,
            [
                "o1|500|500|matched|true",
                "o2|300|300|matched|true",
                "o3|200|0|unmatched|true",
                "o4|100|100|matched|false",
            ]
        );
        assert_eq!(h.rows("late/rec", "SELECT event_id FROM t").await, ["p-p9"]);
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["upserts"]), (0, 0));
    }
}
