//! `kestrel status`: per source and job, the last run and its result, each job's
//! watermark and how far it trails the newest event it has seen, late and quarantined
//! counts over the last day, the size of each job's state (its durable batch state, and
//! an always-on stream's in-memory state at its last checkpoint), and the freshness of
//! every gold table (age of its newest Delta commit) — with a check usable from cron or
//! a monitor.

use std::collections::BTreeMap;

use arrow::array::{Array, Int64Array};
use futures::TryStreamExt;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::job::plan;
use crate::job::spec::JobSpec;
use crate::sink::delta::{self, Warehouse};
use crate::storage::Location;
use crate::time::{iso, Micros};

const DAY_US: Micros = 86_400_000_000;

/// One source.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SourceStatus {
    pub source: String,
    pub last_batch: Option<i64>,
    pub last_run_at: Option<String>,
    pub last_status: Option<String>,
    /// Over the last 24 hours of runs.
    pub files_day: i64,
    pub rows_written_day: i64,
    pub duplicates_day: i64,
    pub quarantined_day: i64,
}

/// One job.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobStatus {
    pub job: String,
    pub last_batch: Option<i64>,
    pub last_run_at: Option<String>,
    pub last_status: Option<String>,
    pub watermark: Option<String>,
    /// The newest event time the job has seen (any source partition).
    pub newest_event: Option<String>,
    /// newest_event − watermark, in seconds: the delay plus whatever an idle or slow
    /// partition holds back.
    pub watermark_lag_s: Option<f64>,
    /// Over the last 24 hours of runs.
    pub too_late_day: i64,
    pub corrections_day: i64,
    /// The job's durable state between batches (watermarks per source partition,
    /// positions, cut-offs: its last batch result), in bytes.
    pub state_bytes: Option<usize>,
    /// When it runs always-on: the state its stream held at the last checkpoint.
    pub stream_state: Option<StreamState>,
    /// Its service levels and the `[slo]` objectives they breach.
    pub slo: crate::ops::slo::ServiceLevels,
}

/// An always-on stream's state at its last checkpoint (from the run log).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StreamState {
    pub checkpoint: i64,
    pub at: String,
    /// Event ids held in memory for deduplication, and their bytes.
    pub ids: i64,
    pub bytes: i64,
    /// What writing the (incremental) checkpoint took.
    pub checkpoint_bytes: i64,
    pub checkpoint_ms: i64,
}

/// One gold table.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TableFreshness {
    pub table: String,
    pub job: String,
    /// Time of the newest commit that wrote data (None: never written); compaction and
    /// vacuum commits are not counted.
    pub last_commit_at: Option<String>,
    pub age_s: Option<f64>,
}

/// Everything `kestrel status` reports.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    pub now: String,
    pub sources: Vec<SourceStatus>,
    pub jobs: Vec<JobStatus>,
    pub tables: Vec<TableFreshness>,
}

/// Per (kind, name): last batch, its finish time and status, and day sums.
#[derive(Debug, Default)]
struct RunSummary {
    last_batch: i64,
    finished_at: Micros,
    status: String,
    files: i64,
    rows_written: i64,
    duplicates: i64,
    quarantined: i64,
    too_late: i64,
    corrections: i64,
    rows_in: i64,
    cpu_ms: i64,
}

/// The run log, opened once for a status: a session with it as `runs`, and its columns
/// (a run log written by an older release lacks the newer ones).
struct RunLog {
    ctx: datafusion::prelude::SessionContext,
    columns: std::collections::HashSet<String>,
}

impl RunLog {
    async fn open(wh: &Warehouse) -> Result<Option<Self>> {
        let Some(t) = wh.open(crate::names::table::RUNS).await? else {
            return Ok(None);
        };
        Ok(Some(RunLog {
            columns: delta::table_columns(&t)?,
            ctx: delta::session_with(&t, "runs").await?,
        }))
    }

    fn has(&self, column: &str) -> bool {
        self.columns.contains(column)
    }
}

/// The last batch of a source or job: its newest run-log row's, else its position (the
/// run log's days beyond `[maintain] run_log_retention` are removed; the position, an
/// application transaction, stays). None when it never ran.
async fn last_batch(
    wh: &Warehouse,
    row: Option<&RunSummary>,
    kind: &str,
    name: &str,
) -> Result<Option<i64>> {
    if let Some(r) = row {
        return Ok(Some(r.last_batch));
    }
    let b = crate::runlog::last_batch(wh, kind, name).await?;
    Ok((b > 0).then_some(b))
}

/// Int64 columns `cols` of `b`, for [`at`].
fn ints(b: &arrow::array::RecordBatch, cols: std::ops::Range<usize>) -> Result<Vec<Int64Array>> {
    cols.map(|i| crate::columns::int64_at(b, i).map_err(Into::into))
        .collect()
}

/// Row `r` of `c`, null as 0.
fn at(c: &Int64Array, r: usize) -> i64 {
    if c.is_valid(r) {
        c.value(r)
    } else {
        0
    }
}

