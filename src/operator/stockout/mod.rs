//! One batch of the `stockout` job: the reads and state around the pure operator in
//! [`crate::operator::stockout::detect`]. The exactly-once protocol is the one in [`super::batch`],
//! with two gold MERGEs: `gold/stockout_alerts` (txn `kestrel-job-stockout`), then
//! `gold/sku_availability` (txn `kestrel-job-stockout-availability`), which also holds
//! the operator's per-sku state and so is committed last: a batch is recomputed until
//! it is, always from the state before the batch.
//!
//! Reads are bounded by the lateness cut-off `c` = W − lookback at batch start: new rows
//! by ingestion batch; the events the cut-off passes in this batch (to move each sku's
//! base); the replayed skus' events at or after `c`; the touched skus' alerts from
//! `c`'s date on; the touched skus' state by bucket.

pub mod detect;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use arrow::array::RecordBatch;
use datafusion::common::ScalarValue;
use datafusion::prelude::{col, lit};

use crate::error::Result;
use crate::job::aggregate::{self as agg, DAY};
use crate::job::plan::{JobPlan, JobState};
use crate::job::spec::JobSpec;
use crate::job::spec::{check_columns, Fields};
use crate::names;
use crate::operator::metrics::{InputCounts, Metrics};
use crate::operator::read::{self, consumed_in, take_new_rows, NewRows};
use crate::operator::stockout::detect::{self as so, AlertChanges, Event, SkuState, Start};
use crate::operator::{Computed, Context, DayInput, GoldRows, Operator, Restated, Write};
use crate::schema::SourceSchema;
use crate::sink::late;
use crate::time::micros;
use crate::time::{iso, Micros};
use std::sync::Arc;

const MINUTE: Micros = 60_000_000;

fn columns(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// A `_key` batch of skus (for semi joins).
fn keys_batch<'a>(skus: impl Iterator<Item = &'a String>) -> Result<RecordBatch> {
    read::keys_batch(skus.map(String::as_str))
}

/// Stock-out detection over one inventory source: alerts per (sku, minute) in the job's
/// table, then each sku's availability (its state) in `availability_table`; the one
/// operator that also runs always-on.
#[derive(Debug, Clone, PartialEq)]
pub struct Stockout {
    pub availability_table: String,
}

/// What one batch of the stock-out job did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StockoutMetrics {
    pub input: InputCounts,
    /// Skus with new events.
    pub skus: i64,
    /// Of those, skus replayed from their base (a late event before their last one).
    pub replayed: i64,
    /// Skus whose base the lateness cut-off moved.
    pub bases_moved: i64,
    /// Alert rows upserted, and deleted (a late event cancelled a stock-out).
    pub alerts_upserted: i64,
    pub alerts_deleted: i64,
    /// Alert changes in minutes the watermark had already closed.
    pub corrections: i64,
}

impl Metrics for StockoutMetrics {
    fn input(&self) -> InputCounts {
        self.input
    }
    fn outputs(&self) -> (i64, i64, i64) {
        (self.alerts_upserted, self.alerts_deleted, self.corrections)
    }
}

/// The stock-out operator: one inventory source with the columns it reads, and
/// `[params] availability_table` (default `gold/sku_availability`).
pub(crate) fn parse(
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    use crate::schema::FieldType as T;
    if sources.len() != 1 {
        return Err(top.err("sources", "one inventory source (e.g. [\"inventory\"])"));
    }
    check_columns(
        top,
        &sources[0],
        &[
            ("sku", T::String),
            ("event_ts", T::Timestamp),
            ("event_id", T::String),
            ("kind", T::String),
            ("quantity", T::Int64),
        ],
        schemas,
    )?;
    let mut availability_table = names::table::SKU_AVAILABILITY.to_string();
    if let Some(p) = top.sub("params")? {
        p.only(&["availability_table"])?;
        if let Some(t) = p.str_opt("availability_table")? {
            if !names::table::is_gold(t) {
                return Err(p.err(
                    "availability_table",
                    format!("a path under gold/, got {t:?}"),
                ));
            }
            availability_table = t.to_string();
        }
    }
    Ok(Arc::new(Stockout { availability_table }))
}

