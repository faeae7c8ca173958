//! `kestrel lag`: lateness percentiles and the suggested watermark delay.

use super::*;

pub(super) async fn lag(
    cfg: Config,
    opts: kestrel::ops::lag::LagOptions,
    png: Option<PathBuf>,
    markdown: Option<PathBuf>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let schemas = kestrel::schema::load_all(&cfg.schemas_dir)?;
    // Jobs are loaded (and validated) only for the decision record.
    let jobs = match &markdown {
        Some(_) => kestrel::job::spec::load_all(&cfg.jobs_dir, &schemas).await?,
        None => Default::default(),
    };
    let ing = Ingestor::with_schemas(cfg, schemas, IngestOptions::default())?;
    let sources = ing.sources()?;
    anyhow::ensure!(
        sources.contains(&opts.source),
        "unknown source `{}` (known: {})",
        opts.source,
        sources.join(", ")
    );
    let arrivals = kestrel::ops::lag::read_arrivals(ing.warehouse(), &opts).await?;
    let r = kestrel::ops::lag::analyse(
        &opts.source,
        &arrivals.partitions,
        arrivals.arrivals.clone(),
        &opts,
    );
    if let Some(dir) = markdown.as_ref().and_then(|m| m.parent()) {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
    }
    let png = png.or_else(|| markdown.as_ref().map(|m| m.with_extension("png")));
    if let Some(p) = &png {
        kestrel::ops::lag::draw_png(&r, p)?;
    }
    if let Some(md) = &markdown {
        use kestrel::ops::watermark_doc;
        let in_force: Vec<_> = jobs
            .values()
            .filter(|j| j.sources.contains(&opts.source))
            .map(|j| {
                watermark_doc::job_watermark(j, &opts.source, &arrivals, opts.target, opts.window)
            })
            .collect();
        let image = png.as_ref().map(|p| {
            if p.parent() == md.parent() {
                p.file_name().map_or_else(
                    || p.display().to_string(),
                    |f| f.to_string_lossy().into_owned(),
                )
            } else {
                p.display().to_string()
            }
        });
        let scope = match opts.since {
            Some(us) => format!("landed since {}", kestrel::time::iso(us)),
            None => "every arrival in bronze".to_string(),
        };
        let now = chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string();
        let doc = watermark_doc::render(&r, &in_force, image.as_deref(), &scope, &now);
        std::fs::write(md, doc).with_context(|| format!("writing {}", md.display()))?;
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
    if let Some(md) = &markdown {
        println!("decision record written to {}", md.display());
    }
    Ok(ExitCode::SUCCESS)
}
