//! The declarative windowed-aggregate operator: pure functions over Arrow record batches
//! of bronze rows (no I/O), shared by micro-batch runs and backfills.
//!
//! One batch of a job, in order:
//! 1. [`split_late`]: new rows older than `W − lookback` (W = watermark at batch start)
//!    are too late; the rest are applied.
//! 2. [`observe`] the new rows into the watermark, then advance it.
//! 3. [`Touched`]: the windows the applied rows fall in ([`SessionScope`] for sessions).
//! 4. The runner reads the older applied bronze rows of those windows and of the windows
//!    whose end the watermark passed in this batch (they turn final even if no new event
//!    hit them); [`assign_windows`] (or [`assign_sessions`]) gives each row its
//!    window(s), [`aggregate`] runs the job's SQL aggregates with DataFusion, and
//!    [`gold_rows`] adds `window_end`, `is_final`, `window_date` and the batch columns;
//!    [`tombstones`] remove sessions a late event merged away.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Date32Array, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMicrosecondArray, UInt32Array,
};
use arrow::compute::{cast, filter_record_batch, take_record_batch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimestampMicrosecondType};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;

use crate::error::{Error, Result};
pub use crate::job::keys::{FastMap, FastSet, KeyEncoder, KeyId};
use crate::schema::ts_type;
use crate::time::watermark::Watermark;
use crate::time::window::WindowSpec;
use crate::time::Micros;

/// Microseconds per day.
pub const DAY: Micros = 86_400_000_000;
/// Column holding a row's window start (micros) after assignment.
pub const WINDOW_START: &str = "window_start";
/// Column holding a session's end (micros) after session assignment.
pub const SESSION_END: &str = "session_end";
/// Merge-source column: `upsert` or `delete` (tombstone of a replaced session).
pub const OP: &str = "_op";

/// Bronze bookkeeping columns a job never reads.
pub const UNREAD_COLUMNS: [&str; 3] = ["_source_file", "_source_line", "_ingested_at"];

/// The bronze columns a job's recompute reads (and its aggregates may use): with
/// `only` (keys and the columns its aggregates read) those, the event time and the
/// columns the watermark and cut-offs need; without, every column but file/line
/// bookkeeping (what a job's expressions are planned against). Bronze order is kept.
pub fn job_input_schema(bronze: &Schema, only: Option<&[&[String]]>) -> SchemaRef {
    let wanted = |name: &str| match only {
        None => !UNREAD_COLUMNS.contains(&name),
        Some(sets) => {
            TIME_COLUMNS.contains(&name) || sets.iter().any(|s| s.iter().any(|c| c == name))
        }
    };
    Arc::new(Schema::new(
        bronze
            .fields()
            .iter()
            .filter(|f| wanted(f.name()))
            .map(|f| f.as_ref().clone())
            .collect::<Vec<_>>(),
    ))
}

/// Columns every recompute reads besides a job's own: event time, and what the
/// watermark (partition, arrival) and the cut-offs (ingestion batch) need.
const TIME_COLUMNS: [&str; 4] = ["event_ts", "_source_partition", "_landed_at", "_batch_id"];

/// Columns read for a batch's new rows: keys, event id and time, partition, arrival.
pub fn new_row_columns(keys: &[String]) -> Vec<String> {
    let mut cols: Vec<String> = keys.to_vec();
    for c in [
        "event_id",
        "event_ts",
        "_source_partition",
        "_landed_at",
        "_batch_id",
    ] {
        if !cols.iter().any(|k| k == c) {
            cols.push(c.to_string());
        }
    }
    cols
}

/// `schema` restricted to `columns` (in that order).
pub fn project(schema: &Schema, columns: &[String]) -> Result<SchemaRef> {
    let fields = columns
        .iter()
        .map(|c| {
            schema.field_with_name(c).cloned().map_err(|source| {
                Error::from(crate::columns::ColumnError::Cast {
                    name: c.to_string(),
                    source,
                })
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(Schema::new(fields)))
}

/// Split new rows into (applied, too late) against `cutoff` = W − lookback (None: no
/// watermark yet, nothing is late).
pub fn split_late(
    batch: &RecordBatch,
    cutoff: Option<Micros>,
) -> Result<(RecordBatch, RecordBatch)> {
    let Some(cutoff) = cutoff else {
        return Ok((batch.clone(), batch.slice(0, 0)));
    };
    let ts = crate::columns::event_ts(batch)?;
    let late: BooleanArray = ts
        .iter()
        .map(|t| Some(t.is_some_and(|t| t < cutoff)))
        .collect();
    let applied = arrow::compute::not(&late)?;
    Ok((
        filter_record_batch(batch, &applied)?,
        filter_record_batch(batch, &late)?,
    ))
}

/// Feed new rows of `source` into the watermark: per source partition, the greatest
/// event time and the newest arrival (`_landed_at`).
pub fn observe(w: &mut Watermark, source: &str, batch: &RecordBatch) -> Result<()> {
    let ts = crate::columns::event_ts(batch)?;
    let part = batch
        .column_by_name("_source_partition")
        .map(|c| cast(c, &DataType::Utf8))
        .transpose()?;
    let part = part.as_ref().map(|c| c.as_string::<i32>());
    let landed = batch
        .column_by_name("_landed_at")
        .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>());
    type Maxima<'a> = (&'a str, (Micros, Micros));
    let mut per: BTreeMap<&str, (Micros, Micros)> = BTreeMap::new();
    // Rows come in runs of one partition (a landed file's): the run's maxima are kept
    // here and go to `per` when the partition changes, not looked up row by row.
    let mut run: Option<Maxima<'_>> = None;
    fn flush<'a>(per: &mut BTreeMap<&'a str, (Micros, Micros)>, run: Option<Maxima<'a>>) {
        if let Some((p, (t, l))) = run {
            let e = per.entry(p).or_insert((Micros::MIN, Micros::MIN));
            e.0 = e.0.max(t);
            e.1 = e.1.max(l);
        }
    }
    for i in 0..batch.num_rows() {
        if ts.is_null(i) {
            continue;
        }
        let p = part.map_or(
            "default",
            |p| {
                if p.is_null(i) {
                    "default"
                } else {
                    p.value(i)
                }
            },
        );
        let l = landed.map_or(ts.value(i), |l| {
            if l.is_null(i) {
                ts.value(i)
            } else {
                l.value(i)
            }
        });
        let v = ts.value(i);
        if matches!(run, Some((q, _)) if q == p) {
            if let Some((_, e)) = &mut run {
                e.0 = e.0.max(v);
                e.1 = e.1.max(l);
            }
        } else {
            flush(&mut per, run.replace((p, (v, l))));
        }
    }
    flush(&mut per, run);
    for (p, (max_ts, newest)) in per {
        w.observe(source, p, max_ts, newest);
    }
    Ok(())
}

