//! The `kestrel` command line: parses arguments and calls the library. Exit codes:
//! 0 ok; 1 error (one-line reason on stderr); 3 finished, but some landed files were
//! rejected whole or changed after processing (see the run log).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kestrel::config::Config;
use kestrel::runner::batch::{JobReport, JobRunner};
use kestrel::runner::ingest::{IngestOptions, Ingestor, SourceReport};

#[derive(Parser)]
#[command(
    name = "kestrel",
    version,
    about = "Micro-batch pipeline on Delta Lake: landed events → bronze → gold, exactly once."
)]
struct Cli {
    /// Config file (default: ./kestrel.toml if present, else built-in defaults).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// More log output (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Ingest what has newly landed (every source, or --source), run every job (or --job)
    /// on it, then exit. For cron.
    Run {
        /// Only these sources (repeatable).
        #[arg(long = "source")]
        sources: Vec<String>,
        /// Only these jobs (repeatable).
        #[arg(long = "job")]
        jobs: Vec<String>,
        /// List every landed file, not only names after the last processed one
        /// (finds files that sort before it and files changed after processing).
        #[arg(long)]
        full_scan: bool,
    },
    /// Generate realistic events for all four sources into the (local) landing zone.
    Demo {
        /// Hours of event time, ending now.
        #[arg(long, default_value_t = 1.0)]
        hours: f64,
        /// Multiply event rates (1.0 ≈ 50k events per hour).
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Random seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
}

fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn,deltalake_core=error,deltalake=error,buoyant_kernel=off",
        1 => "info,kestrel=info,deltalake_core=error,buoyant_kernel=off,datafusion=warn",
        _ => "debug,kestrel=debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .compact()
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kestrel: cannot start runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            // One line: the chain of causes joined.
            let msg = e
                .chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ");
            eprintln!("kestrel: {}", msg.replace('\n', " "));
            ExitCode::from(1)
        }
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let cfg = Config::load(cli.config.as_deref())?;
    match cli.cmd {
        Cmd::Run {
            sources,
            jobs,
            full_scan,
        } => run(cfg, sources, jobs, full_scan).await,
        Cmd::Demo { hours, scale, seed } => demo(cfg, hours, scale, seed),
    }
}

async fn run(
    cfg: Config,
    only: Vec<String>,
    only_jobs: Vec<String>,
    full_scan: bool,
) -> anyhow::Result<ExitCode> {
    // Job definitions are validated up front: a bad job file fails the run before any work.
    let schemas = kestrel::schema::load_all(&cfg.schemas_dir)?;
    let all_jobs = kestrel::job::spec::load_all(&cfg.jobs_dir, &schemas).await?;
    for j in &only_jobs {
        anyhow::ensure!(
            all_jobs.contains_key(j),
            "unknown job `{j}` (known: {})",
            all_jobs.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let lease_ttl = cfg.ingest.lease_ttl;
    let ing = Ingestor::with_schemas(cfg, schemas.clone(), IngestOptions { full_scan })?;
    let all = ing.sources()?;
    let sources: Vec<String> = if only.is_empty() {
        all
    } else {
        for s in &only {
            anyhow::ensure!(
                all.contains(s),
                "unknown source `{s}` (known: {})",
                all.join(", ")
            );
        }
        only
    };
    let mut reports: Vec<SourceReport> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for s in &sources {
        match ing.ingest_source(s).await {
            Ok(r) => reports.push(r),
            Err(e) => failures.push(format!("{s}: {e}")),
        }
    }
    print_summary(&reports);
    // Jobs consume only completed ingestion batches, so they run even when a source
    // failed to ingest; every failure is reported at the end.
    let mut job_failures: Vec<String> = Vec::new();
    let runner = JobRunner::new(ing.warehouse().clone(), schemas, lease_ttl);
    let mut job_reports: Vec<JobReport> = Vec::new();
    for (name, spec) in &all_jobs {
        if !only_jobs.is_empty() && !only_jobs.contains(name) {
            continue;
        }
        match runner.run_job(spec).await {
            Ok(r) => job_reports.push(r),
            Err(e) => job_failures.push(format!("{name}: {e}")),
        }
    }
    print_job_summary(&job_reports);
    match (failures.is_empty(), job_failures.is_empty()) {
        (true, true) => {}
        (false, true) => anyhow::bail!("ingestion failed for {}", failures.join("; ")),
        (true, false) => anyhow::bail!("job failed: {}", job_failures.join("; ")),
        (false, false) => anyhow::bail!(
            "ingestion failed for {}; job failed: {}",
            failures.join("; "),
            job_failures.join("; ")
        ),
    }
    let bad_files: i64 = reports
        .iter()
        .map(|r| r.files_rejected() + r.files_changed())
        .sum();
    if bad_files > 0 {
        eprintln!("kestrel: {bad_files} landed file(s) rejected or changed; see quarantine/<source> and _kestrel/runs");
        return Ok(ExitCode::from(3));
    }
    Ok(ExitCode::SUCCESS)
}

fn print_summary(reports: &[SourceReport]) {
    println!(
        "{:<14} {:>7} {:>10} {:>10} {:>10} {:>11} {:>14}",
        "source", "files", "rows", "written", "duplicates", "quarantined", "files rejected"
    );
    for r in reports {
        println!(
            "{:<14} {:>7} {:>10} {:>10} {:>10} {:>11} {:>14}",
            r.source,
            r.files(),
            r.rows_in(),
            r.rows_written(),
            r.duplicates(),
            r.quarantined(),
            r.files_rejected() + r.files_changed()
        );
    }
    if reports.iter().all(|r| r.batches.is_empty()) {
        println!("nothing new landed");
    }
}

fn print_job_summary(reports: &[JobReport]) {
    if reports.is_empty() {
        return;
    }
    println!();
    println!(
        "{:<24} {:>7} {:>10} {:>9} {:>11} {:>8}  watermark",
        "job", "batches", "applied", "windows", "corrections", "too late"
    );
    for r in reports {
        if let Some(why) = &r.skipped {
            println!("{:<24} skipped: {why}", r.job);
            continue;
        }
        let w = r
            .watermark
            .and_then(chrono::DateTime::from_timestamp_micros)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<24} {:>7} {:>10} {:>9} {:>11} {:>8}  {}",
            r.job,
            r.batches.len(),
            r.applied(),
            r.windows_recomputed(),
            r.corrections(),
            r.too_late(),
            w
        );
    }
}

fn demo(cfg: Config, hours: f64, scale: f64, seed: u64) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        hours > 0.0 && hours <= 24.0 * 30.0,
        "--hours must be between 0 and 720"
    );
    anyhow::ensure!(scale > 0.0, "--scale must be positive");
    anyhow::ensure!(
        !cfg.landing.contains("://") || cfg.landing.starts_with("file://"),
        "demo writes to a local landing zone; landing is {}",
        cfg.landing
    );
    let dir = PathBuf::from(cfg.landing.trim_start_matches("file://"));
    let opts = kestrel::demo::DemoOptions {
        hours,
        scale,
        seed,
        ..Default::default()
    };
    let report = kestrel::demo::generate(&dir, &opts)
        .with_context(|| format!("writing demo events to {}", dir.display()))?;
    println!("wrote demo events to {}", dir.display());
    for (s, (files, lines)) in &report.per_source {
        println!("  {s:<12} {files:>5} files {lines:>8} lines");
    }
    println!(
        "  including {} re-delivered events and {} malformed lines; next: kestrel run",
        report.duplicates, report.malformed
    );
    Ok(ExitCode::SUCCESS)
}
