//! The order/payment operator behind `payments_fast` and `payment_reconciliation`: pure
//! functions over Arrow record batches (no I/O), shared by micro-batch runs and backfills.
//!
//! One batch, in order (DESIGN.md, Reconciliation and stock-out):
//! 1. The runner splits each source's new rows into applied and too late (as windowed jobs
//!    do, [`crate::job::aggregate::split_late`]) and advances the watermark W, the minimum
//!    over orders and payments.
//! 2. [`Touches`]: the order_ids of applied new order lines and payments, and, for the
//!    reconciliation, of orders (and orphan candidates) whose business-window deadline W
//!    crossed in this batch ([`deadline_range`]).
//! 3. The runner reads every applied order line and payment of those order_ids within
//!    `horizon` of the touching events ([`Touches::ranges`]) and [`facts`] joins them with
//!    DataFusion: per order_id its order_ts, amount, captured within the business window,
//!    first capture and first payment.
//! 4. [`reconciliation_rows`] / [`fast_rows`] turn the facts into gold rows (upserts, and
//!    for `payments_fast` tombstones of orders that no longer qualify).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;

use crate::columns::{self, event_ts};
use crate::error::{Error, Result};
use crate::job::aggregate::{DAY, OP};
use crate::schema::ts_type;
use crate::time::{micros, Micros};

/// Partition column of both payments gold tables: the date of order_ts (of the first
/// payment for orphan payments).
pub const ORDER_DATE: &str = "order_date";

/// Second partition column of the payment jobs' gold tables: the UTC hour of the same
/// timestamp `order_date` is the date of, so a batch's MERGE rewrites the hours its
/// orders fall in, not the whole day (see [`crate::job::aggregate::WINDOW_HOUR`]).
pub const ORDER_HOUR: &str = "order_hour";

/// Which payments job: the five-minute fast match or the reconciliation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaymentMode {
    Fast,
    Reconcile,
}

/// Settings of the payments operators (`[params]` in the job file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaymentParams {
    /// Payments with event_ts up to order_ts + this count for an order (default 3d).
    pub business_window: Duration,
    /// How far, in event time, an order's lines and payments are looked for around the
    /// event that touched the order (default 7d; at least the business window).
    pub horizon: Duration,
    /// `payments_fast`: the first capture came at most this long after order_ts (5m).
    pub fast_within: Duration,
}

impl Default for PaymentParams {
    fn default() -> Self {
        PaymentParams {
            business_window: Duration::from_secs(3 * 86_400),
            horizon: Duration::from_secs(7 * 86_400),
            fast_within: Duration::from_secs(300),
        }
    }
}
/// The key column.
pub const ORDER_ID: &str = "order_id";

/// Order-line columns the operator reads.
pub const ORDER_INPUT: [&str; 3] = ["order_id", "event_ts", "amount_cents"];
/// Payment columns the operator reads.
pub const PAYMENT_INPUT: [&str; 4] = ["order_id", "event_ts", "amount_cents", "status"];

/// Status values of `gold/payment_reconciliation`.
pub mod status {
    pub const MATCHED: &str = "matched";
    pub const PENDING: &str = "pending";
    pub const UNMATCHED: &str = "unmatched";
    pub const MISMATCH: &str = "mismatch";
    pub const ORPHAN: &str = "orphan_payment";
}

/// The order_ids a batch re-evaluates and the event times that touched them.
#[derive(Debug, Default, Clone)]
pub struct Touches {
    keys: HashSet<String>,
    times: Vec<Micros>,
}

