//! `operator = "select"`: a filtered projection of one source — the applied events that
//! pass `[params] where` (a SQL predicate over the source's columns), with the columns
//! `[params] columns` names — kept in a gold table partitioned by `event_date`, one row
//! per `event_id`. What a downstream team asks for when it wants "the big orders" or
//! "the checkout clicks" as a table of their own, typed, deduplicated and exactly once.
//!
//! A batch appends its new applied rows that pass the filter: ingestion keeps bronze free
//! of duplicate event ids (exact for the event dates a batch touches), and every bronze
//! row reaches exactly one job batch, so a row is never written twice and the append
//! reads no gold file. Too-late rows (before W − lookback) go to the late ledger, as for
//! every job. A backfill restates a day from every consumed row of the day, too-late
//! ones included, and reports those it added.
//!
//! ```toml
//! name = "big_orders"
//! schedule = "0 */5 * * * *"
//! sources = ["orders"]
//! operator = "select"
//! [params]
//! columns = ["order_id", "sku", "amount_cents"]   # default: every column
//! where = "amount_cents >= 10000"                 # default: every event
//! [sink]
//! merge_keys = ["event_id"]
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{ArrayRef, Date32Array, Int64Array, RecordBatch, StringArray};
use arrow::array::{BooleanArray, TimestampMicrosecondArray};
use arrow::compute::filter_record_batch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::prelude::SessionContext;

use crate::columns::conform;
use crate::error::{Error, Result};
use crate::job::aggregate::{self as agg, DAY};
use crate::job::plan::{JobPlan, JobState};
use crate::job::spec::{Fields, JobSpec};
use crate::names;
use crate::operator::metrics::{InputCounts, Metrics};
use crate::operator::read::{self, consumed_in, take_new_rows, NewRows};
use crate::operator::{Computed, Context, DayInput, Operator, Restated};
use crate::schema::{SourceSchema, EVENT_DATE};
use crate::sink::late;
use crate::time::{date, micros, Micros};

/// The gold table's key and partition column.
const KEY: &str = "event_id";
const PARTITIONS: [&str; 1] = [EVENT_DATE];

/// A filtered projection of one source.
#[derive(Debug, Clone, PartialEq)]
pub struct Select {
    /// Gold columns after `event_id` and `event_ts`, in file order.
    pub columns: Vec<String>,
    /// The SQL predicate rows must pass (None: every row).
    pub filter: Option<String>,
    /// The source columns the predicate reads.
    pub filter_reads: Vec<String>,
}

/// What one batch of a select job did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SelectMetrics {
    pub input: InputCounts,
    /// Applied rows that passed the filter and were written.
    pub selected: i64,
    /// Applied rows the filter left out.
    pub filtered_out: i64,
}

impl Metrics for SelectMetrics {
    fn input(&self) -> InputCounts {
        self.input
    }
    fn outputs(&self) -> (i64, i64, i64) {
        (self.selected, 0, 0)
    }
}

/// The `select` operator: one source, `[params] columns` (each a column of the source)
/// and `[params] where` (planned against the source's columns).
pub(crate) fn parse(
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    if sources.len() != 1 {
        return Err(top.err("sources", "exactly one source for a select job"));
    }
    let schema = &schemas[&sources[0]];
    let all: Vec<String> = schema.fields.iter().map(|f| f.name.clone()).collect();
    let (mut columns, mut filter, mut filter_reads) = (all.clone(), None, Vec::new());
    if let Some(p) = top.sub("params")? {
        p.only(&["columns", "where"])?;
        if let Some(cols) = p.list("columns")? {
            let mut seen = BTreeSet::new();
            for c in &cols {
                if !all.contains(c) {
                    return Err(p.err(
                        "columns",
                        format!(
                            "columns of {} ({}); `{c}` is not one",
                            schema.name,
                            all.join(", ")
                        ),
                    ));
                }
                if !seen.insert(c) {
                    return Err(p.err("columns", format!("each column once; `{c}` repeats")));
                }
            }
            columns = cols;
        }
        if let Some(w) = p.str_opt("where")? {
            filter_reads = predicate_columns(w, &schema.bronze, &all).map_err(|e| {
                p.err(
                    "where",
                    format!("a SQL predicate over {}'s columns ({e})", schema.name),
                )
            })?;
            filter = Some(w.to_string());
        }
    }
    columns.retain(|c| c != KEY && c != "event_ts");
    Ok(Arc::new(Select {
        columns,
        filter,
        filter_reads,
    }))
}

