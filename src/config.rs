//! `kestrel.toml`: where landing and warehouse live, object-store options, ingestion limits.
//!
//! Every error names the file, the field and what was expected. Environment overrides:
//! `KESTREL_LANDING`, `KESTREL_WAREHOUSE`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, Result};

/// Default config file name, looked up in the working directory.
pub const DEFAULT_FILE: &str = "kestrel.toml";

/// Ingestion limits and discovery settings (`[ingest]`).
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// At most this many files in one micro-batch (a run loops over batches).
    pub max_files_per_batch: usize,
    /// At most this many landed bytes in one micro-batch: bounds memory by batch, not by landing size.
    pub max_bytes_per_batch: u64,
    /// Every Nth batch lists the whole source instead of only names after the cursor
    /// (catches files whose names sort before already processed ones, and changed files).
    pub full_scan_every: u64,
    /// How long an ingestion lease lasts before another process may take it over.
    pub lease_ttl: Duration,
    /// Sources to ingest; default: every schema found.
    pub sources: Option<Vec<String>>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            max_files_per_batch: 2_000,
            max_bytes_per_batch: 256 * 1024 * 1024,
            full_scan_every: 12,
            lease_ttl: Duration::from_secs(600),
            sources: None,
        }
    }
}

/// The daemon's timetable and HTTP endpoint (`[schedule]`).
#[derive(Debug, Clone)]
pub struct ScheduleConfig {
    /// Cron (6 fields, UTC) for ingesting every source.
    pub ingest: String,
    /// Cron (6 fields, UTC) for the daily maintenance slot (`kestrel maintain`).
    pub maintenance: String,
    /// `host:port` for `/healthz` and `/metrics`; None (the default) serves nothing.
    pub http: Option<String>,
    /// How long the daemon's single-instance lease lasts unless renewed.
    pub lease_ttl: Duration,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            ingest: "0 */5 * * * *".into(),
            maintenance: "0 30 3 * * *".into(),
            http: None,
            lease_ttl: Duration::from_secs(60),
        }
    }
}

/// Table maintenance (`[maintain]`).
#[derive(Debug, Clone)]
pub struct MaintainConfig {
    /// Vacuum deletes files unreferenced for longer than this. Keep it above the
    /// longest batch and the slowest reader of an old table version.
    pub retention: Duration,
    /// Compaction's target file size in bytes.
    pub target_file_size: u64,
    /// Between batches, compact a partition once it holds this many small files (0: only
    /// the daily maintenance compacts).
    pub open_partition_files: usize,
    /// Target file size of that compaction, in bytes.
    pub open_target_file_size: u64,
    /// `delta.deletedFileRetentionDuration` of the tables kestrel creates: how long a
    /// checkpoint keeps the remove actions of files a compaction or MERGE replaced. Not
    /// a safety margin for readers (vacuum keeps files for `retention`); every
    /// checkpoint writes, and every open reads, the tombstones it keeps.
    pub tombstone_retention: Duration,
    /// The daily maintenance removes the run log's days older than this (`run_date`
    /// partitions; zero keeps them forever). Positions are the log's application
    /// transactions, not its rows, so nothing but history is lost.
    pub run_log_retention: Duration,
}

/// Default `[maintain] run_log_retention`: 30 days, as Delta keeps a table's log
/// (`delta.logRetentionDuration`).
pub const RUN_LOG_RETENTION: Duration = Duration::from_secs(30 * 86_400);

impl Default for MaintainConfig {
    fn default() -> Self {
        let open = crate::sink::compact::OpenCompaction::default();
        MaintainConfig {
            retention: Duration::from_secs(7 * 86_400),
            target_file_size: 128 * 1024 * 1024,
            open_partition_files: open.min_files,
            open_target_file_size: open.target_size,
            tombstone_retention: crate::sink::delta::TOMBSTONE_RETENTION,
            run_log_retention: RUN_LOG_RETENTION,
        }
    }
}

