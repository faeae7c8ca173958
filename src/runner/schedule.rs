//! The daemon (`kestrel schedule`): runs ingestion, every job and a daily maintenance
//! slot on their cron schedules (tokio-cron-scheduler, 6-field cron, UTC).
//!
//! - Tasks: `ingest` (every source, `[schedule] ingest`), one task per job (its TOML
//!   `schedule`; a job's run first ingests its own sources, so it sees what landed up to
//!   its tick), and `maintenance` (`[schedule] maintenance`, see [`crate::ops::maintain`]).
//! - A task whose previous run is still going when its next tick comes is skipped and
//!   counted (`kestrel_runs_total{result="skipped"}`), never run twice at once. Ingestion
//!   of one source is serialised inside the process (a lock per source) and across
//!   processes by the source's lease.
//! - One daemon per warehouse: it holds the lease `scheduler` (renewed every third of its
//!   ttl). A second daemon exits with a message naming the holder, or waits for it with
//!   `--wait`. A killed daemon's lease is taken over at once on the same host, and after
//!   the ttl from another host.
//! - A failed run is logged with its error and counted; the next tick retries it (the
//!   batch protocol resumes a half-done batch exactly).
//! - Shutdown ([`StopFlag`], set on SIGTERM / Ctrl-C): no new runs start; runs in progress
//!   finish the batch they are in and stop before the next one; then the lease is
//!   released. A second signal exits at once, which the batch protocol also makes safe.
//! - Optional HTTP endpoint (`[schedule] http`): `/healthz` and Prometheus `/metrics`.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio_cron_scheduler::{Job, JobScheduler};
use tracing::{error, info, warn};

use crate::config::ScheduleConfig;
use crate::error::{Error, Result};
use crate::job::spec::JobSpec;
use crate::lease::Lease;
use crate::ops::http::{self, Response};
use crate::ops::maintain::{self, MaintainOptions};
use crate::ops::metrics::{Metrics, Outcome};
use crate::runner::batch::JobRunner;
use crate::runner::ingest::Ingestor;
use crate::runner::StopFlag;

/// What stops the daemon from starting or running a task.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error(
        "{file}: a job called `{name}` would share its name with the daemon's own task; rename it"
    )]
    ReservedName { file: String, name: String },
    #[error("another kestrel schedule ({owner}) runs on this warehouse (lease {path}, until {until}); stop it, or start this one with --wait")]
    AnotherScheduler {
        owner: String,
        path: String,
        until: String,
    },
    #[error("stopped while waiting for the scheduler lease")]
    StoppedWaiting,
    #[error("{what}: {reason}")]
    Cron { what: String, reason: String },
    #[error("ingestion failed for {0}")]
    Ingest(String),
    #[error("unknown job {0}")]
    UnknownJob(String),
}

fn cron_error(
    what: impl Into<String>,
) -> impl FnOnce(tokio_cron_scheduler::JobSchedulerError) -> ScheduleError {
    let what = what.into();
    move |e| ScheduleError::Cron {
        what,
        reason: format!("{e:?}"),
    }
}

/// Name of the daemon's single-instance lease.
pub const LEASE: &str = "scheduler";

/// Name of the ingestion task.
pub const INGEST: &str = "ingest";
/// Name of the maintenance task.
pub const MAINTENANCE: &str = "maintenance";

/// What the daemon runs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Task {
    Ingest,
    Job(String),
    Maintain,
}

impl Task {
    fn name(&self) -> &str {
        match self {
            Task::Ingest => INGEST,
            Task::Job(j) => j,
            Task::Maintain => MAINTENANCE,
        }
    }
}

/// One line of the daemon's report.
#[derive(Debug, Clone)]
pub enum Event {
    /// Holding the lease; serving HTTP on this address if configured.
    Started {
        owner: String,
        http: Option<std::net::SocketAddr>,
        tasks: Vec<(String, String)>,
    },
    /// Waiting for another daemon's lease (`--wait`).
    Waiting { holder: String },
    /// A run finished (ok or failed) or was skipped.
    Run {
        task: String,
        outcome: Outcome,
        summary: String,
        duration: Duration,
    },
    /// Shutting down: waiting for these tasks to finish their batch.
    Stopping { running: Vec<String> },
}

/// Options of the daemon.
#[derive(Debug, Clone)]
pub struct ScheduleOptions {
    pub config: ScheduleConfig,
    pub maintain: MaintainOptions,
    /// Wait for another daemon's lease instead of exiting.
    pub wait: bool,
}

/// Totals when the daemon stops.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub ok: u64,
    pub failed: u64,
    pub skipped: u64,
}