#[async_trait::async_trait]
impl Operator for Stockout {
    fn more_outputs(&self, spec: &JobSpec) -> Vec<crate::operator::Output> {
        vec![crate::operator::Output {
            table: self.availability_table.clone(),
            app: names::app::availability(&spec.name),
        }]
    }

    fn can_stream(&self) -> bool {
        true
    }

    fn deferred_output(&self, spec: &JobSpec) -> Option<crate::operator::pending::DeferredOutput> {
        Some(crate::operator::pending::DeferredOutput {
            table: self.availability_table.clone(),
            app: names::app::availability(&spec.name),
            key: "sku",
            partition: so::BUCKET,
            parts: 0..so::BUCKETS as i32,
        })
    }

    fn merge_keys(&self, given: Option<Vec<String>>) -> std::result::Result<Vec<String>, String> {
        crate::operator::natural_keys(given, &["sku", "minute"], "the alerts' key")
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
        let (availability_table, mut state) = (self.availability_table.as_str(), before);
        let source = &spec.sources[0];
        let bronze = cx.source_schema(source)?.bronze.clone();
        let input = plan.input(source)?;
        let lookback = micros(spec.time.lookback);
        let now = cx.now_us();
        let ctx = cx.open(&names::table::bronze(source), "bronze").await?;
        let event_cols = agg::project(&bronze, &columns(&so::INPUT))?;

        // 1. New rows: too-late ones aside; advance the watermark.
        let w_before = state.watermark.current;
        let cutoff = w_before.map(|w| w - lookback);
        let mut new_cols = columns(&so::INPUT);
        new_cols.extend(columns(&["_source_partition", "_landed_at"]));
        let t = std::time::Instant::now();
        // Every read of this job starts at or after the batch's cut-off.
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
            input,
            &agg::project(&bronze, &new_cols)?,
            &bronze,
            cutoff,
            0,
            &mut state,
        )
        .await?;
        let read_new_ms = t.elapsed().as_millis() as u64;
        let late_rows = match cutoff {
            Some(c) if too_late.num_rows() > 0 => {
                let w = w_before.unwrap_or(c);
                let why = late::reason(w, spec.time.lookback);
                Some(late::rows(&too_late, plan.batch_id, w, c, &why, now)?)
            }
            _ => None,
        };
        let w_after = state.watermark.advance();
        let upto = input.upto_batch;
        let cutoffs = state.cutoffs.get(source).cloned().unwrap_or_default();
        let cutoff_after = w_after.map(|w| w - lookback);
        let lo = cutoff.unwrap_or(Micros::MIN / 2);

        // 2. Touched skus, and the events the cut-off passes in this batch. The rows
        // themselves are not needed after this (a million skus' rows: ~75 MB).
        let new_events = so::events_by_sku(&applied)?;
        let input_counts = InputCounts::of(
            &new,
            &applied,
            &too_late,
            (w_before, w_after),
            oldest_landed,
        );
        drop((new, applied, too_late));
        let passed = match cutoff_after {
            Some(ca) if ca > lo => {
                let applied = read::Applied {
                    upto,
                    cutoffs: &cutoffs,
                };
                let rows = read::read_applied(
                    ctx.as_ref(),
                    "bronze",
                    &[(lo, ca)],
                    applied,
                    None,
                    &event_cols,
                )
                .await?;
                so::events_by_sku(&rows)?
            }
            _ => BTreeMap::new(),
        };
        let skus: BTreeSet<&String> = new_events.keys().chain(passed.keys()).collect();
        let t = std::time::Instant::now();
        let mut states = sku_states(cx, availability_table, skus.iter().copied()).await?;
        let state_ms = t.elapsed().as_millis() as u64;