/// The (key, window start) pairs a batch recomputes, for tumbling and sliding windows.
#[derive(Debug, Default)]
pub struct Touched {
    /// Every (key, window start) to recompute.
    pub windows: FastSet<(KeyId, Micros)>,
    /// The subset touched by an applied new row whose window was already final at
    /// batch start: corrections.
    pub corrections: usize,
}

impl Touched {
    /// Windows of the applied new rows; those already final (end <= `w_before`) are
    /// corrections. Returns the rows' key ids (every window of theirs is touched now:
    /// [`assign_windows_in`] takes them as its last part's).
    pub fn add_applied(
        &mut self,
        enc: &mut KeyEncoder,
        spec: &WindowSpec,
        applied: &RecordBatch,
        w_before: Option<Micros>,
    ) -> Result<Vec<KeyId>> {
        let keys = enc.encode(applied)?;
        let ts = crate::columns::event_ts(applied)?;
        let mut corrected: FastSet<(KeyId, Micros)> = FastSet::default();
        for (i, key) in keys.iter().copied().enumerate() {
            if ts.is_null(i) {
                continue;
            }
            spec.each_window(ts.value(i), |start, end| {
                if w_before.is_some_and(|w| end <= w) {
                    corrected.insert((key, start));
                }
                self.windows.insert((key, start));
            });
        }
        self.corrections += corrected.len();
        Ok(keys)
    }

    /// Event-time ranges `[lo, hi)` covering the touched windows, merged.
    pub fn ranges(&self, spec: &WindowSpec) -> Vec<(Micros, Micros)> {
        let size = window_size(spec);
        let starts: Vec<Micros> = self.windows.iter().map(|(_, s)| *s).collect();
        merge_ranges(starts.into_iter().map(|s| (s, s + size)).collect())
    }
}

/// Length of a tumbling or sliding window (0 for sessions).
pub fn window_size(spec: &WindowSpec) -> Micros {
    match *spec {
        WindowSpec::Tumbling { size } | WindowSpec::Sliding { size, .. } => size,
        WindowSpec::Session { .. } => 0,
    }
}

/// Sort and merge overlapping or adjacent `[lo, hi)` ranges.
pub fn merge_ranges(r: Vec<(Micros, Micros)>) -> Vec<(Micros, Micros)> {
    merge_within(r, 1)
}

