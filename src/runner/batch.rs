//! One job micro-batch, exactly once.
//!
//! Protocol for batch `n` of a job (each step idempotent; a crash anywhere and a re-run
//! give the same tables):
//! 1. `n` = last job batch in the run log + 1. If plan `n` exists it is re-executed as is;
//!    otherwise plan `n` takes, per source, the next completed ingestion batch after the
//!    position of result `n−1` and is written put-if-absent. Nothing new: no batch.
//! 2. Unless gold already holds txn (`kestrel-job-<job>`, n), compute: read the new
//!    bronze rows, split off the too-late ones, advance the watermark, recompute the
//!    touched windows from applied bronze rows, and write result `n` (state + counts)
//!    put-if-absent.
//! 3. Append too-late rows to `late/<job>` with txn (`kestrel-late-<job>`, n).
//! 4. MERGE into the gold table with txn (`kestrel-job-<job>`, n): keys + window start,
//!    plus a literal `IN` list of the window dates, so only those partitions are read.
//! 5. Append the run-log entry with txn (`kestrel-runlog-job-<job>`, n): batch `n` is
//!    complete once this commit exists.
//!
//! What a job has consumed is therefore recorded in Delta commits: the gold commit of
//! batch `n` carries `n`, and plan `n` names the ingestion batches (= bronze commits,
//! which carry the ingestion batch id as their own txn) it consumed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::RecordBatch;
use datafusion::common::ScalarValue;
use deltalake::DeltaTable;
use futures::StreamExt;
use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::fault;
use crate::job::aggregate::{self as agg};
use crate::job::plan::{self, Input, JobCounts, JobPlan, JobState};
use crate::job::spec::{JobSpec, LatePolicy};
use crate::lease::Lease;
use crate::names;
use crate::operator::budget::RowBudget;
use crate::operator::{read, Computed, Context, GoldRows, Write};
use crate::runlog::{self, JobEntry};
use crate::runner::follow::Follower;
use crate::schema::SourceSchema;
use crate::sink::compact::{self, OpenCompaction};
use crate::sink::delta::{self, Warehouse};
use crate::sink::late;
use crate::sink::merge::{self, MergeSpec};
use crate::time::clock::Clock;
use crate::time::{micros, Micros};

/// What one run did for one job.
#[derive(Debug, Clone, Default)]
pub struct JobReport {
    pub job: String,
    pub batches: Vec<JobEntry>,
    /// Why the job did not run (e.g. it runs always-on in a stream).
    pub skipped: Option<String>,
    /// The job's watermark after this run (also when no batch ran).
    pub watermark: Option<Micros>,
    /// Arrival time of the newest landed file the job has consumed.
    pub newest_landed: Option<Micros>,
}

impl JobReport {
    fn sum(&self, f: impl Fn(&JobCounts) -> i64) -> i64 {
        self.batches.iter().map(|b| f(&b.counts)).sum()
    }
    pub fn applied(&self) -> i64 {
        self.sum(|c| c.applied)
    }
    pub fn too_late(&self) -> i64 {
        self.sum(|c| c.too_late)
    }
    pub fn windows_recomputed(&self) -> i64 {
        self.sum(|c| c.windows_recomputed)
    }
    pub fn corrections(&self) -> i64 {
        self.sum(|c| c.corrections)
    }
}

/// Attempts of a gold commit that keeps losing races with other writers.
pub const MERGE_ATTEMPTS: u32 = 6;

/// Wait before attempt `attempt + 1`: 100 ms doubling, ±50 % jitter (so two writers that
/// collided do not collide again in step).
fn backoff(attempt: u32) -> std::time::Duration {
    use rand::Rng;
    let base = 100u64 << attempt.min(6);
    let jitter = rand::thread_rng().gen_range(base / 2..=base + base / 2);
    std::time::Duration::from_millis(jitter)
}

/// The partitions a MERGE of `out` reads: per partition column, the values its rows go
/// to and the extra ones (a literal `IN` list each, so pruning needs no statistics).
pub(crate) fn merge_partitions(out: &GoldRows) -> Result<Vec<(&'static str, Vec<ScalarValue>)>> {
    let mut parts = Vec::with_capacity(out.partitions.len());
    for (i, p) in out.partitions.iter().enumerate() {
        let mut values = out.extra_partitions.get(i).cloned().unwrap_or_default();
        for b in &out.rows {
            if let Some(c) = b.column_by_name(p) {
                for r in 0..c.len() {
                    values.push(
                        ScalarValue::try_from_array(c, r)
                            .map_err(|e| Error::query("merge partition values", e))?,
                    );
                }
            }
        }
        values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        values.dedup();
        parts.push((*p, values));
    }
    Ok(parts)
}