        // 3. Each touched sku continues from its state or replays from its base.
        let replay: Vec<&String> = new_events
            .iter()
            .filter(|(sku, ev)| {
                let st = states.get(*sku).cloned().unwrap_or_default();
                ev.first()
                    .is_some_and(|e| Start::choose(&st, &e.key) == Start::Replay)
            })
            .map(|(sku, _)| sku)
            .collect();
        let replayed = if replay.is_empty() {
            BTreeMap::new()
        } else {
            let hi = new_events
                .values()
                .filter_map(|v| v.last().map(|e| e.key.ts))
                .chain(
                    states
                        .values()
                        .filter_map(|s| s.current.after.as_ref().map(|k| k.ts)),
                )
                .max()
                .unwrap_or(lo)
                + 1;
            let keys = keys_batch(replay.iter().copied())?;
            let applied = read::Applied {
                upto,
                cutoffs: &cutoffs,
            };
            let b = read::read_applied(
                ctx.as_ref(),
                "bronze",
                &[(lo, hi.max(lo + 1))],
                applied,
                Some(("sku", &keys)),
                &event_cols,
            )
            .await?;
            so::events_by_sku(&b)?
        };
        let mut computed: BTreeMap<&String, (Option<Micros>, Vec<so::Stockout>)> = BTreeMap::new();
        let mut next: BTreeMap<String, SkuState> = BTreeMap::new();
        for (sku, events) in &new_events {
            let st = states.remove(sku).unwrap_or_default();
            let (from, evs): (&so::Point, Vec<Event>) = if replay.contains(&sku) {
                let after = st.base.after.clone();
                let evs = replayed
                    .get(sku)
                    .map(|v| {
                        v.iter()
                            .filter(|e| after.as_ref().is_none_or(|a| e.key > *a))
                            .cloned()
                            .collect()
                    })
                    .unwrap_or_default();
                (&st.base, evs)
            } else {
                (&st.current, events.clone())
            };
            let (point, stockouts) = so::apply(from, &evs);
            computed.insert(sku, (from.after.as_ref().map(|k| k.ts), stockouts));
            next.insert(
                sku.clone(),
                SkuState {
                    current: point,
                    base: st.base,
                },
            );
        }
        // 4. Move every base the cut-off passed.
        if let Some(ca) = cutoff_after {
            for (sku, events) in &passed {
                let st = match next.get_mut(sku) {
                    Some(s) => s,
                    None => next
                        .entry(sku.clone())
                        .or_insert(states.remove(sku).unwrap_or_default()),
                };
                let after = st.base.after.clone();
                let evs: Vec<Event> = events
                    .iter()
                    .filter(|e| after.as_ref().is_none_or(|a| e.key > *a))
                    .cloned()
                    .collect();
                st.base = so::advance_base(&st.base, &evs, ca);
            }
        }

