//! Ingestion: landed files → `bronze/<source>`, exactly once.
//!
//! Protocol for batch `n` of a source (each step is idempotent, so a crash anywhere and
//! a re-run give the same tables):
//! 1. `n` = last batch in the run log + 1. If plan `n` exists it is re-executed as is
//!    (crash recovery); otherwise discovery lists new files and plan `n` is written with
//!    put-if-absent.
//! 2. Decode and validate the planned files; deduplicate by event_id: first delivery
//!    wins within the batch (plan order = landed time, path, line), then exactly against
//!    bronze for the event dates the batch touches (ignoring rows of batch `n` itself).
//! 3. Append to `bronze/<source>` with txn (`kestrel-ingest-<source>`, n) unless bronze
//!    already holds that txn; same for `quarantine/<source>`.
//! 4. Append the files' outcomes to `_kestrel/ledger` with txn (`kestrel-ledger-<source>`, n).
//! 5. Append the run-log entry with txn (`kestrel-runlog-ingest-<source>`, n): batch `n`
//!    is complete once this commit exists.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::time::clock::Clock;
use crate::time::Micros;
use arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use arrow::datatypes::Date32Type;
use indicatif::{ProgressBar, ProgressStyle};
use tracing::{info, warn};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::fault;
use crate::lease::Lease;
use crate::ledger::{self, FileAction, FileOutcome, Plan, PlannedFile};
use crate::names;
use crate::runlog::{self, IngestEntry};
use crate::schema::{SourceSchema, EVENT_DATE};
use crate::sink::compact;
use crate::sink::delta::{self, Warehouse};
use crate::sink::known::Known;
use crate::sink::quarantine::{self, QuarantineBuilder};
use crate::sink::{bloom, probe};
use crate::source::decode::{Decoded, Rejected};
use crate::source::dedup::{id_hash, DedupSet};
use crate::source::discover::{self, LandedFile};
use crate::source::validate::FileContext;
use crate::source::{pool, read};
use crate::storage::Location;

/// Options of one ingestion run.
#[derive(Debug, Clone, Default)]
pub struct IngestOptions {
    /// List every landed file (not only names after the cursors).
    pub full_scan: bool,
    /// When set, stop between batches (the daemon's graceful shutdown).
    pub stop: Option<super::StopFlag>,
}

/// What one run did for one source (all its batches).
#[derive(Debug, Clone, Default)]
pub struct SourceReport {
    pub source: String,
    pub batches: Vec<IngestEntry>,
}

impl SourceReport {
    fn sum(&self, f: impl Fn(&IngestEntry) -> i64) -> i64 {
        self.batches.iter().map(f).sum()
    }
    pub fn files(&self) -> i64 {
        self.sum(|e| e.files)
    }
    pub fn rows_in(&self) -> i64 {
        self.sum(|e| e.rows_in)
    }
    pub fn rows_written(&self) -> i64 {
        self.sum(|e| e.rows_written)
    }
    pub fn duplicates(&self) -> i64 {
        self.sum(|e| e.duplicates)
    }
    pub fn quarantined(&self) -> i64 {
        self.sum(|e| e.quarantined)
    }
    pub fn files_rejected(&self) -> i64 {
        self.sum(|e| e.files_rejected)
    }
    pub fn files_changed(&self) -> i64 {
        self.sum(|e| e.files_changed)
    }
}

/// How an in-memory dedup set was loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DedupLoad {
    /// Ids held.
    pub ids: usize,
    /// Ids read from bronze (all of them without a checkpoint; the top-up with one).
    pub read_from_bronze: usize,
    pub from_checkpoint: bool,
    /// The last completed ingestion batch the set reflects.
    pub position: i64,
}

/// Ingests sources of one configuration.
pub struct Ingestor {
    cfg: Config,
    landing: Location,
    wh: Warehouse,
    schemas: BTreeMap<String, Arc<SourceSchema>>,
    run_id: String,
    opts: IngestOptions,
    /// The always-on stream's in-memory dedup sets, per source (a source without one
    /// deduplicates against bronze).
    cache: std::sync::Mutex<BTreeMap<String, DedupSet>>,
    clock: Clock,
    /// Where batches are decoded and written when not in this process (`[engine]`).
    cluster: Option<Arc<crate::engine::port::ClusterPort>>,
    /// Where completed batches' bronze rows are handed to the jobs of this process (see
    /// [`crate::operator::fresh`]).
    fresh: Option<Arc<crate::operator::fresh::FreshRows>>,
    /// Where completed batches and the end of each source's ingestion are reported to
    /// the jobs that follow it (see [`super::follow`]).
    progress: Option<Arc<super::follow::Progress>>,
}

impl Ingestor {
    /// Set up from config: open landing and warehouse, load schemas.
    pub fn new(cfg: Config, opts: IngestOptions) -> Result<Self> {
        let schemas = crate::schema::load_all(&cfg.schemas_dir)?;
        Self::with_schemas(cfg, schemas, opts)
    }

    /// Set up from config with schemas the caller has already loaded.
    pub fn with_schemas(
        cfg: Config,
        schemas: BTreeMap<String, Arc<SourceSchema>>,
        opts: IngestOptions,
    ) -> Result<Self> {
        let landing = Location::open(&cfg.landing, &cfg.storage, false).map_err(|e| match e {
            Error::Location { url, reason } if url.starts_with("file:") => Error::Location {
                url,
                reason: format!(
                    "{reason} (the landing zone; `kestrel demo` creates one with sample events)"
                ),
            },
            other => other,
        })?;
        let wh = Warehouse::new(Location::open(&cfg.warehouse, &cfg.storage, true)?)
            .with_tombstone_retention(cfg.maintain.tombstone_retention);
        Ok(Ingestor {
            cfg,
            landing,
            wh,
            schemas,
            run_id: uuid::Uuid::new_v4().to_string(),
            opts,
            cache: std::sync::Mutex::new(BTreeMap::new()),
            clock: Clock::system(),
            cluster: None,
            fresh: None,
            progress: None,
        })
    }

    /// Hand each completed batch's bronze rows to `fresh`, for the jobs of this process.
    pub fn with_fresh(mut self, fresh: Option<Arc<crate::operator::fresh::FreshRows>>) -> Self {
        self.fresh = fresh;
        self
    }

    /// Report each completed batch, and the end of each source's ingestion, to
    /// `progress` (for the jobs that follow a source: [`super::follow`]).
    pub fn with_progress(mut self, progress: Option<Arc<super::follow::Progress>>) -> Self {
        self.progress = progress;
        self
    }

    /// Where completed batches are reported, if anywhere.
    pub fn progress(&self) -> Option<&Arc<super::follow::Progress>> {
        self.progress.as_ref()
    }

    /// Where completed batches' rows are handed over, if anywhere.
    pub fn fresh(&self) -> Option<&Arc<crate::operator::fresh::FreshRows>> {
        self.fresh.as_ref()
    }

    /// Stamp rows and records with `clock`'s processing time (`_ingested_at`, plan,
    /// ledger and run-log times; the system clock by default).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Decode, deduplicate and write each batch's bronze files on the cluster behind
    /// `port` ([`crate::engine::ingest`]); this process still plans and commits. A
    /// source whose dedup set is kept in memory (the always-on stream) stays local.
    pub fn with_cluster(mut self, port: Option<Arc<crate::engine::port::ClusterPort>>) -> Self {
        self.cluster = port;
        self
    }

