//! `kestrel maintain`: compaction, checkpoints and vacuum, and what they did.

use super::*;

pub(super) async fn maintain(
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