/// The daemon.
pub struct Daemon {
    ing: Ingestor,
    runner: JobRunner,
    jobs: Vec<JobSpec>,
    sources: Vec<String>,
    opts: ScheduleOptions,
    metrics: Metrics,
    stop: StopFlag,
    source_locks: BTreeMap<String, tokio::sync::Mutex<()>>,
    running: Mutex<HashSet<String>>,
    lease_held: AtomicBool,
    report: Box<dyn Fn(Event) + Send + Sync>,
}

fn log_table(t: &maintain::TableReport) {
    info!(table = %t.table, files_before = t.files_before, files_after = t.files_after, "maintained");
}

impl Daemon {
    /// A daemon over `ing`'s warehouse; `ing` and `runner` should carry `stop` so runs
    /// end between batches on shutdown.
    pub fn new(
        ing: Ingestor,
        runner: JobRunner,
        jobs: Vec<JobSpec>,
        opts: ScheduleOptions,
        stop: StopFlag,
        report: impl Fn(Event) + Send + Sync + 'static,
    ) -> Result<Arc<Self>> {
        if let Some(j) = jobs
            .iter()
            .find(|j| j.name == INGEST || j.name == MAINTENANCE)
        {
            return Err(ScheduleError::ReservedName {
                file: j.file.to_string(),
                name: j.name.clone(),
            }
            .into());
        }
        let sources = ing.sources()?;
        let source_locks = sources
            .iter()
            .map(|s| (s.clone(), tokio::sync::Mutex::new(())))
            .collect();
        Ok(Arc::new(Daemon {
            ing,
            runner,
            jobs,
            sources,
            opts,
            metrics: Metrics::default(),
            stop,
            source_locks,
            running: Mutex::new(HashSet::new()),
            lease_held: AtomicBool::new(false),
            report: Box::new(report),
        }))
    }

    /// The daemon's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn tasks(&self) -> Vec<(Task, String)> {
        let mut t = vec![(Task::Ingest, self.opts.config.ingest.clone())];
        for j in &self.jobs {
            t.push((Task::Job(j.name.clone()), j.schedule.clone()));
        }
        t.push((Task::Maintain, self.opts.config.maintenance.clone()));
        t
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        match self.running.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    async fn take_lease(&self) -> Result<Lease> {
        let ttl = self.opts.config.lease_ttl;
        let wh = self.ing.warehouse();
        let mut announced = false;
        loop {
            match Lease::acquire(wh, LEASE, ttl).await {
                Ok(l) => return Ok(l),
                Err(Error::LeaseHeld {
                    owner, until, path, ..
                }) => {
                    if !self.opts.wait {
                        return Err(ScheduleError::AnotherScheduler { owner, path, until }.into());
                    }
                    if !announced {
                        (self.report)(Event::Waiting { holder: owner });
                        announced = true;
                    }
                }
                Err(e) => return Err(e),
            }
            if self.stop.stopped() {
                return Err(ScheduleError::StoppedWaiting.into());
            }
            tokio::time::sleep((ttl / 4).min(Duration::from_secs(5))).await;
        }
    }