/// Sort `r` and merge ranges that start less than `within` after the previous one ends
/// (1: overlapping or adjacent; a session gap: events that close share a session).
fn merge_within(mut r: Vec<(Micros, Micros)>, within: Micros) -> Vec<(Micros, Micros)> {
    r.sort_unstable();
    let mut out: Vec<(Micros, Micros)> = Vec::with_capacity(r.len());
    for (lo, hi) in r {
        match out.last_mut() {
            Some(last) if lo.saturating_sub(last.1) < within => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// Event dates (days since the epoch) covered by `[lo, hi)` ranges.
pub fn dates_of(ranges: &[(Micros, Micros)]) -> Vec<i32> {
    let mut out: Vec<i32> = Vec::new();
    for &(lo, hi) in ranges {
        let (a, b) = (lo.div_euclid(DAY), (hi - 1).div_euclid(DAY));
        for d in a..=b {
            let d = d as i32;
            if out.last() != Some(&d) && !out.contains(&d) {
                out.push(d);
            }
        }
    }
    out.sort_unstable();
    out
}

fn append_int_columns(batch: &RecordBatch, cols: Vec<(&str, Vec<Micros>)>) -> Result<RecordBatch> {
    let mut fields: Vec<Arc<Field>> = batch.schema().fields().iter().cloned().collect();
    let mut arrays: Vec<ArrayRef> = batch.columns().to_vec();
    for (name, values) in cols {
        fields.push(Arc::new(Field::new(name, DataType::Int64, false)));
        arrays.push(Arc::new(Int64Array::from(values)));
    }
    Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?)
}

/// Rows of `rows` in the touched windows, one copy per window they fall in, with a
/// `window_start` column (micros). With `finalising = Some((w_before, w_after))`, the
/// windows of `rows` whose end lies in `(w_before, w_after]` are added to `touched`
/// first (they turn final in this batch), in the same pass.
pub fn assign_windows(
    enc: &mut KeyEncoder,
    spec: &WindowSpec,
    rows: &RecordBatch,
    touched: &mut Touched,
    finalising: Option<(Option<Micros>, Micros)>,
) -> Result<RecordBatch> {
    assign_windows_in(
        enc,
        spec,
        std::slice::from_ref(rows),
        touched,
        finalising,
        None,
    )?
    .pop()
    .ok_or_else(|| no_batches("window assignment"))
}

fn no_batches(what: &str) -> Error {
    arrow::error::ArrowError::InvalidArgumentError(format!("{what} of no batches")).into()
}

/// [`assign_windows`] over rows in several batches (of one schema, taken in order as if
/// concatenated), one output batch per input batch: a batch whose rows all stay (each in
/// one window) is passed on, the others are cut to their rows in touched windows. A
/// recompute's rows are the bronze read's batches and the new rows; concatenating them
/// first copied every row once more, and then again to take the touched windows' rows
/// (≈ 40 % of the job's own CPU time on 5M orders, `--bench jobs -- throughput`).
///
/// `applied`: the key ids of the last part when it is the applied new rows
/// [`Touched::add_applied`] returned them for: every window of theirs is touched, so
/// they are neither encoded again nor looked up (half the rows of a batch that reads
/// back as many as it brings; its assignment took 73–119 ms per 1.4M new rows).
pub fn assign_windows_in(
    enc: &mut KeyEncoder,
    spec: &WindowSpec,
    parts: &[RecordBatch],
    touched: &mut Touched,
    finalising: Option<(Option<Micros>, Micros)>,
    applied: Option<Vec<KeyId>>,
) -> Result<Vec<RecordBatch>> {
    let all_touched = match (&applied, parts.last()) {
        (Some(k), Some(last)) if k.len() == last.num_rows() => parts.len() - 1,
        (Some(k), last) => {
            return Err(arrow::error::ArrowError::InvalidArgumentError(format!(
                "window assignment: {} applied key ids for a last part of {} rows",
                k.len(),
                last.map_or(0, |b| b.num_rows())
            ))
            .into())
        }
        (None, _) => usize::MAX,
    };
    let mut applied = applied;
    let mut keys = Vec::with_capacity(parts.len());
    let mut stamps = Vec::with_capacity(parts.len());
    for (p, rows) in parts.iter().enumerate() {
        keys.push(match (p == all_touched, applied.take()) {
            (true, Some(k)) => k,
            (_, k) => {
                applied = k;
                enc.encode(rows)?
            }
        });
        stamps.push(crate::columns::event_ts(rows)?);
    }
    if let Some((b, a)) = finalising {
        for (keys, ts) in keys.iter().zip(&stamps) {
            for (i, key) in keys.iter().enumerate() {
                if ts.is_null(i) {
                    continue;
                }
                spec.each_window(ts.value(i), |start, end| {
                    if end <= a && b.is_none_or(|w| end > w) {
                        touched.windows.insert((*key, start));
                    }
                });
            }
        }
    }
    let mut out = Vec::with_capacity(parts.len());
    for (p, ((rows, keys), ts)) in parts.iter().zip(keys).zip(&stamps).enumerate() {
        let every = p == all_touched;
        let mut idx: Vec<u32> = Vec::with_capacity(rows.num_rows());
        let mut starts: Vec<Micros> = Vec::with_capacity(rows.num_rows());
        for (i, key) in keys.into_iter().enumerate() {
            if ts.is_null(i) {
                continue;
            }
            spec.each_window(ts.value(i), |start, _| {
                if every || touched.windows.contains(&(key, start)) {
                    idx.push(i as u32);
                    starts.push(start);
                }
            });
        }
        // Tumbling windows keeping every row need no copy.
        let all =
            idx.len() == rows.num_rows() && idx.iter().enumerate().all(|(i, x)| *x as usize == i);
        let taken = match all {
            true => rows.clone(),
            false => take_record_batch(rows, &UInt32Array::from(idx))?,
        };
        out.push(append_int_columns(&taken, vec![(WINDOW_START, starts)])?);
    }
    Ok(out)
}

/// A session found by [`assign_sessions`]: key, first and last event time.
pub type SessionBounds = (KeyId, Micros, Micros);

/// An existing gold session of a touched key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoldSession {
    pub key: KeyId,
    pub start: Micros,
    pub end: Micros,
    pub is_final: bool,
}

/// Which event-time spans to recompute per key for session windows, and which existing
/// sessions they replace.
///
/// A key's spans are disjoint, ascending and at least `gap` apart, so no session can
/// cross from one to the next: a touched user with one event hours late and one just now
/// has two short spans, not one that covers the hours between (whose sessions the batch
/// does not change, and would otherwise read from gold and bronze and rewrite).
#[derive(Debug)]
pub struct SessionScope {
    gap: Micros,
    /// Per key: `[lo, hi]` (inclusive) spans, bounded by true session boundaries once
    /// [`SessionScope::widen`]ed.
    pub spans: FastMap<KeyId, Vec<(Micros, Micros)>>,
    /// Existing sessions inside the spans (replaced: updated, or deleted if gone).
    pub replaced: Vec<GoldSession>,
    /// Keys touched by an applied new row (to count corrections).
    applied: FastMap<KeyId, Vec<Micros>>,
}

/// Gold lookups name at most this many event-time ranges (closer ones are read as one):
/// a filter term per range costs every row the read decodes.
pub const MAX_LOOKUP_RANGES: usize = 64;

/// Merge sorted, disjoint `ranges` across their smallest gaps until at most `max` are
/// left (the result covers every input range).
pub fn coalesce_ranges(ranges: Vec<(Micros, Micros)>, max: usize) -> Vec<(Micros, Micros)> {
    let max = max.max(1);
    if ranges.len() <= max {
        return ranges;
    }
    let mut gaps: Vec<(Micros, usize)> = ranges
        .windows(2)
        .enumerate()
        .map(|(i, w)| (w[1].0 - w[0].1, i))
        .collect();
    gaps.sort_unstable();
    // Join range i with i + 1 for the smallest len − max gaps.
    let mut join = vec![false; ranges.len()];
    for &(_, i) in gaps.iter().take(ranges.len() - max) {
        join[i] = true;
    }
    let mut out: Vec<(Micros, Micros)> = Vec::with_capacity(max);
    let mut open = false;
    for (i, r) in ranges.into_iter().enumerate() {
        match out.last_mut() {
            Some(last) if open => last.1 = last.1.max(r.1),
            _ => out.push(r),
        }
        open = join[i];
    }
    out
}

impl SessionScope {
    /// An empty scope for sessions that end at a gap of `gap`.
    pub fn new(gap: Micros) -> Self {
        SessionScope {
            gap,
            spans: FastMap::default(),
            replaced: Vec::new(),
            applied: FastMap::default(),
        }
    }

    /// Add touch events (keys and event times of `rows`); `applied` marks the batch's
    /// applied new rows (as opposed to rows touched only to finalise their session).
    pub fn touch(&mut self, enc: &mut KeyEncoder, rows: &RecordBatch, applied: bool) -> Result<()> {
        let keys = enc.encode(rows)?;
        let ts = crate::columns::event_ts(rows)?;
        let mut touched: Vec<KeyId> = Vec::new();
        for (i, key) in keys.into_iter().enumerate() {
            if ts.is_null(i) {
                continue;
            }
            let t = ts.value(i);
            self.spans.entry(key).or_default().push((t, t));
            touched.push(key);
            if applied {
                self.applied.entry(key).or_default().push(t);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for key in touched {
            if let Some(spans) = self.spans.get_mut(&key) {
                *spans = merge_within(std::mem::take(spans), self.gap);
            }
        }
        Ok(())
    }

    /// Event-time ranges `[lo, hi]` to look for existing sessions in: every span widened
    /// by `gap`, merged, at most [`MAX_LOOKUP_RANGES`] of them. Empty: nothing touched.
    pub fn lookup_ranges(&self) -> Vec<(Micros, Micros)> {
        let gap = self.gap;
        let r = merge_ranges(
            self.spans
                .values()
                .flatten()
                .map(|&(lo, hi)| (lo - gap, hi + gap))
                .collect(),
        );
        coalesce_ranges(r, MAX_LOOKUP_RANGES)
    }

    /// Widen each key's spans to the existing sessions within `gap` of them, so every
    /// span starts and ends at true session boundaries; spans a session links (or that
    /// come within `gap` of each other) become one. `existing` are the gold sessions of
    /// the looked-up ranges (any keys).
    pub fn widen(&mut self, existing: Vec<GoldSession>) {
        let gap = self.gap;
        let mut by_key: FastMap<KeyId, Vec<GoldSession>> = FastMap::default();
        for s in existing {
            if self.spans.contains_key(&s.key) {
                by_key.entry(s.key).or_default().push(s);
            }
        }
        for (key, mut sessions) in by_key {
            sessions.sort_by_key(|s| s.start);
            let Some(spans) = self.spans.get_mut(&key) else {
                continue;
            };
            // Grow until no existing session within `gap` of a span is left out: a
            // session chain may link several existing sessions through new events.
            let mut taken = vec![false; sessions.len()];
            loop {
                let mut grew = false;
                for (i, s) in sessions.iter().enumerate() {
                    if taken[i] {
                        continue;
                    }
                    if let Some(span) = spans
                        .iter_mut()
                        .find(|span| s.end > span.0 - gap && s.start < span.1 + gap)
                    {
                        taken[i] = true;
                        span.0 = span.0.min(s.start);
                        span.1 = span.1.max(s.end);
                        grew = true;
                    }
                }
                if !grew {
                    break;
                }
                *spans = merge_within(std::mem::take(spans), gap);
            }
            for (i, s) in sessions.into_iter().enumerate() {
                if taken[i] {
                    self.replaced.push(s);
                }
            }
        }
    }

    /// Whether event time `t` of `key` lies in one of its spans.
    fn covers(&self, key: &KeyId, t: Micros) -> bool {
        self.spans.get(key).is_some_and(|spans| {
            let i = spans.partition_point(|s| s.1 < t);
            spans.get(i).is_some_and(|s| s.0 <= t)
        })
    }

    /// Event-time ranges `[lo, hi)` to read from bronze, merged.
    pub fn ranges(&self) -> Vec<(Micros, Micros)> {
        merge_ranges(
            self.spans
                .values()
                .flatten()
                .map(|&(lo, hi)| (lo, hi + 1))
                .collect(),
        )
    }

    /// Number of new sessions that hold an applied new row and replace a session that
    /// was already final: corrections.
    pub fn corrections(&self, sessions: &[SessionBounds]) -> usize {
        sessions
            .iter()
            .filter(|(key, start, end)| {
                let hit = self
                    .applied
                    .get(key)
                    .is_some_and(|ts| ts.iter().any(|t| t >= start && t <= end));
                hit && self
                    .replaced
                    .iter()
                    .any(|g| g.is_final && g.key == *key && g.start <= *end && g.end >= *start)
            })
            .count()
    }
}

/// Assign sessions to the rows of `rows` that lie in their key's span: per key, events in
/// event-time order, a gap `>= gap` starts a new session. Adds `window_start` (the
/// session start) and `session_end` columns; returns the sessions found.
pub fn assign_sessions(
    enc: &mut KeyEncoder,
    rows: &RecordBatch,
    scope: &SessionScope,
    gap: Micros,
) -> Result<(RecordBatch, Vec<SessionBounds>)> {
    let keys = enc.encode(rows)?;
    let ts = crate::columns::event_ts(rows)?;
    let mut per_key: FastMap<KeyId, Vec<(Micros, u32)>> = FastMap::default();
    for (i, key) in keys.into_iter().enumerate() {
        if ts.is_null(i) {
            continue;
        }
        let t = ts.value(i);
        if scope.covers(&key, t) {
            per_key.entry(key).or_default().push((t, i as u32));
        }
    }
    let mut idx: Vec<u32> = Vec::new();
    let mut starts: Vec<Micros> = Vec::new();
    let mut ends: Vec<Micros> = Vec::new();
    let mut sessions = Vec::new();
    for (key, mut events) in per_key {
        // The gap rule lives in `time::window::sessions`; its sessions come in event-time
        // order, so each takes the next `events` rows of the sorted list.
        events.sort_unstable();
        let times: Vec<Micros> = events.iter().map(|e| e.0).collect();
        let mut rest = events.iter();
        for s in crate::time::window::sessions(&times, gap) {
            for e in rest.by_ref().take(s.events) {
                idx.push(e.1);
                starts.push(s.start);
                ends.push(s.end);
            }
            sessions.push((key, s.start, s.end));
        }
    }
    let taken = take_record_batch(rows, &UInt32Array::from(idx))?;
    let out = append_int_columns(&taken, vec![(WINDOW_START, starts), (SESSION_END, ends)])?;
    Ok((out, sessions))
}

fn quoted(cols: &[String]) -> Vec<String> {
    cols.iter().map(|c| format!("\"{c}\"")).collect()
}

/// Run the job's aggregates over assigned rows with DataFusion: one row per
/// (keys, window_start[, session_end]). Returns the result's schema and rows.
pub async fn aggregate(
    assigned: RecordBatch,
    keys: &[String],
    aggregates: &[(String, String)],
    session: bool,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    aggregate_parts(vec![assigned], keys, aggregates, session).await
}

/// [`aggregate`] of rows in several batches of one schema ([`assign_windows_in`]'s).
pub async fn aggregate_parts(
    assigned: Vec<RecordBatch>,
    keys: &[String],
    aggregates: &[(String, String)],
    session: bool,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let ctx = SessionContext::new_with_config(
        datafusion::prelude::SessionConfig::new().with_target_partitions(2),
    );
    let schema = assigned
        .first()
        .map(|b| b.schema())
        .ok_or_else(|| no_batches("aggregation"))?;
    let table =
        MemTable::try_new(schema, vec![assigned]).map_err(|e| Error::query("window rows", e))?;
    ctx.register_table("w", Arc::new(table))
        .map_err(|e| Error::query("window rows", e))?;
    let mut group = quoted(keys);
    group.push(format!("\"{WINDOW_START}\""));
    if session {
        group.push(format!("\"{SESSION_END}\""));
    }
    let aggs: Vec<String> = aggregates
        .iter()
        .map(|(c, e)| format!("{e} AS \"{c}\""))
        .collect();
    let g = group.join(", ");
    let sql = format!("SELECT {g}, {} FROM w GROUP BY {g}", aggs.join(", "));
    let df = ctx.sql(&sql).await.map_err(|e| Error::query(&sql, e))?;
    let out_schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
    let rows = df.collect().await.map_err(|e| Error::query(&sql, e))?;
    Ok((out_schema, rows))
}

/// Gold table schema: keys, window start/end (or session start/end), aggregates,
/// `is_final`, `window_date` (partition), `_updated_at`, `_batch_id`. All nullable.
pub fn gold_schema(agg_schema: &Schema, keys: &[String], session: bool) -> SchemaRef {
    let (start, end) = if session {
        ("session_start", "session_end")
    } else {
        ("window_start", "window_end")
    };
    let mut fields: Vec<Field> = Vec::new();
    for k in keys {
        if let Ok(f) = agg_schema.field_with_name(k) {
            fields.push(Field::new(k, plain_type(f.data_type()), true));
        }
    }
    fields.push(Field::new(start, ts_type(), true));
    fields.push(Field::new(end, ts_type(), true));
    for f in agg_schema.fields() {
        let n = f.name().as_str();
        if keys.iter().any(|k| k == n) || n == WINDOW_START || n == SESSION_END {
            continue;
        }
        fields.push(Field::new(n, plain_type(f.data_type()), true));
    }
    fields.push(Field::new("is_final", DataType::Boolean, true));
    fields.push(Field::new("window_date", DataType::Date32, true));
    fields.push(Field::new(WINDOW_HOUR, DataType::Int32, true));
    fields.push(Field::new("_updated_at", ts_type(), true));
    fields.push(Field::new("_batch_id", DataType::Int64, true));
    Arc::new(Schema::new(fields))
}

/// Second partition column of windowed gold tables: the UTC hour (0–23) of the window's
/// (session's) start, under `window_date`. A batch's windows are the last hour or two,
/// and a MERGE rewrites every file holding a row it changes (copy-on-write), so with
/// hourly partitions it rewrites an hour's rows, not the whole open day's.
pub const WINDOW_HOUR: &str = "window_hour";

/// The UTC hour of day (0–23) of a timestamp.
pub fn hour_of(ts: Micros) -> i32 {
    (ts.rem_euclid(DAY) / (3_600 * 1_000_000)) as i32
}

/// Delta has no view types: store Utf8View as Utf8, BinaryView as Binary.
fn plain_type(t: &DataType) -> DataType {
    match t {
        DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
        DataType::BinaryView | DataType::LargeBinary => DataType::Binary,
        other => other.clone(),
    }
}

/// The gold schema plus the merge-source `_op` column.
pub fn merge_schema(gold: &Schema) -> SchemaRef {
    let mut fields: Vec<Field> = gold.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(OP, DataType::Utf8, true));
    Arc::new(Schema::new(fields))
}

/// Columns shared by every gold row of one batch.
#[derive(Debug, Clone, Copy)]
pub struct GoldStamp {
    /// Watermark after the batch (None: no watermark yet, nothing final).
    pub w_after: Option<Micros>,
    /// Added to a window's end before comparing with W (the gap for sessions).
    pub final_after: Micros,
    pub batch_id: i64,
    pub now_us: Micros,
}

/// Aggregated rows → merge-source rows (`_op = 'upsert'`) of the gold schema `gold`.
pub fn gold_rows(
    agg: &[RecordBatch],
    gold: &SchemaRef,
    spec: &WindowSpec,
    stamp: GoldStamp,
) -> Result<Vec<RecordBatch>> {
    let session = matches!(spec, WindowSpec::Session { .. });
    let size = window_size(spec);
    let target = merge_schema(gold);
    let mut out = Vec::with_capacity(agg.len());
    for b in agg {
        let n = b.num_rows();
        let start = crate::columns::int64(b, WINDOW_START)?;
        let end: Vec<Micros> = if session {
            crate::columns::int64(b, SESSION_END)?.values().to_vec()
        } else {
            start.values().iter().map(|s| s + size).collect()
        };
        let mut cols: Vec<ArrayRef> = Vec::with_capacity(target.fields().len());
        for f in target.fields() {
            let name = f.name().as_str();
            let arr: ArrayRef = match name {
                "window_start" | "session_start" => Arc::new(
                    TimestampMicrosecondArray::from(start.values().to_vec()).with_timezone("UTC"),
                ),
                "window_end" | "session_end" => {
                    Arc::new(TimestampMicrosecondArray::from(end.clone()).with_timezone("UTC"))
                }
                "is_final" => Arc::new(BooleanArray::from(
                    end.iter()
                        .map(|e| stamp.w_after.is_some_and(|w| e + stamp.final_after <= w))
                        .collect::<Vec<bool>>(),
                )),
                "window_date" => Arc::new(Date32Array::from(
                    start
                        .values()
                        .iter()
                        .map(|s| s.div_euclid(DAY) as i32)
                        .collect::<Vec<i32>>(),
                )),
                WINDOW_HOUR => Arc::new(Int32Array::from(
                    start
                        .values()
                        .iter()
                        .map(|s| hour_of(*s))
                        .collect::<Vec<i32>>(),
                )),
                "_updated_at" => Arc::new(
                    TimestampMicrosecondArray::from(vec![stamp.now_us; n]).with_timezone("UTC"),
                ),
                "_batch_id" => Arc::new(Int64Array::from(vec![stamp.batch_id; n])),
                OP => Arc::new(StringArray::from(vec!["upsert"; n])),
                other => {
                    let c = b.column_by_name(other).ok_or_else(|| {
                        Error::from(crate::columns::ColumnError::Missing(other.to_string()))
                    })?;
                    cast(c, f.data_type())?
                }
            };
            cols.push(arr);
        }
        out.push(RecordBatch::try_new(target.clone(), cols)?);
    }
    Ok(out)
}

/// Tombstones (`_op = 'delete'`) for replaced sessions that no longer exist: key
/// columns, `session_start` and `window_date` set, the rest null.
pub fn tombstones(
    gone: &[GoldSession],
    key_columns: &[ArrayRef],
    gold: &SchemaRef,
    keys: &[String],
) -> Result<RecordBatch> {
    let target = merge_schema(gold);
    let n = gone.len();
    let mut cols: Vec<ArrayRef> = Vec::with_capacity(target.fields().len());
    for f in target.fields() {
        let name = f.name().as_str();
        let arr: ArrayRef = if let Some(i) = keys.iter().position(|k| k == name) {
            cast(&key_columns[i], f.data_type())?
        } else {
            match name {
                "session_start" => Arc::new(
                    TimestampMicrosecondArray::from(
                        gone.iter().map(|g| g.start).collect::<Vec<_>>(),
                    )
                    .with_timezone("UTC"),
                ),
                "window_date" => Arc::new(Date32Array::from(
                    gone.iter()
                        .map(|g| g.start.div_euclid(DAY) as i32)
                        .collect::<Vec<i32>>(),
                )),
                WINDOW_HOUR => Arc::new(Int32Array::from(
                    gone.iter().map(|g| hour_of(g.start)).collect::<Vec<i32>>(),
                )),
                OP => Arc::new(StringArray::from(vec!["delete"; n])),
                _ => arrow::array::new_null_array(f.data_type(), n),
            }
        };
        cols.push(arr);
    }
    Ok(RecordBatch::try_new(target, cols)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::watermark::Watermark;

    const M: Micros = 60_000_000;

    fn rows(data: &[(&str, Micros)]) -> RecordBatch {
        let data: Vec<_> = data.iter().map(|(k, t)| (*k, Some(*t))).collect();
        rows_of(&data, false)
    }

    /// Rows of (sku, event time) with amount 1; `nullable`: event times may be null.
    fn rows_of(data: &[(&str, Option<Micros>)], nullable: bool) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("sku", DataType::Utf8, false),
            Field::new("event_ts", ts_type(), nullable),
            Field::new("amount", DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from(
                    data.iter().map(|d| d.0).collect::<Vec<_>>(),
                )),
                Arc::new(
                    TimestampMicrosecondArray::from(data.iter().map(|d| d.1).collect::<Vec<_>>())
                        .with_timezone("UTC"),
                ),
                Arc::new(Int64Array::from(vec![1; data.len()])),
            ],
        )
        .unwrap()
    }

    fn keys() -> Vec<String> {
        vec!["sku".to_string()]
    }

    #[test]
    fn late_rows_are_those_before_the_cutoff() {
        let b = rows(&[("a", 10 * M), ("a", 2 * M), ("b", 5 * M)]);
        let (applied, late) = split_late(&b, Some(5 * M)).unwrap();
        assert_eq!((applied.num_rows(), late.num_rows()), (2, 1));
        let (applied, late) = split_late(&b, None).unwrap();
        assert_eq!((applied.num_rows(), late.num_rows()), (3, 0));
    }

    #[test]
    fn observe_uses_event_time_when_no_arrival_column() {
        let mut w = Watermark::new(&["orders"], 0, 5 * M);
        observe(&mut w, "orders", &rows(&[("a", 10 * M), ("a", 3 * M)])).unwrap();
        assert_eq!(w.advance(), Some(10 * M));
    }

    /// Rows of partitions in runs, interleaved, with null partitions and arrival times:
    /// each partition's maxima are those of its rows, looked at one by one.
    #[test]
    fn observe_keeps_each_partitions_maxima_over_interleaved_runs() {
        let data: [(Option<&str>, Micros, Option<Micros>); 8] = [
            (Some("0"), 5 * M, Some(20 * M)),
            (Some("0"), 9 * M, Some(21 * M)),
            (Some("1"), 3 * M, Some(30 * M)),
            (None, 7 * M, None),
            (Some("0"), 2 * M, Some(25 * M)),
            (Some("1"), 11 * M, Some(22 * M)),
            (None, M, Some(40 * M)),
            (Some("0"), 8 * M, None),
        ];
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_ts", ts_type(), false),
            Field::new("_source_partition", DataType::Utf8, true),
            Field::new("_landed_at", ts_type(), true),
        ]));
        let b = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(
                    TimestampMicrosecondArray::from(data.iter().map(|d| d.1).collect::<Vec<_>>())
                        .with_timezone("UTC"),
                ),
                Arc::new(StringArray::from(
                    data.iter().map(|d| d.0).collect::<Vec<_>>(),
                )),
                Arc::new(
                    TimestampMicrosecondArray::from(data.iter().map(|d| d.2).collect::<Vec<_>>())
                        .with_timezone("UTC"),
                ),
            ],
        )
        .unwrap();
        let mut w = Watermark::new(&["orders"], 0, 5 * M);
        observe(&mut w, "orders", &b).unwrap();
        let mut want = crate::time::watermark::SourceWatermark::default();
        for (p, ts, landed) in data {
            want.observe(p.unwrap_or("default"), ts, landed.unwrap_or(ts));
        }
        assert_eq!(w.sources["orders"], want);
        assert_eq!(want.partitions.len(), 3);
    }

    #[tokio::test]
    async fn sliding_windows_recompute_only_touched_pairs_and_count_corrections() {
        let spec = WindowSpec::Sliding {
            size: 10 * M,
            slide: 5 * M,
        };
        let b = rows(&[("a", 12 * M), ("b", M)]);
        let mut enc = KeyEncoder::new(&b.schema(), &keys()).unwrap();
        let mut t = Touched::default();
        // W = 11 min at batch start: window [0,10) of b is final → a correction
        t.add_applied(&mut enc, &spec, &b, Some(11 * M)).unwrap();
        assert_eq!(t.windows.len(), 4); // a: [5,15) [10,20); b: [-5,5) [0,10)
        assert_eq!(t.corrections, 2); // b's two windows both ended by 11 min
        assert_eq!(t.ranges(&spec), vec![(-5 * M, 20 * M)]);
        // bronze holds one more row of a in [10,20) and one of c (not touched)
        let bronze = rows(&[("a", 12 * M), ("a", 17 * M), ("b", M), ("c", 12 * M)]);
        let assigned = assign_windows(&mut enc, &spec, &bronze, &mut t, None).unwrap();
        assert_eq!(assigned.num_rows(), 5); // a@12 ×2, a@17 ×1 ([10,20)), b@1 ×2
        let aggs = vec![("n".to_string(), "count(*)".to_string())];
        let (schema, out) = aggregate(assigned, &keys(), &aggs, false).await.unwrap();
        let gold = gold_schema(&schema, &keys(), false);
        let stamp = GoldStamp {
            w_after: Some(16 * M),
            final_after: 0,
            batch_id: 7,
            now_us: 0,
        };
        let g = gold_rows(&out, &gold, &spec, stamp).unwrap();
        let g = arrow::compute::concat_batches(&g[0].schema(), &g).unwrap();
        assert_eq!(g.num_rows(), 4);
        let mut got: Vec<(String, i64, i64, bool)> = (0..g.num_rows())
            .map(|i| {
                (
                    g.column_by_name("sku")
                        .unwrap()
                        .as_string::<i32>()
                        .value(i)
                        .to_string(),
                    crate::columns::int64(&g, "window_start").unwrap().value(i) / M,
                    crate::columns::int64(&g, "n").unwrap().value(i),
                    g.column_by_name("is_final").unwrap().as_boolean().value(i),
                )
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                ("a".into(), 5, 1, true),
                ("a".into(), 10, 2, false),
                ("b".into(), -5, 1, true),
                ("b".into(), 0, 1, true),
            ]
        );
    }

    /// A five-minute tumbling window and a ten-minute window sliding by five.
    fn tumbling_and_sliding() -> [WindowSpec; 2] {
        [
            WindowSpec::Tumbling { size: 5 * M },
            WindowSpec::Sliding {
                size: 10 * M,
                slide: 5 * M,
            },
        ]
    }

    /// Rows in several batches are assigned exactly as the same rows concatenated: the
    /// same rows in the same order, the same touched windows (finalising ones included),
    /// the same key ids — for tumbling and sliding windows, with empty batches between.
    #[test]
    fn rows_in_parts_are_assigned_as_the_rows_concatenated() {
        let parts = [
            rows(&[("a", 12 * M), ("c", 2 * M), ("b", 7 * M)]),
            rows(&[]),
            rows(&[("a", 17 * M), ("b", M), ("d", 11 * M), ("a", 3 * M)]),
            rows(&[("c", 14 * M)]),
        ];
        let whole = arrow::compute::concat_batches(&parts[0].schema(), &parts).unwrap();
        let applied = rows(&[("a", 12 * M), ("b", M), ("c", 14 * M)]);
        for spec in tumbling_and_sliding() {
            for finalising in [None, Some((Some(5 * M), 10 * M))] {
                let assign = |split: bool| {
                    let mut enc = KeyEncoder::new(&whole.schema(), &keys()).unwrap();
                    let mut t = Touched::default();
                    t.add_applied(&mut enc, &spec, &applied, Some(11 * M))
                        .unwrap();
                    let out = match split {
                        true => {
                            let out = assign_windows_in(
                                &mut enc, &spec, &parts, &mut t, finalising, None,
                            )
                            .unwrap();
                            assert_eq!(out.len(), parts.len());
                            arrow::compute::concat_batches(&out[0].schema(), &out).unwrap()
                        }
                        false => {
                            assign_windows(&mut enc, &spec, &whole, &mut t, finalising).unwrap()
                        }
                    };
                    let ids = enc.encode(&whole).unwrap();
                    (
                        out,
                        t.windows
                            .into_iter()
                            .collect::<std::collections::BTreeSet<_>>(),
                        ids,
                    )
                };
                let (split, whole_out) = (assign(true), assign(false));
                assert_eq!(split, whole_out, "{spec:?} {finalising:?}");
                assert!(split.0.num_rows() > 0);
            }
        }
        let none = assign_windows_in(
            &mut KeyEncoder::new(&whole.schema(), &keys()).unwrap(),
            &WindowSpec::Tumbling { size: 5 * M },
            &[],
            &mut Touched::default(),
            None,
            None,
        )
        .unwrap();
        assert!(none.is_empty());
    }

    /// A recompute's parts end with the applied new rows: taking their key ids from
    /// `add_applied` (no second encoding, no lookups) assigns the same rows, windows and
    /// ids as looking every row up — with a row whose event time is null, finalising
    /// windows, tumbling and sliding; key ids that do not fit the last part are an error.
    #[test]
    fn the_applied_rows_keys_from_touching_assign_as_looking_them_up() {
        // Event times may be null: a schema that allows it.
        let rows = |data: &[(&str, Option<Micros>)]| rows_of(data, true);
        let older = [
            rows(&[("a", Some(12 * M)), ("c", Some(2 * M)), ("b", Some(7 * M))]),
            rows(&[("b", Some(13 * M)), ("e", Some(4 * M))]),
        ];
        let applied = rows(&[
            ("a", Some(12 * M)),
            ("b", None),
            ("c", Some(14 * M)),
            ("d", Some(9 * M)),
        ]);
        let mut parts = older.to_vec();
        parts.push(applied.clone());
        for spec in tumbling_and_sliding() {
            for finalising in [None, Some((Some(5 * M), 10 * M))] {
                let assign = |given: bool| {
                    let mut enc = KeyEncoder::new(&applied.schema(), &keys()).unwrap();
                    let mut t = Touched::default();
                    let ids = t
                        .add_applied(&mut enc, &spec, &applied, Some(11 * M))
                        .unwrap();
                    let given = given.then_some(ids);
                    let out = assign_windows_in(&mut enc, &spec, &parts, &mut t, finalising, given)
                        .unwrap();
                    let windows: std::collections::BTreeSet<_> = t.windows.into_iter().collect();
                    let ids = parts
                        .iter()
                        .map(|p| enc.encode(p).unwrap())
                        .collect::<Vec<_>>();
                    (out, windows, ids)
                };
                let (given, looked_up) = (assign(true), assign(false));
                assert_eq!(given, looked_up, "{spec:?} {finalising:?}");
                assert_eq!(given.0.len(), parts.len());
                assert!(given.0[parts.len() - 1].num_rows() >= 3);
            }
        }
        let mut enc = KeyEncoder::new(&applied.schema(), &keys()).unwrap();
        let wrong = assign_windows_in(
            &mut enc,
            &WindowSpec::Tumbling { size: 5 * M },
            &parts,
            &mut Touched::default(),
            None,
            Some(vec![0; 2]),
        );
        assert!(wrong.is_err());
    }

    #[test]
    fn finalisation_adds_windows_whose_end_the_watermark_passed() {
        let spec = WindowSpec::Tumbling { size: 5 * M };
        let b = rows(&[("a", M), ("a", 6 * M), ("a", 11 * M)]);
        let mut enc = KeyEncoder::new(&b.schema(), &keys()).unwrap();
        let mut t = Touched::default();
        let assigned =
            assign_windows(&mut enc, &spec, &b, &mut t, Some((Some(5 * M), 10 * M))).unwrap();
        let starts: Vec<Micros> = t.windows.iter().map(|(_, s)| *s / M).collect();
        assert_eq!(starts, vec![5]);
        assert_eq!(assigned.num_rows(), 1, "only the finalising window's row");
    }

    #[test]
    fn a_late_event_bridging_two_sessions_replaces_both() {
        let gap = 30 * M;
        let mut enc = KeyEncoder::new(&rows(&[]).schema(), &keys()).unwrap();
        let mut key = |s: &str| enc.encode(&rows(&[(s, 0)])).unwrap().remove(0);
        let (u, v) = (key("u"), key("v"));
        let mut scope = SessionScope::new(gap);
        // the late event at 25 min links [0,10] and [40,50]
        scope
            .touch(&mut enc, &rows(&[("u", 25 * M)]), true)
            .unwrap();
        assert_eq!(scope.lookup_ranges(), vec![(-5 * M, 55 * M)]);
        scope.widen(vec![
            GoldSession {
                key: u,
                start: 0,
                end: 10 * M,
                is_final: true,
            },
            GoldSession {
                key: u,
                start: 40 * M,
                end: 50 * M,
                is_final: true,
            },
            GoldSession {
                key: u,
                start: 200 * M,
                end: 210 * M,
                is_final: false,
            },
            GoldSession {
                key: v,
                start: 0,
                end: 10 * M,
                is_final: true,
            },
        ]);
        assert_eq!(scope.spans[&u], vec![(0, 50 * M)]);
        assert_eq!(scope.replaced.len(), 2);
        let bronze = rows(&[
            ("u", 0),
            ("u", 10 * M),
            ("u", 25 * M),
            ("u", 40 * M),
            ("u", 50 * M),
            ("u", 200 * M),
            ("v", 5 * M),
        ]);
        let (assigned, sessions) = assign_sessions(&mut enc, &bronze, &scope, gap).unwrap();
        assert_eq!(assigned.num_rows(), 5);
        assert_eq!(sessions, vec![(u, 0, 50 * M)]);
        assert_eq!(scope.corrections(&sessions), 1);
    }

    /// A key with an event hours late and one just now gets two spans: the sessions in
    /// between are neither looked up, replaced nor recomputed — unless a session links
    /// the spans, which then become one.
    #[test]
    fn distant_events_of_a_key_scope_two_spans() {
        let gap = 30 * M;
        let mut enc = KeyEncoder::new(&rows(&[]).schema(), &keys()).unwrap();
        let mut key = |s: &str| enc.encode(&rows(&[(s, 0)])).unwrap().remove(0);
        let (u, v) = (key("u"), key("v"));
        let mut scope = SessionScope::new(gap);
        scope
            .touch(
                &mut enc,
                &rows(&[("u", 300 * M), ("u", 10 * M), ("u", 20 * M), ("v", 290 * M)]),
                true,
            )
            .unwrap();
        assert_eq!(scope.spans[&u], vec![(10 * M, 20 * M), (300 * M, 300 * M)]);
        assert_eq!(
            scope.lookup_ranges(),
            vec![(-20 * M, 50 * M), (260 * M, 330 * M)]
        );
        let session = |key, start, end| GoldSession {
            key,
            start,
            end,
            is_final: false,
        };
        scope.widen(vec![
            session(u, 0, 5 * M),         // within gap of 10: taken
            session(u, 100 * M, 150 * M), // between the spans: untouched
            session(u, 310 * M, 320 * M), // within gap of 300: taken
            session(v, 250 * M, 280 * M), // v's: taken for v
        ]);
        assert_eq!(scope.spans[&u], vec![(0, 20 * M), (300 * M, 320 * M)]);
        assert_eq!(scope.spans[&v], vec![(250 * M, 290 * M)]);
        assert_eq!(scope.replaced.len(), 3);
        assert_eq!(
            scope.ranges(),
            vec![
                (0, 20 * M + 1),
                (250 * M, 290 * M + 1),
                (300 * M, 320 * M + 1)
            ]
        );
        let bronze = rows(&[
            ("u", 0),
            ("u", 5 * M),
            ("u", 10 * M),
            ("u", 20 * M),
            ("u", 100 * M),
            ("u", 150 * M),
            ("u", 300 * M),
            ("u", 310 * M),
            ("u", 320 * M),
        ]);
        let (assigned, mut sessions) = assign_sessions(&mut enc, &bronze, &scope, gap).unwrap();
        sessions.sort();
        assert_eq!(
            assigned.num_rows(),
            7,
            "the 100–150 session is not recomputed"
        );
        assert_eq!(sessions, vec![(u, 0, 20 * M), (u, 300 * M, 320 * M)]);

        // A session reaching from one span to within gap of the next links them.
        let mut scope = SessionScope::new(gap);
        scope
            .touch(&mut enc, &rows(&[("u", 10 * M), ("u", 100 * M)]), true)
            .unwrap();
        assert_eq!(scope.spans[&u].len(), 2);
        scope.widen(vec![session(u, 30 * M, 80 * M)]);
        assert_eq!(scope.spans[&u], vec![(10 * M, 100 * M)]);
    }

    #[test]
    fn lookup_ranges_coalesce_across_the_smallest_gaps() {
        let r = vec![(0, 1), (10, 11), (12, 13), (30, 31), (33, 34)];
        assert_eq!(coalesce_ranges(r.clone(), 5), r);
        assert_eq!(
            coalesce_ranges(r.clone(), 3),
            vec![(0, 1), (10, 13), (30, 34)]
        );
        assert_eq!(coalesce_ranges(r, 1), vec![(0, 34)]);
    }

    #[test]
    fn ranges_merge_and_dates_cover_them() {
        assert_eq!(
            merge_ranges(vec![(5, 10), (0, 5), (20, 30), (25, 26)]),
            vec![(0, 10), (20, 30)]
        );
        assert_eq!(
            dates_of(&[(DAY - 1, DAY + 1), (3 * DAY, 3 * DAY + 5)]),
            vec![0, 1, 3]
        );
    }
}
