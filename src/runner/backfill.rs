//! `kestrel backfill --job J --from DATE --to DATE`: recompute a job's gold rows for a
//! range of dates from bronze — a restatement (windowed, payment and stock-out jobs).
//!
//! - Input: every bronze row the job has consumed (ingestion batches up to the job's
//!   position), *including* rows that were too late for the live job: they are in bronze,
//!   and a backfill is the deliberate place to apply them. So the result equals the
//!   incremental one except in windows holding too-late rows; those are reported.
//! - One day at a time (the gold table's date partition): a window (or session) belongs
//!   to the day it starts in, an order to the day of its order_ts (an orphan payment to
//!   its first payment's). A day reads the history its rows need: events of the day plus
//!   one window length after it; for sessions, one gap before the day (to know where
//!   sessions start) and as far after it as sessions starting in the day run; for the
//!   payment jobs, every order_id with a line or payment that day, with all its lines and
//!   payments within `horizon` of the day; for stock-outs, every sku with an event that
//!   day, replayed from its last `count` before the day (its state's history).
//! - Days are recomputed `parallel_days` at a time (1 locally; `[engine] parallel_days`,
//!   default 4, on a cluster, whose executors run their reads side by side); their
//!   MERGEs commit one by one in date order.
//! - The day's recomputed rows are compared with its gold rows; only windows that change
//!   (new, different or gone) are MERGEd, in one commit per day (app id
//!   `kestrel-backfill-<job>`). A re-run changes nothing: idempotent.
//! - It holds the job's lease (waiting for a running batch of the job to finish), so a
//!   backfill and the scheduler or `kestrel run` never write the job's tables at once.
//! - Progress is durable (`_kestrel/backfill/<job>.json`): stopped with Ctrl-C (between
//!   days) or killed, the same command resumes with the first day not done, as long as
//!   the job's input is unchanged; otherwise it starts over (every day is idempotent).
//! - `is_final` follows the job's current watermark; the live job's state is untouched.
//!   A later live correction of a restated window (only possible inside the lookback)
//!   recomputes it from applied rows again, without the too-late ones.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;

use arrow::array::{ArrayRef, RecordBatch, StringArray};
use arrow::datatypes::SchemaRef;
use datafusion::common::ScalarValue;
use serde::{Deserialize, Serialize};
use tracing::info;

use super::batch::JobRunner;
use super::StopFlag;
use crate::error::{Error, Result};
use crate::job::aggregate::{self as agg};
use crate::job::plan;
use crate::job::spec::JobSpec;
use crate::lease::Lease;
use crate::names;

/// Why a backfill does not start or stops before its last day.
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    #[error("`{job}` runs always-on ({owner}): stop its stream to backfill it")]
    Streamed { job: String, owner: String },
    #[error("--from {from} is after --to {to}")]
    EmptyRange { from: String, to: String },
    #[error("stopped while waiting for the job's lease")]
    StoppedWaiting,
    #[error("`{0}` has not run yet: a backfill restates what the job has consumed; run `kestrel run --job {0}` first")]
    NeverRan(String),
    #[error(
        "interrupted before {day}: {done} of {days} days done; run the same command to resume"
    )]
    Interrupted { day: String, done: usize, days: i32 },
    #[error("`{job}` cannot be backfilled: {why}")]
    NoDays { job: String, why: String },
    #[error("backfill progress: {0}")]
    Progress(#[from] serde_json::Error),
}
use crate::columns::{formatters, row_string};
use crate::operator::{read, DayInput, Restated};
use crate::runlog;
use crate::sink::delta;
use crate::sink::merge::{self, MergeSpec};
use crate::time::date;

/// What to backfill.
#[derive(Debug, Clone, Default)]
pub struct BackfillOptions {
    /// First and last window date, inclusive (days since the epoch).
    pub from: i32,
    pub to: i32,
    /// Set on Ctrl-C: stop between days (the command is resumable).
    pub stop: Option<StopFlag>,
}

