//! The windowed-aggregate operator's I/O steps (tumbling, sliding and session windows
//! over one source): a micro-batch's compute — the new rows, the windows they touch,
//! those windows recomputed from applied bronze rows, the gold rows that changed — and a
//! backfill day's restatement. The pure parts (late split, touched windows, assignment,
//! aggregation, gold rows) are in [`crate::job::aggregate`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use arrow::compute::filter_record_batch;
use arrow::datatypes::{Schema, SchemaRef, TimestampMicrosecondType};
use datafusion::prelude::{col, SessionContext};
use tracing::info;

use crate::columns::{formatters, row_string};
use crate::error::{Error, Result};
use crate::job::aggregate::{
    self as agg, GoldSession, GoldStamp, KeyEncoder, SessionScope, Touched, DAY,
};
use crate::job::fold::{self, Fold};
use crate::job::plan::{Cutoff, JobPlan, JobState};
use crate::job::spec::JobSpec;
use crate::job::spec::{is_identifier, Fields};
use crate::names;
use crate::operator::metrics::{InputCounts, Metrics};
use crate::operator::read::{self, consumed_in, take_new_rows, NewRows};
use crate::operator::{Computed, Context, DayInput, GoldRows, Operator, Output, Restated, Write};
use crate::schema::SourceSchema;
use crate::sink::late;
use crate::time::window::WindowSpec;
use crate::time::{iso, micros, Micros};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::MemTable;
use datafusion::logical_expr::LogicalPlan;
use std::time::Duration;

/// Partition column of gold tables of windowed jobs.
pub const GOLD_PARTITION: &str = "window_date";

/// Partition columns of a windowed job's gold table: the window's date, then its hour.
pub const GOLD_PARTITIONS: [&str; 2] = [GOLD_PARTITION, agg::WINDOW_HOUR];

/// What one batch of a windowed job did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct WindowedMetrics {
    pub input: InputCounts,
    /// Windows (or sessions) recomputed and upserted.
    pub windows: i64,
    /// Stale sessions deleted (merged or split by a late event).
    pub sessions_deleted: i64,
    /// Recomputed windows that were already final.
    pub corrections: i64,
}

impl Metrics for WindowedMetrics {
    fn input(&self) -> InputCounts {
        self.input
    }
    fn outputs(&self) -> (i64, i64, i64) {
        (self.windows, self.sessions_deleted, self.corrections)
    }
}

/// The declarative windowed aggregate: `[window]` (tumbling, sliding or session) over
/// `keys`, `[aggregates]` per window, corrections inside the lookback.
#[derive(Debug, Clone, PartialEq)]
pub struct Windowed {
    pub keys: Vec<String>,
    pub window: WindowSpec,
    /// (output column, SQL aggregate expression), in file order.
    pub aggregates: Vec<(String, String)>,
    /// The event columns the aggregate expressions read (found by planning them), so
    /// recomputes read only those, the keys and the time columns.
    pub inputs: Vec<String>,
    /// How each aggregate combines, when every one combines exactly: a batch then folds
    /// its applied rows into gold's windows instead of recomputing them from bronze
    /// ([`crate::job::fold`]).
    pub folds: Option<Vec<Fold>>,
}