/// The event columns `predicate` reads, planned as a filter over the source's bronze
/// schema (so a typo, an unknown column or a non-boolean expression fails at load).
fn predicate_columns(
    predicate: &str,
    bronze: &SchemaRef,
    events: &[String],
) -> std::result::Result<Vec<String>, String> {
    let ctx = SessionContext::new();
    let df = ctx
        .read_batch(RecordBatch::new_empty(bronze.clone()))
        .map_err(|e| e.to_string())?;
    let expr = df.parse_sql_expr(predicate).map_err(|e| e.to_string())?;
    let reads: Vec<String> = expr
        .column_refs()
        .iter()
        .map(|c| c.name.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if let Some(c) = reads.iter().find(|c| !events.contains(c)) {
        return Err(format!("`{c}` is not an event column"));
    }
    df.filter(expr).map_err(|e| e.to_string())?;
    Ok(reads)
}

impl Select {
    /// Columns read from bronze: the key, the event time, the gold columns, the
    /// predicate's.
    fn reads(&self) -> Vec<String> {
        let mut cols = vec![KEY.to_string(), "event_ts".to_string()];
        for c in self.columns.iter().chain(&self.filter_reads) {
            if !cols.contains(c) {
                cols.push(c.clone());
            }
        }
        cols
    }

    /// The gold table's schema.
    fn gold_schema(&self, bronze: &Schema) -> Result<SchemaRef> {
        let mut cols = vec![KEY.to_string(), "event_ts".to_string()];
        cols.extend(self.columns.iter().cloned());
        let mut fields: Vec<Field> = agg::project(bronze, &cols)?
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(Field::new(EVENT_DATE, DataType::Date32, true));
        fields.push(Field::new("_updated_at", crate::schema::ts_type(), true));
        fields.push(Field::new("_batch_id", DataType::Int64, true));
        Ok(Arc::new(Schema::new(fields)))
    }

    /// The rows of `rows` that pass the predicate.
    async fn selected(&self, rows: &RecordBatch) -> Result<RecordBatch> {
        let Some(predicate) = &self.filter else {
            return Ok(rows.clone());
        };
        if rows.num_rows() == 0 {
            return Ok(rows.clone());
        }
        let what = format!("where {predicate}");
        // One partition: the mask comes back in the rows' order.
        let ctx = SessionContext::new_with_config(
            datafusion::prelude::SessionConfig::new().with_target_partitions(1),
        );
        let df = ctx
            .read_batch(rows.clone())
            .map_err(|e| Error::query(&what, e))?;
        let expr = df
            .parse_sql_expr(predicate)
            .map_err(|e| Error::query(&what, e))?;
        // Evaluated as a mask, so the rows keep their order and their types.
        let mask = df
            .select(vec![expr.alias("keep")])
            .map_err(|e| Error::query(&what, e))?
            .collect()
            .await
            .map_err(|e| Error::query(&what, e))?;
        let mask: Vec<Option<bool>> = mask
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<BooleanArray>()
                    .map(|a| a.iter().collect::<Vec<_>>())
                    .unwrap_or_default()
            })
            .collect();
        if mask.len() != rows.num_rows() {
            return Err(crate::columns::ColumnError::Missing(format!(
                "a boolean value of `{predicate}` per row"
            ))
            .into());
        }
        // A null (unknown) predicate leaves the row out, as SQL's WHERE does.
        let keep: BooleanArray = mask.into_iter().map(|k| Some(k == Some(true))).collect();
        Ok(filter_record_batch(rows, &keep)?)
    }

    /// Merge-source rows (gold schema + `_op = 'upsert'`) of `rows`.
    fn gold_rows(
        &self,
        rows: &RecordBatch,
        gold: &SchemaRef,
        batch_id: i64,
        now: Micros,
    ) -> Result<RecordBatch> {
        let n = rows.num_rows();
        let data: Vec<Field> = gold.fields()[..gold.fields().len() - 3]
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        let data = conform(rows, &Arc::new(Schema::new(data)))?;
        let ts = crate::columns::event_ts(rows)?;
        let mut cols: Vec<ArrayRef> = data.columns().to_vec();
        cols.push(Arc::new(Date32Array::from_iter_values(
            ts.values().iter().map(|t| t.div_euclid(DAY) as i32),
        )));
        cols.push(Arc::new(
            TimestampMicrosecondArray::from(vec![now; n]).with_timezone("UTC"),
        ));
        cols.push(Arc::new(Int64Array::from(vec![batch_id; n])));
        cols.push(Arc::new(StringArray::from(vec!["upsert"; n])));
        Ok(RecordBatch::try_new(agg::merge_schema(gold), cols)?)
    }
}