    /// The processing-time clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    fn now_us(&self) -> Micros {
        self.clock.now_us()
    }

    /// The warehouse.
    pub fn warehouse(&self) -> &Warehouse {
        &self.wh
    }

    /// The landing zone.
    pub fn landing(&self) -> &Location {
        &self.landing
    }

    /// Sources this config ingests.
    pub fn sources(&self) -> Result<Vec<String>> {
        let available: Vec<String> = self.schemas.keys().cloned().collect();
        self.cfg.selected_sources(&available)
    }

    /// Keep `source`'s dedup set in memory from now on (the always-on stream) and
    /// deduplicate each batch against it instead of querying bronze. The set starts from
    /// `from` — a checkpointed set and the ingestion batch it reflects — topped up with
    /// the ids of the completed batches after it; without one, it is filled with the ids
    /// of completed batches that arrived within `ttl` of the newest.
    pub async fn keep_dedup_set(
        &self,
        source: &str,
        ttl: std::time::Duration,
        from: Option<(DedupSet, i64)>,
    ) -> Result<DedupLoad> {
        let completed = runlog::last_batch(&self.wh, "ingest", source).await?;
        let (mut set, after) = match from {
            Some((set, pos)) if pos <= completed => (set, Some(pos)),
            Some((_, pos)) => {
                warn!(
                    source,
                    checkpoint = pos,
                    completed,
                    "checkpoint ahead of the run log: rebuilding the dedup set from bronze"
                );
                (DedupSet::new(ttl), None)
            }
            None => (DedupSet::new(ttl), None),
        };
        let mut read = 0usize;
        let bronze = self.wh.open(&names::table::bronze(source)).await?;
        if let (Some(bronze), true) = (bronze, completed > after.unwrap_or(0)) {
            let ctx = delta::session_with(&bronze, "bronze").await?;
            let filter = match after {
                // Only the batches after the checkpoint (file statistics prune the rest).
                Some(pos) => Some(format!("_batch_id > {pos} AND _batch_id <= {completed}")),
                None => {
                    // The newest arrival: among the last completed batch's rows.
                    let newest = delta::sql(
                        &ctx,
                        &format!("SELECT CAST(max(_landed_at) AS BIGINT) FROM bronze WHERE _batch_id = {completed}"),
                    )
                    .await?;
                    newest
                        .first()
                        .filter(|b| b.num_rows() > 0 && b.column(0).is_valid(0))
                        .map(|b| crate::columns::int64_at(b, 0).map(|c| c.value(0)))
                        .transpose()?
                        .map(|newest| {
                            let from = newest - set.ttl() - 3_600_000_000;
                            format!(
                                "_batch_id <= {completed} AND CAST(_landed_at AS BIGINT) >= {from}"
                            )
                        })
                }
            };
            if let Some(filter) = filter {
                let rows = delta::sql(
                    &ctx,
                    &format!("SELECT CAST(event_id AS VARCHAR), CAST(_landed_at AS BIGINT) FROM bronze WHERE {filter}"),
                )
                .await?;
                for b in &rows {
                    let ids = crate::columns::string_at(b, 0)?;
                    let landed = crate::columns::int64_at(b, 1)?;
                    for i in 0..b.num_rows() {
                        if ids.is_valid(i) {
                            set.insert(ids.value(i), landed.value(i));
                            read += 1;
                        }
                    }
                }
            }
        }
        let load = DedupLoad {
            ids: set.len(),
            read_from_bronze: read,
            from_checkpoint: after.is_some(),
            position: completed,
        };
        info!(
            source,
            ids = load.ids,
            read,
            from_checkpoint = load.from_checkpoint,
            "dedup set loaded"
        );
        self.cache
            .lock()
            .map_err(|_| Error::Poisoned("the dedup set cache"))?
            .insert(source.to_string(), set);
        Ok(load)
    }

    /// Run `f` on `source`'s in-memory dedup set, if one is kept.
    pub fn with_dedup_set<R>(&self, source: &str, f: impl FnOnce(&DedupSet) -> R) -> Option<R> {
        let g = self.cache.lock().ok()?;
        g.get(source).map(f)
    }

    /// Ids and bytes held by `source`'s in-memory dedup set, if one is kept.
    /// The id of this process's run (stamped on its run-log rows).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    pub fn dedup_set_size(&self, source: &str) -> Option<(usize, usize)> {
        let g = self.cache.lock().ok()?;
        g.get(source).map(|s| (s.len(), s.bytes()))
    }

    /// Ingest everything newly landed for one source (as many batches as needed).
    pub async fn ingest_source(&self, source: &str) -> Result<SourceReport> {
        // Its end is reported to the jobs that follow it on every way out, and before the
        // compaction, which they need not wait for.
        let ending = self.progress.as_ref().map(|p| p.ending(source));
        let schema = self
            .schemas
            .get(source)
            .ok_or_else(|| Error::NoSchema(source.to_string()))?
            .clone();
        let mut lease = Lease::acquire(
            &self.wh,
            &format!("ingest-{source}"),
            self.cfg.ingest.lease_ttl,
        )
        .await?;
        let result = self.ingest_batches(source, &schema, &mut lease).await;
        drop(ending);
        if let Some(r) = result.as_ref().ok().filter(|r| !r.batches.is_empty()) {
            self.compact_open(source, r.quarantined() > 0).await;
        }
        // What decoding freed goes back before the jobs start on top of it: a run that
        // ingested a three-hour backlog at Kestrel's scale (1.9M events) peaked at 902 MB
        // and still held 585 MB resident afterwards, with ~45 MB of it in use.
        read::release_buffers();
        crate::alloc::release();
        if let Err(e) = lease.release().await {
            warn!(source, error = %e, "could not release lease");
        }
        result
    }

    /// After a source's batches, under its lease: compact the crowded open partitions of
    /// its bronze table, its part of the file ledger, the run log, and — when the
    /// batches `quarantined` records — its quarantine table (see
    /// [`crate::sink::compact`]). A quarantine table only crowds when records land in
    /// it, and looking cost a cold open of it every run (≈ 8 ms, once it exists). A
    /// failure is logged, not fatal: the batches are committed, and the next run (or
    /// the daily maintenance) tries again.
    async fn compact_open(&self, source: &str, quarantined: bool) {
        let open = self.cfg.maintain.open_compaction();
        let own: &[(&str, &str)] = &[("source", source)];
        let columns = self
            .schemas
            .get(source)
            .into_iter()
            .flat_map(|s| s.bronze.fields().iter().map(|f| f.name().as_str()));
        let mut tables = vec![(
            names::table::bronze(source),
            &[][..],
            Some(delta::bronze_writer_properties(columns)),
            false,
        )];
        if quarantined {
            tables.push((names::table::quarantine(source), &[], None, false));
        }
        tables.push((
            names::table::LEDGER.to_string(),
            own,
            Some(ledger::writer_properties()),
            true,
        ));
        tables.push((names::table::RUNS.to_string(), &[], None, true));
        for (table, only, props, bookkeeping) in tables {
            let done =
                compact::open_partitions(&self.wh, &table, &open, only, props, bookkeeping).await;
            if let Err(e) = done {
                warn!(source, %table, error = %e, "open-partition compaction failed; next run");
            }
        }
    }

    async fn ingest_batches(
        &self,
        source: &str,
        schema: &Arc<SourceSchema>,
        lease: &mut Lease,
    ) -> Result<SourceReport> {
        let mut report = SourceReport {
            source: source.to_string(),
            batches: Vec::new(),
        };
        let mut full_scan_done = false;
        // What had landed when this ingestion started; files landing meanwhile are the
        // next run's (as Spark's `Trigger.AvailableNow`), so a run ends — and its jobs
        // run — even while producers land faster than it ingests.
        let mut pending_at_start: Option<HashSet<String>> = None;
        // Under the source's lease no other writer completes its batches.
        let mut last = runlog::last_batch(&self.wh, "ingest", source).await?;
        // The bronze files this ingestion writes, for its later batches' probes.
        let mut known = Known::default();
        loop {
            if pending_at_start.as_ref().is_some_and(|p| p.is_empty()) {
                break;
            }
            // Stopped (also before the first batch: one that has not started is not
            // running, and the next run does it).
            if self.opts.stop.as_ref().is_some_and(|s| s.stopped()) {
                info!(source, "stopping between batches");
                break;
            }
            if !report.batches.is_empty() {
                lease.renew(self.cfg.ingest.lease_ttl).await?;
                // A backlog's next batch starts from what the last one freed, not on top
                // of it: over 5M orders in four batches the resident floor between
                // batches rose 225 → 449 MiB without giving it back, and stayed at
                // 120–145 MiB with it. Given back only above a bound, though: below
                // it the next batch reuses the pages instead of faulting them in anew
                // (see `alloc::KEEP_RESIDENT_BYTES`).
                crate::alloc::release_above(crate::alloc::KEEP_RESIDENT_BYTES);
            }
            let n = last + 1;
            let (plan, resumed) = match ledger::read_plan(&self.wh, source, n).await? {
                Some(p) => {
                    info!(
                        source,
                        batch = n,
                        files = p.files.len(),
                        "resuming planned batch"
                    );
                    (p, true)
                }
                None => {
                    let force_full = self.opts.full_scan && !full_scan_done;
                    match self.plan_next(source, last, n, force_full).await? {
                        Some((p, pending)) => {
                            full_scan_done |= p.full_scan;
                            pending_at_start.get_or_insert(pending);
                            (p, false)
                        }
                        None => break,
                    }
                }
            };
            fault::point("after_plan");
            fault::pause("ingest_after_plan").await;
            let entry = self.execute(&plan, schema, resumed, &mut known).await?;
            fault::pause("ingest_after_batch").await;
            if let Some(pending) = &mut pending_at_start {
                for f in &plan.files {
                    pending.remove(&f.file.path);
                }
            }
            report.batches.push(entry);
            last = n;
        }
        Ok(report)
    }

    /// Discover new files and durably plan batch `n`, with the paths of every file the
    /// listing found to do (this batch's and those left for later); None when nothing
    /// is new.
    async fn plan_next(
        &self,
        source: &str,
        last: i64,
        n: i64,
        force_full: bool,
    ) -> Result<Option<(Plan, HashSet<String>)>> {
        let prev = if last > 0 {
            ledger::read_plan(&self.wh, source, last).await?
        } else {
            None
        };
        let mut cursors = prev.map(|p| p.cursors_after).unwrap_or_default();
        let every = self.cfg.ingest.full_scan_every as i64;
        let full = force_full || cursors.is_empty() || (every > 0 && n % every == 0);
        let listed =
            discover::list_source(&self.landing, source, (!full).then_some(&cursors)).await?;
        let mut new_files: Vec<LandedFile> = Vec::new();
        let mut changed: Vec<PlannedFile> = Vec::new();
        if full {
            let known = ledger::known_files(&self.wh, source, &listed).await?;
            for f in listed {
                match known.get(&f.path) {
                    None => new_files.push(f),
                    Some(k) => {
                        let etag_differs =
                            matches!((&k.e_tag, &f.e_tag), (Some(a), Some(b)) if a != b);
                        if k.size != f.size || etag_differs {
                            changed.push(PlannedFile {
                                action: FileAction::Changed {
                                    previous_size: k.size,
                                    previous_e_tag: k.e_tag.clone(),
                                },
                                file: f,
                            });
                        }
                    }
                }
            }
        } else {
            new_files = listed;
        }
        if new_files.is_empty() && changed.is_empty() {
            return Ok(None);
        }
        let pending: HashSet<String> = new_files
            .iter()
            .map(|f| f.path.clone())
            .chain(changed.iter().map(|f| f.file.path.clone()))
            .collect();
        // Processing order: arrival time, then path.
        new_files.sort_by(|a, b| (a.landed_at_us, &a.path).cmp(&(b.landed_at_us, &b.path)));
        let (max_files, max_bytes) = (
            self.cfg.ingest.max_files_per_batch,
            self.cfg.ingest.max_bytes_per_batch,
        );
        let mut take = 0usize;
        let mut bytes = 0u64;
        while take < new_files.len() {
            if take > 0 && (take >= max_files || bytes + new_files[take].size > max_bytes) {
                break;
            }
            bytes += new_files[take].size;
            take += 1;
        }
        for f in &new_files[..take] {
            let c = cursors.entry(f.partition.clone()).or_default();
            if f.path > *c {
                *c = f.path.clone();
            }
        }
        // A file left for later must sort after its partition's new cursor, or the next
        // incremental listing would never see it: pull such files into this batch.
        let mut files: Vec<PlannedFile> = Vec::with_capacity(take + changed.len());
        for (i, f) in new_files.into_iter().enumerate() {
            let keep = i < take || cursors.get(&f.partition).is_some_and(|c| f.path <= *c);
            if keep {
                files.push(PlannedFile {
                    file: f,
                    action: FileAction::Ingest,
                });
            }
        }
        files.sort_by(|a, b| {
            (a.file.landed_at_us, &a.file.path).cmp(&(b.file.landed_at_us, &b.file.path))
        });
        files.extend(changed);
        let plan = Plan {
            source: source.to_string(),
            batch_id: n,
            created_at: self.clock.now().to_rfc3339(),
            full_scan: full,
            files,
            cursors_after: cursors,
        };
        let durable = ledger::write_plan(&self.wh, &plan).await?;
        info!(
            source,
            batch = n,
            files = durable.files.len(),
            full_scan = full,
            "planned batch"
        );
        Ok(Some((durable, pending)))
    }

    /// Execute a plan (first time, or `resumed` after a crash). `known`: the bronze files
    /// this ingestion wrote so far, which the dedup's probe rules in or out without
    /// reading them; the batch's own files are added.
    async fn execute(
        &self,
        plan: &Plan,
        schema: &Arc<SourceSchema>,
        resumed: bool,
        known: &mut Known,
    ) -> Result<IngestEntry> {
        let started = self.now_us();
        let cpu0 = crate::time::clock::cpu_us();
        let timer = Instant::now();
        let source = plan.source.as_str();
        let n = plan.batch_id;
        let ingested_at = self.now_us();
        let app = names::app::ingest(source);
        // The rows held of the batch before are not this one's (and memory holds one) —
        // unless jobs follow this ingestion: then they stay until the run's jobs that
        // read the source took them, or this batch's replace them. A follower's first
        // batch starts after the ingestion's second (it waits for a slot and its lease):
        // on 5M orders in four batches `revenue_5m` read its first batch back from
        // bronze (`read_new_ms` 266–273), where it now takes it from memory.
        if let Some(f) = self.fresh.as_ref().filter(|_| self.progress.is_none()) {
            f.forget(source);
        }

        let bronze = self
            .wh
            .open_or_create(&names::table::bronze(source), &schema.bronze, &[EVENT_DATE])
            .await?;
        let bronze_done = delta::holds(&bronze, &app, n).await?;
        let keeps_set = self
            .cache
            .lock()
            .map_err(|_| Error::Poisoned("the dedup set cache"))?
            .contains_key(source);
        // On a cluster (unless the stream keeps this source's dedup set here): decode,
        // dedup and bronze files there, every commit here.
        let remote = match (&self.cluster, keeps_set) {
            (Some(port), false) => Some(
                crate::engine::ingest::run(
                    &crate::operator::port::ReadPort::session(port.as_ref()),
                    plan,
                    schema,
                    &self.landing,
                    &self.wh.loc,
                    ingested_at,
                    bronze.version().unwrap_or(0),
                    !bronze_done,
                    &self.cfg.storage,
                )
                .await?,
            ),
            _ => None,
        };

        // 2. decode + validate
        let bar = progress(plan.files.len() as u64, &format!("{source} batch {n}"));
        let (decoded, remote) = match remote {
            Some(mut r) => (std::mem::take(&mut r.decoded), Some(r)),
            None => (
                self.decode_all(plan, schema, ingested_at, &bar).await?,
                None,
            ),
        };
        let mut batches: Vec<RecordBatch> = Vec::new();
        let mut quarantine = QuarantineBuilder::default();
        let mut outcomes = Vec::with_capacity(plan.files.len());
        let (mut rows_in, mut files_rejected, mut files_changed) = (0i64, 0i64, 0i64);
        for (pf, decoded) in plan.files.iter().zip(decoded) {
            let f = &pf.file;
            let outcome = match &pf.action {
                FileAction::Changed { previous_size, .. } => {
                    files_changed += 1;
                    warn!(source, file = %f.path, "file changed after it was processed");
                    FileOutcome {
                        status: "changed",
                        records: 0,
                        reason: Some(format!(
                            "landed files are immutable: size/e-tag changed after processing (was {previous_size} bytes, now {})",
                            f.size
                        )),
                    }
                }
                FileAction::Ingest => {
                    let decoded = decoded.unwrap_or_else(|| Decoded::FileRejected {
                        reason: "file was not decoded".into(),
                    });
                    match decoded {
                        Decoded::Rows {
                            batch,
                            rejects,
                            records,
                        } => {
                            rows_in += records as i64;
                            for r in &rejects {
                                quarantine.push(
                                    &f.path,
                                    &f.partition,
                                    f.landed_at_us,
                                    n,
                                    ingested_at,
                                    r,
                                );
                            }
                            if let Some(b) = batch {
                                batches.push(b);
                            }
                            FileOutcome {
                                status: "ingested",
                                records: records as i64,
                                reason: (!rejects.is_empty())
                                    .then(|| format!("{} record(s) quarantined", rejects.len())),
                            }
                        }
                        Decoded::FileRejected { reason } => {
                            files_rejected += 1;
                            warn!(source, file = %f.path, %reason, "file rejected");
                            let r = Rejected {
                                line: None,
                                raw: None,
                                reason: reason.clone(),
                            };
                            quarantine.push(
                                &f.path,
                                &f.partition,
                                f.landed_at_us,
                                n,
                                ingested_at,
                                &r,
                            );
                            FileOutcome {
                                status: "rejected",
                                records: 0,
                                reason: Some(reason),
                            }
                        }
                    }
                }
            };
            outcomes.push(outcome);
        }
        bar.finish_and_clear();
        fault::point("after_decode");
        let decode_ms = timer.elapsed().as_millis() as u64;
        // The process's CPU time at each phase's end (all its threads): CPU ÷ wall time
        // of a phase is the cores it kept busy, which the batch log shows.
        let cpu_decoded = crate::time::clock::cpu_us();

        // dedup, then 3. bronze
        let t_dedup = Instant::now();
        // Deduplicated against bronze (not the stream's in-memory set): the next batch's
        // probe will ask about the files written here.
        let mut probed = false;
        let (deduped, valid, rows_written) = match remote {
            // The cluster deduplicated and wrote the files: commit them.
            Some(r) => (Bronze::Written(r.adds), r.valid, r.written),
            None => {
                let valid: i64 = batches.iter().map(|b| b.num_rows() as i64).sum();
                // Against the stream's in-memory set when it keeps one (Ok), else
                // against bronze.
                let cached = {
                    let mut g = self
                        .cache
                        .lock()
                        .map_err(|_| Error::Poisoned("the dedup set cache"))?;
                    match g.get_mut(source) {
                        Some(set) => Some(dedup_in_memory(&batches, schema, set)?),
                        None => None,
                    }
                };
                probed = cached.is_none();
                let masks = match cached {
                    Some(m) => m,
                    None => dedup(&batches, &bronze, schema, n, known).await?,
                };
                let parts = delta::with_masks(batches, masks);
                let written = delta::kept_count(&parts) as i64;
                (Bronze::Kept(parts), valid, written)
            }
        };
        let dedup_ms = t_dedup.elapsed().as_millis() as u64;
        let cpu_deduped = crate::time::clock::cpu_us();
        let t_bronze = Instant::now();
        let duplicates = valid - rows_written;
        let mut bronze_version = None;
        // This batch's bronze rows, for the jobs of this process once it is complete: only
        // rows written here (a replay's are an earlier process's, a cluster's are there),
        // and only a batch small enough to hold (see `operator::fresh`).
        let mut handed: Option<Vec<RecordBatch>> = None;
        if bronze_done {
            info!(
                source,
                batch = n,
                "bronze already holds this batch (replay)"
            );
        } else if rows_written > 0 {
            let t = match deduped {
                Bronze::Kept(parts) => {
                    // The kept rows copied and encoded on every core, committed in one
                    // append with the txn (as the cluster's write tasks' files are).
                    let props = delta::bronze_writer_properties_for(
                        schema.bronze.fields().iter().map(|f| f.name().as_str()),
                        &parts,
                    );
                    let writers = std::thread::available_parallelism().map_or(2, |n| n.get());
                    // Held with the columns the jobs read, once they are known.
                    let wanted = self.fresh.as_ref().and_then(|f| f.wanted(source));
                    let hold_columns: Option<Arc<[usize]>> = wanted.map(|w| {
                        (0..schema.bronze.fields().len())
                            .filter(|&i| w.contains(schema.bronze.field(i).name()))
                            .collect()
                    });
                    let hold = self.fresh.as_ref().is_some_and(|f| match &hold_columns {
                        Some(ix) => f.would_hold_columns(delta::kept_bytes_of(&parts, ix)),
                        None => f.would_hold(delta::kept_bytes(&parts)),
                    });
                    let how = delta::KeptWrite {
                        cut: Some(schema.bronze.index_of(EVENT_DATE)?),
                        writers,
                        hold,
                        hold_columns,
                        remember: probed.then(|| schema.event_id_index()),
                    };
                    let written = delta::write_kept(&bronze, parts, props, how).await?;
                    if hold {
                        handed = Some(written.rows);
                    }
                    let t = delta::commit_adds(bronze, written.adds, &app, n).await?;
                    for (name, file) in written.known {
                        known.insert(name, file);
                    }
                    t
                }
                Bronze::Written(adds) => delta::commit_adds(bronze, adds, &app, n).await?,
            };
            bronze_version = t.version().map(|v| v as i64);
        } else if matches!(deduped, Bronze::Kept(_)) {
            handed = Some(Vec::new());
        }
        fault::point("after_bronze");
        let bronze_ms = t_bronze.elapsed().as_millis() as u64;
        let cpu_bronze = crate::time::clock::cpu_us();

        let quarantined = quarantine.len() as i64;
        if let Some(qb) = quarantine.finish()? {
            let q = self
                .wh
                .open_or_create(&names::table::quarantine(source), &quarantine::SCHEMA, &[])
                .await?;
            delta::commit_once(q, &app, n, |q| delta::append(q, vec![qb], &[], &app, n)).await?;
        }
        fault::point("after_quarantine");

        // 4. ledger
        let rows = ledger::ledger_batch(plan, &outcomes, self.now_us())?;
        ledger::record(&self.wh, source, n, rows).await?;
        fault::point("after_ledger");

        // 5. run log
        let status = if files_rejected + files_changed > 0 {
            "partial"
        } else {
            "ok"
        };
        let message = (files_rejected + files_changed > 0).then(|| {
            outcomes
                .iter()
                .zip(&plan.files)
                .filter(|(o, _)| o.status != "ingested")
                .map(|(o, f)| {
                    format!(
                        "{}: {}",
                        f.file.path,
                        o.reason.as_deref().unwrap_or(o.status)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        });
        let entry = IngestEntry {
            run_id: self.run_id.clone(),
            source: source.to_string(),
            batch_id: n,
            started_at_us: started,
            finished_at_us: started + timer.elapsed().as_micros() as i64,
            files: plan.files.len() as i64,
            files_rejected,
            files_changed,
            rows_in,
            rows_written,
            duplicates,
            quarantined,
            bronze_version,
            status: status.to_string(),
            message,
            landed_oldest_us: plan.files.iter().map(|f| f.file.landed_at_us).min(),
            cpu_ms: (crate::time::clock::cpu_us() - cpu0) / 1000,
            resumed,
        };
        runlog::log_ingest(&self.wh, &entry).await?;
        if let (Some(f), Some(rows)) = (&self.fresh, handed) {
            f.hand_over(source, n, rows);
        }
        if let Some(p) = &self.progress {
            p.completed(source, n);
        }
        fault::point("after_runlog");
        info!(
            source,
            batch = n,
            files = entry.files,
            rows_in,
            rows_written,
            duplicates,
            quarantined,
            decode_ms,
            decode_cpu_ms = (cpu_decoded - cpu0) / 1000,
            dedup_ms,
            dedup_cpu_ms = (cpu_deduped - cpu_decoded) / 1000,
            bronze_ms,
            bronze_cpu_ms = (cpu_bronze - cpu_deduped) / 1000,
            total_ms = timer.elapsed().as_millis() as u64,
            "batch committed"
        );
        Ok(entry)
    }

    /// Read and decode the planned files, on as many threads as there are cores, keeping
    /// plan order. `None` for files that are not read (changed files).
    ///
    /// One job per decoding thread ([`crate::source::pool`]), each taking the next file
    /// not yet taken as soon as it is done with one, and fetching and decoding it on its
    /// own thread ([`decode_planned_here`]) — as arrow-json's reference decode in the
    /// ingestion benchmark does. After a failure the other jobs take no new file; every
    /// job is awaited, and the first job's error (in job order) is returned.
    async fn decode_all(
        &self,
        plan: &Plan,
        schema: &Arc<SourceSchema>,
        ingested_at: i64,
        bar: &ProgressBar,
    ) -> Result<Vec<Option<Decoded>>> {
        let files: Arc<[PlannedFile]> = plan.files.clone().into();
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let handle = tokio::runtime::Handle::current();
        let workers = (0..pool::threads().clamp(1, files.len().max(1))).map(|_| {
            let (files, next, failed) = (files.clone(), next.clone(), failed.clone());
            let (landing, schema, bar) = (self.landing.clone(), schema.clone(), bar.clone());
            let (n, handle) = (plan.batch_id, handle.clone());
            let what = || format!("a decoder of {}'s batch {}", plan.source, plan.batch_id);
            pool::run(what, move || {
                use std::sync::atomic::Ordering::Relaxed;
                let mut done = Vec::new();
                // After a failure the others take no new file.
                while !failed.load(Relaxed) {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(pf) = files.get(i) else { break };
                    let d = decode_planned_here(&landing, pf, &schema, n, ingested_at, &handle)
                        .inspect_err(|_| failed.store(true, Relaxed))?;
                    bar.inc(1);
                    done.push((i, d));
                }
                Ok(done)
            })
        });
        // Every decoder is awaited (none is left running), the first error reported.
        let results = futures::future::join_all(workers).await;
        let mut decoded: Vec<Option<Decoded>> = plan.files.iter().map(|_| None).collect();
        for done in results {
            for (i, d) in done? {
                decoded[i] = d;
            }
        }
        Ok(decoded)
    }
}

/// What a decoded file carries of its batch and arrival ([`FileContext`]).
fn file_context(pf: &PlannedFile, n: i64, ingested_at: i64) -> FileContext {
    let f = &pf.file;
    FileContext {
        source_file: f.path.clone(),
        partition: f.partition.clone(),
        landed_at_us: f.landed_at_us,
        batch_id: n,
        ingested_at_us: ingested_at,
    }
}

/// Read and decode one planned file for batch `n` on the calling thread (a decoding
/// thread, [`crate::source::pool`], or the blocking pool's, [`decode_planned`]): a file
/// read whole is fetched through the landing store (its retries, and the faults
/// tests inject there) on `handle`, then decoded right here; a file read in ranges is
/// read and decoded right here too ([`read::decode_in_ranges`]).
fn decode_planned_here(
    landing: &Location,
    pf: &PlannedFile,
    schema: &Arc<SourceSchema>,
    n: i64,
    ingested_at: i64,
    handle: &tokio::runtime::Handle,
) -> Result<Option<Decoded>> {
    let f = &pf.file;
    if pf.action != FileAction::Ingest {
        return Ok(None);
    }
    let ctx = file_context(pf, n, ingested_at);
    if read::streams(f.format, f.size) {
        let decoded = read::decode_in_ranges(landed(landing, f), f.format, schema, &ctx, handle)?;
        return Ok(Some(decoded));
    }
    let display = landing.display(&f.path);
    let fetched = handle.block_on(read::fetch_whole(
        &landing.store,
        &landing.path(&f.path),
        f.size,
        &display,
    ))?;
    let decoded = match fetched {
        Ok(whole) => whole.decode(f.size, &display, f.format, schema, &ctx)?,
        Err(reason) => Decoded::FileRejected { reason },
    };
    Ok(Some(decoded))
}

/// The landed object `f` of `landing`, to read in ranges ([`read::decode_in_ranges`]).
fn landed(landing: &Location, f: &LandedFile) -> read::Landed {
    read::Landed {
        store: landing.store.clone(),
        path: landing.path(&f.path),
        size: f.size,
        e_tag: f.e_tag.clone(),
        display: landing.display(&f.path),
    }
}

/// Read and decode one planned file for batch `n` (`None` for a file that is not read:
/// a changed one), on tokio's blocking pool: [`decode_planned_here`] for a cluster's
/// executors ([`crate::engine::ingest`]), which decode as the coordinator does.
pub(crate) async fn decode_planned(
    landing: &Location,
    pf: &PlannedFile,
    schema: &Arc<SourceSchema>,
    n: i64,
    ingested_at: i64,
) -> Result<Option<Decoded>> {
    if pf.action != FileAction::Ingest {
        return Ok(None);
    }
    let what = || format!("decoder for {}", pf.file.path);
    let (landing, file, schema) = (landing.clone(), pf.clone(), schema.clone());
    let handle = tokio::runtime::Handle::current();
    pool::on_blocking_thread(what, move || {
        decode_planned_here(&landing, &file, &schema, n, ingested_at, &handle)
    })
    .await
}

/// A batch's deduplicated rows: to write (the decoded batches and the rows of each
/// that dedup keeps), or written by a cluster (to commit).
enum Bronze {
    Kept(Vec<delta::Kept>),
    Written(Vec<deltalake::kernel::Add>),
}

fn progress(len: u64, label: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} files ({eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(label.to_string());
    bar
}

/// Which rows of `batches` are not duplicate event_ids by an in-memory set (first
/// occurrence within the batch wins, then anything the set holds): a mask per batch.
/// Adds the kept ids to the set with their arrival times.
fn dedup_in_memory(
    batches: &[RecordBatch],
    schema: &SourceSchema,
    set: &mut DedupSet,
) -> Result<Vec<BooleanArray>> {
    let id_idx = schema.event_id_index();
    let landed_idx = schema.bronze.index_of("_landed_at")?;
    let mut masks = Vec::with_capacity(batches.len());
    for b in batches {
        let ids = b.column(id_idx).as_string::<i32>();
        let landed = b
            .column(landed_idx)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        let mask: BooleanArray = (0..b.num_rows())
            .map(|i| {
                Some(
                    ids.is_valid(i) && {
                        let at = if landed.is_valid(i) {
                            landed.value(i)
                        } else {
                            0
                        };
                        set.insert_hash(id_hash(ids.value(i)), at)
                    },
                )
            })
            .collect();
        masks.push(mask);
    }
    Ok(masks)
}

/// The event ids bronze already holds in the touched event `dates` (rows of batch `n`
/// itself excepted) whose hash is one of `incoming`'s: every incoming id it holds, and
/// rarely (a 64-bit hash collision) another, which the caller's exact comparison with
/// its own ids leaves out. See [`probe`].
async fn existing_ids(
    incoming: &probe::Incoming,
    dates: &BTreeSet<i32>,
    bronze: &deltalake::DeltaTable,
    n: i64,
    known: Option<&Known>,
) -> Result<HashSet<String, foldhash::fast::RandomState>> {
    let days: Vec<String> = dates.iter().map(|d| crate::time::date(*d)).collect();
    let t = Instant::now();
    let found = probe::existing_ids(bronze, &days, n, incoming, known).await?;
    info!(
        incoming = incoming.len(),
        files = found.files,
        known_files = found.known_files,
        row_groups = found.row_groups,
        row_groups_read = found.row_groups_read,
        held = found.ids.len(),
        ms = t.elapsed().as_millis() as u64,
        "dedup probe"
    );
    Ok(found.ids)
}

/// Which rows of `batches` are not duplicate event_ids (a mask per batch): first
/// occurrence within the batch wins, then anything already in bronze for the touched
/// event dates (rows of batch `n` itself excepted, so a replay computes the same
/// result; the files `known` names are ruled in or out by their rows' hashes).
async fn dedup(
    batches: &[RecordBatch],
    bronze: &deltalake::DeltaTable,
    schema: &SourceSchema,
    n: i64,
    known: &Known,
) -> Result<Vec<BooleanArray>> {
    let date_idx = schema.bronze.index_of(EVENT_DATE)?;
    let mut dates = BTreeSet::new();
    for b in batches {
        event_dates(b, date_idx, &mut dates);
    }
    dedup_masks(batches, bronze, schema, n, &dates, Some(known)).await
}

/// Add the event dates (days since the epoch) in `b`'s `event_date` column at `idx` to
/// `into`: what a batch's dedup looks up in bronze.
pub(crate) fn event_dates(b: &RecordBatch, idx: usize, into: &mut BTreeSet<i32>) {
    let d = b.column(idx).as_primitive::<Date32Type>();
    // Neighbours mostly share a date: one set insert per run of a date, not per row.
    let mut last = None;
    for v in d.iter().flatten() {
        if last != Some(v) {
            into.insert(v);
            last = Some(v);
        }
    }
}

/// [`dedup`] of some of a batch's rows (`batches`, in plan order) against bronze in the
/// event `dates` the whole batch touches (all of them, or one hash partition of a
/// cluster's batch, [`crate::engine::ingest`]); `known`: bronze files this process
/// wrote, with their rows' hashes.
pub(crate) async fn dedup_masks(
    batches: &[RecordBatch],
    bronze: &deltalake::DeltaTable,
    schema: &SourceSchema,
    n: i64,
    dates: &BTreeSet<i32>,
    known: Option<&Known>,
) -> Result<Vec<BooleanArray>> {
    let id_idx = schema.event_id_index();
    if batches.iter().all(|b| b.num_rows() == 0) {
        return Ok(batches
            .iter()
            .map(|b| BooleanArray::from(vec![true; b.num_rows()]))
            .collect());
    }
    // First occurrence within the batch; the distinct ids are then what the probe asks
    // bronze about (one pass over the batch's ids, not two).
    let probing = bronze.version().unwrap_or(0) > 0;
    let (mut masks, hashes, range) = first_seen(batches, id_idx, probing);
    if let (true, Some((lo, hi))) = (probing, range) {
        let incoming = probe::Incoming::with(hashes, lo, hi);
        // Ids bronze holds whose hash is an incoming one's; compared exactly below.
        let existing = existing_ids(&incoming, dates, bronze, n, known).await?;
        if !existing.is_empty() {
            for (b, m) in batches.iter().zip(masks.iter_mut()) {
                let id = b.column(id_idx).as_string::<i32>();
                *m = m
                    .iter()
                    .zip(id.iter())
                    .map(|(keep, v)| {
                        Some(keep == Some(true) && v.is_some_and(|s| !existing.contains(s)))
                    })
                    .collect();
            }
        }
    }
    Ok(masks)
}

/// A batch's ids from which [`first_seen`] splits its work over threads; below it, one.
const FIRST_SEEN_PARALLEL_ROWS: usize = 100_000;

/// Ids per bucket [`first_seen`] aims at: a bucket's set stays in the core's cache.
const FIRST_SEEN_BUCKET_IDS: usize = 2048;

/// The first occurrence of each event id (column `id_idx`) in `batches`, in plan order:
/// a mask per batch; when `probing`, also each distinct id's filter hash
/// ([`bloom::hash`]), in ascending order, and the ids' least and greatest.
///
/// Every id is hashed once (on one thread per core for a large batch), the ids are
/// scattered by the hash's top bits into buckets of ≈ 2k ids, plan order kept within a
/// bucket, and each bucket's first occurrences are found with a set of its own that
/// stays in cache: one set over a batch's million ids (one per core, split by hash)
/// took a cache miss an insert, ≈ 150 ns — the dedup outside its probe took 128–301 ms
/// per 1.4M-id batch that way, 89–232 ms this way (`throughput-run`, two alternating
/// pairs of 5M events). A bucket's set is keyed by the 64-bit hash and compares the ids
/// themselves only when hashes are equal: a re-delivery, or a collision, whose ids are
/// then kept apart exactly ([`bucket_firsts`]). The buckets come in hash order, so the
/// distinct hashes come out sorted bucket by bucket, as the probe wants them
/// ([`probe::Incoming`]).
fn first_seen(
    batches: &[RecordBatch],
    id_idx: usize,
    probing: bool,
) -> (Vec<BooleanArray>, Vec<u64>, Option<(&str, &str)>) {
    let ids: Vec<&arrow::array::StringArray> = batches
        .iter()
        .map(|b| b.column(id_idx).as_string::<i32>())
        .collect();
    let mut starts = Vec::with_capacity(ids.len() + 1);
    let mut total = 0usize;
    for id in &ids {
        starts.push(total);
        total += id.len();
    }
    starts.push(total);
    let threads = match total < FIRST_SEEN_PARALLEL_ROWS {
        true => 1,
        false => std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
    };
    // 1. Each id's hash, on `threads` runs of whole batches; 2. (hash, row) by bucket.
    let (hashes, range) = hash_on_threads(&ids, total, threads, probing);
    let bits = (total / FIRST_SEEN_BUCKET_IDS)
        .max(1)
        .next_power_of_two()
        .trailing_zeros();
    let bucket = |h: u64| match bits {
        0 => 0,
        _ => (h >> (64 - bits)) as usize,
    };
    let (entries, ends) = scatter(&ids, &starts, &hashes, 1 << bits, bucket);
    drop(hashes);
    // 3. Each bucket's first occurrences, buckets split over the threads in order.
    let value = |r: u32| {
        let r = r as usize;
        let b = starts.partition_point(|s| *s <= r) - 1;
        ids[b].value(r - starts[b])
    };
    let mut runs: Vec<&[(u64, u32)]> = Vec::with_capacity(threads);
    let per = entries.len().div_ceil(threads).max(1);
    let mut from = 0;
    for k in 0..ends.len() {
        // A run ends at a bucket's end once it holds its share.
        if ends[k] - from >= per || k + 1 == ends.len() {
            runs.push(&entries[from..ends[k]]);
            from = ends[k];
        }
    }
    let found = on_threads(runs, |run| bucket_firsts(run, bucket, value, probing));
    // 4. The masks, and the distinct hashes in bucket order.
    let mut first = vec![false; total];
    let mut distinct = Vec::new();
    for (rows, hashes) in found {
        for r in rows {
            first[r as usize] = true;
        }
        distinct.extend(hashes);
    }
    let masks = starts
        .windows(2)
        .map(|w| BooleanArray::new(first[w[0]..w[1]].iter().copied().collect(), None))
        .collect();
    (masks, distinct, range)
}

/// Each id's hash ([`bloom::hash`]; 0 for a null id, which is never a first occurrence)
/// in plan order, `ids`' batches split into `threads` runs of about `total / threads`
/// rows; and when `probing`, the ids' least and greatest.
fn hash_on_threads<'a>(
    ids: &[&'a arrow::array::StringArray],
    total: usize,
    threads: usize,
    probing: bool,
) -> (Vec<u64>, Option<(&'a str, &'a str)>) {
    let mut hashes = vec![0u64; total];
    let mut runs: Vec<(&[&arrow::array::StringArray], &mut [u64])> = Vec::new();
    let (mut rest_ids, mut rest) = (ids, &mut hashes[..]);
    let per = total.div_ceil(threads).max(1);
    while !rest_ids.is_empty() {
        let (mut n, mut rows) = (0, 0);
        while n < rest_ids.len() && (rows < per || n == 0) {
            rows += rest_ids[n].len();
            n += 1;
        }
        let (these, others) = std::mem::take(&mut rest).split_at_mut(rows);
        runs.push((&rest_ids[..n], these));
        (rest_ids, rest) = (&rest_ids[n..], others);
    }
    let ranges = on_threads(runs, |(ids, out)| hash_ids(ids, out, probing));
    let range = ranges.into_iter().flatten().fold(None, |r, (lo, hi)| {
        Some(probe::widen(Some(probe::widen(r, lo)), hi))
    });
    (hashes, range)
}

/// The (hash, row) of every non-null id, rows numbered across `ids`' batches (batch `b`
/// from `starts[b]`), grouped by `bucket` of the hash (one of `buckets`), plan order
/// kept within a bucket (a counting sort); and where each bucket's entries end. Rows
/// are numbered in 32 bits: a batch is bounded by memory far below 4G rows.
fn scatter(
    ids: &[&arrow::array::StringArray],
    starts: &[usize],
    hashes: &[u64],
    buckets: usize,
    bucket: impl Fn(u64) -> usize,
) -> (Vec<(u64, u32)>, Vec<usize>) {
    let valid = |r: usize, b: usize| ids[b].is_valid(r - starts[b]);
    let mut ends = vec![0usize; buckets];
    for (b, w) in starts.windows(2).enumerate() {
        for (r, h) in (w[0]..).zip(&hashes[w[0]..w[1]]) {
            if valid(r, b) {
                ends[bucket(*h)] += 1;
            }
        }
    }
    let mut at = 0;
    for e in ends.iter_mut() {
        at += *e;
        *e = at;
    }
    let mut fill: Vec<usize> = std::iter::once(0).chain(ends.iter().copied()).collect();
    let mut entries = vec![(0u64, 0u32); at];
    for (b, w) in starts.windows(2).enumerate() {
        for (r, h) in (w[0]..).zip(&hashes[w[0]..w[1]]) {
            if valid(r, b) {
                let k = bucket(*h);
                entries[fill[k]] = (*h, r as u32);
                fill[k] += 1;
            }
        }
    }
    (entries, ends)
}

/// The first occurrences among `run`'s (hash, row) entries, which come bucket by bucket
/// (`bucket` of the hash), rows in plan order within a bucket: their rows, and when
/// `probing` their hashes, sorted within each bucket. One set serves every bucket, kept
/// in cache; it compares the ids (`value` of a row) only when hashes are equal, and
/// keeps ids of equal hashes apart exactly.
fn bucket_firsts<'a>(
    run: &[(u64, u32)],
    bucket: impl Fn(u64) -> usize,
    value: impl Fn(u32) -> &'a str,
    probing: bool,
) -> (Vec<u32>, Vec<u64>) {
    let mut set: HashMap<u64, u32, std::hash::BuildHasherDefault<Rotated>> =
        HashMap::with_capacity_and_hasher(4 * FIRST_SEEN_BUCKET_IDS, Default::default());
    let mut collided: HashSet<&str, foldhash::fast::RandomState> = HashSet::default();
    let mut rows = Vec::with_capacity(run.len());
    let mut distinct = Vec::with_capacity(if probing { run.len() } else { 0 });
    let mut i = 0;
    while i < run.len() {
        let k = bucket(run[i].0);
        let d0 = distinct.len();
        set.clear();
        while i < run.len() && bucket(run[i].0) == k {
            let (h, r) = run[i];
            let first = match set.entry(h) {
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(r);
                    true
                }
                std::collections::hash_map::Entry::Occupied(e) => {
                    // A re-delivery, or distinct ids of equal hashes: told apart exactly
                    // (an id of the same hash bucket only, so one set for all buckets).
                    let s = value(r);
                    s != value(*e.get()) && collided.insert(s)
                }
            };
            if first {
                rows.push(r);
                if probing {
                    distinct.push(h);
                }
            }
            i += 1;
        }
        distinct[d0..].sort_unstable();
    }
    (rows, distinct)
}

/// Each of `ids`' hash ([`bloom::hash`]) into `out` (row for row; a null id's left as
/// it is), and when `probing` the ids' least and greatest.
fn hash_ids<'a>(
    ids: &[&'a arrow::array::StringArray],
    out: &mut [u64],
    probing: bool,
) -> Option<(&'a str, &'a str)> {
    let mut range: Option<(&str, &str)> = None;
    let mut at = 0;
    for id in ids {
        for i in 0..id.len() {
            if id.is_valid(i) {
                let s = id.value(i);
                out[at] = bloom::hash(s.as_bytes());
                if probing {
                    range = Some(probe::widen(range, s));
                }
            }
            at += 1;
        }
    }
    range
}

/// `work` on each of `runs`, the first on the calling thread and the others on scoped
/// threads joined before this returns; results in run order. A run's thread cannot fail
/// but by a bug; its panic is re-raised here.
fn on_threads<I: Send, T: Send>(runs: Vec<I>, work: impl Fn(I) -> T + Sync) -> Vec<T> {
    let mut runs = runs.into_iter();
    let Some(first) = runs.next() else {
        return Vec::new();
    };
    std::thread::scope(|scope| {
        let work = &work;
        let others: Vec<_> = runs.map(|r| scope.spawn(move || work(r))).collect();
        let mut results = vec![work(first)];
        results.extend(others.into_iter().map(|t| match t.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }));
        results
    })
}

