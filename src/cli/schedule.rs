//! `kestrel schedule`: the daemon.

use super::*;

pub(super) async fn schedule(
    mut cfg: Config,
    http: Option<String>,
    wait: bool,
) -> anyhow::Result<ExitCode> {
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
    let app = App::load(cfg, ingest).await?.with_engine().await?;
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