/// Runs jobs against one warehouse.
#[derive(Clone)]
pub struct JobRunner {
    pub(crate) wh: Warehouse,
    schemas: BTreeMap<String, Arc<SourceSchema>>,
    run_id: String,
    pub(crate) lease_ttl: std::time::Duration,
    stop: Option<super::StopFlag>,
    open: OpenCompaction,
    clock: Clock,
    /// The always-on mode's uncommitted state rows: with them, the job's deferred output
    /// is not MERGEd by its batches (see [`super::deferred`]).
    pending: Option<Arc<crate::operator::pending::Pending>>,
    /// Where the operators' reads run when not in this process (`[engine]`).
    cluster: Option<Arc<crate::engine::port::ClusterPort>>,
    /// Backfill days recomputed at once ([`super::backfill`]).
    pub(crate) parallel_days: usize,
    /// Rows the jobs' batches recompute at once (clones share it; see
    /// [`crate::operator::budget`]).
    budget: Arc<RowBudget>,
    /// New rows the ingestion of this process hands over (see [`crate::operator::fresh`]).
    fresh: Option<Arc<crate::operator::fresh::FreshRows>>,
}

impl JobRunner {
    /// A runner over `wh` with the loaded source schemas.
    pub fn new(
        wh: Warehouse,
        schemas: BTreeMap<String, Arc<SourceSchema>>,
        lease_ttl: std::time::Duration,
    ) -> Self {
        JobRunner {
            wh,
            schemas,
            run_id: uuid::Uuid::new_v4().to_string(),
            lease_ttl,
            stop: None,
            open: OpenCompaction::default(),
            clock: Clock::system(),
            pending: None,
            cluster: None,
            parallel_days: 1,
            budget: Arc::new(RowBudget::default()),
            fresh: None,
        }
    }

    /// Take a batch's new rows from `fresh` when it holds them, instead of bronze.
    pub fn with_fresh(mut self, fresh: Option<Arc<crate::operator::fresh::FreshRows>>) -> Self {
        self.fresh = fresh;
        self
    }

    /// Recompute at most `rows` new rows at once (`compute_budget_rows`).
    pub fn with_budget(mut self, rows: usize) -> Self {
        self.budget = Arc::new(RowBudget::new(rows));
        self
    }

    /// Run the operators' reads and aggregates on the cluster behind `port` (see
    /// [`crate::engine`]); plans, MERGEs and commits stay in this process.
    pub fn with_cluster(mut self, port: Option<crate::engine::port::ClusterPort>) -> Self {
        self.cluster = port.map(Arc::new);
        self
    }

    /// Recompute `n` backfill days at once (on a cluster: `[engine] parallel_days`).
    pub fn with_parallel_days(mut self, n: usize) -> Self {
        self.parallel_days = n.max(1);
        self
    }

    /// A runner whose batches leave the job's deferred output to `pending` (the
    /// always-on mode's [`super::deferred::Deferral`]).
    pub(crate) fn deferring(&self, pending: Arc<crate::operator::pending::Pending>) -> Self {
        let mut r = self.clone();
        r.pending = Some(pending);
        r
    }

    /// Stamp rows and records with `clock`'s processing time (the system clock by
    /// default; tests set one).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Processing time now, in microseconds.
    pub(crate) fn now_us(&self) -> Micros {
        self.clock.now_us()
    }

    /// Compact crowded open partitions of a job's tables after its batches this way
    /// (`[maintain] open_partition_files`; see [`crate::sink::compact`]).
    pub fn with_open_compaction(mut self, open: OpenCompaction) -> Self {
        self.open = open;
        self
    }

    /// The warehouse it writes to.
    pub fn warehouse(&self) -> &Warehouse {
        &self.wh
    }

    /// Stop between batches once `stop` is set (a batch in progress completes).
    pub fn with_stop(mut self, stop: super::StopFlag) -> Self {
        self.stop = Some(stop);
        self
    }