/// A 64-bit hash used as its own hash in a bucket's set ([`first_seen`]), rotated so the
/// bits the set's table is indexed and tagged by are not the bucket's (its top bits,
/// which every id of the bucket shares).
#[derive(Default)]
struct Rotated(u64);

impl std::hash::Hasher for Rotated {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v.rotate_left(24);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::StringArray;
    use arrow::datatypes::{DataType, Field, Schema};

    /// A batch's event dates: every date once, runs of a date and nulls alike.
    #[test]
    fn event_dates_are_each_date_of_the_batch() {
        let dates = arrow::array::Date32Array::from(vec![
            Some(3),
            Some(3),
            None,
            Some(1),
            Some(3),
            Some(2),
            Some(2),
        ]);
        let schema = Arc::new(Schema::new(vec![Field::new("d", DataType::Date32, true)]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(dates)]).unwrap();
        let mut into = BTreeSet::from([7]);
        event_dates(&b, 0, &mut into);
        assert_eq!(into.into_iter().collect::<Vec<_>>(), vec![1, 2, 3, 7]);
    }

    /// Distinct ids of equal hashes are kept apart (each one's first occurrence wins),
    /// and repeats of either are dropped; hashes come sorted within a bucket.
    #[test]
    fn ids_of_equal_hashes_are_told_apart() {
        let ids = ["a", "b", "a", "c", "b", "d", "c"];
        let hash = |s: &str| match s {
            "a" | "b" => 9,
            "c" => 3,
            _ => 1 << 63,
        };
        // Buckets by the top bit: "d" alone in the second; plan order within each.
        let bucket = |h: u64| (h >> 63) as usize;
        let mut run: Vec<(u64, u32)> = (0..ids.len() as u32)
            .map(|r| (hash(ids[r as usize]), r))
            .collect();
        run.sort_by_key(|(h, r)| (bucket(*h), *r));
        let (rows, hashes) = bucket_firsts(&run, bucket, |r| ids[r as usize], true);
        let mut rows = rows;
        rows.sort();
        assert_eq!(rows, vec![0, 1, 3, 5]);
        assert_eq!(hashes, vec![3, 9, 9, 1 << 63]);
        let (_, hashes) = bucket_firsts(&run, bucket, |r| ids[r as usize], false);
        assert!(hashes.is_empty());
    }