impl MaintainConfig {
    /// The between-batches compaction these settings ask for.
    pub fn open_compaction(&self) -> crate::sink::compact::OpenCompaction {
        crate::sink::compact::OpenCompaction {
            min_files: self.open_partition_files,
            target_size: self.open_target_file_size,
        }
    }
}

/// The whole configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it came from (None: built-in defaults).
    pub file: Option<PathBuf>,
    /// Landing zone URL or local path.
    pub landing: String,
    /// Warehouse URL or local path.
    pub warehouse: String,
    /// object_store / delta-rs storage options (`[storage]`), e.g. `aws_endpoint`.
    pub storage: BTreeMap<String, String>,
    /// Directory of `<source>.json` schemas; the shipped schemas are built in as a fallback.
    pub schemas_dir: PathBuf,
    /// Directory of `<job>.toml` definitions; the shipped jobs are built in as a fallback.
    pub jobs_dir: PathBuf,
    /// Ingestion settings.
    pub ingest: IngestConfig,
    /// Daemon settings.
    pub schedule: ScheduleConfig,
    /// Table maintenance settings.
    pub maintain: MaintainConfig,
    /// How many sources and jobs one `kestrel run` works on at once, each under its own
    /// lease (as separate processes would; a job starts once the sources it reads are
    /// ingested); default one per core.
    pub parallel_jobs: usize,
    /// New rows the jobs of one process recompute at once (windowed batches; a batch
    /// larger than this runs alone); see [`crate::operator::budget`].
    pub compute_budget_rows: usize,
    /// Where reads and aggregates execute (`[engine]`; default this process).
    pub engine: crate::engine::EngineConfig,
}