    /// Run until `stop` is set (or the lease is lost).
    pub async fn run(self: Arc<Self>) -> Result<Summary> {
        // Bind first (a taken port fails before the lease is touched), serve once the
        // lease is ours.
        let listener = match &self.opts.config.http {
            Some(addr) => Some(http::bind(addr).await?),
            None => None,
        };
        let mut lease = self.take_lease().await?;
        self.lease_held.store(true, Ordering::SeqCst);
        let http_addr = listener.map(|(listener, local)| {
            let d = self.clone();
            tokio::spawn(http::serve(listener, move |path| {
                let d = d.clone();
                async move { d.http(&path).await }
            }));
            local
        });
        // Cron ticks only post the task; each run gets a thread of the blocking pool and
        // drives its future there with `Handle::block_on` (job futures borrow across
        // awaits and are not `Send`; DataFusion still runs its partitions on the
        // runtime's worker threads). Not a `LocalSet`: inside one, delta-rs' checkpoint
        // (delta-kernel reads the log with `block_in_place`) panics with "can call
        // blocking only when running on the multi-threaded runtime" — every tenth
        // commit of a table, which killed that run and left its task "still going"
        // for ever.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Task>();
        let mut sched = JobScheduler::new()
            .await
            .map_err(cron_error("cannot start the scheduler"))?;
        let tasks = self.tasks();
        for (task, cron) in &tasks {
            let name = task.name().to_string();
            let tx = tx.clone();
            let task = task.clone();
            let job = Job::new_async(cron.as_str(), move |_, _| {
                let _ = tx.send(task.clone());
                Box::pin(async {})
            })
            .map_err(cron_error(format!("schedule of {name}")))?;
            sched
                .add(job)
                .await
                .map_err(cron_error(format!("cannot add {name}")))?;
        }
        sched
            .start()
            .await
            .map_err(cron_error("cannot start the scheduler"))?;
        (self.report)(Event::Started {
            owner: lease.owner().to_string(),
            http: http_addr,
            tasks: tasks
                .iter()
                .map(|(t, c)| (t.name().to_string(), c.clone()))
                .collect(),
        });

        let ttl = self.opts.config.lease_ttl;
        let handle = tokio::runtime::Handle::current();
        let lost = async {
            // Renew the lease until told to stop; losing it stops the daemon.
            let mut last_renew = Instant::now();
            let mut lost = None;
            while !self.stop.stopped() {
                tokio::select! {
                    Some(task) = rx.recv() => {
                        let (d, handle) = (self.clone(), handle.clone());
                        tokio::task::spawn_blocking(move || handle.block_on(d.tick(task)));
                    }
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
                if last_renew.elapsed() >= ttl / 3 {
                    if let Err(e) = lease.renew(ttl).await {
                        error!(error = %e, "scheduler lease lost; stopping");
                        lost = Some(e);
                        self.stop.stop();
                        break;
                    }
                    last_renew = Instant::now();
                }
            }
            // Runs in progress finish their batch; keep the lease alive meanwhile.
            let mut announced = false;
            loop {
                let running: Vec<String> = self.running().iter().cloned().collect();
                if running.is_empty() {
                    break;
                }
                if !announced {
                    (self.report)(Event::Stopping { running });
                    announced = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                if lost.is_none()
                    && last_renew.elapsed() >= ttl / 3
                    && lease.renew(ttl).await.is_ok()
                {
                    last_renew = Instant::now();
                }
            }
            lost
        }
        .await;
        let _ = sched.shutdown().await;
        self.lease_held.store(false, Ordering::SeqCst);
        if lost.is_none() {
            lease.release().await?;
        }
        if let Some(e) = lost {
            return Err(e);
        }
        let count = |o| {
            self.tasks()
                .iter()
                .map(|(t, _)| self.metrics.runs(t.name(), o))
                .sum()
        };
        Ok(Summary {
            ok: count(Outcome::Ok),
            failed: count(Outcome::Failed),
            skipped: count(Outcome::Skipped),
        })
    }

    /// One tick of `task`: skipped when its previous run is still going.
    async fn tick(self: Arc<Self>, task: Task) {
        if self.stop.stopped() {
            return;
        }
        let name = task.name().to_string();
        if !self.running().insert(name.clone()) {
            self.metrics.run(&name, Outcome::Skipped);
            let n = self.metrics.runs(&name, Outcome::Skipped);
            warn!(task = %name, skipped = n, "previous run still going; tick skipped");
            (self.report)(Event::Run {
                task: name,
                outcome: Outcome::Skipped,
                summary: format!("previous run still going ({n} skipped so far)"),
                duration: Duration::ZERO,
            });
            return;
        }
        let t0 = Instant::now();
        // A panic in a run is that run's failure, reported like any other; the task
        // must not stay "still going" for ever.
        let result = std::panic::AssertUnwindSafe(self.execute(&task))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                Err(Error::Panicked {
                    what: name.clone(),
                    message: crate::error::panic_message(panic.as_ref()),
                })
            });
        let idle = {
            let mut running = self.running();
            running.remove(&name);
            running.is_empty()
        };
        // A daemon runs for months: between runs it holds what a `kestrel run` process
        // holds when it starts. The footers cached by its reads go (a tick's reads share
        // them; the next tick's reads are other files, or read them again in a few ms),
        // and what the run freed goes back to the system. Kept from tick to tick, the
        // cache's long-lived entries pinned pages all through the heap: over a day of
        // small drops in one process the hourly median of a run's peak RSS grew from
        // 148 to 264 MB (README, "Cost over time").
        // So do the rows a task's ingestion handed to its jobs (a later task's jobs read
        // them from bronze).
        if idle {
            crate::sink::delta::clear_file_metadata();
            if let Some(f) = self.ing.fresh() {
                f.clear();
            }
        }
        crate::alloc::release();
        let (outcome, summary) = match result {
            Ok(s) => (Outcome::Ok, s),
            // Another writer (a backfill, a `kestrel run`) holds the job or source.
            Err(Error::LeaseHeld { name, owner, .. }) => (
                Outcome::Skipped,
                format!("{name} is held by {owner}; next tick"),
            ),
            Err(e) => {
                error!(task = %name, error = %e, "run failed; retrying at the next tick");
                (Outcome::Failed, format!("{e}; retrying at the next tick"))
            }
        };
        self.metrics.run(&name, outcome);
        (self.report)(Event::Run {
            task: name,
            outcome,
            summary,
            duration: t0.elapsed(),
        });
    }

    fn job(&self, name: &str) -> Option<&JobSpec> {
        self.jobs.iter().find(|j| j.name == name)
    }