        // 5. Alerts against the rows the touched skus have: a replayed sku's from the
        // cut-off on; a continuing sku's only in the minutes of its new stock-outs (it has
        // no alert after its last event), which file statistics prune to a few files.
        let mut minutes_of: BTreeMap<&String, Vec<Micros>> = BTreeMap::new();
        for (sku, (_, stockouts)) in &computed {
            if !replay.contains(sku) && !stockouts.is_empty() {
                minutes_of.insert(*sku, so::per_minute(stockouts).into_keys().collect());
            }
        }
        let t = std::time::Instant::now();
        let existing =
            existing_alerts(cx, spec, &replay, &minutes_of, lo, w_after, &computed).await?;
        let alerts_ms = t.elapsed().as_millis() as u64;
        let mut changes = AlertChanges::default();
        for (sku, (span, stockouts)) in &computed {
            let ex = existing.get(*sku).map(Vec::as_slice).unwrap_or(&[]);
            let c = so::reconcile_alerts(sku, *span, stockouts, ex, now);
            changes.upserts.extend(c.upserts);
            changes.deletes.extend(c.deletes);
        }
        let closed = |m: Micros| w_before.is_some_and(|w| m + MINUTE <= w);
        let corrections = changes
            .upserts
            .iter()
            .chain(&changes.deletes)
            .filter(|a| closed(a.minute))
            .count();
        tracing::info!(
            job = %spec.name,
            read_new_ms,
            state_ms,
            alerts_ms,
            "stock-outs evaluated"
        );
        let metrics = StockoutMetrics {
            input: input_counts,
            skus: new_events.len() as i64,
            replayed: replay.len() as i64,
            bases_moved: passed.len() as i64,
            alerts_upserted: changes.upserts.len() as i64,
            alerts_deleted: changes.deletes.len() as i64,
            corrections: corrections as i64,
        };
        // New alerts only (the usual case): an append, not a MERGE over the day's files.
        let append_only = changes.deletes.is_empty()
            && changes.upserts.iter().all(|a| {
                existing
                    .get(&a.sku)
                    .is_none_or(|ex| ex.iter().all(|e| e.minute != a.minute))
            });
        let alerts = so::alert_rows(&changes, plan.batch_id, now)?;
        let availability = so::availability_rows(&next, plan.batch_id, now)?;
        let mut alerts_out = cx.gold_output(
            spec,
            so::alerts_schema(),
            vec![alerts],
            &[so::ALERT_DATE],
            Vec::new(),
        );
        if append_only {
            alerts_out.write = Write::Append;
        }
        let gold = vec![
            alerts_out,
            GoldRows {
                table: availability_table.to_string(),
                app: names::app::availability(&spec.name),
                keys: vec![("sku".to_string(), false)],
                schema: so::availability_schema(),
                rows: vec![availability],
                partitions: vec![so::BUCKET],
                cluster: None,
                extra_partitions: Vec::new(),
                write: Write::Merge,
            },
        ];
        Computed::new(plan, state, &metrics, late_rows, gold)
    }

    /// The stock-out alerts of minutes on `day`: every sku with an event that day,
    /// replayed from its last `count` before the day (or its first event) through the
    /// day. `detected_at` of an alert that exists is kept. `sku_availability` (the live
    /// job's state) is not restated.
    async fn restate(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        day: i32,
        input: &DayInput,
    ) -> Result<Restated> {
        let (ctx, late_ctx) = (&input.ctx, input.late.as_ref());
        let (lo, hi) = (day as Micros * DAY, (day as Micros + 1) * DAY);
        let source = &spec.sources[0];
        let bronze = cx.source_schema(source)?.bronze.clone();
        let table = read::session_table(source);
        let pos = input.position(source);
        let sku_ts = agg::project(&bronze, &["sku".to_string(), "event_ts".to_string()])?;
        let touched = read::read(ctx, &table, consumed_in((lo, hi), pos), &sku_ts).await?;
        let skus: std::collections::BTreeSet<String> = crate::columns::string(&touched, "sku")?
            .iter()
            .flatten()
            .map(str::to_string)
            .collect();
        let keys = read::keys_batch(skus.iter().map(String::as_str))?;
        // Where each sku's replay starts: its last count before the day.
        let counts = if skus.is_empty() {
            RecordBatch::new_empty(sku_ts.clone())
        } else {
            let filter = col("kind")
                .eq(lit("count"))
                .and(col("event_ts").lt(read::ts_lit(lo)))
                .and(col("_batch_id").lt_eq(lit(pos)));
            read::read_keys(ctx, &table, filter, "sku", &keys, &sku_ts).await?
        };
        let mut start: HashMap<String, Micros> = HashMap::new();
        {
            let (sku, ts) = (
                crate::columns::string(&counts, "sku")?,
                crate::columns::event_ts(&counts)?,
            );
            for i in 0..counts.num_rows() {
                let e = start.entry(sku.value(i).to_string()).or_insert(Micros::MIN);
                *e = (*e).max(ts.value(i));
            }
        }
        let from = if skus.iter().all(|s| start.contains_key(s)) {
            start.values().copied().min().unwrap_or(lo)
        } else {
            Micros::MIN / 2 // a sku that never had a count: its whole history
        };
        let cols: Vec<String> = so::INPUT.iter().map(|c| c.to_string()).collect();
        let target = agg::project(&bronze, &cols)?;
        let events = if skus.is_empty() {
            RecordBatch::new_empty(target)
        } else {
            let filter =
                read::in_ranges("event_ts", &[(from, hi)]).and(col("_batch_id").lt_eq(lit(pos)));
            let filter = if hi - from < 1100 * DAY {
                read::dates_in(crate::schema::EVENT_DATE, &agg::dates_of(&[(from, hi)])).and(filter)
            } else {
                filter
            };
            read::read_keys(ctx, &table, filter, "sku", &keys, &target).await?
        };
        // Existing alerts of the day keep their detected_at.
        let existing = match cx.open(&spec.table, "alerts").await? {
            Some(gctx) => {
                let b = read::read(
                    &gctx,
                    "alerts",
                    read::dates_in(so::ALERT_DATE, &[day]),
                    &so::alerts_schema(),
                )
                .await?;
                so::alerts_from(&b)?
            }
            None => BTreeMap::new(),
        };
        let now = cx.now_us();
        let mut changes = so::AlertChanges::default();
        for (sku, evs) in so::events_by_sku(&events)? {
            let begin = start.get(&sku).copied().unwrap_or(Micros::MIN);
            let evs: Vec<so::Event> = evs.into_iter().filter(|e| e.key.ts >= begin).collect();
            let (_, stockouts) = so::apply(&so::Point::default(), &evs);
            for (minute, st) in so::per_minute(&stockouts) {
                if minute < lo || minute >= hi {
                    continue;
                }
                let detected_at = existing
                    .get(&sku)
                    .and_then(|v| v.iter().find(|a| a.minute == minute))
                    .map_or(now, |a| a.detected_at);
                changes.upserts.push(so::Alert {
                    sku: sku.clone(),
                    minute,
                    first_stockout_ts: st.ts,
                    on_hand: st.on_hand,
                    detected_at,
                });
            }
        }
        let rows = so::alert_rows(&changes, input.as_of_batch, now)?;
        // Alerts of a sku with a too-late event in its replay before the alert.
        let with_too_late = match late_ctx {
            Some(lctx) if !skus.is_empty() => {
                let filter = read::in_ranges("event_ts", &[(from, hi)]);
                let filter = if hi - from < 1100 * DAY {
                    read::dates_in(late::PARTITION, &agg::dates_of(&[(from, hi)])).and(filter)
                } else {
                    filter
                };
                let late_rows =
                    read::read_keys(lctx, "late", filter, "sku", &keys, &sku_ts).await?;
                let (sku, ts) = (
                    crate::columns::string(&late_rows, "sku")?,
                    crate::columns::event_ts(&late_rows)?,
                );
                let mut late_at: HashMap<&str, Vec<Micros>> = HashMap::new();
                for i in 0..late_rows.num_rows() {
                    late_at.entry(sku.value(i)).or_default().push(ts.value(i));
                }
                // Restated alerts and the day's existing ones (a late event can cancel one).
                let candidates = changes
                    .upserts
                    .iter()
                    .chain(existing.values().flatten())
                    .filter(|a| a.minute >= lo && a.minute < hi);
                let mut out: Vec<String> = candidates
                    .filter(|a| {
                        let begin = start.get(&a.sku).copied().unwrap_or(Micros::MIN);
                        late_at.get(a.sku.as_str()).is_some_and(|v| {
                            v.iter().any(|t| *t >= begin && *t <= a.first_stockout_ts)
                        })
                    })
                    .map(|a| format!("{} @ {}", a.sku, iso(a.minute)))
                    .collect();
                out.dedup();
                out.sort();
                out.dedup();
                out
            }
            _ => Vec::new(),
        };
        Ok(Restated {
            rows,
            gold_schema: so::alerts_schema(),
            ident: vec!["sku".to_string(), "minute".to_string()],
            partition: so::ALERT_DATE,
            partitions: &[so::ALERT_DATE],
            with_too_late,
        })
    }
}

