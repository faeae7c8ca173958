//! The application a command works with, built once per process from the config:
//! source schemas, job definitions (all validated before any work), the ingestor and
//! the job runner; and the orchestration `kestrel run` performs (which sources and jobs
//! a running stream owns, ingest, then jobs, every failure collected). The CLI parses,
//! calls in here and prints; the scheduler and the stream take the same parts.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::job::spec::JobSpec;
use crate::lease::Lease;
use crate::runner::batch::{JobReport, JobRunner};
use crate::runner::follow::Progress;
use crate::runner::ingest::{IngestOptions, Ingestor, SourceReport};
use crate::schema::SourceSchema;
use crate::sink::delta::Warehouse;
use crate::time::clock::Clock;

/// Config, schemas, jobs, ingestor and runner of one process.
pub struct App {
    pub schemas: BTreeMap<String, Arc<SourceSchema>>,
    pub jobs: BTreeMap<String, JobSpec>,
    pub ingestor: Ingestor,
    pub runner: JobRunner,
    /// Jobs a `run` runs at once (`parallel_jobs`).
    pub parallel_jobs: usize,
    /// Where the jobs' reads run (`[engine]`): see [`App::with_engine`].
    engine: crate::engine::EngineConfig,
    /// The cluster the reads run on, if any.
    cluster: Option<crate::engine::port::ClusterPort>,
}

/// What one `run` did: per source and per job, and what failed (a job that reads
/// several sources, one of whose ingestion failed, is reported skipped: see
/// [`not_ingested`]).
#[derive(Debug, Default)]
pub struct RunOutcome {
    pub sources: Vec<SourceReport>,
    /// Sources skipped because a running stream owns them: (source, job, owner).
    pub left_to_streams: Vec<(String, String, String)>,
    pub jobs: Vec<JobReport>,
    /// `source: error`, one per failed source.
    pub ingest_failures: Vec<String>,
    /// `job: error`, one per failed job.
    pub job_failures: Vec<String>,
}

impl RunOutcome {
    /// What failed, in one line (`ingestion failed for …; job failed: …`), if anything.
    pub fn failures(&self) -> Option<String> {
        let (ing, jobs) = (&self.ingest_failures, &self.job_failures);
        match (ing.is_empty(), jobs.is_empty()) {
            (true, true) => None,
            (false, true) => Some(format!("ingestion failed for {}", ing.join("; "))),
            (true, false) => Some(format!("job failed: {}", jobs.join("; "))),
            (false, false) => Some(format!(
                "ingestion failed for {}; job failed: {}",
                ing.join("; "),
                jobs.join("; ")
            )),
        }
    }
}

/// Why a job that reads `sources` must not run after this run's ingestion of those of
/// them it ingested (`read`, results in the same order), if it must not: it reads several
/// sources and one of them failed. A job batch consumes one ingestion batch per source,
/// so such a job run beside a failed source would take the others' new batches without
/// that source's — different batches, a different watermark, even rows judged too late —
/// from the run that ingests every source. It runs in the next run that ingests them
/// all. A job that reads one source takes the batches completed before the failure, as
/// it would have in that run. A source busy under another process's lease is not a
/// failure: that process ingests it, and the job goes on with the batches completed so
/// far (as the daemon's job tasks do).
fn not_ingested(
    sources: &[String],
    read: &[&String],
    ingested: &[Arc<Result<SourceReport>>],
) -> Option<String> {
    if sources.len() < 2 {
        return None;
    }
    let failed: Vec<&str> = read
        .iter()
        .zip(ingested)
        .filter(|(_, r)| matches!(r.as_ref(), Err(e) if !matches!(e, Error::LeaseHeld { .. })))
        .map(|(s, _)| s.as_str())
        .collect();
    (!failed.is_empty()).then(|| {
        format!(
            "not run: ingestion of {} failed (the next run that ingests it runs the job)",
            failed.join(", ")
        )
    })
}