    /// The first occurrence of each id wins, whether the ids are split over threads (a
    /// large batch) or not, with the same hashes and range either way.
    #[test]
    fn first_occurrences_are_the_same_on_one_thread_and_on_several() {
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Utf8, true)]));
        // 6 batches of 30k ids: every fifth id repeats one of an earlier batch or row,
        // and a few are null.
        let batches: Vec<RecordBatch> = (0..6)
            .map(|b| {
                let ids: Vec<Option<String>> = (0..30_000)
                    .map(|i| match i % 5 {
                        0 => Some(format!("id-{}", (b * 30_000 + i) / 7)),
                        _ if i % 997 == 0 => None,
                        _ => Some(format!("id-{b}-{i}")),
                    })
                    .collect();
                RecordBatch::try_new(schema.clone(), vec![Arc::new(StringArray::from(ids))])
                    .unwrap()
            })
            .collect();
        let mut seen = HashSet::new();
        let mut expect_hashes = Vec::new();
        let expect: Vec<Vec<bool>> = batches
            .iter()
            .map(|b| {
                let id = b.column(0).as_string::<i32>();
                id.iter()
                    .map(|v| {
                        v.is_some_and(|s| {
                            let first = seen.insert(s.to_string());
                            if first {
                                expect_hashes.push(bloom::hash(s.as_bytes()));
                            }
                            first
                        })
                    })
                    .collect()
            })
            .collect();
        expect_hashes.sort_unstable();
        let (lo, hi) = (
            seen.iter().min().unwrap().clone(),
            seen.iter().max().unwrap().clone(),
        );
        assert!(batches.iter().map(|b| b.num_rows()).sum::<usize>() >= FIRST_SEEN_PARALLEL_ROWS);
        // All six batches (split over threads), and the first alone (one thread).
        for n in [6, 1] {
            let (masks, mut hashes, range) = first_seen(&batches[..n], 0, true);
            let got: Vec<Vec<bool>> = masks
                .iter()
                .map(|m| m.iter().map(|v| v == Some(true)).collect())
                .collect();
            assert_eq!(got, expect[..n], "{n} batches");
            if n == 6 {
                hashes.sort_unstable();
                assert_eq!(hashes, expect_hashes);
                assert_eq!(range, Some((lo.as_str(), hi.as_str())));
            }
        }
        let (_, hashes, range) = first_seen(&batches, 0, false);
        assert!(
            hashes.is_empty() && range.is_none(),
            "not probing: nothing gathered"
        );
        // One thread, not probing (no hash taken): the same first occurrences.
        let (masks, hashes, _) = first_seen(&batches[..1], 0, false);
        let got: Vec<Vec<bool>> = masks
            .iter()
            .map(|m| m.iter().map(|v| v == Some(true)).collect())
            .collect();
        assert_eq!(got, expect[..1]);
        assert!(hashes.is_empty());
    }
}
