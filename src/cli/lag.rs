//! `kestrel lag`: lateness percentiles and the suggested watermark delay.

use super::*;

pub(super) async fn lag(
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