impl Touches {
    /// Touch the order_id of every row of `rows` (columns `order_id`, `event_ts`).
    pub fn add(&mut self, rows: &RecordBatch) -> Result<()> {
        let ids = columns::string(rows, ORDER_ID)?;
        let ts = event_ts(rows)?;
        for i in 0..rows.num_rows() {
            if ids.is_null(i) || ts.is_null(i) {
                continue;
            }
            self.keys.insert(ids.value(i).to_string());
            self.times.push(ts.value(i));
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The touched order_ids as a one-column batch (`_key`), sorted.
    pub fn keys_batch(&self) -> Result<RecordBatch> {
        let mut keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        keys.sort_unstable();
        crate::columns::keys_batch(keys.into_iter())
    }

    /// Event-time ranges `[t − horizon, t + horizon]` around every touch, merged: where
    /// the touched orders' lines and payments are looked for.
    pub fn ranges(&self, horizon: Micros) -> Vec<(Micros, Micros)> {
        let mut times = self.times.clone();
        times.sort_unstable();
        let mut out: Vec<(Micros, Micros)> = Vec::new();
        for t in times {
            let (lo, hi) = (t.saturating_sub(horizon), t.saturating_add(horizon + 1));
            match out.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        out
    }
}

/// Event times `[lo, hi)` of orders (by order_ts) and orphan candidates (by first payment)
/// whose deadline (+ business window) the watermark crossed moving from `before` to
/// `after`: `before < t + window <= after`. None when W did not advance.
pub fn deadline_range(
    before: Option<Micros>,
    after: Option<Micros>,
    window: Micros,
) -> Option<(Micros, Micros)> {
    let a = after?;
    let lo = match before {
        Some(b) if b >= a => return None,
        Some(b) => b - window + 1,
        None => Micros::MIN / 2,
    };
    Some((lo, a - window + 1))
}

/// Per order_id (sorted): `order_id`, `order_ts` and `amount_cents` (null without order
/// lines), `captured_cents` (captured − refunded within order_ts + business window; all
/// payments for an order_id without lines), `first_capture_ts` (same payments),
/// `first_payment_ts` (any status).
///
/// `orders` holds `order_id, event_ts, amount_cents`; `payments` also `status`. The join
/// and aggregation are one DataFusion plan.
pub async fn facts(
    orders: RecordBatch,
    payments: RecordBatch,
    business_window: std::time::Duration,
) -> Result<RecordBatch> {
    let ctx = SessionContext::new_with_config(
        datafusion::prelude::SessionConfig::new().with_target_partitions(2),
    );
    for (name, b) in [("o", orders), ("p", payments)] {
        let t = MemTable::try_new(b.schema(), vec![vec![b]])
            .map_err(|e| Error::query(format!("register {name}"), e))?;
        ctx.register_table(name, Arc::new(t))
            .map_err(|e| Error::query(format!("register {name}"), e))?;
    }
    let window = micros(business_window);
    let sql = format!(
        "WITH ord AS (
           SELECT order_id, MIN(event_ts) AS order_ts, SUM(amount_cents) AS amount_cents
           FROM o GROUP BY order_id
         ), j AS (
           SELECT COALESCE(ord.order_id, p.order_id) AS order_id,
                  ord.order_ts, ord.amount_cents,
                  p.event_ts AS pay_ts, p.amount_cents AS pay_cents, p.status,
                  (ord.order_ts IS NULL
                   OR CAST(p.event_ts AS BIGINT) <= CAST(ord.order_ts AS BIGINT) + {window})
                    AS counted
           FROM ord FULL OUTER JOIN p ON ord.order_id = p.order_id
         )
         SELECT order_id,
                MIN(order_ts) AS order_ts,
                MIN(amount_cents) AS amount_cents,
                COALESCE(SUM(CASE WHEN counted AND status = 'captured' THEN pay_cents
                                  WHEN counted AND status = 'refunded' THEN -pay_cents
                                  ELSE 0 END), 0) AS captured_cents,
                MIN(CASE WHEN counted AND status = 'captured' THEN pay_ts END)
                  AS first_capture_ts,
                MIN(pay_ts) AS first_payment_ts
         FROM j GROUP BY order_id ORDER BY order_id"
    );
    let out = crate::sink::delta::sql(&ctx, &sql).await?;
    let schema = facts_schema();
    let conformed = out
        .iter()
        .map(|b| crate::columns::conform(b, &schema))
        .collect::<Result<Vec<_>>>()?;
    Ok(arrow::compute::concat_batches(&schema, &conformed)?)
}

fn facts_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new(ORDER_ID, DataType::Utf8, false),
        Field::new("order_ts", ts_type(), true),
        Field::new("amount_cents", DataType::Int64, true),
        Field::new("captured_cents", DataType::Int64, true),
        Field::new("first_capture_ts", ts_type(), true),
        Field::new("first_payment_ts", ts_type(), true),
    ]))
}

/// Status of an order (DESIGN.md): `matched` when captured == amount; otherwise `pending`
/// while W < order_ts + window; then `unmatched` (nothing captured) or `mismatch`.
pub fn order_status(
    order_ts: Micros,
    amount: i64,
    captured: i64,
    w: Option<Micros>,
    window: Micros,
) -> &'static str {
    if captured == amount {
        status::MATCHED
    } else if w.is_none_or(|w| w < order_ts + window) {
        status::PENDING
    } else if captured == 0 {
        status::UNMATCHED
    } else {
        status::MISMATCH
    }
}