/// One source or job at a time per core (what `parallel_jobs` defaults to).
pub fn default_parallel_jobs() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl Config {
    /// Defaults: `./landing`, `./warehouse`, `./schemas`.
    pub fn defaults(base: &Path) -> Self {
        Config {
            file: None,
            landing: base.join("landing").to_string_lossy().into_owned(),
            warehouse: base.join("warehouse").to_string_lossy().into_owned(),
            storage: BTreeMap::new(),
            schemas_dir: base.join("schemas"),
            jobs_dir: base.join("jobs"),
            ingest: IngestConfig::default(),
            schedule: ScheduleConfig::default(),
            maintain: MaintainConfig::default(),
            parallel_jobs: default_parallel_jobs(),
            compute_budget_rows: crate::operator::budget::DEFAULT_ROWS,
            engine: crate::engine::EngineConfig::default(),
        }
    }

    /// Load `path`, or `./kestrel.toml` if it exists, or the defaults; then apply env overrides.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        let mut cfg = match path {
            Some(p) => Self::from_file(p)?,
            None => {
                let p = Path::new(DEFAULT_FILE);
                if p.exists() {
                    Self::from_file(p)?
                } else {
                    Self::defaults(Path::new("."))
                }
            }
        };
        if let Ok(v) = std::env::var("KESTREL_LANDING") {
            if !v.is_empty() {
                cfg.landing = v;
            }
        }
        if let Ok(v) = std::env::var("KESTREL_WAREHOUSE") {
            if !v.is_empty() {
                cfg.warehouse = v;
            }
        }
        Ok(cfg)
    }

    /// Parse one config file. Relative local paths are relative to the file's directory.
    pub fn from_file(path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(&file, e))?;
        let base = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        Self::parse(&text, &file, base)
    }

    /// Parse config text; `file` is used in error messages, `base` resolves relative paths.
    pub fn parse(text: &str, file: &str, base: &Path) -> Result<Self> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let field = e
                .span()
                .map(|s| format!("at byte {}", s.start))
                .unwrap_or_else(|| "(syntax)".into());
            Error::config(file, field, format!("valid TOML ({})", e.message()))
        })?;
        let mut cfg = Self::defaults(base);
        cfg.file = Some(PathBuf::from(file));
        let fields = [
            "landing",
            "warehouse",
            "schemas",
            "jobs",
            "storage",
            "ingest",
            "schedule",
            "maintain",
            "parallel_jobs",
            "compute_budget_rows",
            "engine",
        ];
        for (key, value) in &table {
            match key.as_str() {
                "landing" => cfg.landing = location(file, key, value, base)?,
                "warehouse" => cfg.warehouse = location(file, key, value, base)?,
                "schemas" => {
                    let s = string(file, key, value, "a directory path")?;
                    cfg.schemas_dir = base.join(s);
                }
                "jobs" => {
                    let s = string(file, key, value, "a directory path")?;
                    cfg.jobs_dir = base.join(s);
                }
                "storage" => {
                    let t = value.as_table().ok_or_else(|| {
                        Error::config(file, key, "a table of string options, e.g. [storage]")
                    })?;
                    for (k, v) in t {
                        let s = string(file, &format!("storage.{k}"), v, "a string")?;
                        cfg.storage.insert(k.clone(), s.to_string());
                    }
                }
                "ingest" => {
                    let t = value
                        .as_table()
                        .ok_or_else(|| Error::config(file, key, "a table [ingest]"))?;
                    parse_ingest(file, t, &mut cfg.ingest)?;
                }
                "schedule" => {
                    let t = value
                        .as_table()
                        .ok_or_else(|| Error::config(file, key, "a table [schedule]"))?;
                    parse_schedule(file, t, &mut cfg.schedule)?;
                }
                "maintain" => {
                    let t = value
                        .as_table()
                        .ok_or_else(|| Error::config(file, key, "a table [maintain]"))?;
                    parse_maintain(file, t, &mut cfg.maintain)?;
                }
                "parallel_jobs" => cfg.parallel_jobs = positive(file, key, value)? as usize,
                "compute_budget_rows" => {
                    cfg.compute_budget_rows = positive(file, key, value)? as usize
                }
                "engine" => {
                    let t = value
                        .as_table()
                        .ok_or_else(|| Error::config(file, key, "a table [engine]"))?;
                    cfg.engine = crate::engine::EngineConfig::parse(file, t)?;
                }
                other => {
                    return Err(Error::config(
                        file,
                        other,
                        format!("one of the known fields ({})", fields.join(", ")),
                    ))
                }
            }
        }
        Ok(cfg)
    }

    /// Sources to ingest, given the schemas available.
    pub fn selected_sources(&self, available: &[String]) -> Result<Vec<String>> {
        match &self.ingest.sources {
            None => Ok(available.to_vec()),
            Some(list) => {
                for s in list {
                    if !available.contains(s) {
                        return Err(Error::config(
                            self.file_name(),
                            "ingest.sources",
                            format!(
                                "names of sources with a schema ({}); `{s}` has none",
                                available.join(", ")
                            ),
                        ));
                    }
                }
                Ok(list.clone())
            }
        }
    }

    /// The config file name for messages.
    pub fn file_name(&self) -> String {
        self.file
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "(defaults)".into())
    }
}

fn string<'a>(file: &str, field: &str, value: &'a toml::Value, what: &str) -> Result<&'a str> {
    value
        .as_str()
        .ok_or_else(|| Error::config(file, field, format!("{what}, got {}", value.type_str())))
}

fn location(file: &str, field: &str, value: &toml::Value, base: &Path) -> Result<String> {
    let s = string(file, field, value, "a local path or an s3:// URL")?;
    if s.trim().is_empty() {
        return Err(Error::config(
            file,
            field,
            "a non-empty local path or s3:// URL",
        ));
    }
    if s.contains("://") {
        let url = url::Url::parse(s)
            .map_err(|e| Error::config(file, field, format!("a valid URL ({e}), got `{s}`")))?;
        match url.scheme() {
            "s3" | "s3a" | "file" => Ok(s.to_string()),
            other => Err(Error::config(
                file,
                field,
                format!("a local path, file:// or s3:// URL, got scheme `{other}`"),
            )),
        }
    } else {
        Ok(base.join(s).to_string_lossy().into_owned())
    }
}

fn positive(file: &str, field: &str, value: &toml::Value) -> Result<u64> {
    match value.as_integer() {
        Some(i) if i > 0 => Ok(i as u64),
        _ => Err(Error::config(
            file,
            field,
            format!("a positive integer, got {value}"),
        )),
    }
}