    /// Run every batch of `spec` that newly ingested data allows.
    pub async fn run_job(&self, spec: &JobSpec) -> Result<JobReport> {
        self.run_job_following(spec, None).await
    }

    /// [`JobRunner::run_job`], taking its source's batches as `follower` reports them
    /// completed until that ingestion ends ([`super::follow`]; None: the batches already
    /// completed).
    pub async fn run_job_following(
        &self,
        spec: &JobSpec,
        mut follower: Option<Follower>,
    ) -> Result<JobReport> {
        let mut report = JobReport {
            job: spec.name.clone(),
            ..Default::default()
        };
        let mut lease =
            Lease::acquire(&self.wh, &names::lease::job(&spec.name), self.lease_ttl).await?;
        let result = self
            .run_batches(spec, &mut lease, &mut report, follower.as_mut())
            .await;
        // Its compaction and the lease's release are the job's work too.
        if let Some(f) = follower.as_mut() {
            f.hold_slot().await;
        }
        if result.is_ok() && !report.batches.is_empty() {
            self.compact_open(spec, report.too_late() > 0).await;
        }
        if let Err(e) = lease.release().await {
            warn!(job = %spec.name, error = %e, "could not release lease");
        }
        result.map(|()| report)
    }

    /// Run `specs` ([`JobRunner::run_job`] each), up to `parallel` at once on the
    /// runtime's threads; results in the order of `specs`. Jobs are independent: each
    /// reads bronze and writes only its own tables under its own lease, and what they
    /// share (the run log, the plans) takes concurrent appends, as it does from several
    /// `kestrel run` processes. A job whose task panics is reported as failed.
    pub async fn run_jobs(&self, specs: &[&JobSpec], parallel: usize) -> Vec<Result<JobReport>> {
        let tasks = specs.iter().map(|spec| self.run_job_in_task(spec, None));
        futures::stream::iter(tasks)
            .buffered(parallel.max(1))
            .collect()
            .await
    }

    /// [`JobRunner::run_job_following`] as a task of its own on the runtime's threads (so
    /// jobs run at once use every core); a panic in it is reported as the job's failure.
    pub async fn run_job_in_task(
        &self,
        spec: &JobSpec,
        follower: Option<Follower>,
    ) -> Result<JobReport> {
        let (runner, spec) = (self.clone(), spec.clone());
        let name = spec.name.clone();
        tokio::spawn(async move { runner.run_job_following(&spec, follower).await })
            .await
            .unwrap_or_else(|source| {
                Err(Error::Task {
                    what: format!("job {name}"),
                    source,
                })
            })
    }

    /// After a job's batches, under its lease: compact the crowded open partitions of its
    /// gold tables, the run log and — when the batches sent events to it (`too_late`) —
    /// its late ledger, which only crowds when rows land in it (looking cost a cold open
    /// of it every run once it exists). A failure is logged, not fatal: the next run, or
    /// the daily maintenance, tries again.
    async fn compact_open(&self, spec: &JobSpec, too_late: bool) {
        let mut tables: Vec<String> = spec.outputs().into_iter().map(|o| o.table).collect();
        if too_late {
            tables.push(names::table::late(&spec.name));
        }
        tables.push(names::table::RUNS.to_string());
        for table in tables {
            let bookkeeping = table == names::table::RUNS;
            let done =
                compact::open_partitions(&self.wh, &table, &self.open, &[], None, bookkeeping)
                    .await;
            if let Err(e) = done {
                warn!(job = %spec.name, %table, error = %e, "open-partition compaction failed; next run");
            }
        }
    }

