//! `kestrel stream --job J`: a job always-on, with its poll summaries.

use super::*;

pub(super) async fn stream(
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
