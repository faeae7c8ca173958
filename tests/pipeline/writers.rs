//! Several writers on one warehouse on S3 (moto): two `kestrel run` loops, a
//! `kestrel schedule` daemon (ingestion, every job and table maintenance on fast
//! crons) and `kestrel backfill`s of four jobs, all at once for minutes while files keep
//! landing. Afterwards every table equals one clean single-writer run over the same
//! files, no event is in bronze twice, no file is in the ledger twice, and every
//! table's Delta log is contiguous. Writers really collided: moto's request log counts
//! the commits it refused with 412 (another writer had taken that version).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use kestrel::sink::delta::Warehouse;
use kestrel::storage::Location;

use crate::common::*;
use crate::faults::{files_by_mtime, replay_tables, SKIP};
use crate::ops::Daemon;
use crate::s3::{options, start_moto};

/// How long files keep landing while the writers run.
const LANDING: Duration = Duration::from_secs(60);
/// In this many drops.
const DROPS: u32 = 12;

/// Every shipped job definition with `schedule` replaced by `cron`.
fn jobs_every(dir: &std::path::Path, cron: &str) {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("jobs");
    for e in std::fs::read_dir(shipped).unwrap() {
        let name = e.unwrap().file_name();
        shipped_job_on(dir, &name.to_string_lossy(), cron);
    }
}

/// A kestrel command's output, with the log levels that show retries.
fn kestrel_logged(env: &Env, args: &[&str]) -> std::process::Output {
    env.kestrel_env(args, &[("RUST_LOG", LOG)])
}

/// The log levels of every writer: warnings, and the store layer's retries.
const LOG: &str = "warn,kestrel::storage=info";

/// Every process's outcome: (what, exit code, stderr) of the ones that failed, and the
/// retry lines seen.
#[derive(Default)]
struct Outcomes {
    runs: usize,
    failures: Vec<String>,
    races: usize,
    retries: usize,
    /// `run`s that found a source or job held by another writer (exit 1, named).
    busy: usize,
    /// Backfills that came before the job's first batch (exit 1, named).
    not_yet: usize,
    /// (what, seconds) of every process.
    seconds: Vec<(String, f64)>,
}

/// Whether a failed run's one-line reason names only leases held by other writers
/// (`kestrel: ingestion failed for A: … is busy: …; B: … is busy: …; job failed: …`).
fn only_busy(stderr: &str) -> bool {
    let Some(last) = stderr.lines().last() else {
        return false;
    };
    last.starts_with("kestrel: ")
        && last
            .split("; ")
            .all(|part| part.contains(" is busy: lease held by "))
}

impl Outcomes {
    fn record(&mut self, what: &str, out: &std::process::Output, took: Duration) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        self.runs += 1;
        self.seconds.push((what.to_string(), took.as_secs_f64()));
        self.races += stderr.matches("lost a race").count();
        self.retries += stderr.matches("retrying").count();
        if out.status.code() == Some(1) && only_busy(&stderr) {
            // Another writer held a source or job: `run` ran the rest and says so.
            self.busy += 1;
        } else if out.status.code() == Some(1) && stderr.contains("has not run yet: a backfill") {
            // A backfill that came before the job's first batch: nothing to restate.
            self.not_yet += 1;
        } else if out.status.code() != Some(0) {
            self.failures.push(format!(
                "{what}: exit {:?}\nstdout:\n{}\nstderr:\n{stderr}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout)
            ));
        }
    }
}

/// The versions of a table's commit files and of its checkpoints, each sorted.
async fn log_versions(wh: &Location, table: &str) -> (Vec<u64>, Vec<u64>) {
    let prefix = wh.path(&format!("{table}/_delta_log"));
    let metas: Vec<_> = wh.store.list(Some(&prefix)).try_collect().await.unwrap();
    let (mut commits, mut checkpoints) = (Vec::new(), Vec::new());
    for m in metas {
        let name = m.location.filename().unwrap_or_default().to_string();
        let Some(v) = name.split('.').next().and_then(|v| v.parse::<u64>().ok()) else {
            continue;
        };
        if name.ends_with(".json") && name.split('.').count() == 2 {
            commits.push(v);
        } else if name.contains(".checkpoint") {
            checkpoints.push(v);
        }
    }
    commits.sort();
    checkpoints.sort();
    (commits, checkpoints)
}