/// A declarative windowed aggregate: one source, `keys`, `[window]` and `[aggregates]`,
/// each expression planned against the source's columns (which also finds the columns
/// the job reads).
pub(crate) async fn parse(
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    if sources.len() != 1 {
        return Err(top.err("sources", "exactly one source for a windowed aggregate job"));
    }
    let schema = &schemas[&sources[0]];
    let keys = top
        .list("keys")?
        .ok_or_else(|| top.err("keys", "a list of key columns"))?;
    for k in &keys {
        if schema.index_of(k).is_none() {
            let cols: Vec<&str> = schema.fields.iter().map(|f| f.name.as_str()).collect();
            return Err(top.err(
                "keys",
                format!(
                    "columns of {} ({}); `{k}` is not one",
                    schema.name,
                    cols.join(", ")
                ),
            ));
        }
    }
    let w = top.sub("window")?.ok_or_else(|| {
        top.err(
            "window",
            "a [window] table (kind = tumbling | sliding | session)",
        )
    })?;
    w.only(&["kind", "size", "slide", "gap"])?;
    let need = |key: &str| -> Result<Duration> {
        let d = w.duration(key, Duration::ZERO)?;
        if d.is_zero() {
            return Err(w.err(key, "a positive duration"));
        }
        Ok(d)
    };
    let window = match w.str("kind")? {
        "tumbling" => WindowSpec::tumbling(need("size")?).map_err(|e| w.err("size", e))?,
        "sliding" => {
            WindowSpec::sliding(need("size")?, need("slide")?).map_err(|e| w.err("slide", e))?
        }
        "session" => WindowSpec::session(need("gap")?).map_err(|e| w.err("gap", e))?,
        other => {
            return Err(w.err(
                "kind",
                format!("tumbling, sliding or session, got {other:?}"),
            ))
        }
    };
    let a = top.sub("aggregates")?.ok_or_else(|| {
        top.err(
            "aggregates",
            "a table of output column = \"SQL aggregate expression\"",
        )
    })?;
    let mut aggregates = Vec::new();
    for (col, v) in a.table {
        let expr = v
            .as_str()
            .ok_or_else(|| a.err(col, "a SQL aggregate expression string"))?;
        if !is_identifier(col)
            || keys.contains(col)
            || [
                "window_start",
                "window_end",
                "session_start",
                "session_end",
                "is_final",
            ]
            .contains(&col.as_str())
            || col.starts_with('_')
        {
            return Err(a.err(
                col,
                "a lower-case output column name that is not a key or window column",
            ));
        }
        aggregates.push((col.clone(), expr.to_string()));
    }
    if aggregates.is_empty() {
        return Err(a.err("", "at least one aggregate"));
    }
    // Plan each expression with DataFusion against an empty table of the columns a job
    // reads from bronze.
    let ctx = SessionContext::new();
    let input = crate::job::aggregate::job_input_schema(&schema.bronze, None);
    let empty = MemTable::try_new(
        input.clone(),
        vec![vec![RecordBatch::new_empty(input.clone())]],
    )
    .map_err(|e| Error::query("empty events table", e))?;
    ctx.register_table("events", Arc::new(empty))
        .map_err(|e| Error::query("empty events table", e))?;
    let group = keys
        .iter()
        .map(|k| format!("\"{k}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let mut inputs = std::collections::BTreeSet::new();
    let events = datafusion::common::DFSchema::try_from(input.as_ref().clone())
        .map_err(|e| Error::query("empty events table", e))?;
    let mut folds: Option<Vec<Fold>> = Some(Vec::new());
    for (col, expr) in &aggregates {
        let sql = if group.is_empty() {
            format!("SELECT {expr} AS \"{col}\" FROM events")
        } else {
            format!("SELECT {group}, {expr} AS \"{col}\" FROM events GROUP BY {group}")
        };
        let planned = match ctx.sql(&sql).await {
            Ok(df) => {
                // Whether the expression combines exactly (see `crate::job::fold`).
                let output = df
                    .schema()
                    .field_with_unqualified_name(col)
                    .map(|f| f.data_type().clone());
                let fold = match (ctx.state().create_logical_expr(expr, &events), output) {
                    (Ok(e), Ok(t)) => Fold::of(&e, &t),
                    _ => None,
                };
                folds = folds.zip(fold).map(|(mut v, f)| {
                    v.push(f);
                    v
                });
                df.into_optimized_plan()
            }
            Err(e) => Err(e),
        };
        match planned {
            Ok(plan) => scanned_columns(&plan, &mut inputs),
            Err(e) => {
                let msg = e.to_string();
                let first = msg.lines().next().unwrap_or_default().to_string();
                return Err(a.err(
                    col,
                    format!("an aggregate over {} columns ({first})", schema.name),
                ));
            }
        }
    }
    Ok(Arc::new(Windowed {
        keys,
        window,
        aggregates,
        inputs: inputs.into_iter().collect(),
        folds,
    }))
}

/// Add the columns the table scans of `plan` read to `out`.
fn scanned_columns(plan: &LogicalPlan, out: &mut std::collections::BTreeSet<String>) {
    let _ = plan.apply(|node| {
        if let LogicalPlan::TableScan(scan) = node {
            out.extend(
                scan.projected_schema
                    .fields()
                    .iter()
                    .map(|f| f.name().clone()),
            );
        }
        Ok(TreeNodeRecursion::Continue)
    });
}

#[async_trait::async_trait]
impl Operator for Windowed {
    /// A session job also keeps the sessions open at its watermark
    /// ([`crate::job::sessions_open`]), replaced every batch: its last commit.
    fn more_outputs(&self, spec: &JobSpec) -> Vec<Output> {
        match self.window {
            WindowSpec::Session { .. } => vec![Output {
                table: names::table::open_sessions(&spec.table),
                app: names::app::open_sessions(&spec.name),
            }],
            _ => Vec::new(),
        }
    }

    /// What [`Windowed::process`] takes of its source's new rows: keys, the columns its
    /// aggregates read, the time columns.
    fn new_row_columns(
        &self,
        spec: &JobSpec,
        source: &str,
        bronze: &Schema,
    ) -> Option<Vec<String>> {
        (spec.sources.first().map(String::as_str) == Some(source)).then(|| {
            agg::job_input_schema(bronze, Some(&[&self.keys, &self.inputs]))
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect()
        })
    }

    fn merge_keys(&self, given: Option<Vec<String>>) -> std::result::Result<Vec<String>, String> {
        Ok(given.unwrap_or_else(|| {
            let mut k = self.keys.to_vec();
            k.push(crate::job::spec::window_start_column(&self.window).to_string());
            k
        }))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// A windowed job's batch: the applied new rows, the windows (sessions) they touch,
    /// those recomputed from every applied row in them, and the gold rows that changed.
    async fn process(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        plan: &JobPlan,
        before: JobState,
    ) -> Result<Computed> {
        let mut state = before;
        let (keys, window) = (self.keys.as_slice(), &self.window);
        let (aggregates, inputs) = (self.aggregates.as_slice(), self.inputs.as_slice());
        let source = &spec.sources[0];
        let schema = cx.source_schema(source)?.bronze.clone();
        let input = plan.input(source)?;
        let lookback = micros(spec.time.lookback);
        let ctx = cx.open(&names::table::bronze(source), "bronze").await?;
        // Reads project the job's input columns (keys, what its aggregates read, time
        // columns); the session finalisation lookup only keys, times and arrival columns.
        let new_schema = agg::project(&schema, &agg::new_row_columns(keys))?;
        let input_schema = agg::job_input_schema(&schema, Some(&[keys, inputs]));
        // 1. New rows; lateness is judged against W at batch start. They carry the job's
        // input columns: applied ones join the recompute as they are, so only older rows
        // are read again.
        let t = Instant::now();
        let w_before = state.watermark.current;
        let cutoff = w_before.map(|w| w - lookback);
        let NewRows {
            new,
            applied,
            too_late: late_rows,
            oldest_landed,
        } = take_new_rows(
            cx.given_rows(),
            ctx.as_ref(),
            "bronze",
            source,
            input,
            &input_schema,
            &schema,
            cutoff,
            lookback,
            &mut state,
        )
        .await?;
        let read_new_ms = t.elapsed().as_millis() as u64;
        // Recomputing reads back many times the new rows (every row of the touched
        // windows): wait for the process's budget, so heavy batches do not stack.
        let _held = cx.hold(new.num_rows()).await;
        // 2. Advance the watermark.
        let w_after = state.watermark.advance();
        let cutoffs = state.cutoffs.get(source).cloned().unwrap_or_default();
        let older = input.after_batch;
        let advanced = match (w_before, w_after) {
            (_, None) => None,
            (Some(b), Some(a)) if a <= b => None,
            (b, Some(a)) => Some((b, a)),
        };

        // 3–4. Touched windows, recomputed from applied bronze rows.
        let mut enc = KeyEncoder::new(&schema, keys)?;
        let now = cx.now_us();
        let (gold, windows, deleted, corrections) = match window {
            WindowSpec::Session { gap } => {
                let gap = *gap;
                let mut scope = SessionScope::new(gap);
                scope.touch(&mut enc, &applied, true)?;
                if let Some((b, a)) = advanced {
                    // Sessions whose end + gap the watermark passed now turn final.
                    let lo = b.map_or(Micros::MIN / 2, |b| b - gap + 1);
                    let rows = read::read_applied(
                        ctx.as_ref(),
                        "bronze",
                        &[(lo, a - gap + 1)],
                        read::Applied {
                            upto: older,
                            cutoffs: &cutoffs,
                        },
                        None,
                        &new_schema,
                    )
                    .await?;
                    scope.touch(&mut enc, &rows, false)?;
                }
                let lookup = scope.lookup_ranges();
                if !lookup.is_empty() {
                    let existing =
                        gold_sessions(cx, spec, &mut enc, keys, &lookup, lookback).await?;
                    scope.widen(existing);
                }
                let ranges = scope.ranges();
                let rows = recompute_rows(ctx.as_ref(), &ranges, older, &cutoffs, &applied).await?;
                cx.read_ahead();
                let (assigned, sessions) = agg::assign_sessions(&mut enc, &rows, &scope, gap)?;
                let (agg_schema, out) = agg::aggregate(assigned, keys, aggregates, true).await?;
                let gold_schema = agg::gold_schema(&agg_schema, keys, true);
                let stamp = GoldStamp {
                    w_after,
                    final_after: gap,
                    batch_id: plan.batch_id,
                    now_us: now,
                };
                let mut rows = agg::gold_rows(&out, &gold_schema, window, stamp)?;
                let kept: HashSet<(agg::KeyId, Micros)> =
                    sessions.iter().map(|(k, s, _)| (*k, *s)).collect();
                let gone: Vec<GoldSession> = scope
                    .replaced
                    .iter()
                    .filter(|g| !kept.contains(&(g.key, g.start)))
                    .cloned()
                    .collect();
                if !gone.is_empty() {
                    let key_cols = enc.decode(gone.iter().map(|g| g.key))?;
                    rows.push(agg::tombstones(&gone, &key_cols, &gold_schema, keys)?);
                }
                let corrections = scope.corrections(&sessions);
                ((gold_schema, rows), sessions.len(), gone.len(), corrections)
            }
            _ => {
                let mut touched = Touched::default();
                let t = Instant::now();
                let applied_keys = touched.add_applied(&mut enc, window, &applied, w_before)?;
                let touch_ms = t.elapsed().as_millis() as u64;
                let gold_ctx = match &self.folds {
                    Some(_) if folding() => foldable_gold(cx, spec, aggregates).await?,
                    _ => None,
                };
                let (agg_schema, out) = if let (Some(gctx), Some(folds)) =
                    (gold_ctx, self.folds.as_deref())
                {
                    // Fold the applied rows into gold's windows (`crate::job::fold`).
                    let assigned = agg::assign_windows_in(
                        &mut enc,
                        window,
                        std::slice::from_ref(&applied),
                        &mut touched,
                        None,
                        Some(applied_keys),
                    )?;
                    let (agg_schema, partial) =
                        agg::aggregate_parts(assigned, keys, aggregates, false).await?;
                    let aggregate_ms = t.elapsed().as_millis() as u64 - touch_ms;
                    let held = gold_windows(
                        &gctx,
                        &schema,
                        keys,
                        window,
                        &mut enc,
                        &touched,
                        advanced,
                        &agg_schema,
                    )
                    .await?;
                    // The batch's reads are done (see the recompute below).
                    cx.read_ahead();
                    let gold_ms = t.elapsed().as_millis() as u64 - touch_ms - aggregate_ms;
                    let held_rows = held.num_rows();
                    let out =
                        fold::fold(partial, &agg_schema, held, keys, aggregates, folds).await?;
                    info!(
                        job = %spec.name,
                        read_new_ms,
                        touch_ms,
                        aggregate_ms,
                        gold_ms,
                        fold_ms = t.elapsed().as_millis() as u64 - touch_ms - aggregate_ms - gold_ms,
                        rows = applied.num_rows(),
                        gold_rows = held_rows,
                        "windows folded"
                    );
                    (agg_schema, out)
                } else {
                    let mut ranges = touched.ranges(window);
                    if let Some((b, a)) = advanced {
                        // Windows whose end the watermark passed now turn final: their rows
                        // lie in [b − size, a); one read covers them and the touched windows.
                        let lo = b.map_or(Micros::MIN / 2, |b| b - agg::window_size(window) + 1);
                        ranges.push((lo, a));
                        ranges = agg::merge_ranges(ranges);
                    }
                    let rows =
                        recompute_parts(ctx.as_ref(), &ranges, older, &cutoffs, &applied).await?;
                    // The batch's reads are done: the next batch's new rows are read while
                    // this one assigns and aggregates on one core.
                    cx.read_ahead();
                    let read_ms = t.elapsed().as_millis() as u64 - touch_ms;
                    // The last part is the applied rows (see `recompute_parts`).
                    let assigned = agg::assign_windows_in(
                        &mut enc,
                        window,
                        &rows,
                        &mut touched,
                        advanced,
                        Some(applied_keys),
                    )?;
                    let assign_ms = t.elapsed().as_millis() as u64 - touch_ms - read_ms;
                    let (agg_schema, out) =
                        agg::aggregate_parts(assigned, keys, aggregates, false).await?;
                    info!(
                        job = %spec.name,
                        read_new_ms,
                        touch_ms,
                        read_ms,
                        assign_ms,
                        aggregate_ms = t.elapsed().as_millis() as u64 - touch_ms - read_ms - assign_ms,
                        rows = rows.iter().map(|r| r.num_rows()).sum::<usize>(),
                        "windows recomputed"
                    );
                    (agg_schema, out)
                };
                let gold_schema = agg::gold_schema(&agg_schema, keys, false);
                let stamp = GoldStamp {
                    w_after,
                    final_after: 0,
                    batch_id: plan.batch_id,
                    now_us: now,
                };
                let rows = agg::gold_rows(&out, &gold_schema, window, stamp)?;
                let windows = rows.iter().map(|b| b.num_rows()).sum();
                ((gold_schema, rows), windows, 0, touched.corrections)
            }
        };

        let late = match (cutoff, w_before) {
            (Some(c), Some(w)) if late_rows.num_rows() > 0 => Some(late::rows(
                &late_rows,
                plan.batch_id,
                w,
                c,
                &late::reason(w, spec.time.lookback),
                now,
            )?),
            _ => None,
        };
        let metrics = WindowedMetrics {
            input: InputCounts::of(
                &new,
                &applied,
                &late_rows,
                (w_before, w_after),
                oldest_landed,
            ),
            windows: windows as i64,
            sessions_deleted: deleted as i64,
            corrections: corrections as i64,
        };
        // A session job's open sessions come from the merge rows before they move.
        let open = match window {
            WindowSpec::Session { .. } => Some(
                open_sessions(
                    cx,
                    spec,
                    keys,
                    &gold.0,
                    &gold.1,
                    (w_before, w_after),
                    lookback,
                    plan.batch_id,
                )
                .await?,
            ),
            _ => None,
        };
        let mut out = vec![cx.gold_output(spec, gold.0, gold.1, &GOLD_PARTITIONS, Vec::new())];
        out.extend(open);
        Computed::new(plan, state, &metrics, late, out)
    }

    /// A windowed job's rows of windows starting on `day`.
    async fn restate(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        day: i32,
        input: &DayInput,
    ) -> Result<Restated> {
        let (ctx, late_ctx) = (&input.ctx, input.late.as_ref());
        let (keys, window) = (self.keys.as_slice(), &self.window);
        let (aggregates, inputs) = (self.aggregates.as_slice(), self.inputs.as_slice());
        let source = &spec.sources[0];
        let bronze = cx.source_schema(source)?.bronze.clone();
        let input_schema = agg::job_input_schema(&bronze, Some(&[keys, inputs]));
        let (lo, hi) = (day as Micros * DAY, (day as Micros + 1) * DAY);
        let position = input.position(source);
        let table = read::session_table(source);
        let read_range = |from: Micros, to: Micros| {
            let filter = consumed_in((from, to), position);
            let schema = input_schema.clone();
            let table = table.clone();
            async move { read::read(ctx, &table, filter, &schema).await }
        };
        let mut enc = KeyEncoder::new(&input_schema, keys)?;
        let session = matches!(window, WindowSpec::Session { .. });
        let (assigned, final_after, late_span) = match window {
            WindowSpec::Session { gap } => {
                let gap = *gap;
                // Sessions starting in the day: one gap before it tells where they start;
                // read further on while one of them may still continue.
                let mut read_to = hi + gap;
                loop {
                    let rows = read_range(lo - gap, read_to).await?;
                    let mut scope = SessionScope::new(gap);
                    scope.touch(&mut enc, &rows, false)?;
                    let (assigned, sessions) = agg::assign_sessions(&mut enc, &rows, &scope, gap)?;
                    let open = sessions
                        .iter()
                        .any(|(_, s, e)| *s >= lo && *s < hi && *e >= read_to - gap);
                    if open {
                        read_to += DAY;
                        continue;
                    }
                    let starts = crate::columns::int64(&assigned, agg::WINDOW_START)?;
                    let keep: BooleanArray = starts
                        .values()
                        .iter()
                        .map(|s| Some(*s >= lo && *s < hi))
                        .collect();
                    break (filter_record_batch(&assigned, &keep)?, gap, (lo, read_to));
                }
            }
            _ => {
                let size = agg::window_size(window);
                let rows = read_range(lo, hi + size).await?;
                let mut touched = Touched::default();
                touched.add_applied(&mut enc, window, &rows, None)?;
                touched.windows.retain(|(_, s)| *s >= lo && *s < hi);
                let assigned = agg::assign_windows(&mut enc, window, &rows, &mut touched, None)?;
                (assigned, 0, (lo, hi + size))
            }
        };
        let (agg_schema, out) = agg::aggregate(assigned.clone(), keys, aggregates, session).await?;
        let gold_schema = agg::gold_schema(&agg_schema, keys, session);
        let stamp = GoldStamp {
            w_after: input.watermark,
            final_after,
            batch_id: input.as_of_batch,
            now_us: cx.now_us(),
        };
        let new_rows = agg::gold_rows(&out, &gold_schema, window, stamp)?;
        let new = arrow::compute::concat_batches(&agg::merge_schema(&gold_schema), &new_rows)?;

        let start_col = if session {
            "session_start"
        } else {
            "window_start"
        };
        let mut ident: Vec<String> = keys.to_vec();
        ident.push(start_col.to_string());
        // Windows holding rows that were too late for the live job.
        let with_too_late = match late_ctx {
            Some(lctx) => {
                too_late_windows(lctx, keys, window, &assigned, late_span, (lo, hi), &bronze)
                    .await?
            }
            None => Vec::new(),
        };

        Ok(Restated {
            rows: new,
            gold_schema,
            ident,
            partition: GOLD_PARTITION,
            partitions: &GOLD_PARTITIONS,
            with_too_late,
        })
    }
}

/// The open-sessions table after the batch whose gold merge rows are `rows`: from the
/// table as the last batch left it — or, the first time, from the gold sessions not yet
/// final (from W − lookback's date on: sessions are assumed shorter than the lookback).
#[allow(clippy::too_many_arguments)]
async fn open_sessions(
    cx: &Context<'_>,
    spec: &JobSpec,
    keys: &[String],
    gold: &SchemaRef,
    rows: &[RecordBatch],
    (w_before, w_after): (Option<Micros>, Option<Micros>),
    lookback: Micros,
    batch_id: i64,
) -> Result<GoldRows> {
    use crate::job::sessions_open as so;
    let open = so::schema(gold);
    let table = names::table::open_sessions(&spec.table);
    let before = match cx.open(&table, "open").await? {
        Some(ctx) => read::read(&ctx, "open", datafusion::prelude::lit(true), &open).await?,
        None => match cx.open(&spec.table, "gold").await? {
            Some(ctx) => {
                let mut filter = col("is_final").eq(datafusion::prelude::lit(false));
                if let Some(w) = w_before {
                    let days = agg::dates_of(&[(w - lookback, w + 1)]);
                    filter = read::dates_in(GOLD_PARTITION, &days).and(filter);
                }
                read::read(&ctx, "gold", filter, gold).await?
            }
            None => RecordBatch::new_empty(gold.clone()),
        },
    };
    let now_open = so::after_batch(&before, rows, keys, &open, w_after, batch_id)?;
    let mut ident: Vec<(String, bool)> = keys.iter().map(|k| (k.clone(), true)).collect();
    ident.push(("session_start".to_string(), false));
    Ok(GoldRows {
        table,
        app: names::app::open_sessions(&spec.name),
        keys: ident,
        schema: open,
        rows: vec![now_open],
        partitions: Vec::new(),
        cluster: None,
        extra_partitions: Vec::new(),
        write: Write::Replace,
    })
}

/// Existing gold sessions that overlap one of the `[lo, hi]` `ranges` (ending at or
/// after its `lo`, starting at or before its `hi`), looked up in the window dates from
/// the first `lo − lookback` (sessions are assumed shorter than the lookback) to the
/// last `hi`.
async fn gold_sessions(
    cx: &Context<'_>,
    spec: &JobSpec,
    enc: &mut KeyEncoder,
    keys: &[String],
    ranges: &[(Micros, Micros)],
    lookback: Micros,
) -> Result<Vec<GoldSession>> {
    let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
        return Ok(Vec::new());
    };
    let (lo, hi) = (first.0, last.1);
    let bronze = &cx.source_schema(&spec.sources[0])?.bronze;
    let Some(ctx) = cx.open(&spec.table, "gold").await? else {
        return Ok(Vec::new());
    };
    let days = agg::dates_of(&[(lo - lookback, hi + 1)]);
    let overlaps = any_range(ranges, |lo, hi| {
        col("session_end")
            .gt_eq(read::ts_lit(lo))
            .and(col("session_start").lt_eq(read::ts_lit(hi)))
    });
    let filter = read::dates_in(GOLD_PARTITION, &days).and(overlaps);
    let mut fields = key_fields(bronze, keys)?;
    for (name, ty) in [
        ("session_start", crate::schema::ts_type()),
        ("session_end", crate::schema::ts_type()),
        ("is_final", arrow::datatypes::DataType::Boolean),
    ] {
        fields.push(arrow::datatypes::Field::new(name, ty, true));
    }
    let target: SchemaRef = Arc::new(Schema::new(fields));
    let b = read::read(&ctx, "gold", filter, &target).await?;
    let key_rows = enc.encode(&b)?;
    let start = b
        .column(keys.len())
        .as_primitive::<TimestampMicrosecondType>();
    let end = b
        .column(keys.len() + 1)
        .as_primitive::<TimestampMicrosecondType>();
    let fin = b.column(keys.len() + 2).as_boolean();
    Ok(key_rows
        .into_iter()
        .enumerate()
        .map(|(i, key)| GoldSession {
            key,
            start: start.value(i),
            end: end.value(i),
            is_final: fin.value(i),
        })
        .collect())
}

/// `each` of the `[lo, hi]` ranges, or-ed (false for none): a gold lookup's filter.
fn any_range(
    ranges: &[(Micros, Micros)],
    each: impl Fn(Micros, Micros) -> datafusion::prelude::Expr,
) -> datafusion::prelude::Expr {
    ranges
        .iter()
        .map(|&(lo, hi)| each(lo, hi))
        .reduce(datafusion::prelude::Expr::or)
        .unwrap_or(datafusion::prelude::lit(false))
}

/// The fields of the key columns typed as in bronze, so that gold's keys read with them
/// encode as the new rows' do.
fn key_fields(bronze: &Schema, keys: &[String]) -> Result<Vec<arrow::datatypes::Field>> {
    Ok(agg::project(bronze, keys)?
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect())
}

/// Whether windowed jobs whose aggregates combine exactly fold their batches into gold
/// (the default), rather than recomputing touched windows from bronze
/// (`KESTREL_WINDOWS=recompute`: the reference path the tests compare against).
fn folding() -> bool {
    std::env::var("KESTREL_WINDOWS").map_or(true, |v| v != "recompute")
}

/// `spec`'s gold table, opened, when it holds every aggregate column (a job whose
/// aggregates changed since recomputes); None when it does not exist yet.
async fn foldable_gold(
    cx: &Context<'_>,
    spec: &JobSpec,
    aggregates: &[(String, String)],
) -> Result<Option<SessionContext>> {
    let Some(ctx) = cx.open(&spec.table, "gold").await? else {
        return Ok(None);
    };
    let df = ctx
        .table("gold")
        .await
        .map_err(|e| Error::query(&spec.table, e))?;
    let has = |c: &str| df.schema().field_with_unqualified_name(c).is_ok();
    Ok(aggregates.iter().all(|(c, _)| has(c)).then_some(ctx))
}

/// Gold's rows of the windows a folding batch writes — those its applied rows touch and
/// those whose end the watermark passes in it (`advanced`, as the recompute finalises
/// them) — as keys, `window_start` (micros) and the aggregates, of `agg_schema`.
#[allow(clippy::too_many_arguments)]
async fn gold_windows(
    ctx: &SessionContext,
    bronze: &SchemaRef,
    keys: &[String],
    window: &WindowSpec,
    enc: &mut KeyEncoder,
    touched: &Touched,
    advanced: Option<(Option<Micros>, Micros)>,
    agg_schema: &SchemaRef,
) -> Result<RecordBatch> {
    let size = agg::window_size(window);
    let finalised = |start: Micros| {
        let end = start + size;
        advanced.is_some_and(|(b, a)| end <= a && b.is_none_or(|w| end > w))
    };
    // Window starts to read, [lo, hi).
    let mut starts = touched.ranges(window);
    if let Some((b, a)) = advanced {
        starts.push((b.map_or(Micros::MIN / 2, |b| b - size + 1), a - size + 1));
    }
    let starts = agg::coalesce_ranges(agg::merge_ranges(starts), agg::MAX_LOOKUP_RANGES);
    if starts.is_empty() {
        return Ok(RecordBatch::new_empty(agg_schema.clone()));
    }
    let within = any_range(&starts, |lo, hi| {
        col("window_start")
            .gt_eq(read::ts_lit(lo))
            .and(col("window_start").lt(read::ts_lit(hi)))
    });
    // Dates prune partitions, unless a range is open to the past (the first watermark).
    let filter = match starts.first().is_some_and(|(lo, _)| *lo > Micros::MIN / 4) {
        true => read::dates_in(GOLD_PARTITION, &agg::dates_of(&starts)).and(within),
        false => within,
    };
    let mut fields = key_fields(bronze, keys)?;
    fields.push(arrow::datatypes::Field::new(
        "window_start",
        crate::schema::ts_type(),
        true,
    ));
    for f in agg_schema.fields().iter().skip(keys.len() + 1) {
        fields.push(arrow::datatypes::Field::new(
            f.name(),
            f.data_type().clone(),
            true,
        ));
    }
    let target: SchemaRef = Arc::new(Schema::new(fields));
    let b = read::read(ctx, "gold", filter, &target).await?;
    let ids = enc.encode(&b)?;
    let start = b
        .column(keys.len())
        .as_primitive::<TimestampMicrosecondType>();
    let wanted: BooleanArray = ids
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let s = start.value(i);
            Some(!start.is_null(i) && (touched.windows.contains(&(*key, s)) || finalised(s)))
        })
        .collect();
    let b = filter_record_batch(&b, &wanted)?;
    crate::columns::conform(&b, agg_schema)
}