/// Schema of `gold/payment_reconciliation`.
pub fn reconciliation_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new(ORDER_ID, DataType::Utf8, false),
        Field::new("order_ts", ts_type(), true),
        Field::new("amount_cents", DataType::Int64, true),
        Field::new("captured_cents", DataType::Int64, true),
        Field::new("first_capture_ts", ts_type(), true),
        Field::new("status", DataType::Utf8, true),
        Field::new("is_final", DataType::Boolean, true),
        Field::new(ORDER_DATE, DataType::Date32, true),
        Field::new(ORDER_HOUR, DataType::Int32, true),
        Field::new("_updated_at", ts_type(), true),
        Field::new("_batch_id", DataType::Int64, true),
    ]))
}

/// Schema of `gold/payments_fast`.
pub fn fast_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new(ORDER_ID, DataType::Utf8, false),
        Field::new("order_ts", ts_type(), true),
        Field::new("amount_cents", DataType::Int64, true),
        Field::new("first_capture_ts", ts_type(), true),
        Field::new("lag_s", DataType::Float64, true),
        Field::new(ORDER_DATE, DataType::Date32, true),
        Field::new(ORDER_HOUR, DataType::Int32, true),
        Field::new("_updated_at", ts_type(), true),
        Field::new("_batch_id", DataType::Int64, true),
    ]))
}

/// The batch-level values stamped on gold rows.
#[derive(Debug, Clone, Copy)]
pub struct Stamp {
    /// Watermark at batch start (for counting corrections).
    pub w_before: Option<Micros>,
    /// Watermark after the batch (for statuses and `is_final`).
    pub w_after: Option<Micros>,
    pub batch_id: i64,
    pub now_us: Micros,
}

/// Gold rows and what they amount to.
#[derive(Debug)]
pub struct GoldOut {
    /// Merge-source rows (gold schema + `_op`).
    pub rows: RecordBatch,
    pub upserts: usize,
    pub tombstones: usize,
    /// Re-evaluated orders whose business window had already closed when the batch
    /// started (late data reopened them).
    pub corrections: usize,
}

/// One output row under construction (columns appended in schema order).
#[derive(Default)]
struct Rows {
    id: Vec<String>,
    order_ts: Vec<Option<Micros>>,
    amount: Vec<Option<i64>>,
    captured: Vec<Option<i64>>,
    first_capture: Vec<Option<Micros>>,
    status: Vec<Option<&'static str>>,
    is_final: Vec<bool>,
    lag_s: Vec<Option<f64>>,
    date: Vec<i32>,
    hour: Vec<i32>,
    op: Vec<&'static str>,
}