    async fn run_batches(
        &self,
        spec: &JobSpec,
        lease: &mut Lease,
        report: &mut JobReport,
        mut follower: Option<&mut Follower>,
    ) -> Result<()> {
        if self.pending.is_none() {
            // A stream killed while deferring its state left it to whoever runs next.
            super::deferred::catch_up(self, spec).await?;
        }
        // The job's position and its sources' completed ingestion batches, read once
        // (one look at the run log): what lands meanwhile is the next run's.
        let of: Vec<(&str, &str)> = std::iter::once(("job", spec.name.as_str()))
            .chain(spec.sources.iter().map(|s| ("ingest", s.as_str())))
            .collect();
        let positions = runlog::last_batches(&self.wh, &of).await?;
        let mut done = positions[0];
        let mut ingested: BTreeMap<String, i64> = spec
            .sources
            .iter()
            .cloned()
            .zip(positions[1..].iter().copied())
            .collect();
        let mut state = self.state_before(spec, done + 1).await?;
        // Reading each next batch's new rows while one computes (not in the always-on
        // mode, whose next batch has not landed, nor on a cluster).
        use crate::operator::prefetch;
        let prefetch = (self.pending.is_none() && self.cluster.is_none() && prefetch::enabled())
            .then(|| prefetch::Prefetch::new(ingested.clone()));
        let mut renewed = false;
        loop {
            // Stopped (also before the first batch: one that has not started is not
            // running, and the next run does it).
            if self.stop.as_ref().is_some_and(|s| s.stopped()) {
                info!(job = %spec.name, "stopping between batches");
                break;
            }
            if !report.batches.is_empty() && !std::mem::take(&mut renewed) {
                lease.renew(self.lease_ttl).await?;
            }
            let n = done + 1;
            let (plan, resumed) = match plan::read_plan(&self.wh, &spec.name, n).await? {
                Some(p) => {
                    info!(job = %spec.name, batch = n, "resuming planned batch");
                    (p, true)
                }
                None => match self.plan_next(spec, n, &state, &ingested).await? {
                    Some(p) => (p, false),
                    None => {
                        // Following its source: wait for the ingestion's next batch.
                        let Some(f) = follower.as_deref_mut() else {
                            break;
                        };
                        let source = f.source().to_string();
                        let after = ingested.get(&source).copied().unwrap_or(0);
                        let Some(completed) = f.next_after(after).await else {
                            break;
                        };
                        ingested.insert(source.clone(), completed);
                        if let Some(p) = &prefetch {
                            p.completed(&source, completed);
                        }
                        // The wait was as long as an ingestion batch.
                        lease.renew(self.lease_ttl).await?;
                        renewed = true;
                        continue;
                    }
                },
            };
            fault::point("job_after_plan");
            let (entry, after) = self
                .execute(spec, &plan, state, resumed, prefetch.as_ref())
                .await?;
            report.batches.push(entry);
            state = after;
            done = n;
        }
        report.watermark = state.watermark.current;
        report.newest_landed = state
            .watermark
            .sources
            .values()
            .filter_map(|s| s.newest_landed())
            .max();
        Ok(())
    }