#[test]
fn concurrent_writers_on_s3_equal_one_clean_writer() {
    let Some(moto) = start_moto() else { return };
    // 90 minutes of demo events: every partition gets files every minute (no idle
    // partition, whose watermark would depend on how the files were batched) and no
    // event is older than the lookback, so the result does not depend on batching.
    let source = Env::new();
    source.run_ok(&["demo", "--hours", "0.75", "--scale", "0.3"], 0);
    let files = files_by_mtime(&source.landing());
    assert!(files.len() > 250, "{}", files.len());

    let opts: BTreeMap<String, String> = options(&moto.endpoint);
    let mut storage = String::from("[storage]\n");
    for (k, v) in &opts {
        storage.push_str(&format!("{k} = \"{v}\"\n"));
    }
    let soak = Env::new();
    std::fs::write(
        soak.path().join("kestrel.toml"),
        format!(
            "landing = \"landing\"\nwarehouse = \"s3://lake/soak\"\n{storage}\n\
             [schedule]\ningest = \"*/10 * * * * *\"\nmaintenance = \"*/20 * * * * *\"\n\
             [maintain]\nopen_partition_files = 4\n"
        ),
    )
    .unwrap();
    jobs_every(&soak.path().join("jobs"), "5/10 * * * * *");

    let stop = Arc::new(AtomicBool::new(false));
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let mut daemon = Daemon::start(&soak, &[], &[("RUST_LOG", LOG)]);
    daemon.wait_for("started;");
    let started = Instant::now();
    let landing = soak.landing();
    std::thread::scope(|s| {
        // The producer: files land in arrival order over LANDING, each under a `_` name
        // and renamed, with its arrival time as mtime.
        let lander = s.spawn(|| {
            let per_tick = files.len().div_ceil(DROPS as usize);
            for (k, chunk) in files.chunks(per_tick).enumerate() {
                for (p, mtime) in chunk {
                    let rel = p.strip_prefix(source.landing()).unwrap();
                    let to = landing.join(rel);
                    let dir = to.parent().unwrap();
                    std::fs::create_dir_all(dir).unwrap();
                    let tmp = dir.join(format!("_{}", to.file_name().unwrap().to_string_lossy()));
                    std::fs::copy(p, &tmp).unwrap();
                    set_mtime(&tmp, *mtime);
                    std::fs::rename(&tmp, &to).unwrap();
                }
                let next = LANDING * (k as u32 + 1) / DROPS;
                std::thread::sleep(next.saturating_sub(started.elapsed()));
            }
        });
        // Two cron-like run loops.
        for i in 0..2 {
            let (stop, outcomes, soak) = (stop.clone(), outcomes.clone(), &soak);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let out = kestrel_logged(soak, &["run"]);
                    outcomes
                        .lock()
                        .unwrap()
                        .record(&format!("run loop {i}"), &out, t.elapsed());
                    std::thread::sleep(Duration::from_millis(3000 + 2000 * i));
                }
            });
        }
        // Backfills of four jobs over the days the events span, again and again.
        let (stop2, outcomes2, soak2) = (stop.clone(), outcomes.clone(), &soak);
        s.spawn(move || {
            let now = chrono::Utc::now();
            let from = (now - chrono::Duration::hours(2))
                .format("%Y-%m-%d")
                .to_string();
            let to = now.format("%Y-%m-%d").to_string();
            std::thread::sleep(Duration::from_secs(20));
            let jobs = [
                "revenue_5m",
                "sessions",
                "payment_reconciliation",
                "stockout",
            ];
            let mut k = 0;
            while !stop2.load(Ordering::Relaxed) {
                let job = jobs[k % jobs.len()];
                let args = ["backfill", "--job", job, "--from", &from, "--to", &to];
                let t = Instant::now();
                let out = kestrel_logged(soak2, &args);
                outcomes2
                    .lock()
                    .unwrap()
                    .record(&format!("backfill {job}"), &out, t.elapsed());
                k += 1;
                std::thread::sleep(Duration::from_secs(5));
            }
        });
        lander.join().unwrap();
        // Let the writers see the last files, then stop them.
        std::thread::sleep(Duration::from_secs(10));
        stop.store(true, Ordering::Relaxed);
    });
    daemon.signal(libc::SIGTERM);
    let (code, daemon_out) = daemon.finish_within(Duration::from_secs(240));
    assert_eq!(code, Some(0), "{daemon_out}");
    let daemon_races = daemon_out.matches("lost a race").count();
    let daemon_failed = daemon_out.matches(": FAILED in").count();
    let daemon_ok = daemon_out.matches(": ok in").count();

    // Whatever the writers left is finished by one more run.
    let t = Instant::now();
    let out = kestrel_logged(&soak, &["run"]);
    let mut o = outcomes.lock().unwrap();
    o.record("final run", &out, t.elapsed());
    assert!(o.failures.is_empty(), "{}", o.failures.join("\n\n"));
    assert_eq!(daemon_failed, 0, "{daemon_out}");

    // One clean writer over the same files (the same landing directory: same paths and
    // arrival times), on local disk.
    let clean = Env::new();
    std::fs::write(
        clean.path().join("kestrel.toml"),
        format!(
            "landing = \"{}\"\nwarehouse = \"warehouse\"\n",
            soak.landing().display()
        ),
    )
    .unwrap();
    clean.run_ok(&["run"], 0);

    let s3 = Location::open("s3://lake/soak", &opts, false).unwrap();
    let wh = Warehouse::new(s3.clone());
    let mut skip: Vec<&str> = SKIP.to_vec();
    // Batch numbers and the watermark recorded with a late row depend on how the work
    // was split between writers.
    skip.extend([
        "_batch_id",
        "batch_id",
        "_job_batch_id",
        "_watermark",
        "_cutoff",
    ]);
    for t in replay_tables() {
        assert_eq!(
            snapshot_of(&wh, &t, &skip),
            clean.snapshot(&t, &skip),
            "{t} differs from a single writer's"
        );
    }
    // No event twice, no file twice.
    for src in ["clickstream", "orders", "payments", "inventory"] {
        let rows = snapshot_of(&wh, &format!("bronze/{src}"), &[]);
        let ids: std::collections::BTreeSet<&str> = rows
            .iter()
            .filter_map(|r| r.split('|').find_map(|f| f.strip_prefix("event_id=")))
            .collect();
        assert_eq!(ids.len(), rows.len(), "bronze/{src} holds an event twice");
        assert!(!rows.is_empty(), "bronze/{src} is empty");
    }
    let ledger = snapshot_of(&wh, "_kestrel/ledger", &[]);
    let paths: std::collections::BTreeSet<&str> = ledger
        .iter()
        .filter_map(|r| r.split('|').find_map(|f| f.strip_prefix("path=")))
        .collect();
    assert_eq!(paths.len(), ledger.len(), "a file is in the ledger twice");
    assert_eq!(ledger.len(), files.len(), "every landed file once");
    // Every writer compacts the run log: no row of it twice (two compactions of the same
    // files both committing doubled it — delta-rs does not see that conflict).
    let runs = snapshot_of(&wh, "_kestrel/runs", &[]);
    let distinct: std::collections::BTreeSet<&String> = runs.iter().collect();
    assert_eq!(distinct.len(), runs.len(), "a run-log row twice");

    // Every table's log: commits contiguous up to its version, anything cleaned up
    // below a checkpoint.
    let mut all_tables = replay_tables();
    all_tables.extend(["_kestrel/runs", "_kestrel/plans"].map(String::from));
    let rt = rt();
    for t in &all_tables {
        let (commits, checkpoints) = rt.block_on(log_versions(&s3, t));
        if commits.is_empty() {
            continue;
        }
        let (first, last) = (commits[0], *commits.last().unwrap());
        assert_eq!(
            commits,
            (first..=last).collect::<Vec<_>>(),
            "{t}: the Delta log has a gap"
        );
        assert!(
            first == 0 || checkpoints.iter().any(|c| *c + 1 >= first),
            "{t}: commits from {first} on, no checkpoint at {} or later ({checkpoints:?})",
            first - 1
        );
        let v = rt.block_on(wh.open(t)).unwrap().and_then(|t| t.version());
        assert_eq!(v, Some(last), "{t}");
    }

    // The writers collided: commits refused by S3 because another writer had just
    // taken the version (delta-rs then committed at the next one, or kestrel planned
    // the commit again).
    let requests = moto.requests();
    let refused = requests
        .lines()
        .filter(|l| l.contains("_delta_log/") && l.contains("\" 412 "))
        .count();
    eprintln!(
        "{} runs and backfills ({} found a source or job busy), {} daemon races, {} races \
         and {} store retries in the others, {refused} Delta commits refused with 412, in {:.0} s",
        o.runs,
        o.busy,
        daemon_races,
        o.races,
        o.retries,
        started.elapsed().as_secs_f64()
    );
    for (what, secs) in &o.seconds {
        eprintln!("  {what}: {secs:.1} s");
    }
    eprintln!("  daemon: {daemon_ok} runs ok");
    assert!(refused > 0, "no two writers ever raced for a Delta version");
}