/// The windows of `assigned` (the day's recomputed rows) that hold a row of the late
/// ledger, as `key… @ start`.
#[allow(clippy::too_many_arguments)]
async fn too_late_windows(
    lctx: &SessionContext,
    keys: &[String],
    window: &WindowSpec,
    assigned: &RecordBatch,
    (from, to): (Micros, Micros),
    (lo, hi): (Micros, Micros),
    bronze: &SchemaRef,
) -> Result<Vec<String>> {
    let mut cols: Vec<String> = keys.to_vec();
    cols.push("event_ts".into());
    cols.push("event_id".into());
    let schema = agg::project(bronze, &cols)?;
    let filter = read::dates_in(late::PARTITION, &agg::dates_of(&[(from, to)]))
        .and(read::in_ranges("event_ts", &[(from, to)]));
    let rows = read::read(lctx, "late", filter, &schema).await?;
    if rows.num_rows() == 0 {
        return Ok(Vec::new());
    }
    let ts = crate::columns::event_ts(&rows)?;
    let key_cols: Vec<String> = keys.to_vec();
    let fk = formatters(&rows, &key_cols)?;
    let mut out: BTreeMap<String, ()> = BTreeMap::new();
    match window {
        WindowSpec::Session { .. } => {
            // The session of the late row: same key, start ≤ ts ≤ end.
            let ak = formatters(assigned, &key_cols)?;
            let starts = crate::columns::int64(assigned, agg::WINDOW_START)?;
            let ends = crate::columns::int64(assigned, agg::SESSION_END)?;
            let mut sessions: HashMap<String, Vec<(Micros, Micros)>> = HashMap::new();
            for i in 0..assigned.num_rows() {
                sessions
                    .entry(row_string(&ak, i))
                    .or_default()
                    .push((starts.value(i), ends.value(i)));
            }
            for i in 0..rows.num_rows() {
                let k = row_string(&fk, i);
                let t = ts.value(i);
                if let Some(s) = sessions
                    .get(&k)
                    .and_then(|v| v.iter().find(|(s, e)| *s <= t && t <= *e))
                {
                    out.insert(
                        format!("{} @ {}", k.replace('\u{1f}', " ").trim_end(), iso(s.0)),
                        (),
                    );
                }
            }
        }
        _ => {
            for i in 0..rows.num_rows() {
                let k = row_string(&fk, i);
                window.each_window(ts.value(i), |start, _| {
                    if start >= lo && start < hi {
                        out.insert(
                            format!("{} @ {}", k.replace('\u{1f}', " ").trim_end(), iso(start)),
                            (),
                        );
                    }
                });
            }
        }
    }
    Ok(out.into_keys().collect())
}