#[async_trait::async_trait]
impl Operator for Select {
    fn merge_keys(&self, given: Option<Vec<String>>) -> std::result::Result<Vec<String>, String> {
        crate::operator::natural_keys(given, &[KEY], "one row per event")
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
        let mut state = before;
        let source = &spec.sources[0];
        let bronze = cx.source_schema(source)?.bronze.clone();
        let ctx = cx.open(&names::table::bronze(source), "bronze").await?;
        let target = agg::job_input_schema(&bronze, Some(&[&self.reads()]));
        let w_before = state.watermark.current;
        let cutoff = w_before.map(|w| w - micros(spec.time.lookback));
        // No read of this job reaches below the cut-off: a cut-off is kept for nothing.
        let NewRows {
            new,
            applied,
            too_late,
            oldest_landed,
        } = take_new_rows(
            cx.given_rows(),
            ctx.as_ref(),
            "bronze",
            source,
            plan.input(source)?,
            &target,
            &bronze,
            cutoff,
            0,
            &mut state,
        )
        .await?;
        let w_after = state.watermark.advance();
        let now = cx.now_us();
        let late = match (cutoff, w_before) {
            (Some(c), Some(w)) if too_late.num_rows() > 0 => {
                let why = late::reason(w, spec.time.lookback);
                Some(late::rows(&too_late, plan.batch_id, w, c, &why, now)?)
            }
            _ => None,
        };
        let selected = self.selected(&applied).await?;
        let gold_schema = self.gold_schema(&bronze)?;
        let rows = self.gold_rows(&selected, &gold_schema, plan.batch_id, now)?;
        let metrics = SelectMetrics {
            input: InputCounts::of(
                &new,
                &applied,
                &too_late,
                (w_before, w_after),
                oldest_landed,
            ),
            selected: selected.num_rows() as i64,
            filtered_out: (applied.num_rows() - selected.num_rows()) as i64,
        };
        let mut out = cx.gold_output(spec, gold_schema, vec![rows], &PARTITIONS, Vec::new());
        out.write = crate::operator::Write::Append;
        Computed::new(plan, state, &metrics, late, vec![out])
    }

