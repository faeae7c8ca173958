//! `kestrel backfill`: restate a job's days, with progress.

use super::*;

pub(super) async fn backfill(
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
    let app = App::load(cfg, ingest).await?.with_engine().await?;
    let spec = app.job(&job)?.clone();
    if reingest {
        // Files never ingested land in bronze, and the job consumes them (too-late rows
        // go to its late ledger as usual) before the restatement reads what it consumed:
        // the same cycle as `kestrel run` for the job's sources and the job.
        let out = app
            .run(&spec.sources, std::slice::from_ref(&spec.name))
            .await?;
        if let Some(failed) = out.failures() {
            anyhow::bail!(failed);
        }
        let batches: usize = out.jobs.iter().map(|r| r.batches.len()).sum();
        if !json {
            super::run::print_summary(&out.sources);
            println!("{job}: {batches} new batch(es) before the backfill\n");
        }
    }
    let bar = progress_bar((to - from + 1) as u64, "backfill");
    let quiet = json || !bar.is_hidden();
    let opts = BackfillOptions {
        from,
        to,
        stop: Some(stop),
    };
    let report = app
        .runner
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