impl Rows {
    /// The merge-source batch for `gold` (its columns, then `_op`).
    fn build(self, gold: &SchemaRef, stamp: &Stamp) -> Result<RecordBatch> {
        let n = self.id.len();
        let ts = |v: Vec<Option<Micros>>| -> ArrayRef {
            Arc::new(TimestampMicrosecondArray::from(v).with_timezone("UTC"))
        };
        let columns: [(&str, ArrayRef); 13] = [
            (ORDER_ID, Arc::new(StringArray::from(self.id))),
            ("order_ts", ts(self.order_ts)),
            ("amount_cents", Arc::new(Int64Array::from(self.amount))),
            ("captured_cents", Arc::new(Int64Array::from(self.captured))),
            ("first_capture_ts", ts(self.first_capture)),
            ("status", Arc::new(StringArray::from(self.status))),
            ("is_final", Arc::new(BooleanArray::from(self.is_final))),
            ("lag_s", Arc::new(Float64Array::from(self.lag_s))),
            (ORDER_DATE, Arc::new(Date32Array::from(self.date))),
            (ORDER_HOUR, Arc::new(Int32Array::from(self.hour))),
            ("_updated_at", ts(vec![Some(stamp.now_us); n])),
            (
                "_batch_id",
                Arc::new(Int64Array::from(vec![stamp.batch_id; n])),
            ),
            (OP, Arc::new(StringArray::from(self.op))),
        ];
        let target = crate::job::aggregate::merge_schema(gold);
        let cols = target
            .fields()
            .iter()
            .map(|f| {
                columns
                    .iter()
                    .find(|(name, _)| name == f.name())
                    .map(|(_, a)| a.clone())
                    .ok_or_else(|| {
                        Error::from(crate::columns::ColumnError::Missing(f.name().to_string()))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RecordBatch::try_new(target, cols)?)
    }
}

/// The facts' columns, typed.
struct Facts<'a> {
    id: &'a StringArray,
    order_ts: &'a TimestampMicrosecondArray,
    amount: Int64Array,
    captured: Int64Array,
    first_capture: &'a TimestampMicrosecondArray,
    first_payment: &'a TimestampMicrosecondArray,
}

impl<'a> Facts<'a> {
    fn of(b: &'a RecordBatch) -> Result<Self> {
        let ts = |name: &str| columns::ts(b, name);
        Ok(Facts {
            id: columns::string(b, ORDER_ID)?,
            order_ts: ts("order_ts")?,
            amount: crate::columns::int64(b, "amount_cents")?,
            captured: crate::columns::int64(b, "captured_cents")?,
            first_capture: ts("first_capture_ts")?,
            first_payment: ts("first_payment_ts")?,
        })
    }
    fn opt_ts(a: &TimestampMicrosecondArray, i: usize) -> Option<Micros> {
        a.is_valid(i).then(|| a.value(i))
    }
}

fn day(t: Micros) -> i32 {
    t.div_euclid(DAY) as i32
}

/// `gold/payment_reconciliation` rows for the re-evaluated order_ids: one per order, one
/// per orphan payment whose deadline W reached (none before that).
pub fn reconciliation_rows(
    facts: &RecordBatch,
    params: &PaymentParams,
    stamp: Stamp,
) -> Result<GoldOut> {
    let f = Facts::of(facts)?;
    let window = micros(params.business_window);
    let closed = |t: Micros, w: Option<Micros>| w.is_some_and(|w| w >= t + window);
    let mut r = Rows::default();
    let mut corrections = 0;
    for i in 0..facts.num_rows() {
        let (anchor, row_status, amount, order_ts) = match Facts::opt_ts(f.order_ts, i) {
            Some(o) => {
                let amount = if f.amount.is_valid(i) {
                    f.amount.value(i)
                } else {
                    0
                };
                let st = order_status(o, amount, f.captured.value(i), stamp.w_after, window);
                (o, st, Some(amount), Some(o))
            }
            None => match Facts::opt_ts(f.first_payment, i) {
                Some(p) if closed(p, stamp.w_after) => (p, status::ORPHAN, None, None),
                _ => continue,
            },
        };
        corrections += usize::from(closed(anchor, stamp.w_before));
        r.id.push(f.id.value(i).to_string());
        r.order_ts.push(order_ts);
        r.amount.push(amount);
        r.captured.push(Some(f.captured.value(i)));
        r.first_capture.push(Facts::opt_ts(f.first_capture, i));
        r.status.push(Some(row_status));
        r.is_final.push(closed(anchor, stamp.w_after));
        r.date.push(day(anchor));
        r.hour.push(crate::job::aggregate::hour_of(anchor));
        r.op.push("upsert");
    }
    let upserts = r.id.len();
    Ok(GoldOut {
        rows: r.build(&reconciliation_schema(), &stamp)?,
        upserts,
        tombstones: 0,
        corrections,
    })
}

/// `gold/payments_fast` rows: an upsert for every re-evaluated order whose first capture
/// (within the business window) came at most `fast_within` after order_ts, a tombstone
/// for every other re-evaluated order that has a row now (`existing`: a late earlier
/// order line can disqualify one).
pub fn fast_rows(
    facts: &RecordBatch,
    params: &PaymentParams,
    stamp: Stamp,
    existing: &HashSet<String>,
) -> Result<GoldOut> {
    let f = Facts::of(facts)?;
    let window = micros(params.business_window);
    let within = micros(params.fast_within);
    let mut r = Rows::default();
    let (mut upserts, mut tombstones, mut corrections) = (0, 0, 0);
    for i in 0..facts.num_rows() {
        let Some(o) = Facts::opt_ts(f.order_ts, i) else {
            continue; // no order: never a row
        };
        corrections += usize::from(stamp.w_before.is_some_and(|w| w >= o + window));
        let capture = Facts::opt_ts(f.first_capture, i);
        let fast = capture.is_some_and(|c| c - o <= within);
        if !fast && !existing.contains(f.id.value(i)) {
            continue;
        }
        r.id.push(f.id.value(i).to_string());
        r.order_ts.push(Some(o));
        r.amount
            .push(f.amount.is_valid(i).then(|| f.amount.value(i)));
        r.first_capture.push(capture);
        r.lag_s.push(capture.map(|c| (c - o) as f64 / 1e6));
        r.date.push(day(o));
        r.hour.push(crate::job::aggregate::hour_of(o));
        if fast {
            upserts += 1;
            r.op.push("upsert");
        } else {
            tombstones += 1;
            r.op.push("delete");
        }
    }
    Ok(GoldOut {
        rows: r.build(&fast_schema(), &stamp)?,
        upserts,
        tombstones,
        corrections,
    })
}

/// Days (since the epoch) of every event time in `rows`: with the output rows' dates,
/// the gold partitions a MERGE must read (a re-evaluated order's existing row sits in the
/// partition of an order_ts or first payment among these rows).
pub fn event_days(rows: &RecordBatch) -> Result<Vec<i32>> {
    let ts = event_ts(rows)?;
    let mut days: Vec<i32> = ts.iter().flatten().map(day).collect();
    days.sort_unstable();
    days.dedup();
    Ok(days)
}

/// The UTC hours of the events in `rows` (the hour partitions a MERGE must read, with
/// the days of [`event_days`]).
pub fn event_hours(rows: &RecordBatch) -> Result<Vec<i32>> {
    let ts = event_ts(rows)?;
    let mut hours: Vec<i32> = ts
        .iter()
        .flatten()
        .map(crate::job::aggregate::hour_of)
        .collect();
    hours.sort_unstable();
    hours.dedup();
    Ok(hours)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::AsArray;
    use arrow::compute::cast;

    const S: Micros = 1_000_000;
    const D: Micros = DAY;

    fn ts_col(v: Vec<Micros>) -> ArrayRef {
        Arc::new(TimestampMicrosecondArray::from(v).with_timezone("UTC"))
    }

    fn orders(rows: &[(&str, Micros, i64)]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("order_id", DataType::Utf8, false),
            Field::new("event_ts", ts_type(), false),
            Field::new("amount_cents", DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
                ts_col(rows.iter().map(|r| r.1).collect()),
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2))),
            ],
        )
        .unwrap()
    }

    fn payments(rows: &[(&str, Micros, i64, &str)]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("order_id", DataType::Utf8, false),
            Field::new("event_ts", ts_type(), false),
            Field::new("amount_cents", DataType::Int64, false),
            Field::new("status", DataType::Utf8, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
                ts_col(rows.iter().map(|r| r.1).collect()),
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.3))),
            ],
        )
        .unwrap()
    }

    async fn sample() -> RecordBatch {
        let o = orders(&[("X", 2 * S, 400), ("X", 0, 600), ("Z", 100 * S, 700)]);
        let p = payments(&[
            ("X", 10 * S, 1000, "failed"),
            ("X", 20 * S, 1000, "captured"),
            ("X", 3 * D, 50, "captured"), // exactly at the deadline: counts
            ("X", 3 * D + 1, 200, "refunded"), // after it: does not
            ("X", 5 * S, 1000, "authorized"),
            ("Y", 5 * S, 999, "captured"), // no order: every payment counts
            ("Y", 10 * D, 9, "refunded"),
        ]);
        facts(o, p, std::time::Duration::from_secs(3 * 86_400))
            .await
            .unwrap()
    }

    fn row(b: &RecordBatch, i: usize) -> String {
        let f = Facts::of(b).unwrap();
        let o = |v: Option<Micros>| v.map_or("-".to_string(), |v| (v / S).to_string());
        format!(
            "{} {} {} {} {} {}",
            f.id.value(i),
            o(Facts::opt_ts(f.order_ts, i)),
            if f.amount.is_valid(i) {
                f.amount.value(i).to_string()
            } else {
                "-".into()
            },
            f.captured.value(i),
            o(Facts::opt_ts(f.first_capture, i)),
            o(Facts::opt_ts(f.first_payment, i)),
        )
    }

    #[tokio::test]
    async fn facts_join_lines_and_payments_within_the_business_window() {
        let b = sample().await;
        let rows: Vec<String> = (0..b.num_rows()).map(|i| row(&b, i)).collect();
        assert_eq!(
            rows,
            vec![
                "X 0 1000 1050 20 5".to_string(),
                "Y - - 990 5 5".to_string(),
                "Z 100 700 0 - -".to_string(),
            ]
        );
    }

    #[test]
    fn status_rules() {
        let w = 3 * D;
        assert_eq!(order_status(0, 10, 10, None, w), status::MATCHED);
        assert_eq!(order_status(0, 10, 0, Some(3 * D - 1), w), status::PENDING);
        assert_eq!(order_status(0, 10, 0, None, w), status::PENDING);
        assert_eq!(order_status(0, 10, 0, Some(3 * D), w), status::UNMATCHED);
        assert_eq!(order_status(0, 10, 5, Some(3 * D), w), status::MISMATCH);
        assert_eq!(order_status(0, 10, 15, Some(4 * D), w), status::MISMATCH);
    }

    #[test]
    fn deadline_range_is_what_the_watermark_crossed() {
        let w = 3 * D;
        assert_eq!(
            deadline_range(Some(w + 10), Some(w + 20), w),
            Some((11, 21))
        );
        assert_eq!(deadline_range(Some(w + 20), Some(w + 20), w), None);
        assert_eq!(deadline_range(Some(5), None, w), None);
        assert_eq!(
            deadline_range(None, Some(w + 20), w),
            Some((Micros::MIN / 2, 21))
        );
    }

    #[test]
    fn touch_ranges_merge_around_touches() {
        let mut t = Touches::default();
        t.add(&orders(&[("A", 100, 1), ("B", 110, 1), ("A", 1000, 1)]))
            .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.ranges(10), vec![(90, 121), (990, 1011)]);
        assert_eq!(t.ranges(500), vec![(-400, 1501)]);
        let k = t.keys_batch().unwrap();
        assert_eq!(k.column(0).as_string::<i32>().value(1), "B");
    }

    fn stamp(w_before: Option<Micros>, w_after: Option<Micros>) -> Stamp {
        Stamp {
            w_before,
            w_after,
            batch_id: 7,
            now_us: 0,
        }
    }

    fn col_strs(b: &RecordBatch, name: &str) -> Vec<String> {
        let c = cast(b.column_by_name(name).unwrap(), &DataType::Utf8).unwrap();
        c.as_string::<i32>()
            .iter()
            .map(|v| v.unwrap_or("∅").to_string())
            .collect()
    }

    #[tokio::test]
    async fn reconciliation_rows_by_watermark() {
        let b = sample().await;
        let p = PaymentParams::default();
        // Before any deadline: X (1050 of 1000) and Z pending; no orphan row for Y.
        let out = reconciliation_rows(&b, &p, stamp(None, Some(3 * D))).unwrap();
        assert_eq!(col_strs(&out.rows, "order_id"), vec!["X", "Z"]);
        assert_eq!(col_strs(&out.rows, "status"), vec!["mismatch", "pending"]);
        assert_eq!(col_strs(&out.rows, "is_final"), vec!["true", "false"]);
        assert_eq!(out.corrections, 0);
        // W past every deadline; the batch started with X already closed: a correction.
        let out = reconciliation_rows(&b, &p, stamp(Some(3 * D), Some(20 * D))).unwrap();
        assert_eq!(col_strs(&out.rows, "order_id"), vec!["X", "Y", "Z"]);
        assert_eq!(
            col_strs(&out.rows, "status"),
            vec!["mismatch", "orphan_payment", "unmatched"]
        );
        assert_eq!(
            col_strs(&out.rows, "amount_cents"),
            vec!["1000", "∅", "700"]
        );
        assert_eq!(
            col_strs(&out.rows, "order_date"),
            vec!["1970-01-01", "1970-01-01", "1970-01-01"]
        );
        assert_eq!(out.corrections, 1);
        assert_eq!(out.upserts, 3);
    }

    #[tokio::test]
    async fn fast_rows_upsert_quick_captures_and_delete_only_existing_rows() {
        let b = sample().await;
        let mut p = PaymentParams::default();
        let none = HashSet::new();
        let out = fast_rows(&b, &p, stamp(None, None), &none).unwrap();
        assert_eq!(col_strs(&out.rows, "order_id"), vec!["X"]);
        assert_eq!(col_strs(&out.rows, "lag_s"), vec!["20.0"]);
        assert_eq!((out.upserts, out.tombstones), (1, 0));
        // With 10 s allowed X no longer qualifies: a tombstone, since it has a row.
        p.fast_within = std::time::Duration::from_secs(10);
        let existing: HashSet<String> = ["X".to_string()].into();
        let out = fast_rows(&b, &p, stamp(None, None), &existing).unwrap();
        assert_eq!(col_strs(&out.rows, OP), vec!["delete"]);
        assert_eq!((out.upserts, out.tombstones), (0, 1));
    }
}