/// The state of `skus` from the availability table (absent skus have none yet).
async fn sku_states<'a>(
    cx: &Context<'_>,
    table: &str,
    skus: impl Iterator<Item = &'a String> + Clone,
) -> Result<BTreeMap<String, SkuState>> {
    let mut buckets: Vec<i32> = skus.clone().map(|s| so::bucket_of(s)).collect();
    if buckets.is_empty() {
        return Ok(BTreeMap::new());
    }
    buckets.sort_unstable();
    buckets.dedup();
    let mut states = match cx.open(table, "state").await? {
        Some(ctx) => {
            let filter = col(so::BUCKET).in_list(
                buckets
                    .iter()
                    .map(|b| datafusion::prelude::lit(ScalarValue::Int32(Some(*b))))
                    .collect(),
                false,
            );
            let b = read::read_keys(
                &ctx,
                "state",
                filter,
                "sku",
                &keys_batch(skus.clone())?,
                &so::availability_schema(),
            )
            .await?;
            so::states_from(&b)?
        }
        None => BTreeMap::new(),
    };
    // The always-on mode's states not committed yet supersede the table's.
    let wanted: std::collections::HashSet<&str> = skus.map(String::as_str).collect();
    if let Some(p) = cx.pending_rows(table, &wanted)? {
        states.extend(so::states_from(&p)?);
    }
    Ok(states)
}

