//! `kestrel stream --job J`: a job always-on, with its poll summaries.

use super::*;

/// `kestrel stream`'s options.
#[derive(clap::Args)]
pub(super) struct StreamArgs {
    /// The job (today: stockout).
    #[arg(long)]
    pub(super) job: String,
    /// Time between polls, e.g. 1s, 500ms.
    #[arg(long, default_value = "1s")]
    pub(super) interval: String,
    /// Stop after N polls.
    #[arg(long)]
    pub(super) max_polls: Option<u64>,
    /// Stop after N consecutive polls that found nothing new.
    #[arg(long)]
    pub(super) idle_polls: Option<u64>,
    /// Duplicate deliveries are removed within this much arrival time.
    #[arg(long, default_value = "26h")]
    pub(super) dedup_ttl: String,
    /// Compact, checkpoint and vacuum the job's tables between polls this often
    /// ([maintain] settings); `off` never does.
    #[arg(long, default_value = "1h")]
    pub(super) maintain_every: String,
    /// MERGE the job's state table (sku_availability) with every batch, as `run`
    /// does; by default one bucket is committed per poll and the rest held in
    /// memory and in a file per batch (alerts are never deferred).
    #[arg(long)]
    pub(super) state_every_poll: bool,
}

pub(super) async fn stream(cfg: Config, args: StreamArgs) -> anyhow::Result<ExitCode> {
    let StreamArgs {
        job,
        interval,
        max_polls,
        idle_polls,
        dedup_ttl,
        maintain_every,
        state_every_poll,
    } = args;
    let maintain_every = match maintain_every.as_str() {
        "off" => None,
        v => Some(kestrel::config::parse_duration(v).map_err(|e| {
            anyhow::anyhow!("--maintain-every: expected a duration such as 1h, or off ({e})")
        })?),
    };
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
    let app = App::load(cfg, IngestOptions::default())
        .await?
        .with_engine()
        .await?;
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
        defer_state: !state_every_poll,
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
        if let Some((part, rows)) = r.state_committed {
            println!(
                "{ts} state: bucket {part} committed ({rows} rows), {} rows pending",
                r.state_pending
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
    if summary.state_caught_up > 0 {
        println!(
            "state: {} rows a stopped stream had left uncommitted were committed at start",
            summary.state_caught_up
        );
    }
    println!(
        "stopped after {} polls: {} files, {} events, {} job batches{last}; {} state rows committed when stopping",
        summary.polls, summary.files, summary.events, summary.job_batches, summary.state_final
    );
    Ok(ExitCode::SUCCESS)
}