/// The rows a batch recomputes its windows from: the older applied bronze rows (ingestion
/// batches up to `older`) in `ranges`, then the batch's own applied rows, already in
/// memory.
async fn recompute_rows(
    ctx: Option<&SessionContext>,
    ranges: &[(Micros, Micros)],
    older: i64,
    cutoffs: &[Cutoff],
    applied: &RecordBatch,
) -> Result<RecordBatch> {
    match recompute_parts(ctx, ranges, older, cutoffs, applied)
        .await?
        .as_slice()
    {
        [one] => Ok(one.clone()),
        parts => Ok(arrow::compute::concat_batches(&applied.schema(), parts)?),
    }
}

/// The rows of a recompute — the applied bronze rows of `ranges` from ingestion batches up
/// to `older` (as the read produced them), then `applied` — not concatenated: window
/// assignment takes each batch's rows of the touched windows ([`agg::assign_windows_in`]).
/// The applied rows are always the last part.
async fn recompute_parts(
    ctx: Option<&SessionContext>,
    ranges: &[(Micros, Micros)],
    older: i64,
    cutoffs: &[Cutoff],
    applied: &RecordBatch,
) -> Result<Vec<RecordBatch>> {
    let (Some(ctx), false) = (ctx, ranges.is_empty()) else {
        return Ok(vec![applied.clone()]);
    };
    let mut parts = read::read_applied_parts(
        Some(ctx),
        "bronze",
        ranges,
        read::Applied {
            upto: older,
            cutoffs,
        },
        None,
        &applied.schema(),
    )
    .await?;
    parts.push(applied.clone());
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use crate::operator::testing::{order, Harness};

    const JOB: &str = r#"
name = "rev"
schedule = "0 */5 * * * *"
sources = ["orders"]
keys = ["sku"]
[window]
kind = "tumbling"
size = "5m"
[aggregates]
orders = "count(*)"
revenue_cents = "sum(amount_cents)"
[time]
watermark_delay = "30s"
idle_timeout = "1h"
lookback = "10m"
late_policy = "side_output"
"#;

    const GOLD: &str = "SELECT sku, window_start, orders, revenue_cents, is_final FROM t \
                        ORDER BY sku, window_start";

    /// The windowed operator over in-memory tables, batch by batch: in order, out of
    /// order, a late event inside the lookback correcting a final window, one outside it
    /// going to the late ledger and the counter, and a restart between batches. Its
    /// aggregates combine, so its batches after the first fold into gold.
    #[tokio::test]
    async fn windows_follow_event_time_in_memory() {
        five_cases(true).await;
    }

    /// The same batches recomputing every touched window from bronze.
    #[tokio::test]
    async fn windows_recomputed_from_bronze_follow_event_time_alike() {
        five_cases(false).await;
    }

    /// The job of `toml`, folding (its aggregates must combine) or recomputing.
    async fn job_folding(h: &Harness, toml: &str, fold: bool) -> crate::job::spec::JobSpec {
        let mut job = h.job(toml).await;
        let Some(w) = job
            .operator
            .as_any()
            .downcast_ref::<super::Windowed>()
            .cloned()
        else {
            panic!("{:?}", job.operator);
        };
        assert!(w.folds.is_some(), "count(*) and sum(amount_cents) fold");
        if !fold {
            job.operator = std::sync::Arc::new(super::Windowed { folds: None, ..w });
        }
        job
    }

    async fn five_cases(fold: bool) {
        let mut h = Harness::new("2026-12-01T12:00:00Z");
        let job = job_folding(&h, JOB, fold).await;
        // In order (and out of order within the batch): W = 10:06 − 30 s.
        h.land(
            "orders",
            "2026-12-01T10:06:10Z",
            &[
                order("e2", "10:03:00", "A", 200),
                order("e1", "10:01:00", "A", 100),
                order("e3", "10:04:00", "B", 50),
                order("e4", "10:06:00", "A", 10),
            ],
        );
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["applied"], m["too_late"]), (4, 4, 0));
        assert_eq!((m["windows"], m["corrections"]), (3, 0));
        assert_eq!(
            h.rows("gold/rev", GOLD).await,
            [
                "A|2026-12-01T10:00:00Z|2|300|true",
                "A|2026-12-01T10:05:00Z|1|10|false",
                "B|2026-12-01T10:00:00Z|1|50|true",
            ]
        );
        // A restart: the state goes through its durable form.
        h.restart();
        // Late inside the lookback (cut-off 09:55:30): a correction of A@10:00; late
        // outside it: the late ledger and the counter, no window.
        h.land(
            "orders",
            "2026-12-01T10:19:40Z",
            &[
                order("e5", "10:02:00", "A", 1000),
                order("e6", "09:50:00", "A", 7),
                order("e7", "10:19:00", "B", 5),
            ],
        );
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["applied"], m["too_late"]), (3, 2, 1));
        // A@10:00 corrected, B@10:15 new, A@10:05 turned final.
        assert_eq!((m["windows"], m["corrections"]), (3, 1));
        assert_eq!(
            h.rows("gold/rev", GOLD).await,
            [
                "A|2026-12-01T10:00:00Z|3|1300|true",
                "A|2026-12-01T10:05:00Z|1|10|true",
                "B|2026-12-01T10:00:00Z|1|50|true",
                "B|2026-12-01T10:15:00Z|1|5|false",
            ]
        );
        assert_eq!(
            h.rows("late/rev", "SELECT event_id, _reason, _cutoff FROM t")
                .await,
            [
                "e6|event_ts before the watermark (2026-12-01T10:05:30Z) minus lookback (600s): \
              its windows are closed|2026-12-01T09:55:30Z"
            ]
        );
        // Nothing new: no window changes.
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["windows"]), (0, 0));
    }

    /// A job without keys: one row per window, folded like any other.
    #[tokio::test]
    async fn a_job_without_keys_has_one_row_per_window() {
        for fold in [true, false] {
            let mut h = Harness::new("2026-12-01T12:00:00Z");
            let job = job_folding(&h, &JOB.replace("keys = [\"sku\"]", "keys = []"), fold).await;
            let batches = [
                (
                    "10:06:10",
                    [("e1", "10:01:00", "A", 100), ("e2", "10:03:00", "B", 50)],
                ),
                (
                    "10:08:10",
                    [("e3", "10:02:00", "A", 7), ("e4", "10:07:00", "B", 1)],
                ),
            ];
            for (landed, events) in batches {
                let events = events.map(|(id, ts, sku, cents)| order(id, ts, sku, cents));
                h.land("orders", &format!("2026-12-01T{landed}Z"), &events);
                h.run(&job).await;
            }
            assert_eq!(
                h.rows(
                    "gold/rev",
                    "SELECT window_start, orders, revenue_cents FROM t ORDER BY window_start"
                )
                .await,
                ["2026-12-01T10:00:00Z|3|157", "2026-12-01T10:05:00Z|1|1"],
                "fold: {fold}"
            );
        }
    }

    const SESSIONS: &str = r#"
