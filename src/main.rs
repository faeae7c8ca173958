//! The `kestrel` command line: parses arguments and calls the library. Exit codes:
//! 0 ok; 1 error (one-line reason on stderr); 2 bad command line; 3 finished, but some
//! landed files were rejected whole or changed after processing (see the run log);
//! 4 `status --check`: a gold table is staler than `--max-age`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kestrel::app::App;
use kestrel::config::Config;
use kestrel::runner::batch::JobReport;
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
    /// Run a job always-on: poll the landing zone and push what lands through ingestion
    /// and the job at once (the job and its sources are left to the stream by `run`).
    /// Stops cleanly on SIGTERM or Ctrl-C.
    Stream {
        /// The job (today: stockout).
        #[arg(long)]
        job: String,
        /// Time between polls, e.g. 1s, 500ms.
        #[arg(long, default_value = "1s")]
        interval: String,
        /// Stop after N polls.
        #[arg(long)]
        max_polls: Option<u64>,
        /// Stop after N consecutive polls that found nothing new.
        #[arg(long)]
        idle_polls: Option<u64>,
        /// Duplicate deliveries are removed within this much arrival time.
        #[arg(long, default_value = "26h")]
        dedup_ttl: String,
        /// Compact, checkpoint and vacuum the job's tables between polls this often
        /// ([maintain] settings); `off` never does.
        #[arg(long, default_value = "1h")]
        maintain_every: String,
    },
    /// Last runs, watermarks, late and quarantined counts, and gold-table freshness.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Exit 4 (naming them on stderr) if any gold table is older than --max-age.
        #[arg(long, requires = "max_age")]
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
        Cmd::Status {
            json,
            check,
            max_age,
            jobs,
        } => status(cfg, json, check, max_age, jobs).await,
        Cmd::Schedule { http, wait } => schedule(cfg, http, wait).await,
        Cmd::Backfill {
            job,
            from,
            to,
            reingest,
            json,
        } => backfill(cfg, job, from, to, reingest, json).await,
        Cmd::Lag {
            source,
            since,
            target,
            window,
            lookback,
            png,
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
            };
            lag(cfg, opts, png, json).await
        }
        Cmd::Maintain {
            retention,
            no_compact,
            no_vacuum,
            json,
        } => maintain(cfg, retention, no_compact, no_vacuum, json).await,
        Cmd::Stream {
            job,
            interval,
            max_polls,
            idle_polls,
            dedup_ttl,
            maintain_every,
        } => {
            let maintain_every = match maintain_every.as_str() {
                "off" => None,
                v => Some(kestrel::config::parse_duration(v).map_err(|e| {
                    anyhow::anyhow!(
                        "--maintain-every: expected a duration such as 1h, or off ({e})"
                    )
                })?),
            };
            stream(
                cfg,
                job,
                interval,
                max_polls,
                idle_polls,
                dedup_ttl,
                maintain_every,
            )
            .await
        }
    }
}