/// Existing alert rows: of the `replayed` skus from the date of `lo` (the cut-off:
/// every alert a replay can change lies at or after it) to the newest computed
/// stock-out; of the other skus in `minutes_of`, in those minutes only.
async fn existing_alerts(
    cx: &Context<'_>,
    spec: &JobSpec,
    replayed: &[&String],
    minutes_of: &BTreeMap<&String, Vec<Micros>>,
    lo: Micros,
    w_after: Option<Micros>,
    computed: &BTreeMap<&String, (Option<Micros>, Vec<so::Stockout>)>,
) -> Result<BTreeMap<String, Vec<so::Alert>>> {
    if replayed.is_empty() && minutes_of.is_empty() {
        return Ok(BTreeMap::new());
    }
    let Some(ctx) = cx.open(&spec.table, "alerts").await? else {
        return Ok(BTreeMap::new());
    };
    let mut out: BTreeMap<String, Vec<so::Alert>> = BTreeMap::new();
    let mut take = |b: RecordBatch| -> Result<()> {
        for (sku, rows) in so::alerts_from(&b)? {
            let v = out.entry(sku).or_default();
            for r in rows {
                if !v.contains(&r) {
                    v.push(r);
                }
            }
        }
        Ok(())
    };
    if !replayed.is_empty() {
        let hi = computed
            .values()
            .filter_map(|(_, s)| s.last().map(|s| s.ts))
            .chain(w_after)
            .max()
            .unwrap_or(lo)
            .max(lo)
            + 1;
        let lo_minute = lo.div_euclid(MINUTE) * MINUTE;
        let mut filter = col("minute").gt_eq(read::ts_lit(lo_minute));
        if hi - lo_minute < 1100 * agg::DAY {
            filter = read::dates_in(so::ALERT_DATE, &agg::dates_of(&[(lo_minute, hi)])).and(filter);
        }
        let keys = keys_batch(replayed.iter().copied())?;
        take(read::read_keys(&ctx, "alerts", filter, "sku", &keys, &so::alerts_schema()).await?)?;
    }
    if !minutes_of.is_empty() {
        let mut minutes: Vec<Micros> = minutes_of.values().flatten().copied().collect();
        minutes.sort_unstable();
        minutes.dedup();
        let days: Vec<i32> = {
            let mut d: Vec<i32> = minutes
                .iter()
                .map(|m| m.div_euclid(agg::DAY) as i32)
                .collect();
            d.dedup();
            d
        };
        let filter = read::dates_in(so::ALERT_DATE, &days)
            .and(col("minute").in_list(minutes.iter().map(|m| read::ts_lit(*m)).collect(), false));
        let keys = keys_batch(minutes_of.keys().copied())?;
        take(read::read_keys(&ctx, "alerts", filter, "sku", &keys, &so::alerts_schema()).await?)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::operator::testing::Harness;

    const JOB: &str = r#"
name = "so"
schedule = "0 */5 * * * *"
sources = ["inventory"]
operator = "stockout"
[time]
watermark_delay = "30s"
idle_timeout = "1h"
lookback = "10m"
late_policy = "side_output"
[sink]
table = "gold/so_alerts"
merge_keys = ["sku", "minute"]
[params]
availability_table = "gold/so_availability"
"#;

    fn ev(id: &str, ts: &str, sku: &str, kind: &str, q: i64) -> String {
        format!(
            r#"{{"event_id":"{id}","event_ts":"2026-12-01T{ts}Z","sku":"{sku}","warehouse_id":"w1","kind":"{kind}","quantity":{q}}}"#
        )
    }

    const ALERTS: &str = "SELECT sku, minute, on_hand FROM t ORDER BY sku, minute";
    const AVAILABILITY: &str = "SELECT sku, on_hand, available FROM t ORDER BY sku";

    /// The stock-out operator over in-memory tables: a stock-out in order, a late
    /// receipt inside the lookback cancelling it (the sku is replayed from its base), an
    /// event outside the lookback to the late ledger and the counter, a restart.
    #[tokio::test]
    async fn stockouts_follow_event_time_in_memory() {
        let mut h = Harness::new("2026-12-01T12:00:00Z");
        let job = h.job(JOB).await;
        h.land(
            "inventory",
            "2026-12-01T10:01:10Z",
            &[
                ev("a1", "10:00:00", "A", "count", 2),
                ev("b1", "10:00:00", "B", "count", 5),
                ev("a2", "10:01:00", "A", "sale", -2),
            ],
        );
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["skus"], m["alerts_upserted"]), (3, 2, 1));
        assert_eq!(
            h.rows("gold/so_alerts", ALERTS).await,
            ["A|2026-12-01T10:01:00Z|0"]
        );
        assert_eq!(
            h.rows("gold/so_availability", AVAILABILITY).await,
            ["A|0|false", "B|5|true"]
        );
        h.restart();
        // W was 10:00:30, so the cut-off is 09:50:30.
        h.land(
            "inventory",
            "2026-12-01T10:06:10Z",
            &[
                ev("a3", "10:00:30", "A", "receipt", 3),
                ev("b2", "09:40:00", "B", "sale", -1),
                ev("b3", "10:06:00", "B", "sale", -5),
            ],
        );
        let m = h.run(&job).await;
        assert_eq!((m["rows_in"], m["applied"], m["too_late"]), (3, 2, 1));
        assert_eq!(
            (m["replayed"], m["alerts_deleted"], m["alerts_upserted"]),
            (1, 1, 1)
        );
        assert_eq!(
            h.rows("gold/so_alerts", ALERTS).await,
            ["B|2026-12-01T10:06:00Z|0"]
        );
        assert_eq!(
            h.rows("gold/so_availability", AVAILABILITY).await,
            ["A|3|true", "B|0|false"]
        );
        assert_eq!(h.rows("late/so", "SELECT event_id FROM t").await, ["b2"]);
        let m = h.run(&job).await;
        assert_eq!(
            (m["rows_in"], m["alerts_upserted"], m["alerts_deleted"]),
            (0, 0, 0)
        );
    }
}