fn non_negative(file: &str, field: &str, value: &toml::Value) -> Result<u64> {
    match value.as_integer() {
        Some(i) if i >= 0 => Ok(i as u64),
        _ => Err(Error::config(
            file,
            field,
            format!("a non-negative integer (0 turns it off), got {value}"),
        )),
    }
}

fn parse_ingest(file: &str, t: &toml::Table, ingest: &mut IngestConfig) -> Result<()> {
    for (key, value) in t {
        let field = format!("ingest.{key}");
        match key.as_str() {
            "max_files_per_batch" => ingest.max_files_per_batch = positive(file, &field, value)? as usize,
            "max_bytes_per_batch" => ingest.max_bytes_per_batch = positive(file, &field, value)?,
            "full_scan_every" => ingest.full_scan_every = positive(file, &field, value)?,
            "lease_ttl" => ingest.lease_ttl = duration(file, &field, value)?,
            "sources" => {
                let arr = value.as_array().ok_or_else(|| {
                    Error::config(file, &field, "an array of source names")
                })?;
                let mut v = Vec::new();
                for item in arr {
                    v.push(string(file, &field, item, "an array of source names")?.to_string());
                }
                ingest.sources = Some(v);
            }
            other => {
                return Err(Error::config(
                    file,
                    format!("ingest.{other}"),
                    "one of max_files_per_batch, max_bytes_per_batch, full_scan_every, lease_ttl, sources",
                ))
            }
        }
    }
    Ok(())
}

fn duration(file: &str, field: &str, value: &toml::Value) -> Result<Duration> {
    let s = string(file, field, value, "a duration such as \"10m\"")?;
    parse_duration(s)
        .map_err(|e| Error::config(file, field, format!("a duration such as \"10m\" ({e})")))
}

/// Check a 6-field cron expression (`sec min hour dom month dow`, UTC).
pub fn check_cron(expr: &str) -> std::result::Result<(), String> {
    if expr.split_whitespace().count() < 6 {
        return Err(format!(
            "a 6-field cron `sec min hour dom month dow`, e.g. \"0 */5 * * * *\", got {expr:?}"
        ));
    }
    tokio_cron_scheduler::Job::new_async(expr, |_, _| Box::pin(async {}))
        .map(|_| ())
        .map_err(|e| format!("a valid cron expression, got {expr:?} ({e:?})"))
}

fn parse_schedule(file: &str, t: &toml::Table, s: &mut ScheduleConfig) -> Result<()> {
    for (key, value) in t {
        let field = format!("schedule.{key}");
        match key.as_str() {
            "ingest" | "maintenance" => {
                let expr = string(file, &field, value, "a 6-field cron string")?;
                check_cron(expr).map_err(|e| Error::config(file, &field, e))?;
                if key == "ingest" {
                    s.ingest = expr.to_string();
                } else {
                    s.maintenance = expr.to_string();
                }
            }
            "http" => {
                let addr = string(file, &field, value, "an address such as \"127.0.0.1:9464\"")?;
                addr.parse::<std::net::SocketAddr>().map_err(|e| {
                    Error::config(
                        file,
                        &field,
                        format!("an address such as \"127.0.0.1:9464\", got {addr:?} ({e})"),
                    )
                })?;
                s.http = Some(addr.to_string());
            }
            "lease_ttl" => {
                s.lease_ttl = duration(file, &field, value)?;
                if s.lease_ttl < Duration::from_secs(5) {
                    return Err(Error::config(file, &field, "a duration of at least 5s"));
                }
            }
            other => {
                return Err(Error::config(
                    file,
                    format!("schedule.{other}"),
                    "one of ingest, maintenance, http, lease_ttl",
                ))
            }
        }
    }
    Ok(())
}

