//! `kestrel run`: ingest what landed, run the jobs, print what happened.

use super::*;

pub(super) async fn run(
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
    let app = App::load(cfg, opts).await?.with_engine().await?;
    let out = app.run(&only, &only_jobs).await?;
    for (source, job, owner) in &out.left_to_streams {
        println!("{source}: left to the running stream of {job} ({owner})");
    }
    print_summary(&out.sources);
    print_job_summary(&out.jobs);
    if let Some(failed) = out.failures() {
        anyhow::bail!(failed);
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

pub(super) fn print_summary(reports: &[SourceReport]) {
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

pub(super) fn print_job_summary(reports: &[JobReport]) {
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