name = "visits"
schedule = "0 */5 * * * *"
sources = ["orders"]
keys = ["sku"]
[window]
kind = "session"
gap = "10m"
[aggregates]
orders = "count(*)"
[time]
watermark_delay = "30s"
idle_timeout = "1h"
lookback = "1h"
"#;

    const OPEN: &str = "SELECT sku, session_start, session_end, orders, watermark FROM t \
                        ORDER BY sku, session_start";

    /// A session job keeps the sessions open at its watermark as a table: sessions turn
    /// final and leave it as W passes their end + gap, a late event rewrites a closed
    /// session without reopening it, a batch with nothing new keeps it, and a warehouse
    /// without the table starts it from the gold sessions not yet final.
    #[tokio::test]
    async fn open_sessions_are_a_table() {
        let mut h = Harness::new("2026-12-01T12:00:00Z");
        let job = h.job(SESSIONS).await;
        h.land(
            "orders",
            "2026-12-01T10:03:10Z",
            &[
                order("e1", "10:00:00", "A", 1),
                order("e2", "10:03:00", "A", 1),
                order("e3", "10:01:00", "B", 1),
            ],
        );
        h.run(&job).await;
        assert_eq!(
            h.rows("gold/visits_open", OPEN).await,
            [
                "A|2026-12-01T10:00:00Z|2026-12-01T10:03:00Z|2|2026-12-01T10:02:30Z",
                "B|2026-12-01T10:01:00Z|2026-12-01T10:01:00Z|1|2026-12-01T10:02:30Z",
            ]
        );
        // W = 10:19:30: A (until 10:13) and B (until 10:11) are final; C opens.
        h.land(
            "orders",
            "2026-12-01T10:20:00Z",
            &[order("e4", "10:20:00", "C", 1)],
        );
        h.run(&job).await;
        assert_eq!(
            h.rows("gold/visits_open", OPEN).await,
            ["C|2026-12-01T10:20:00Z|2026-12-01T10:20:00Z|1|2026-12-01T10:19:30Z"]
        );
        // Late for A (its session grows, still final); C goes on.
        h.restart();
        h.land(
            "orders",
            "2026-12-01T10:22:10Z",
            &[
                order("e5", "10:05:00", "A", 1),
                order("e6", "10:22:00", "C", 1),
            ],
        );
        h.run(&job).await;
        let want = ["C|2026-12-01T10:20:00Z|2026-12-01T10:22:00Z|2|2026-12-01T10:21:30Z"];
        assert_eq!(h.rows("gold/visits_open", OPEN).await, want);
        assert_eq!(
            h.rows(
                "gold/visits",
                "SELECT orders, is_final FROM t WHERE sku = 'A'"
            )
            .await,
            ["3|true"]
        );
        h.run(&job).await;
        assert_eq!(h.rows("gold/visits_open", OPEN).await, want);
        // Without the table (an older warehouse), the next batch starts it from gold.
        h.port.remove("gold/visits_open");
        h.land(
            "orders",
            "2026-12-01T10:23:10Z",
            &[order("e7", "10:23:00", "D", 1)],
        );
        h.run(&job).await;
        assert_eq!(
            h.rows("gold/visits_open", OPEN).await,
            [
                "C|2026-12-01T10:20:00Z|2026-12-01T10:22:00Z|2|2026-12-01T10:22:30Z",
                "D|2026-12-01T10:23:00Z|2026-12-01T10:23:00Z|1|2026-12-01T10:22:30Z",
            ]
        );
    }
}
