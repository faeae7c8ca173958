//! The command line's commands: arguments (clap), dispatch, and one module per command
//! that calls the library and prints what it did. `main.rs` only starts the runtime.

use anyhow::Context;
use clap::{Parser, Subcommand};
use kestrel::app::App;
use kestrel::config::Config;
use kestrel::runner::batch::JobReport;
use kestrel::runner::ingest::{IngestOptions, Ingestor, SourceReport};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

mod backfill;
mod cluster;
mod demo;
mod lag;
mod maintain;
mod run;
mod schedule;
mod status;
mod stream;

#[derive(Parser)]
#[command(
    name = "kestrel",
    version,
    about = "Micro-batch pipeline on Delta Lake: landed events → bronze → gold, exactly once."
)]
pub(crate) struct Cli {
    /// Config file (default: ./kestrel.toml if present, else built-in defaults).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// More log output (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub(crate) verbose: u8,
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
    /// Run a job always-on: poll the landing zone and push what lands through ingestion
    /// and the job at once (the job and its sources are left to the stream by `run`).
    /// Stops cleanly on SIGTERM or Ctrl-C.
    Stream(stream::StreamArgs),
    /// Last runs, watermarks, late and quarantined counts, state, service levels and
    /// gold-table freshness.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Exit 4 (naming them on stderr) if a job breaches one of its [slo] objectives
        /// or, with --max-age, a gold table is older than that.
        #[arg(long)]
        check: bool,
        /// Freshness limit for --check, e.g. 15m.
        #[arg(long)]
        max_age: Option<String>,
        /// Only these jobs (repeatable).
        #[arg(long = "job")]
        jobs: Vec<String>,
    },
    /// Run as a daemon: ingestion, every job on its cron schedule and a daily maintenance
    /// slot ([schedule] in kestrel.toml). Stops cleanly on SIGTERM or Ctrl-C.
    Schedule {
        /// Serve /healthz and /metrics on this address (overrides [schedule] http).
        #[arg(long)]
        http: Option<String>,
        /// Wait for another daemon on the same warehouse to stop instead of exiting.
        #[arg(long)]
        wait: bool,
    },
    /// Recompute a job's gold rows for a range of dates from bronze, including events
    /// that were too late for the live job (a restatement); reports the windows (orders)
    /// that changed and those holding too-late rows. Idempotent; Ctrl-C stops between
    /// days and the same command resumes.
    Backfill {
        /// The job.
        #[arg(long)]
        job: String,
        /// First date (UTC) of windows, sessions, orders or alert minutes, YYYY-MM-DD.
        #[arg(long)]
        from: String,
        /// Last window date (UTC), inclusive.
        #[arg(long)]
        to: String,
        /// First list the job's landing sources in full and ingest anything never
        /// ingested (as `run --full-scan`).
        #[arg(long)]
        reingest: bool,
        /// Print JSON instead of a summary.
        #[arg(long)]
        json: bool,
    },
    /// How late a source's events arrive (landed − event time from bronze: p50 … max,
    /// per partition) and the watermark_delay that keeps corrections under --target.
    Lag {
        /// The source.
        #[arg(long)]
        source: String,
        /// Only events landed in this last stretch of time, e.g. 7d.
        #[arg(long)]
        since: Option<String>,
        /// Acceptable fraction of events arriving after their window was final.
        #[arg(long, default_value_t = 0.001)]
        target: f64,
        /// Window size the corrections are judged against.
        #[arg(long, default_value = "5m")]
        window: String,
        /// Lookback (events later than this are too late, not corrections).
        #[arg(long, default_value = "3d")]
        lookback: String,
        /// Draw the histogram (log scale) with the percentiles marked into this PNG.
        #[arg(long)]
        png: Option<PathBuf>,
        /// Write the watermark decision record (Markdown) here: the lateness measured,
        /// what each delay implies, every job's watermark, lookback and late-data policy
        /// replayed on these arrivals, and the histogram beside it (FILE.png unless --png).
        #[arg(long, value_name = "FILE")]
        markdown: Option<PathBuf>,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Compact closed date partitions of every table, write Delta checkpoints and vacuum
    /// files older than the retention ([maintain] in kestrel.toml).
    Maintain {
        /// Vacuum retention, overriding [maintain] retention (e.g. 7d).
        #[arg(long)]
        retention: Option<String>,
        /// Checkpoint and vacuum only.
        #[arg(long)]
        no_compact: bool,
        /// Compact and checkpoint only.
        #[arg(long)]
        no_vacuum: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run a process of a Ballista cluster that `[engine] kind = "ballista"` sends
    /// reads and aggregates to (see README "Running on a cluster").
    Cluster {
        #[command(subcommand)]
        role: cluster::Role,
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

pub(crate) async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let cfg = Config::load(cli.config.as_deref())?;
    match cli.cmd {
        Cmd::Run {
            sources,
            jobs,
            full_scan,
        } => run::run(cfg, sources, jobs, full_scan).await,
        Cmd::Demo { hours, scale, seed } => demo::demo(cfg, hours, scale, seed),
        Cmd::Status {
            json,
            check,
            max_age,
            jobs,
        } => status::status(cfg, json, check, max_age, jobs).await,
        Cmd::Schedule { http, wait } => schedule::schedule(cfg, http, wait).await,
        Cmd::Backfill {
            job,
            from,
            to,
            reingest,
            json,
        } => backfill::backfill(cfg, job, from, to, reingest, json).await,
        Cmd::Lag {
            source,
            since,
            target,
            window,
            lookback,
            png,
            markdown,
            json,
        } => {
            let dur = |flag: &str, v: &str| {
                kestrel::config::parse_duration(v)
                    .map_err(|e| anyhow::anyhow!("{flag}: expected a duration such as 5m ({e})"))
            };
            anyhow::ensure!(
                (0.0..1.0).contains(&target),
                "--target: expected a fraction in [0, 1), e.g. 0.001"
            );
            let window = dur("--window", &window)?;
            anyhow::ensure!(!window.is_zero(), "--window must be positive");
            let since = since
                .map(|s| dur("--since", &s))
                .transpose()?
                .map(|d| chrono::Utc::now().timestamp_micros() - d.as_micros() as i64);
            let opts = kestrel::ops::lag::LagOptions {
                source,
                since,
                target,
                window: window.as_micros() as i64,
                lookback: dur("--lookback", &lookback)?.as_micros() as i64,
                delays: Vec::new(),
            };
            lag::lag(cfg, opts, png, markdown, json).await
        }
        Cmd::Maintain {
            retention,
            no_compact,
            no_vacuum,
            json,
        } => maintain::maintain(cfg, retention, no_compact, no_vacuum, json).await,
        Cmd::Stream(args) => stream::stream(cfg, args).await,
        Cmd::Cluster { role } => cluster::cluster(role, cfg).await,
    }
}

/// A stop flag set by the first SIGTERM or Ctrl-C; a second one exits at once (safe:
/// every batch resumes exactly from its durable plan).
pub(super) fn stop_on_signal(what: &'static str) -> kestrel::runner::StopFlag {
    let stop = kestrel::runner::StopFlag::default();
    let flag = stop.clone();
    tokio::spawn(async move {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            return;
        };
        let mut signals = 0;
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            signals += 1;
            if signals == 1 {
                eprintln!("kestrel: stopping {what} (again to exit at once)");
                flag.stop();
            } else {
                eprintln!("kestrel: exiting now; the interrupted batch resumes on the next start");
                std::process::exit(130);
            }
        }
    });
    stop
}

/// A progress bar on a terminal; hidden otherwise (log lines carry the progress).
pub(super) fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what.to_string());
    bar
}

pub(super) fn humantime_secs(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs_f64())
}