fn parse_maintain(file: &str, t: &toml::Table, m: &mut MaintainConfig) -> Result<()> {
    for (key, value) in t {
        let field = format!("maintain.{key}");
        match key.as_str() {
            "retention" => m.retention = duration(file, &field, value)?,
            "target_file_size" => m.target_file_size = positive(file, &field, value)?,
            "open_partition_files" => {
                m.open_partition_files = non_negative(file, &field, value)? as usize
            }
            "open_target_file_size" => m.open_target_file_size = positive(file, &field, value)?,
            "tombstone_retention" => m.tombstone_retention = duration(file, &field, value)?,
            "run_log_retention" => m.run_log_retention = duration(file, &field, value)?,
            other => return Err(Error::config(
                file,
                format!("maintain.{other}"),
                "one of retention, target_file_size, open_partition_files, open_target_file_size, tombstone_retention, run_log_retention",
            )),
        }
    }
    Ok(())
}

/// The files in `dir` with extension `ext`, sorted; empty when `dir` does not exist.
pub fn files_with_extension(dir: &Path, ext: &str) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir.display().to_string(), e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    paths.sort();
    Ok(paths)
}

/// Parse a duration like `30s`, `5m`, `26h`, `3d`, `250ms` (a bare number is seconds).
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` does not start with a number"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        u => return Err(format!("unknown unit `{u}` (use ms, s, m, h or d)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}` is not a non-negative duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_resolves_relative_paths() {
        let cfg = Config::parse(
            "landing = \"l\"\nwarehouse = \"s3://bucket/wh\"\n[storage]\naws_region = \"us-east-1\"\n[ingest]\nmax_files_per_batch = 10\n",
            "k.toml",
            Path::new("/base"),
        )
        .unwrap();
        assert_eq!(cfg.landing, "/base/l");
        assert_eq!(cfg.warehouse, "s3://bucket/wh");
        assert_eq!(cfg.storage["aws_region"], "us-east-1");
        assert_eq!(cfg.ingest.max_files_per_batch, 10);
    }

    #[test]
    fn errors_name_file_field_and_expectation() {
        let e = Config::parse("landing = 5\n", "k.toml", Path::new("."))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "k.toml: field `landing`: expected a local path or an s3:// URL, got integer"
        );
        let e = Config::parse(
            "[ingest]\nmax_files_per_batch = 0\n",
            "k.toml",
            Path::new("."),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`ingest.max_files_per_batch`") && e.contains("positive integer"),
            "{e}"
        );
        let e = Config::parse("lnding = \"x\"\n", "k.toml", Path::new("."))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`lnding`") && e.contains("known fields"), "{e}");
        let e = Config::parse("warehouse = \"ftp://x\"\n", "k.toml", Path::new("."))
            .unwrap_err()
            .to_string();
        assert!(e.contains("scheme `ftp`"), "{e}");
    }

    #[test]
    fn parallel_jobs_defaults_to_the_cores_and_must_be_positive() {
        let cfg = Config::parse("", "k.toml", Path::new(".")).unwrap();
        assert_eq!(cfg.parallel_jobs, default_parallel_jobs());
        let cfg = Config::parse("parallel_jobs = 3\n", "k.toml", Path::new(".")).unwrap();
        assert_eq!(cfg.parallel_jobs, 3);
        let e = Config::parse("parallel_jobs = 0\n", "k.toml", Path::new("."))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "k.toml: field `parallel_jobs`: expected a positive integer, got 0"
        );
    }

    #[test]
    fn compute_budget_rows_defaults_and_must_be_positive() {
        let cfg = Config::parse("", "k.toml", Path::new(".")).unwrap();
        assert_eq!(
            cfg.compute_budget_rows,
            crate::operator::budget::DEFAULT_ROWS
        );
        let cfg =
            Config::parse("compute_budget_rows = 500000\n", "k.toml", Path::new(".")).unwrap();
        assert_eq!(cfg.compute_budget_rows, 500_000);
        let e = Config::parse("compute_budget_rows = -1\n", "k.toml", Path::new("."))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "k.toml: field `compute_budget_rows`: expected a positive integer, got -1"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("3d").unwrap(), Duration::from_secs(259_200));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("5 parsecs").is_err());
    }
}