    /// The day's rows: every consumed event of the day that passes the filter, too-late
    /// ones included.
    async fn restate(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        day: i32,
        input: &DayInput,
    ) -> Result<Restated> {
        let source = &spec.sources[0];
        let bronze = cx.source_schema(source)?.bronze.clone();
        let (lo, hi) = (day as Micros * DAY, (day as Micros + 1) * DAY);
        let target = agg::job_input_schema(&bronze, Some(&[&self.reads()]));
        let rows = read::read(
            &input.ctx,
            &read::session_table(source),
            consumed_in((lo, hi), input.position(source)),
            &target,
        )
        .await?;
        let selected = self.selected(&rows).await?;
        let gold_schema = self.gold_schema(&bronze)?;
        let rows = self.gold_rows(&selected, &gold_schema, input.as_of_batch, cx.now_us())?;
        // Restated rows the live job left out as too late.
        let with_too_late = match &input.late {
            Some(lctx) if rows.num_rows() > 0 => {
                let ids = Arc::new(Schema::new(vec![Field::new(KEY, DataType::Utf8, true)]));
                let filter = read::dates_in(late::PARTITION, &[day])
                    .and(read::in_ranges("event_ts", &[(lo, hi)]));
                let keys = read::keys_batch(crate::columns::string(&rows, KEY)?.iter().flatten())?;
                let late_rows = read::read_keys(lctx, "late", filter, KEY, &keys, &ids).await?;
                let mut out: Vec<String> = crate::columns::string(&late_rows, KEY)?
                    .iter()
                    .flatten()
                    .map(|id| format!("{id} @ {}", date(day)))
                    .collect();
                out.sort();
                out.dedup();
                out
            }
            _ => Vec::new(),
        };
        Ok(Restated {
            rows,
            gold_schema,
            ident: vec![KEY.to_string()],
            partition: EVENT_DATE,
            partitions: &PARTITIONS,
            with_too_late,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::operator::testing::{order, Harness};

    const JOB: &str = r#"
name = "big"
schedule = "0 */5 * * * *"
sources = ["orders"]
operator = "select"
[params]
columns = ["sku", "amount_cents"]
where = "amount_cents >= 150 AND sku <> 'X'"
[time]
watermark_delay = "30s"
idle_timeout = "1h"
lookback = "10m"
[sink]
merge_keys = ["event_id"]
"#;

    const GOLD: &str = "SELECT event_id, event_ts, sku, amount_cents, event_date FROM t \
                        ORDER BY event_id";

    /// The select operator over in-memory tables: rows that pass the predicate, in and
    /// out of order, late inside the lookback (kept), late outside it (the ledger and
    /// the counter), and a restart between batches.
    #[tokio::test]
    async fn selected_rows_follow_event_time_in_memory() {
        let mut h = Harness::new("2026-12-01T12:00:00Z");
        let job = h.job(JOB).await;
        h.land(
            "orders",
            "2026-12-01T10:06:10Z",
            &[
                order("e2", "10:03:00", "A", 200),
                order("e1", "10:01:00", "A", 100),
                order("e3", "10:06:00", "X", 900),
            ],
        );
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["selected"], m["filtered_out"]), (3, 1, 2));
        assert_eq!(
            h.rows("gold/big", GOLD).await,
            ["e2|2026-12-01T10:03:00Z|A|200|2026-12-01"]
        );
        h.restart();
        // W was 10:05:30: the cut-off is 09:55:30.
        h.land(
            "orders",
            "2026-12-01T10:20:00Z",
            &[
                order("e4", "09:58:00", "B", 150),
                order("e5", "09:50:00", "B", 999),
                order("e6", "10:19:00", "B", 151),
            ],
        );
        let m = h.run(&job).await;
        assert_eq!((m["applied"], m["too_late"], m["selected"]), (2, 1, 2));
        assert_eq!(
            h.rows("gold/big", GOLD).await,
            [
                "e2|2026-12-01T10:03:00Z|A|200|2026-12-01",
                "e4|2026-12-01T09:58:00Z|B|150|2026-12-01",
                "e6|2026-12-01T10:19:00Z|B|151|2026-12-01",
            ]
        );
        assert_eq!(h.rows("late/big", "SELECT event_id FROM t").await, ["e5"]);
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["selected"]), (0, 0));
    }

    /// `[params]` errors name the field and what was expected.
    #[tokio::test]
    async fn bad_params_are_named() {
        let h = Harness::new("2026-12-01T12:00:00Z");
        let err = |params: &str| {
            let text = JOB.replace(
                "columns = [\"sku\", \"amount_cents\"]\nwhere = \"amount_cents >= 150 AND sku <> 'X'\"",
                params,
            );
            let schemas = h.schemas.clone();
            async move {
                crate::job::spec::parse(&text, "jobs/big.toml", &schemas)
                    .await
                    .unwrap_err()
                    .to_string()
            }
        };
        let e = err("columns = [\"nope\"]").await;
        assert!(
            e.contains("`params.columns`") && e.contains("`nope` is not one"),
            "{e}"
        );
        let e = err("where = \"amount_cents >= \"").await;
        assert!(
            e.contains("`params.where`") && e.contains("SQL predicate"),
            "{e}"
        );
        let e = err("where = \"_batch_id > 3\"").await;
        assert!(e.contains("`_batch_id` is not an event column"), "{e}");
        let e = err("where = \"amount_cents + 1\"").await;
        assert!(e.contains("`params.where`"), "{e}");
        let e = err("limit = 3").await;
        assert!(e.contains("`params.limit`"), "{e}");
    }
}