impl App {
    /// Load the schemas and every job file, then build the ingestor (with `ingest`) and
    /// the job runner (with the config's lease TTL, open-day compaction and, when
    /// `ingest` has one, the same stop flag).
    pub async fn load(cfg: Config, ingest: IngestOptions) -> Result<App> {
        let schemas = crate::schema::load_all(&cfg.schemas_dir)?;
        let jobs = crate::job::spec::load_all(&cfg.jobs_dir, &schemas).await?;
        Self::with_parts(cfg, schemas, jobs, ingest)
    }

    /// [`App::load`] with the schemas and jobs already loaded (a benchmark's, a test's).
    pub fn with_parts(
        cfg: Config,
        schemas: BTreeMap<String, Arc<SourceSchema>>,
        jobs: BTreeMap<String, JobSpec>,
        ingest: IngestOptions,
    ) -> Result<App> {
        let lease_ttl = cfg.ingest.lease_ttl;
        let parallel_jobs = cfg.parallel_jobs;
        let budget_rows = cfg.compute_budget_rows;
        let open = cfg.maintain.open_compaction();
        let stop = ingest.stop.clone();
        let engine = cfg.engine.clone();
        // The batch a source has just ingested goes to its jobs in memory.
        let fresh = crate::operator::fresh::FreshRows::from_env().map(Arc::new);
        // With room for more than one thing at once, a job that reads one source takes
        // its batches as the ingestion completes them.
        let progress = (parallel_jobs > 1).then(|| Arc::new(Progress::default()));
        let ingestor = Ingestor::with_schemas(cfg, schemas.clone(), ingest)?
            .with_fresh(fresh.clone())
            .with_progress(progress);
        let mut runner = JobRunner::new(ingestor.warehouse().clone(), schemas.clone(), lease_ttl)
            .with_open_compaction(open)
            .with_budget(budget_rows)
            .with_fresh(fresh);
        if let Some(stop) = stop {
            runner = runner.with_stop(stop);
        }
        Ok(App {
            schemas,
            jobs,
            ingestor,
            runner,
            parallel_jobs,
            engine,
            cluster: None,
        })
    }

    /// Run the jobs' reads where `[engine]` says, for the commands that run jobs (`run`,
    /// `schedule`, `backfill`, `stream`; `status` and `maintain` read nothing through it
    /// and work with the cluster down). Checked before anything is read or committed: an
    /// unreachable scheduler fails the command with nothing done, unless
    /// `[engine] fallback = "local"`.
    pub async fn with_engine(mut self) -> Result<Self> {
        let cluster = crate::engine::connect::read_port(&self.engine, self.warehouse()).await?;
        let days = if cluster.is_some() {
            self.engine.parallel_days
        } else {
            1
        };
        self.ingestor = self.ingestor.with_cluster(cluster.clone().map(Arc::new));
        self.runner = self
            .runner
            .with_cluster(cluster.clone())
            .with_parallel_days(days);
        self.cluster = cluster;
        Ok(self)
    }