/// One day's outcome.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DayReport {
    pub date: String,
    /// Windows (or sessions) starting that day after the recompute.
    pub windows: usize,
    /// Windows whose row was inserted, changed or deleted.
    pub changed: usize,
    pub deleted: usize,
    /// Windows holding rows that were too late for the live job, as `key… @ start`.
    pub with_too_late_rows: Vec<String>,
    /// Done by an earlier, interrupted run of the same backfill.
    pub resumed: bool,
}

/// The whole backfill.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BackfillReport {
    pub job: String,
    pub from: String,
    pub to: String,
    /// The job batch whose input was restated (its consumed ingestion batches).
    pub as_of_batch: i64,
    pub days: Vec<DayReport>,
}

impl BackfillReport {
    pub fn changed(&self) -> usize {
        self.days.iter().map(|d| d.changed).sum()
    }
    pub fn windows(&self) -> usize {
        self.days.iter().map(|d| d.windows).sum()
    }
    pub fn with_too_late_rows(&self) -> usize {
        self.days.iter().map(|d| d.with_too_late_rows.len()).sum()
    }
}

/// Something to tell the user while it runs.
#[derive(Debug, Clone)]
pub enum Progress<'a> {
    /// Waiting for a running batch of the job (its lease holder).
    Waiting(&'a str),
    /// Resuming: these days were done by an interrupted run.
    Resuming(usize),
    Day(&'a DayReport),
}

/// The durable progress of a backfill.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Checkpoint {
    from: i32,
    to: i32,
    as_of_batch: i64,
    done: Vec<i32>,
}

/// Parse `YYYY-MM-DD` to a day number.
pub fn parse_date(s: &str) -> std::result::Result<i32, String> {
    let d = chrono::NaiveDate::parse_from_str(s.trim(), "%Y-%m-%d")
        .map_err(|e| format!("expected a date YYYY-MM-DD, got {s:?} ({e})"))?;
    let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).unwrap_or_default();
    Ok((d - epoch).num_days() as i32)
}