async fn run_summaries(
    log: Option<&RunLog>,
    now: Micros,
) -> Result<BTreeMap<(String, String), RunSummary>> {
    let mut out = BTreeMap::new();
    let Some(log) = log else {
        return Ok(out);
    };
    let ctx = &log.ctx;
    let since = (now - DAY_US) as f64 / 1e6;
    let day = |c: &str| {
        format!(
            "sum(CASE WHEN to_unixtime(started_at) >= {since} THEN coalesce({c}, 0) ELSE 0 END)"
        )
    };
    let sql = format!(
        "SELECT kind, name, max(batch_id), \
         CAST(to_unixtime(max(finished_at)) * 1000000 AS BIGINT), \
         {}, {}, {}, {}, {}, {}, {}, {} FROM runs GROUP BY kind, name",
        day("files"),
        day("rows_written"),
        day("duplicates"),
        day("quarantined"),
        day("too_late"),
        day("corrections"),
        day("rows_in"),
        if log.has("cpu_ms") {
            day("cpu_ms")
        } else {
            "CAST(0 AS BIGINT)".to_string()
        }
    );
    for b in delta::sql(ctx, &sql).await? {
        let kind = crate::columns::string_at(&b, 0)?;
        let name = crate::columns::string_at(&b, 1)?;
        let ints = ints(&b, 2..12)?;
        for r in 0..b.num_rows() {
            let v = |i: usize| at(&ints[i], r);
            out.insert(
                (kind.value(r).to_string(), name.value(r).to_string()),
                RunSummary {
                    last_batch: v(0),
                    finished_at: v(1),
                    status: String::new(),
                    files: v(2),
                    rows_written: v(3),
                    duplicates: v(4),
                    quarantined: v(5),
                    too_late: v(6),
                    corrections: v(7),
                    rows_in: v(8),
                    cpu_ms: v(9),
                },
            );
        }
    }
    // The status of each last batch.
    let last = delta::sql(
        ctx,
        "SELECT r.kind, r.name, r.status FROM runs r JOIN \
         (SELECT kind, name, max(batch_id) AS b FROM runs GROUP BY kind, name) m \
         ON r.kind = m.kind AND r.name = m.name AND r.batch_id = m.b",
    )
    .await?;
    for b in last {
        let (k, n, s) = (
            crate::columns::string_at(&b, 0)?,
            crate::columns::string_at(&b, 1)?,
            crate::columns::string_at(&b, 2)?,
        );
        for r in 0..b.num_rows() {
            if let Some(x) = out.get_mut(&(k.value(r).to_string(), n.value(r).to_string())) {
                x.status = s.value(r).to_string();
            }
        }
    }
    Ok(out)
}

/// Per job, the state its stream held at its last checkpoint (none before any stream
/// checkpointed: the run log then has no checkpoint columns).
async fn stream_states(log: Option<&RunLog>) -> Result<BTreeMap<String, StreamState>> {
    let mut out = BTreeMap::new();
    let Some(log) = log.filter(|l| l.has("state_ids")) else {
        return Ok(out);
    };
    let sql = "SELECT r.name, r.batch_id, CAST(to_unixtime(r.finished_at) * 1000000 AS BIGINT), \
               r.state_ids, r.state_bytes, r.checkpoint_bytes, r.duration_ms FROM runs r JOIN \
               (SELECT name, max(batch_id) AS b FROM runs WHERE kind = 'checkpoint' GROUP BY name) m \
               ON r.name = m.name AND r.batch_id = m.b WHERE r.kind = 'checkpoint'";
    for b in delta::sql(&log.ctx, sql).await? {
        let name = crate::columns::string_at(&b, 0)?;
        let ints = ints(&b, 1..7)?;
        for r in 0..b.num_rows() {
            let v = |i: usize| at(&ints[i], r);
            out.insert(
                name.value(r).to_string(),
                StreamState {
                    checkpoint: v(0),
                    at: iso(v(1)),
                    ids: v(2),
                    bytes: v(3),
                    checkpoint_bytes: v(4),
                    checkpoint_ms: v(5),
                },
            );
        }
    }
    Ok(out)
}