    /// Stamp everything this app writes with `clock`'s processing time.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.ingestor = self.ingestor.with_clock(clock.clone());
        self.runner = self.runner.with_clock(clock);
        self
    }

    pub fn warehouse(&self) -> &Warehouse {
        self.ingestor.warehouse()
    }

    /// The landing zone.
    pub fn landing(&self) -> &crate::storage::Location {
        self.ingestor.landing()
    }

    /// The job called `name`, or an error listing the known ones.
    pub fn job(&self, name: &str) -> Result<&JobSpec> {
        self.jobs.get(name).ok_or_else(|| Error::UnknownJob {
            name: name.to_string(),
            known: self.jobs.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// The jobs called `names` (every job when empty), in name order; an unknown name is
    /// an error.
    pub fn select_jobs(&self, names: &[String]) -> Result<Vec<&JobSpec>> {
        for n in names {
            self.job(n)?;
        }
        Ok(self
            .jobs
            .values()
            .filter(|j| names.is_empty() || names.contains(&j.name))
            .collect())
    }

    /// The sources called `names` (the config's selection when empty); an unknown name
    /// is an error.
    pub fn select_sources(&self, names: &[String]) -> Result<Vec<String>> {
        let all = self.ingestor.sources()?;
        if names.is_empty() {
            return Ok(all);
        }
        if let Some(s) = names.iter().find(|s| !all.contains(s)) {
            return Err(Error::UnknownSource {
                name: s.clone(),
                known: all.join(", "),
            });
        }
        Ok(names.to_vec())
    }

    /// Jobs running always-on in a `kestrel stream` right now: (job, owner).
    pub async fn streams(&self) -> Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        for name in self.jobs.keys() {
            if let Some(owner) = Lease::stream_owner(self.warehouse(), name).await? {
                out.push((name.clone(), owner));
            }
        }
        Ok(out)
    }

    /// One `kestrel run`: ingest `sources` (those a running stream's job reads are left
    /// to it) and run `jobs` (empty: all; a streamed job is reported as skipped),
    /// `parallel_jobs` sources and jobs at once. A job starts once every source it reads
    /// that this run ingests is done, so it sees the batches this run committed, as if the
    /// sources had all been ingested first (a job of several sources one of which failed
    /// does not run: [`not_ingested`]); the others' ingestion and jobs meanwhile use the
    /// cores a job's reads and MERGEs leave idle. With `parallel_jobs` above one, a job
    /// that reads one source instead follows its ingestion batch by batch
    /// ([`crate::runner::follow`]).
    pub async fn run(&self, sources: &[String], jobs: &[String]) -> Result<RunOutcome> {
        if let Some(c) = &self.cluster {
            c.new_run();
        }
        let jobs = self.select_jobs(jobs)?;
        let sources = self.select_sources(sources)?;
        let streamed = self.streams().await?;
        let mut out = RunOutcome::default();
        let mut ingest: Vec<&String> = Vec::new();
        for s in &sources {
            let owner = streamed
                .iter()
                .find(|(j, _)| self.jobs[j].sources.iter().any(|js| js == s));
            if let Some((job, owner)) = owner {
                out.left_to_streams
                    .push((s.clone(), job.clone(), owner.clone()));
                continue;
            }
            ingest.push(s);
        }
        let (streaming, runnable): (Vec<&JobSpec>, Vec<&JobSpec>) = jobs
            .into_iter()
            .partition(|spec| streamed.iter().any(|(j, _)| *j == spec.name));
        let (ingested, results) = self.ingest_and_run(&ingest, &runnable).await;
        // What the jobs did not take is theirs no longer (a daemon's next run ingests
        // anew).
        if let Some(f) = self.ingestor.fresh() {
            f.clear();
        }
        for (s, r) in ingest.iter().zip(ingested) {
            match r.as_ref() {
                Ok(r) => out.sources.push(r.clone()),
                Err(e) => out.ingest_failures.push(format!("{s}: {e}")),
            }
        }
        for (spec, result) in runnable.iter().zip(results) {
            match result {
                Ok(r) => out.jobs.push(r),
                Err(e) => out.job_failures.push(format!("{}: {e}", spec.name)),
            }
        }
        for spec in streaming {
            if let Some((_, owner)) = streamed.iter().find(|(j, _)| *j == spec.name) {
                out.jobs.push(JobReport {
                    job: spec.name.clone(),
                    skipped: Some(format!("running always-on in a stream ({owner})")),
                    ..Default::default()
                });
            }
        }
        // Reported in name order, as the jobs are listed.
        out.jobs.sort_by(|a, b| a.job.cmp(&b.job));
        Ok(out)
    }

    /// Ingest `sources` and run `jobs`, at most `parallel_jobs` of them at once (sources
    /// first, in order; a job once the sources it reads among `sources` are done, or, when
    /// it reads one, as that one completes its batches).
    /// Results in the order given. With `parallel_jobs = 1` this is every source in turn,
    /// then every job in turn.
    async fn ingest_and_run(
        &self,
        sources: &[&String],
        jobs: &[&JobSpec],
    ) -> (Vec<Arc<Result<SourceReport>>>, Vec<Result<JobReport>>) {
        use futures::FutureExt;
        // A batch handed over goes once the run's jobs that read its source took it.
        if let Some(f) = self.ingestor.fresh() {
            for s in sources {
                let readers: Vec<&&JobSpec> = jobs
                    .iter()
                    .filter(|j| j.sources.iter().any(|js| js == *s))
                    .collect();
                f.expect_takers(s, readers.len());
                // Held with the columns its jobs read from the first batch, when every
                // one of them says which before it runs.
                let declared = self.schemas.get(s.as_str()).and_then(|schema| {
                    readers
                        .iter()
                        .map(|j| j.operator.new_row_columns(j, s, &schema.bronze))
                        .collect::<Option<Vec<Vec<String>>>>()
                });
                if let Some(cols) = declared.filter(|c| !c.is_empty()) {
                    f.want(s, cols.into_iter().flatten());
                }
            }
        }
        // A slot per source or job at work; fair, so sources queued first go first.
        let slots = Arc::new(tokio::sync::Semaphore::new(self.parallel_jobs.max(1)));
        let progress = self.ingestor.progress();
        if let Some(p) = progress {
            for s in sources {
                p.start(s);
            }
        }
        // Each source's ingestion, shared: its result is the run's and the waits' of the
        // jobs that read it.
        let ingestions: Vec<_> = sources
            .iter()
            .map(|s| {
                let slots = &slots;
                async move {
                    // The semaphore is never closed; without a slot, ingest anyway.
                    let _slot = slots.acquire().await.ok();
                    Arc::new(self.ingestor.ingest_source(s).await)
                }
                .shared()
            })
            .collect();
        let runs = jobs.iter().map(|spec| {
            let (read, waits): (Vec<&String>, Vec<_>) = sources
                .iter()
                .zip(&ingestions)
                .filter(|(s, _)| spec.sources.iter().any(|js| js == **s))
                .map(|(s, ingestion)| (*s, ingestion.clone()))
                .unzip();
            // A job that reads one source, ingested in this run, follows it.
            let follower = match (progress, &spec.sources[..], &read[..]) {
                (Some(p), [_], [source]) => p.follow(source, slots.clone()),
                _ => None,
            };
            let slots = &slots;
            async move {
                if let Some(mut f) = follower {
                    f.hold_slot().await;
                    return self.runner.run_job_in_task(spec, Some(f)).await;
                }
                let ingested = futures::future::join_all(waits).await;
                if let Some(why) = not_ingested(&spec.sources, &read, &ingested) {
                    return Ok(JobReport {
                        job: spec.name.clone(),
                        skipped: Some(why),
                        ..Default::default()
                    });
                }
                let _slot = slots.acquire().await.ok();
                self.runner.run_job_in_task(spec, None).await
            }
        });
        futures::join!(
            futures::future::join_all(ingestions.clone()),
            futures::future::join_all(runs)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_of_several_sources_waits_for_every_failed_one_but_not_for_a_busy_one() {
        let (orders, payments) = ("orders".to_string(), "payments".to_string());
        let ok = || Arc::new(Ok(SourceReport::default()));
        let busy = || {
            Arc::new(Err(Error::LeaseHeld {
                name: "payments".into(),
                owner: "host:1".into(),
                until: "later".into(),
                path: "p".into(),
            }))
        };
        let failed = || {
            Arc::new(Err(Error::Plan {
                path: "p".into(),
                reason: "store down".into(),
            }))
        };
        let both = [orders.clone(), payments.clone()];
        let read = [&orders, &payments];
        let why = |s: &str| {
            Some(format!(
                "not run: ingestion of {s} failed (the next run that ingests it runs the job)"
            ))
        };
        assert_eq!(not_ingested(&both, &read, &[ok(), ok()]), None);
        assert_eq!(not_ingested(&both, &read, &[ok(), busy()]), None);
        assert_eq!(not_ingested(&both, &[], &[]), None);
        // One source: the batches completed before the failure are the job's.
        assert_eq!(not_ingested(&both[..1], &read[..1], &[failed()]), None);
        assert_eq!(
            not_ingested(&both, &read, &[ok(), failed()]),
            why("payments")
        );
        // Only one of the two ingested in this run (`--source payments`), and it failed.
        assert_eq!(
            not_ingested(&both, &read[1..], &[failed()]),
            why("payments")
        );
        assert_eq!(
            not_ingested(&both, &read, &[failed(), failed()]),
            why("orders, payments")
        );
    }
}