impl JobRunner {
    /// Restate `spec`'s windows of `opts.from ..= opts.to`; see the module docs.
    pub async fn backfill(
        &self,
        spec: &JobSpec,
        opts: &BackfillOptions,
        mut progress: impl FnMut(Progress<'_>),
    ) -> Result<BackfillReport> {
        if let Some(why) = spec.operator.no_days() {
            return Err(BackfillError::NoDays {
                job: spec.name.clone(),
                why: why.to_string(),
            }
            .into());
        }
        if let Some(owner) = Lease::stream_owner(&self.wh, &spec.name).await? {
            return Err(BackfillError::Streamed {
                job: spec.name.clone(),
                owner,
            }
            .into());
        }
        if opts.from > opts.to {
            return Err(BackfillError::EmptyRange {
                from: date(opts.from),
                to: date(opts.to),
            }
            .into());
        }
        let name = names::lease::job(&spec.name);
        let mut announced = false;
        let mut lease = loop {
            match Lease::acquire(&self.wh, &name, self.lease_ttl).await {
                Ok(l) => break l,
                Err(Error::LeaseHeld { owner, .. }) => {
                    if !announced {
                        progress(Progress::Waiting(&owner));
                        announced = true;
                    }
                    if opts.stop.as_ref().is_some_and(|s| s.stopped()) {
                        return Err(BackfillError::StoppedWaiting.into());
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        };
        let result = self
            .backfill_days(spec, opts, &mut lease, &mut progress)
            .await;
        if let Err(e) = lease.release().await {
            tracing::warn!(job = %spec.name, error = %e, "could not release lease");
        }
        result
    }

    async fn backfill_days(
        &self,
        spec: &JobSpec,
        opts: &BackfillOptions,
        lease: &mut Lease,
        progress: &mut impl FnMut(Progress<'_>),
    ) -> Result<BackfillReport> {
        let done_batch = runlog::last_batch(&self.wh, "job", &spec.name).await?;
        let state = match plan::read_result(&self.wh, &spec.name, done_batch).await? {
            Some(r) if done_batch > 0 => r.state,
            _ => return Err(BackfillError::NeverRan(spec.name.clone()).into()),
        };
        let key = names::key::backfill_progress(&spec.name);
        let fresh = Checkpoint {
            from: opts.from,
            to: opts.to,
            as_of_batch: done_batch,
            done: Vec::new(),
        };
        let mut ck = match self.wh.loc.get_opt(&key).await? {
            Some(raw) => match serde_json::from_slice::<Checkpoint>(&raw) {
                Ok(c)
                    if c.from == fresh.from && c.to == fresh.to && c.as_of_batch == done_batch =>
                {
                    progress(Progress::Resuming(c.done.len()));
                    c
                }
                _ => fresh,
            },
            None => fresh,
        };
        let mut report = BackfillReport {
            job: spec.name.clone(),
            from: date(opts.from),
            to: date(opts.to),
            as_of_batch: done_batch,
            days: Vec::new(),
        };
        // Every source's bronze as `bronze_<source>`.
        let cx = self.context();
        let ctx = cx.sources_session(spec).await?;
        let late = cx.open(&names::table::late(&spec.name), "late").await?;
        let input = DayInput {
            watermark: state.watermark.current,
            positions: state.positions.clone(),
            as_of_batch: done_batch,
            ctx,
            late,
        };
        // Days are independent (a day reads bronze as of the same batch, and its own
        // gold partition), so several are recomputed at once — on a cluster their reads
        // run side by side on the executors — while their MERGEs, one commit each, go
        // in date order here.
        let pending: Vec<i32> = (opts.from..=opts.to)
            .filter(|d| !ck.done.contains(d))
            .collect();
        let input = &input;
        let mut restated = futures::stream::iter(pending.into_iter().map(|day| async move {
            let r = spec
                .operator
                .restate(&self.context(), spec, day, input)
                .await;
            (day, r)
        }))
        .buffered(self.parallel_days.max(1));
        for day in opts.from..=opts.to {
            if ck.done.contains(&day) {
                let d = DayReport {
                    date: date(day),
                    resumed: true,
                    ..Default::default()
                };
                progress(Progress::Day(&d));
                report.days.push(d);
                continue;
            }
            if opts.stop.as_ref().is_some_and(|s| s.stopped()) {
                return Err(BackfillError::Interrupted {
                    day: date(day),
                    done: ck.done.len(),
                    days: opts.to - opts.from + 1,
                }
                .into());
            }
            let r = match restated.next().await {
                Some((d, r)) if d == day => r?,
                _ => {
                    return Err(Error::Panicked {
                        what: format!("backfill of {} at {}", spec.name, date(day)),
                        message: "days were recomputed out of order".into(),
                    })
                }
            };
            let d = self.apply_restated(spec, day, r).await?;
            ck.done.push(day);
            let body = serde_json::to_vec_pretty(&ck).map_err(BackfillError::from)?;
            self.wh.loc.put(&key, body).await?;
            crate::fault::point("backfill_after_day");
            lease.renew(self.lease_ttl).await?;
            progress(Progress::Day(&d));
            report.days.push(d);
        }
        self.wh.loc.delete_if_exists(&key).await?;
        Ok(report)
    }

    /// Compare `r` with the day's gold partition and MERGE the windows that changed (new,
    /// different, gone) in one commit.
    async fn apply_restated(&self, spec: &JobSpec, day: i32, r: Restated) -> Result<DayReport> {
        let Restated {
            rows: new,
            gold_schema,
            ident,
            partition,
            partitions,
            with_too_late,
        } = r;
        // A table created by an earlier release may lack a column (the hour partition):
        // compare and write only the columns it has.
        let current = self.wh.open(&spec.table).await?;
        let (gold_schema, new) = match &current {
            Some(t) => {
                let has = delta::table_columns(t)?;
                let keep: Vec<usize> = (0..gold_schema.fields().len())
                    .filter(|i| has.contains(gold_schema.field(*i).name()))
                    .collect();
                let fitted: SchemaRef = std::sync::Arc::new(gold_schema.project(&keep)?);
                let new = read::conform(&new, &agg::merge_schema(&fitted))?;
                (fitted, new)
            }
            None => (gold_schema, new),
        };
        let values: Vec<String> = gold_schema
            .fields()
            .iter()
            .map(|f| f.name().clone())
            // Processing-time and bookkeeping columns are not data.
            .filter(|n| {
                !ident.contains(n)
                    && !["_updated_at", "_batch_id", "detected_at"].contains(&n.as_str())
            })
            .collect();
        let existing = match current {
            Some(t) => {
                let gctx = delta::session_with(&t, "gold").await?;
                read::read(
                    &gctx,
                    "gold",
                    read::dates_in(partition, &[day]),
                    &gold_schema,
                )
                .await?
            }
            None => RecordBatch::new_empty(gold_schema.clone()),
        };
        let old_map: HashMap<String, (String, usize)> = {
            let (fk, fv) = (
                formatters(&existing, &ident)?,
                formatters(&existing, &values)?,
            );
            (0..existing.num_rows())
                .map(|i| (row_string(&fk, i), (row_string(&fv, i), i)))
                .collect()
        };
        let mut changed_idx: Vec<u32> = Vec::new();
        let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
        {
            let (fk, fv) = (formatters(&new, &ident)?, formatters(&new, &values)?);
            for i in 0..new.num_rows() {
                let k = row_string(&fk, i);
                let v = row_string(&fv, i);
                if old_map.get(&k).is_none_or(|(ov, _)| *ov != v) {
                    changed_idx.push(i as u32);
                }
                seen.insert(k);
            }
        }
        let mut gone_idx: Vec<u32> = old_map
            .iter()
            .filter(|(k, _)| !seen.contains(*k))
            .map(|(_, (_, i))| *i as u32)
            .collect();
        gone_idx.sort_unstable();

        let report = DayReport {
            date: date(day),
            windows: new.num_rows(),
            changed: changed_idx.len() + gone_idx.len(),
            deleted: gone_idx.len(),
            with_too_late_rows: with_too_late,
            resumed: false,
        };
        if report.changed == 0 {
            return Ok(report);
        }
        let mut merge_rows = vec![arrow::compute::take_record_batch(
            &new,
            &arrow::array::UInt32Array::from(changed_idx),
        )?];
        if !gone_idx.is_empty() {
            let gone = arrow::compute::take_record_batch(
                &existing,
                &arrow::array::UInt32Array::from(gone_idx),
            )?;
            let mut cols: Vec<ArrayRef> = gone.columns().to_vec();
            cols.push(std::sync::Arc::new(StringArray::from(vec![
                "delete";
                gone.num_rows()
            ])));
            merge_rows.push(RecordBatch::try_new(agg::merge_schema(&gold_schema), cols)?);
        }
        let out = self.context().gold_output(
            spec,
            gold_schema.clone(),
            merge_rows,
            partitions,
            Vec::new(),
        );
        let (table, out) = self.open_gold(out).await?;
        let app = names::app::backfill(&spec.name);
        let version = delta::txn_version(&table, &app).await?.unwrap_or(0) + 1;
        let ms = MergeSpec {
            keys: &out.keys,
            partitions: vec![(partition, vec![ScalarValue::Date32(Some(day))])],
            columns: gold_schema
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect(),
            op_column: agg::OP,
            cluster: out.cluster,
        };
        let (_, counts) = merge::merge(table, out.rows, &ms, &app, version).await?;
        info!(
            job = %spec.name,
            day = %report.date,
            changed = report.changed,
            updated = counts.updated,
            inserted = counts.inserted,
            deleted = counts.deleted,
            "backfill merge"
        );
        Ok(report)
    }
}
