//! `kestrel status`: the warehouse's health as a table or JSON, `--check`.

use super::*;

pub(super) async fn status(
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
    let st = status::collect(app.warehouse(), Some(app.landing()), &sources, &jobs, now).await?;
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
            "{:<24} {:>6} {:<21} {:<21} {:>9} {:>8} {:>7}  state",
            "job", "batch", "last run", "watermark", "W lag", "late/d", "corr./d"
        );
        for j in &st.jobs {
            let mut state = j
                .state_bytes
                .map_or("-".to_string(), |b| format!("{} B", b));
            if let Some(s) = &j.stream_state {
                state.push_str(&format!(
                    "; stream: {} ids, {:.1} MiB (checkpoint {} at {}: {} B in {} ms)",
                    s.ids,
                    s.bytes as f64 / (1 << 20) as f64,
                    s.checkpoint,
                    s.at,
                    s.checkpoint_bytes,
                    s.checkpoint_ms
                ));
            }
            println!(
                "{:<24} {:>6} {:<21} {:<21} {:>9} {:>8} {:>7}  {}",
                j.job,
                j.last_batch.map_or("-".into(), |b| b.to_string()),
                d(&j.last_run_at),
                d(&j.watermark),
                j.watermark_lag_s.map_or("-".into(), |l| format!("{l:.0}s")),
                j.too_late_day,
                j.corrections_day,
                state
            );
        }
        println!();
        println!(
            "{:<24} {:>9} {:>9} {:>16} {:>8} {:>8} {:>9} {:>10}  breached",
            "service levels", "p50", "p99", "unread", "skew", "late", "recovery", "CPU s/M"
        );
        for j in &st.jobs {
            let l = &j.slo;
            let s = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}s"));
            println!(
                "{:<24} {:>9} {:>9} {:>16} {:>8} {:>8} {:>9} {:>10}  {}",
                j.job,
                s(l.latency_p50_s),
                s(l.latency_p99_s),
                format!("{} ({})", l.lag_files, s(l.lag_oldest_s)),
                s(l.skew_s),
                l.late_rate
                    .map_or("-".into(), |r| format!("{:.2}%", r * 100.0)),
                s(l.recovery_s),
                l.cpu_s_per_million
                    .map_or("-".into(), |c| format!("{c:.1}")),
                if l.breaches.is_empty() {
                    "-".to_string()
                } else {
                    l.breaches.join("; ")
                }
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
    if check {
        // One line naming every problem: stale tables, then breached objectives.
        let mut problems = Vec::new();
        if let Some(max_age) = max_age {
            let stale = status::stale(&st, max_age);
            if !stale.is_empty() {
                problems.push(format!(
                    "{} gold table(s) older than {}: {}",
                    stale.len(),
                    humantime_secs(max_age),
                    stale.join(", ")
                ));
            }
        }
        let breaches = status::breaches(&st);
        if !breaches.is_empty() {
            problems.push(format!(
                "{} service-level objective(s) breached: {}",
                breaches.len(),
                breaches.join("; ")
            ));
        }
        if !problems.is_empty() {
            eprintln!("kestrel: {}", problems.join("; "));
            return Ok(ExitCode::from(4));
        }
    }
    Ok(ExitCode::SUCCESS)
}