/// Collect the status of `sources` and `jobs` at `now` (micros); with `landing`, also
/// the files landed and not yet ingested (consumer lag).
pub async fn collect(
    wh: &Warehouse,
    landing: Option<&Location>,
    sources: &[String],
    jobs: &[&JobSpec],
    now: Micros,
) -> Result<Status> {
    use crate::ops::slo;
    let log = RunLog::open(wh).await?;
    let runs = run_summaries(log.as_ref(), now).await?;
    let mut pending: BTreeMap<String, slo::Pending> = BTreeMap::new();
    let mut streams = stream_states(log.as_ref()).await?;
    let mut status = Status {
        now: iso(now),
        ..Default::default()
    };
    for s in sources {
        let r = runs.get(&("ingest".to_string(), s.clone()));
        status.sources.push(SourceStatus {
            source: s.clone(),
            last_batch: last_batch(wh, r, "ingest", s).await?,
            last_run_at: r.map(|r| iso(r.finished_at)),
            last_status: r.map(|r| r.status.clone()),
            files_day: r.map_or(0, |r| r.files),
            rows_written_day: r.map_or(0, |r| r.rows_written),
            duplicates_day: r.map_or(0, |r| r.duplicates),
            quarantined_day: r.map_or(0, |r| r.quarantined),
        });
    }
    for spec in jobs {
        let r = runs.get(&("job".to_string(), spec.name.clone()));
        let mut js = JobStatus {
            job: spec.name.clone(),
            last_batch: last_batch(wh, r, "job", &spec.name).await?,
            last_run_at: r.map(|r| iso(r.finished_at)),
            last_status: r.map(|r| r.status.clone()),
            too_late_day: r.map_or(0, |r| r.too_late),
            corrections_day: r.map_or(0, |r| r.corrections),
            stream_state: streams.remove(&spec.name),
            ..Default::default()
        };
        let mut skew = None;
        if let Some(r) = r {
            if let Some(result) = plan::read_result(wh, &spec.name, r.last_batch).await? {
                js.state_bytes = Some(serde_json::to_vec(&result.state)?.len());
                skew = result
                    .state
                    .watermark
                    .sources
                    .values()
                    .filter_map(|s| {
                        let t = s.partitions.values().map(|p| p.max_event_ts);
                        Some(t.clone().max()? - t.min()?)
                    })
                    .max()
                    .map(|us| us as f64 / 1e6);
                let w = result.state.watermark.current;
                let newest = result
                    .state
                    .watermark
                    .sources
                    .values()
                    .flat_map(|s| s.partitions.values().map(|p| p.max_event_ts))
                    .max();
                js.watermark = w.map(iso);
                js.newest_event = newest.map(iso);
                js.watermark_lag_s = match (newest, w) {
                    (Some(n), Some(w)) => Some((n - w) as f64 / 1e6),
                    _ => None,
                };
            }
        }
        let mut m = slo::Measured {
            skew_s: skew,
            state_bytes: js
                .state_bytes
                .map(|b| b as i64 + js.stream_state.as_ref().map_or(0, |s| s.bytes)),
            ..Default::default()
        };
        if let Some(landing) = landing {
            for s in &spec.sources {
                if !pending.contains_key(s) {
                    pending.insert(s.clone(), slo::pending(wh, landing, s).await?);
                }
                let p = pending[s];
                m.pending.files += p.files;
                m.pending.bytes += p.bytes;
                m.pending.oldest_us = m.pending.oldest_us.into_iter().chain(p.oldest_us).min();
            }
        }
        let mut from_runs = slo::FromRuns {
            rows_in_day: r.map_or(0, |r| r.rows_in),
            too_late_day: r.map_or(0, |r| r.too_late),
            cpu_ms_day: r.map_or(0, |r| r.cpu_ms),
            ..Default::default()
        };
        if let Some(log) = log.as_ref().filter(|l| l.has("landed_oldest")) {
            slo::from_runs(&log.ctx, spec, &mut from_runs).await?;
        }
        js.slo = slo::levels(&spec.slo, &from_runs, &m, now);
        status.jobs.push(js);
        for table in spec.outputs().into_iter().map(|o| o.table) {
            let last = match wh.open(&table).await? {
                Some(t) => {
                    // Freshness is about data: compaction and vacuum commits don't count.
                    let info: Vec<_> = t
                        .history(Some(10))
                        .try_collect()
                        .await
                        .map_err(|e| Error::delta(&table, e))?;
                    info.iter()
                        .find(|c| {
                            !c.operation
                                .as_deref()
                                .is_some_and(|op| op == "OPTIMIZE" || op.starts_with("VACUUM"))
                        })
                        .and_then(|c| c.timestamp)
                        .map(|ms| ms * 1000)
                }
                None => None,
            };
            status.tables.push(TableFreshness {
                table,
                job: spec.name.clone(),
                last_commit_at: last.map(iso),
                age_s: last.map(|l| (now - l) as f64 / 1e6),
            });
        }
    }
    Ok(status)
}

/// Every breached service-level objective, as `job: objective: …`.
pub fn breaches(status: &Status) -> Vec<String> {
    status
        .jobs
        .iter()
        .flat_map(|j| {
            j.slo
                .breaches
                .iter()
                .map(move |b| format!("{}: {b}", j.job))
        })
        .collect()
}

/// Gold tables older than `max_age` (or never written), with why.
pub fn stale(status: &Status, max_age: std::time::Duration) -> Vec<String> {
    status
        .tables
        .iter()
        .filter_map(|t| match t.age_s {
            None => Some(format!("{} (never written)", t.table)),
            Some(a) if a > max_age.as_secs_f64() => Some(format!("{} ({a:.0} s old)", t.table)),
            _ => None,
        })
        .collect()
}