    /// What its operators compute with: the warehouse (or the cluster reading it) as
    /// their read port, the source schemas, its clock.
    pub(crate) fn context(&self) -> Context<'_> {
        let port: &dyn crate::operator::port::ReadPort = match &self.cluster {
            Some(c) => c.as_ref(),
            None => &self.wh,
        };
        Context::new(port, &self.schemas, &self.clock)
            .with_pending(self.pending.as_deref())
            .with_budget(&self.budget)
            .with_fresh(self.fresh.as_deref())
    }

    /// The state before batch `n`: result `n−1`'s, or the initial state.
    async fn state_before(&self, spec: &JobSpec, n: i64) -> Result<JobState> {
        if n <= 1 {
            return Ok(JobState::initial(
                &spec.sources,
                micros(spec.time.watermark_delay),
                micros(spec.time.idle_timeout),
            ));
        }
        plan::read_result(&self.wh, &spec.name, n - 1)
            .await?
            .map(|r| r.state)
            .ok_or_else(|| Error::Plan {
                path: names::key::job_plan(&spec.name, n - 1, "result"),
                reason: "missing: the job's history is incomplete".into(),
            })
    }

    /// Plan batch `n`: per source, the next completed ingestion batch (one at a time, as a
    /// live pipeline would have seen them). None when no source has one.
    async fn plan_next(
        &self,
        spec: &JobSpec,
        n: i64,
        state: &JobState,
        ingested: &BTreeMap<String, i64>,
    ) -> Result<Option<JobPlan>> {
        let mut inputs = BTreeMap::new();
        let mut any = false;
        for s in &spec.sources {
            let after = state.positions.get(s).copied().unwrap_or(0);
            let ingested = ingested.get(s).copied().unwrap_or(0);
            let upto = ingested.min(after + 1).max(after);
            any |= upto > after;
            let bronze_version = if upto > after {
                self.wh
                    .open(&names::table::bronze(s))
                    .await?
                    .and_then(|t| t.version())
                    .map(|v| v as i64)
            } else {
                None
            };
            inputs.insert(
                s.clone(),
                Input {
                    after_batch: after,
                    upto_batch: upto,
                    bronze_version,
                },
            );
        }
        if !any {
            return Ok(None);
        }
        let p = JobPlan {
            job: spec.name.clone(),
            batch_id: n,
            created_at: self.clock.now().to_rfc3339(),
            inputs,
        };
        plan::write_plan(&self.wh, &p).await.map(Some)
    }

    /// Run batch `plan` from `before` (`resumed`: its plan was found, a run before was
    /// interrupted in it), reading new rows ahead with `prefetch`; returns its run-log
    /// entry and the state after it.
    async fn execute(
        &self,
        spec: &JobSpec,
        plan: &JobPlan,
        before: JobState,
        resumed: bool,
        prefetch: Option<&crate::operator::prefetch::Prefetch>,
    ) -> Result<(JobEntry, JobState)> {
        let started = self.now_us();
        let cpu0 = crate::time::clock::cpu_us();
        let t0 = Instant::now();
        let n = plan.batch_id;
        let deferred = self.pending.as_ref().map(|p| p.output().table.clone());
        // The commit that completes the batch's gold writes (a deferred output's is not
        // one of them).
        let crate::operator::Output {
            table: marker,
            app: marker_app,
        } = match &deferred {
            Some(d) => spec
                .outputs()
                .into_iter()
                .rfind(|o| &o.table != d)
                .unwrap_or_else(|| spec.completing_output()),
            None => spec.completing_output(),
        };
        let gold_done = self.committed(&marker, &marker_app, n).await?;
        let durable = plan::read_result(&self.wh, &spec.name, n).await?;
        // A batch whose gold is done needs no compute, but in the always-on mode its
        // deferred rows must come back (from its file; a batch a `run` began has none).
        let deferred_done = match (&deferred, gold_done && durable.is_some()) {
            (Some(_), true) => super::deferred::read_rows(&self.wh, &spec.name, n).await?,
            _ => None,
        };
        let mut merged = None;
        let computed = match (gold_done, durable) {
            (true, Some(result)) if deferred.is_none() || deferred_done.is_some() => {
                merged = self.written_before(spec, n, deferred.as_deref()).await?;
                Computed {
                    result,
                    late: None,
                    gold: Vec::new(),
                }
            }
            _ => {
                let mut c = spec
                    .operator
                    .process(&self.context().with_prefetch(prefetch), spec, plan, before)
                    .await?;
                // Operators that do not start it themselves: during the MERGE.
                if let Some(p) = prefetch {
                    p.launch();
                }
                c.result = plan::write_result(&self.wh, &c.result).await?;
                c
            }
        };
        // The deferred output's rows: durable before any commit of the batch, committed
        // later by the stream.
        let deferred_rows = match &deferred {
            Some(d) => {
                let rows = match deferred_done {
                    Some(r) => r,
                    None => {
                        let Some(out) = computed.gold.iter().find(|g| &g.table == d) else {
                            return Err(Error::Plan {
                                path: names::key::job_plan(&spec.name, n, "result"),
                                reason: format!(
                                    "the batch computed no rows for its deferred output {d}"
                                ),
                            });
                        };
                        let schema = out
                            .rows
                            .first()
                            .map(|b| b.schema())
                            .unwrap_or_else(|| agg::merge_schema(&out.schema));
                        arrow::compute::concat_batches(&schema, &out.rows)?
                    }
                };
                super::deferred::write_rows(&self.wh, &spec.name, n, &rows).await?;
                Some(rows)
            }
            None => None,
        };
        let compute_ms = t0.elapsed().as_millis();
        fault::pause("job_after_compute").await;
        fault::point("job_after_compute");
        let counts = computed.result.counts.clone();
        if let (Some(rows), LatePolicy::SideOutput) = (&computed.late, spec.time.late_policy) {
            if rows.num_rows() > 0 {
                self.append_late(spec, rows, n).await?;
            }
        }
        fault::point("job_after_late");
        let mut written = counts.windows_recomputed + counts.deleted;
        let last = computed.gold.len().saturating_sub(1);
        for (i, out) in computed.gold.into_iter().enumerate() {
            if i > 0 {
                fault::point("job_between_merges");
            }
            if i > 0 && i == last {
                fault::point("job_before_completing_merge");
            }
            if deferred.as_ref() == Some(&out.table) {
                continue; // committed by the stream (`super::deferred`)
            }
            // A resumed batch's recomputed rows for a table the interrupted run already
            // committed can come out empty (its operator reads that table back); what
            // the committed rows were is in the commit.
            let nothing = out.write != Write::Replace && out.rows.iter().all(|b| b.num_rows() == 0);
            let w = if resumed && nothing {
                self.written_if_held(&out.table, &out.app, n).await?
            } else {
                self.merge_gold(spec, out, n).await?
            };
            if let Some(w) = w {
                *merged.get_or_insert(0) += w;
            }
        }
        if let Some(w) = merged {
            written = w;
        }
        fault::point("job_after_gold");
        let entry = JobEntry {
            run_id: self.run_id.clone(),
            job: spec.name.clone(),
            batch_id: n,
            started_at_us: started,
            finished_at_us: self.now_us(),
            counts,
            rows_written: written,
            status: "ok".into(),
            message: None,
            metrics: computed.result.metrics.clone(),
            cpu_ms: (crate::time::clock::cpu_us() - cpu0) / 1000,
            resumed,
        };
        runlog::log_job(&self.wh, &entry).await?;
        fault::point("job_after_runlog");
        if let (Some(p), Some(rows)) = (&self.pending, &deferred_rows) {
            p.add(n, rows)?;
        }
        info!(
            job = %spec.name,
            batch = n,
            compute_ms,
            total_ms = t0.elapsed().as_millis() as u64,
            applied = entry.counts.applied,
            metrics = ?entry.metrics,
            "job batch done"
        );
        Ok((entry, computed.result.state))
    }

    async fn append_late(&self, spec: &JobSpec, rows: &RecordBatch, n: i64) -> Result<()> {
        let path = names::table::late(&spec.name);
        let table = self
            .wh
            .open_or_create(&path, &rows.schema(), &[late::PARTITION])
            .await?;
        let app = names::app::late(&spec.name);
        delta::commit_once(table, &app, n, |t| {
            delta::append(t, vec![rows.clone()], &[late::PARTITION], &app, n)
        })
        .await?;
        Ok(())
    }

    /// Whether `table` holds the commit of batch `n` by `app`.
    /// The rows batch `n`'s gold commits wrote (outputs other than `deferred`), when a
    /// run killed after them left the batch without its run-log row; None if none of
    /// them names its rows (as when the batch had nothing to write).
    async fn written_before(
        &self,
        spec: &JobSpec,
        n: i64,
        deferred: Option<&str>,
    ) -> Result<Option<i64>> {
        let mut written = None;
        for out in spec.outputs() {
            if Some(out.table.as_str()) == deferred {
                continue;
            }
            if let Some(w) = self.written_if_held(&out.table, &out.app, n).await? {
                *written.get_or_insert(0) += w;
            }
        }
        Ok(written)
    }

    /// The rows `(app, n)`'s commit wrote to `table`, if the table holds it.
    async fn written_if_held(&self, table: &str, app: &str, n: i64) -> Result<Option<i64>> {
        let Some(t) = self.wh.open(table).await? else {
            return Ok(None);
        };
        if !delta::holds(&t, app, n).await? {
            return Ok(None);
        }
        delta::written_by(&t, app, n).await
    }

    async fn committed(&self, table: &str, app: &str, n: i64) -> Result<bool> {
        Ok(match self.wh.open(table).await? {
            Some(t) => delta::holds(&t, app, n).await?,
            None => false,
        })
    }

    /// MERGE `out` unless its table already holds batch `n` (or there is nothing to
    /// write); returns the rows rewritten, inserted and deleted when it merged.
    ///
    /// A commit that loses a race with another writer's (a compaction of the same
    /// partitions by `kestrel maintain`, another process's batch) is planned again
    /// against the newer table: the rows are this batch's durable result, so the retry
    /// writes the same thing; if the other writer committed this very batch, its
    /// transaction is found and nothing is written. Retries back off with jitter and give
    /// up after [`MERGE_ATTEMPTS`], reporting the table.
    pub(super) async fn merge_gold(
        &self,
        spec: &JobSpec,
        out: GoldRows,
        n: i64,
    ) -> Result<Option<i64>> {
        if out.write != Write::Replace && out.rows.iter().all(|b| b.num_rows() == 0) {
            return Ok(None);
        }
        let mut attempt = 1;
        loop {
            match self.merge_gold_once(spec, &out, n).await {
                Err(e) if e.is_commit_conflict() && attempt < MERGE_ATTEMPTS => {
                    let wait = backoff(attempt);
                    warn!(job = %spec.name, table = %out.table, batch = n, attempt, wait_ms = wait.as_millis() as u64, error = %e, "gold commit lost a race with another writer; planning it again");
                    self.wh.forget(&out.table);
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err(e) if e.is_commit_conflict() => {
                    return Err(Error::CommitRaces {
                        table: out.table.clone(),
                        batch: n,
                        attempts: MERGE_ATTEMPTS,
                        last: e.to_string(),
                    })
                }
                other => return other,
            }
        }
    }

    async fn merge_gold_once(&self, spec: &JobSpec, out: &GoldRows, n: i64) -> Result<Option<i64>> {
        let (table, out) = self.open_gold(out.clone()).await?;
        if delta::holds(&table, &out.app, n).await? {
            // Committed by a run killed before its run-log row: report what it wrote.
            return delta::written_by(&table, &out.app, n).await;
        }
        fault::pause("job_before_gold_commit").await;
        if out.write != Write::Merge {
            let rows = out
                .rows
                .iter()
                .map(|b| read::conform(b, &out.schema))
                .collect::<Result<Vec<_>>>()?;
            let written = rows.iter().map(|b| b.num_rows() as i64).sum();
            if out.write == Write::Replace {
                delta::overwrite(table, rows, &out.schema, &out.app, n).await?;
                info!(job = %spec.name, table = %out.table, batch = n, rows = written, "gold replaced");
            } else {
                delta::append(table, rows, &out.table_partitions(), &out.app, n).await?;
                info!(job = %spec.name, table = %out.table, batch = n, inserted = written, "gold append");
            }
            return Ok(Some(written));
        }
        let ms = MergeSpec {
            keys: &out.keys,
            partitions: merge_partitions(&out)?,
            columns: out
                .schema
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect(),
            op_column: agg::OP,
            cluster: out.cluster,
        };
        let (_, counts) = merge::merge(table, out.rows, &ms, &out.app, n).await?;
        info!(
            job = %spec.name,
            table = %out.table,
            batch = n,
            updated = counts.updated,
            inserted = counts.inserted,
            deleted = counts.deleted,
            files_scanned = counts.files_scanned,
            "gold merge"
        );
        Ok(Some(counts.updated + counts.inserted + counts.deleted))
    }

    /// Open (or create) `out`'s table, and fit `out` to it: a table created by an earlier
    /// release lacks the hour partition column, so the rows go without it and the MERGE
    /// names only the partition columns the table has.
    pub(crate) async fn open_gold(&self, mut out: GoldRows) -> Result<(DeltaTable, GoldRows)> {
        let table = self
            .wh
            .open_or_create(&out.table, &out.schema, &out.table_partitions())
            .await?;
        let parts = delta::partition_columns(&table)?;
        let has = delta::table_columns(&table)?;
        // A table created before gold clustered its hours partitions by the hour (or,
        // older still, lacks it): then nothing is clustered.
        if out
            .cluster
            .is_some_and(|c| parts.iter().any(|p| p == c) || !has.contains(c))
        {
            out.cluster = None;
        }
        if out.schema.fields().iter().all(|f| has.contains(f.name())) {
            return Ok((table, out));
        }
        let keep: Vec<usize> = (0..out.schema.fields().len())
            .filter(|i| has.contains(out.schema.field(*i).name()))
            .collect();
        out.schema = Arc::new(out.schema.project(&keep)?);
        let target = agg::merge_schema(&out.schema);
        out.rows = out
            .rows
            .iter()
            .map(|b| read::conform(b, &target))
            .collect::<Result<_>>()?;
        let (mut kept, mut extra) = (Vec::new(), Vec::new());
        for (i, p) in out.partitions.iter().enumerate() {
            if parts.iter().any(|q| q == p) || out.cluster == Some(*p) {
                kept.push(*p);
                extra.push(out.extra_partitions.get(i).cloned().unwrap_or_default());
            }
        }
        out.partitions = kept;
        out.extra_partitions = extra;
        Ok((table, out))
    }
}