async fn run(
    cfg: Config,
    only: Vec<String>,
    only_jobs: Vec<String>,
    full_scan: bool,
) -> anyhow::Result<ExitCode> {
    // Job definitions are validated up front: a bad job file fails the run before any work.
    let opts = IngestOptions {
        full_scan,
        ..Default::default()
    };
    let app = App::load(cfg, opts).await?;
    let out = app.run(&only, &only_jobs).await?;
    for (source, job, owner) in &out.left_to_streams {
        println!("{source}: left to the running stream of {job} ({owner})");
    }
    print_summary(&out.sources);
    print_job_summary(&out.jobs);
    let (failures, job_failures) = (&out.ingest_failures, &out.job_failures);
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
    let bad_files: i64 = out
        .sources
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
        let w = r.watermark.map_or("-".into(), kestrel::time::iso);
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

async fn stream(
    cfg: Config,
    job: String,
    interval: String,
    max_polls: Option<u64>,
    idle_polls: Option<u64>,
    dedup_ttl: String,
    maintain_every: Option<std::time::Duration>,
) -> anyhow::Result<ExitCode> {
    use kestrel::runner::stream::{self, StreamOptions};
    let dedup_ttl = kestrel::config::parse_duration(&dedup_ttl)
        .map_err(|e| anyhow::anyhow!("--dedup-ttl: expected a duration such as 26h ({e})"))?;
    let interval = kestrel::config::parse_duration(&interval)
        .map_err(|e| anyhow::anyhow!("--interval: expected a duration such as 1s ({e})"))?;
    anyhow::ensure!(!interval.is_zero(), "--interval must be positive");
    let lease_ttl = cfg.ingest.lease_ttl;
    let maintain = maintain_every.map(|every| {
        (
            every,
            kestrel::ops::maintain::MaintainOptions::from_config(&cfg),
        )
    });
    let app = App::load(cfg, IngestOptions::default()).await?;
    let spec = app.job(&job)?.clone();
    anyhow::ensure!(
        spec.can_stream(),
        "`{job}` cannot run always-on: only the stock-out operator has a stream mode"
    );
    let stop = stop_on_signal("after the current poll");
    let opts = StreamOptions {
        interval,
        max_polls,
        idle_polls,
        lease_ttl,
        dedup_ttl,
        maintain,
        ..Default::default()
    };
    println!("streaming {job} every {interval:?}; SIGTERM or Ctrl-C stops it cleanly");
    let summary = stream::run(&app.ingestor, &app.runner, &spec, &opts, &stop, |r| {
        let ts = chrono::Utc::now().format("%H:%M:%S");
        if r.files > 0 || r.job_batches > 0 {
            let w = r.watermark.map_or("-".into(), kestrel::time::iso);
            let lag = r.lag_s.map_or("-".into(), |l| format!("{l:.1}s"));
            println!(
                "{ts} poll {}: {} files, {} events, {} batches, alerts +{} -{}, watermark {w}, lag {lag}, dedup set {} ids ({:.1} MB), {} ms",
                r.poll, r.files, r.events, r.job_batches, r.alerts_written, r.alerts_deleted, r.dedup_ids, r.dedup_bytes as f64 / 1e6, r.duration_ms
            );
        }
        if let Some((ms, bytes)) = r.checkpoint {
            println!(
                "{ts} checkpoint: {:.1} MB in {ms} ms",
                bytes as f64 / 1e6
            );
        }
        if let Some(m) = &r.maintenance {
            let before: usize = m.tables.iter().map(|t| t.files_before).sum();
            let after: usize = m.tables.iter().map(|t| t.files_after).sum();
            let vacuumed: usize = m.tables.iter().map(|t| t.files_vacuumed).sum();
            let ms: u64 = m.tables.iter().map(|t| t.duration_ms).sum();
            println!(
                "{ts} maintenance: {} tables, {before} files compacted to {after}, {vacuumed} vacuumed, {ms} ms",
                m.tables.len()
            );
        }
        if let Some(w) = &r.warning {
            eprintln!("{ts} warning: {w}");
        }
    })
    .await?;
    for (source, load) in &summary.loads {
        println!(
            "{source}: dedup set started with {} ids ({}; {} read from bronze)",
            load.ids,
            if load.from_checkpoint {
                "from its checkpoint"
            } else {
                "rebuilt from bronze"
            },
            load.read_from_bronze
        );
    }
    let last = summary
        .final_checkpoint
        .map(|(ms, bytes)| format!("; final checkpoint {:.1} MB in {ms} ms", bytes as f64 / 1e6))
        .unwrap_or_default();
    println!(
        "stopped after {} polls: {} files, {} events, {} job batches{last}",
        summary.polls, summary.files, summary.events, summary.job_batches
    );
    Ok(ExitCode::SUCCESS)
}

async fn status(
    cfg: Config,
    json: bool,
    check: bool,
    max_age: Option<String>,
    only_jobs: Vec<String>,
) -> anyhow::Result<ExitCode> {
    use kestrel::ops::status;
    let max_age = max_age
        .map(|m| {
            kestrel::config::parse_duration(&m)
                .map_err(|e| anyhow::anyhow!("--max-age: expected a duration such as 15m ({e})"))
        })
        .transpose()?;
    let app = App::load(cfg, IngestOptions::default()).await?;
    let jobs = app.select_jobs(&only_jobs)?;
    let sources = app.select_sources(&[])?;
    let now = chrono::Utc::now().timestamp_micros();
    let st = status::collect(app.warehouse(), &sources, &jobs, now).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
    } else {
        let d = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        println!(
            "{:<14} {:>6} {:<21} {:<8} {:>8} {:>10} {:>11}",
            "source", "batch", "last run", "result", "files/d", "rows/d", "quarant./d"
        );
        for s in &st.sources {
            println!(
                "{:<14} {:>6} {:<21} {:<8} {:>8} {:>10} {:>11}",
                s.source,
                s.last_batch.map_or("-".into(), |b| b.to_string()),
                d(&s.last_run_at),
                d(&s.last_status),
                s.files_day,
                s.rows_written_day,
                s.quarantined_day
            );
        }
        println!();
        println!(
            "{:<24} {:>6} {:<21} {:<21} {:>9} {:>8} {:>7}",
            "job", "batch", "last run", "watermark", "W lag", "late/d", "corr./d"
        );
        for j in &st.jobs {
            println!(
                "{:<24} {:>6} {:<21} {:<21} {:>9} {:>8} {:>7}",
                j.job,
                j.last_batch.map_or("-".into(), |b| b.to_string()),
                d(&j.last_run_at),
                d(&j.watermark),
                j.watermark_lag_s.map_or("-".into(), |l| format!("{l:.0}s")),
                j.too_late_day,
                j.corrections_day
            );
        }
        println!();
        println!("{:<28} {:<21} {:>10}", "gold table", "last commit", "age");
        for t in &st.tables {
            println!(
                "{:<28} {:<21} {:>10}",
                t.table,
                d(&t.last_commit_at),
                t.age_s.map_or("never".into(), |a| format!("{a:.0}s"))
            );
        }
    }
    if let (true, Some(max_age)) = (check, max_age) {
        let stale = status::stale(&st, max_age);
        if !stale.is_empty() {
            eprintln!(
                "kestrel: {} gold table(s) older than {}: {}",
                stale.len(),
                humantime_secs(max_age),
                stale.join(", ")
            );
            return Ok(ExitCode::from(4));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A stop flag set by the first SIGTERM or Ctrl-C; a second one exits at once (safe:
/// every batch resumes exactly from its durable plan).
fn stop_on_signal(what: &'static str) -> kestrel::runner::StopFlag {
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

async fn schedule(mut cfg: Config, http: Option<String>, wait: bool) -> anyhow::Result<ExitCode> {
    use kestrel::ops::metrics::Outcome;
    use kestrel::runner::schedule::{Daemon, Event, ScheduleOptions};
    if let Some(addr) = http {
        addr.parse::<std::net::SocketAddr>().map_err(|e| {
            anyhow::anyhow!("--http: expected an address such as 127.0.0.1:9464 ({e})")
        })?;
        cfg.schedule.http = Some(addr);
    }
    let stop = stop_on_signal("after the running batches");
    let opts = ScheduleOptions {
        config: cfg.schedule.clone(),
        maintain: kestrel::ops::maintain::MaintainOptions::from_config(&cfg),
        wait,
    };
    let ingest = IngestOptions {
        stop: Some(stop.clone()),
        ..Default::default()
    };
    let app = App::load(cfg, ingest).await?;
    let jobs = app.jobs.into_values().collect();
    let daemon = Daemon::new(app.ingestor, app.runner, jobs, opts, stop, |e| {
        let ts = chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ");
        match e {
            Event::Started { owner, http, tasks } => {
                println!("{ts} scheduler {owner} started; SIGTERM or Ctrl-C stops it cleanly");
                for (t, cron) in tasks {
                    println!("{ts}   {t:<24} {cron}");
                }
                if let Some(a) = http {
                    println!("{ts} serving http://{a}/healthz and http://{a}/metrics");
                }
            }
            Event::Waiting { holder } => {
                println!("{ts} waiting for the running scheduler ({holder}) to stop");
            }
            Event::Run {
                task,
                outcome,
                summary,
                duration,
            } => {
                let what = match outcome {
                    Outcome::Ok => "ok",
                    Outcome::Failed => "FAILED",
                    Outcome::Skipped => "skipped",
                };
                println!(
                    "{ts} {task}: {what} in {:.1}s: {summary}",
                    duration.as_secs_f64()
                );
            }
            Event::Stopping { running } => {
                println!(
                    "{ts} stopping: waiting for {} to finish its batch",
                    running.join(", ")
                );
            }
        }
    })?;
    let summary = daemon.run().await?;
    println!(
        "scheduler stopped: {} runs ok, {} failed, {} skipped (previous run still going)",
        summary.ok, summary.failed, summary.skipped
    );
    Ok(ExitCode::SUCCESS)
}

async fn backfill(
    cfg: Config,
    job: String,
    from: String,
    to: String,
    reingest: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use kestrel::runner::backfill::{parse_date, BackfillOptions, Progress};
    let from = parse_date(&from).map_err(|e| anyhow::anyhow!("--from: {e}"))?;
    let to = parse_date(&to).map_err(|e| anyhow::anyhow!("--to: {e}"))?;
    anyhow::ensure!(from <= to, "--from must not be after --to");
    let stop = stop_on_signal("after the current day");
    let ingest = IngestOptions {
        full_scan: reingest,
        stop: Some(stop.clone()),
    };
    let app = App::load(cfg, ingest).await?;
    let spec = app.job(&job)?.clone();
    let (ing, runner) = (&app.ingestor, &app.runner);
    if reingest {
        // Files never ingested land in bronze, and the job consumes them (too-late rows
        // go to its late ledger as usual) before the restatement reads what it consumed.
        let mut reports = Vec::new();
        for s in &spec.sources {
            reports.push(ing.ingest_source(s).await?);
        }
        let r = runner.run_job(&spec).await?;
        if !json {
            print_summary(&reports);
            println!(
                "{job}: {} new batch(es) before the backfill\n",
                r.batches.len()
            );
        }
    }
    let bar = progress_bar((to - from + 1) as u64, "backfill");
    let quiet = json || !bar.is_hidden();
    let opts = BackfillOptions {
        from,
        to,
        stop: Some(stop),
    };
    let report = runner
        .backfill(&spec, &opts, |p| match p {
            Progress::Waiting(owner) => {
                eprintln!("kestrel: waiting for the running batch of {job} ({owner}) to finish")
            }
            Progress::Resuming(n) => eprintln!("kestrel: resuming: {n} day(s) already done"),
            Progress::Day(d) => {
                bar.set_message(d.date.clone());
                bar.inc(1);
                if !quiet {
                    println!(
                        "{}: {} windows, {} changed, {} holding too-late rows{}",
                        d.date,
                        d.windows,
                        d.changed,
                        d.with_too_late_rows.len(),
                        if d.resumed {
                            " (done before the interruption)"
                        } else {
                            ""
                        }
                    );
                }
            }
        })
        .await?;
    bar.finish_and_clear();
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "backfilled {} {} .. {} (input: what job batch {} consumed): {} days, {} windows, {} changed",
        report.job,
        report.from,
        report.to,
        report.as_of_batch,
        report.days.len(),
        report.windows(),
        report.changed()
    );
    let late: Vec<&String> = report
        .days
        .iter()
        .flat_map(|d| &d.with_too_late_rows)
        .collect();
    if late.is_empty() {
        println!("no window in the range holds rows that were too late for the live job");
    } else {
        println!(
            "{} window(s) hold rows that were too late for the live job (restated here):",
            late.len()
        );
        for w in late.iter().take(20) {
            println!("  {w}");
        }
        if late.len() > 20 {
            println!("  … and {} more (--json lists all)", late.len() - 20);
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn lag(
    cfg: Config,
    opts: kestrel::ops::lag::LagOptions,
    png: Option<PathBuf>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let schemas = kestrel::schema::load_all(&cfg.schemas_dir)?;
    let ing = Ingestor::with_schemas(cfg, schemas, IngestOptions::default())?;
    let sources = ing.sources()?;
    anyhow::ensure!(
        sources.contains(&opts.source),
        "unknown source `{}` (known: {})",
        opts.source,
        sources.join(", ")
    );
    let r = kestrel::ops::lag::run(ing.warehouse(), &opts).await?;
    if let Some(p) = &png {
        kestrel::ops::lag::draw_png(&r, p)?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: lateness = _landed_at − event_ts over {} events",
        r.source, r.overall.events
    );
    println!(
        "{:<14} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "partition", "events", "p50 s", "p90 s", "p99 s", "p99.9 s", "max s"
    );
    let row = |name: &str, q: &kestrel::ops::lag::Quantiles| {
        println!(
            "{:<14} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            name, q.events, q.p50_s, q.p90_s, q.p99_s, q.p999_s, q.max_s
        )
    };
    row("(all)", &r.overall);
    if r.partitions.len() > 1 {
        for (p, q) in &r.partitions {
            row(if p.is_empty() { "(none)" } else { p }, q);
        }
    }
    println!();
    println!(
        "replayed in arrival order against {} s windows, lookback {} s:",
        r.window_s, r.lookback_s
    );
    println!(
        "{:>12} {:>12} {:>10} {:>16}",
        "delay s", "corrections", "fraction", "beyond lookback"
    );
    for c in &r.candidates {
        let mark = if c.delay_s == r.suggested_delay_s {
            "  <- suggested"
        } else {
            ""
        };
        println!(
            "{:>12} {:>12} {:>10.5} {:>16}{mark}",
            c.delay_s, c.corrections, c.correction_fraction, c.beyond_lookback
        );
    }
    println!();
    println!(
        "suggested watermark_delay = \"{}s\" (corrections at most {} of events)",
        r.suggested_delay_s, r.target
    );
    if let Some(p) = &png {
        println!("histogram written to {}", p.display());
    }
    Ok(ExitCode::SUCCESS)
}

async fn maintain(
    mut cfg: Config,
    retention: Option<String>,
    no_compact: bool,
    no_vacuum: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use kestrel::ops::maintain;
    if let Some(r) = retention {
        cfg.maintain.retention = kestrel::config::parse_duration(&r)
            .map_err(|e| anyhow::anyhow!("--retention: expected a duration such as 7d ({e})"))?;
    }
    let opts = maintain::MaintainOptions {
        no_compact,
        no_vacuum,
        ..maintain::MaintainOptions::from_config(&cfg)
    };
    let app = App::load(cfg, IngestOptions::default()).await?;
    let jobs: Vec<kestrel::job::spec::JobSpec> = app.jobs.values().cloned().collect();
    let sources = app.select_sources(&[])?;
    let bar = progress_bar(
        jobs.len() as u64 * 2 + sources.len() as u64 * 2 + 2,
        "maintain",
    );
    let report = maintain::run(app.warehouse(), &sources, &jobs, &opts, |t| {
        bar.set_message(t.table.clone());
        bar.inc(1);
    })
    .await?;
    bar.finish_and_clear();
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{:<32} {:>7} {:>7} {:>10} {:>8} {:>7}  note",
            "table", "files", "after", "partitions", "vacuumed", "ms"
        );
        for t in &report.tables {
            println!(
                "{:<32} {:>7} {:>7} {:>10} {:>8} {:>7}  {}",
                t.table,
                t.files_before,
                t.files_after,
                t.partitions_compacted,
                t.files_vacuumed,
                t.duration_ms,
                t.skipped.clone().unwrap_or_default()
            );
        }
        if report.plans_expired > 0 {
            println!(
                "{} durable batch plans older than the retention deleted",
                report.plans_expired
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A progress bar on a terminal; hidden otherwise (log lines carry the progress).
fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
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

fn humantime_secs(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs_f64())
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