    /// The live stream that owns `job`, if any.
    async fn streamed(&self, job: &JobSpec) -> Result<Option<String>> {
        Lease::stream_owner(self.ing.warehouse(), &job.name).await
    }

    /// Sources owned by a running stream (its job's sources).
    async fn streamed_sources(&self) -> Result<HashSet<String>> {
        let mut out = HashSet::new();
        for j in &self.jobs {
            if self.streamed(j).await?.is_some() {
                out.extend(j.sources.iter().cloned());
            }
        }
        Ok(out)
    }

    /// Ingest `sources` (each under its lock); returns (files, rows written, quarantined).
    async fn ingest(&self, sources: &[String]) -> Result<(i64, i64, i64)> {
        let streamed = self.streamed_sources().await?;
        let mut totals = (0, 0, 0);
        let mut failures = Vec::new();
        for s in sources {
            if streamed.contains(s) || self.stop.stopped() {
                continue;
            }
            let Some(lock) = self.source_locks.get(s) else {
                continue;
            };
            let _guard = lock.lock().await;
            match self.ing.ingest_source(s).await {
                Ok(r) => {
                    self.metrics.ingested(&r.batches);
                    totals.0 += r.files();
                    totals.1 += r.rows_written();
                    totals.2 += r.quarantined();
                }
                // Another process (a `kestrel run` from cron) is ingesting it: jobs go on
                // with the batches completed so far.
                Err(Error::LeaseHeld { owner, .. }) => {
                    info!(source = %s, %owner, "source busy; left to its lease holder");
                }
                Err(e) => failures.push(format!("{s}: {e}")),
            }
        }
        if !failures.is_empty() {
            return Err(ScheduleError::Ingest(failures.join("; ")).into());
        }
        Ok(totals)
    }

    async fn execute(&self, task: &Task) -> Result<String> {
        match task {
            Task::Ingest => {
                let (files, rows, quarantined) = self.ingest(&self.sources).await?;
                Ok(format!(
                    "{files} files, {rows} rows to bronze, {quarantined} quarantined"
                ))
            }
            Task::Job(name) => {
                let Some(spec) = self.job(name) else {
                    return Err(ScheduleError::UnknownJob(name.clone()).into());
                };
                if let Some(owner) = self.streamed(spec).await? {
                    return Ok(format!("left to the running stream ({owner})"));
                }
                let (files, _, _) = self.ingest(&spec.sources).await?;
                let r = self.runner.run_job(spec).await?;
                self.metrics.job_batches(&r.batches);
                let w = r.watermark.map_or("-".into(), crate::time::iso);
                Ok(format!(
                    "{files} new files; {} batches, {} applied, {} windows, {} corrections, {} too late; watermark {w}",
                    r.batches.len(),
                    r.applied(),
                    r.windows_recomputed(),
                    r.corrections(),
                    r.too_late()
                ))
            }
            Task::Maintain => {
                let mut opts = self.opts.maintain.clone();
                opts.today = maintain::today();
                opts.stop = Some(self.stop.clone());
                let r = maintain::run(
                    self.ing.warehouse(),
                    &self.sources,
                    &self.jobs,
                    &opts,
                    log_table,
                )
                .await?;
                let before: usize = r.tables.iter().map(|t| t.files_before).sum();
                let after: usize = r.tables.iter().map(|t| t.files_after).sum();
                let vacuumed: usize = r.tables.iter().map(|t| t.files_vacuumed).sum();
                Ok(format!(
                    "{} tables: {before} files compacted to {after}, {vacuumed} vacuumed, {} left for the next slot",
                    r.tables.len(),
                    r.skipped()
                ))
            }
        }
    }

    async fn http(&self, path: &str) -> Response {
        match path {
            "/healthz" => {
                if self.lease_held.load(Ordering::SeqCst) && !self.stop.stopped() {
                    Response::text(200, "ok\n")
                } else {
                    Response::text(503, "stopping\n")
                }
            }
            "/metrics" => {
                let jobs: Vec<&JobSpec> = self.jobs.iter().collect();
                let now = chrono::Utc::now().timestamp_micros();
                let status = crate::ops::status::collect(
                    self.ing.warehouse(),
                    Some(self.ing.landing()),
                    &self.sources,
                    &jobs,
                    now,
                )
                .await;
                let status = match status {
                    Ok(s) => Some(s),
                    Err(e) => {
                        warn!(error = %e, "metrics: status unavailable");
                        None
                    }
                };
                let up = self.lease_held.load(Ordering::SeqCst) && !self.stop.stopped();
                Response {
                    status: 200,
                    content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    body: self.metrics.render(status.as_ref(), up),
                }
            }
            _ => Response::text(404, "try /healthz or /metrics\n"),
        }
    }
}
