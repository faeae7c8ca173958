//! A store that fails: every object-store call of a `kestrel run` fails with a transient
//! error at 5 %, and 5 % of the put-if-absent writes that land report an error anyway
//! (`KESTREL_STORE_FAULTS`, see `fault.rs`). A replay of a few hours of drops under those
//! faults gives the tables of a clean replay; a run that fails anyway says so in one line
//! and exits non-zero, and the next run completes.

use std::path::{Path, PathBuf};

use crate::common::*;

/// Every file under `dir`, with its mtime, oldest first.
pub(crate) fn files_by_mtime(dir: &Path) -> Vec<(PathBuf, i64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let m = std::fs::metadata(&p).unwrap().modified().unwrap();
                let s = m.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
                out.push((p, s));
            }
        }
    }
    out.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    out
}

/// Copy `files` (from [`files_by_mtime`] of `from`'s landing zone) to the same paths of
/// `to`'s, each with its arrival time.
pub(crate) fn land_copies(from: &Env, to: &Env, files: &[(PathBuf, i64)]) {
    for (p, mtime) in files {
        let dest = to.landing().join(p.strip_prefix(from.landing()).unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(p, &dest).unwrap();
        set_mtime(&dest, *mtime);
    }
}

/// Processing-time and storage-identity columns, which differ between two replays.
pub(crate) const SKIP: [&str; 6] = [
    "_ingested_at",
    "_updated_at",
    "_recorded_at",
    "recorded_at",
    "detected_at",
    "e_tag",
];

/// Every table a replay of the demo writes (late ledgers absent in both compare equal).
pub(crate) fn replay_tables() -> Vec<String> {
    let mut tables = vec![
        "_kestrel/ledger".to_string(),
        "_kestrel/mirror/customers/deletes".to_string(),
    ];
    for s in [
        "clickstream",
        "orders",
        "payments",
        "inventory",
        "customers",
    ] {
        tables.push(format!("bronze/{s}"));
        tables.push(format!("quarantine/{s}"));
    }
    for j in [
        "clickstream_5m",
        "sessions",
        "revenue_5m",
        "revenue_1h",
        "payments_fast",
        "payment_reconciliation",
        "stockout",
        "customers",
    ] {
        tables.push(format!("late/{j}"));
    }
    for t in [
        "clickstream_5m",
        "sessions",
        "revenue_5m",
        "revenue_1h",
        "payments_fast",
        "payment_reconciliation",
        "stockout_alerts",
        "sku_availability",
        "sessions_open",
        "customers",
        "customers_history",
    ] {
        tables.push(format!("gold/{t}"));
    }
    tables
}

#[test]
fn a_replay_under_store_faults_equals_a_clean_replay() {
    // Three hours of demo events, landed in six drops.
    let source = Env::new();
    source.run_ok(&["demo", "--hours", "3", "--scale", "0.05"], 0);
    let files = files_by_mtime(&source.landing());
    assert!(files.len() > 100, "{}", files.len());
    let (clean, faulty) = (Env::new(), Env::new());
    let drops = 6;
    let per = files.len().div_ceil(drops);
    let (mut injected, mut retried, mut ours, mut failed_runs) = (0, 0, 0, 0);
    for (k, chunk) in files.chunks(per).enumerate() {
        for env in [&clean, &faulty] {
            land_copies(&source, env, chunk);
        }
        clean.run_ok(&["run"], 0);
        let mut done = false;
        for attempt in 0..6 {
            let seed = format!("rate=0.05,ambiguous=0.05,seed={}", k * 10 + attempt);
            let out = faulty.kestrel_env(
                &["run"],
                &[
                    ("KESTREL_STORE_FAULTS", seed.as_str()),
                    (
                        "RUST_LOG",
                        "warn,kestrel::fault=debug,kestrel::storage=debug",
                    ),
                ],
            );
            let stderr = String::from_utf8_lossy(&out.stderr);
            injected += stderr.matches("injected store fault").count()
                + stderr.matches("injected ambiguous create").count();
            retried += stderr.matches("retrying").count();
            ours += stderr.matches("it was ours").count();
            match out.status.code() {
                Some(0) => {
                    done = true;
                    break;
                }
                Some(_) => {
                    failed_runs += 1;
                    // One line that says what failed.
                    let last = stderr.lines().last().unwrap_or_default();
                    assert!(last.starts_with("kestrel: "), "{stderr}");
                }
                None => panic!("killed by a signal: {stderr}"),
            }
        }
        assert!(done, "drop {k}: no run completed under faults");
    }
    assert!(
        injected > 50 && retried > 0 && ours > 0,
        "faults injected: {injected}, retried: {retried}, ambiguous creates resolved: {ours}"
    );
    eprintln!(
        "{injected} faults injected, {retried} retries, {ours} ambiguous creates found ours, {failed_runs} runs failed"
    );
    let tables = replay_tables();
    for t in &tables {
        assert_eq!(faulty.snapshot(t, &SKIP), clean.snapshot(t, &SKIP), "{t}");
    }
    // Each batch's counts are the same, and no event was counted twice.
    let runs = "SELECT kind, name, batch_id, rows_in, rows_written, duplicates, quarantined, \
                rows_applied, too_late, windows_recomputed, windows_deleted, corrections \
                FROM t WHERE status = 'ok' ORDER BY kind, name, batch_id";
    assert_eq!(
        faulty.query("_kestrel/runs", runs),
        clean.query("_kestrel/runs", runs)
    );
}

/// One source cannot be ingested in a run (every call on its landed files fails): the
/// run exits 1 naming it, the jobs that read it are reported skipped and not run (a job
/// batch takes one ingestion batch per source, so `payments_fast` would otherwise take
/// the new orders without their payments), the others run; the next run ingests it and
/// every table and run-log count equals a replay where nothing failed.
#[test]
fn a_source_that_fails_to_ingest_holds_back_only_the_jobs_that_read_it() {
    let source = Env::new();
    source.run_ok(&["demo", "--hours", "1", "--scale", "0.05"], 0);
    let files = files_by_mtime(&source.landing());
    let (clean, faulty) = (Env::new(), Env::new());
    for (k, chunk) in files.chunks(files.len().div_ceil(2)).enumerate() {
        for env in [&clean, &faulty] {
            land_copies(&source, env, chunk);
        }
        clean.run_ok(&["run"], 0);
        if k == 0 {
            faulty.run_ok(&["run"], 0);
            continue;
        }
        let out = faulty.kestrel_env(
            &["run"],
            &[("KESTREL_STORE_FAULTS", "rate=1,path=payments/")],
        );
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("kestrel: ingestion failed for payments: ")
                && !last.contains("job failed"),
            "{stderr}"
        );
        for job in ["payments_fast", "payment_reconciliation"] {
            assert!(
                stdout.lines().any(|l| l.starts_with(job)
                    && l.contains("skipped: not run: ingestion of payments failed")),
                "{job}: {stdout}"
            );
        }
        // The jobs that do not read payments ran.
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("revenue_5m") && !l.contains("skipped")),
            "{stdout}"
        );
        faulty.run_ok(&["run"], 0);
    }
    for t in &replay_tables() {
        assert_eq!(faulty.snapshot(t, &SKIP), clean.snapshot(t, &SKIP), "{t}");
    }
    let runs = "SELECT kind, name, batch_id, rows_in, rows_written, duplicates, rows_applied, \
                too_late, corrections FROM t WHERE status = 'ok' ORDER BY kind, name, batch_id";
    assert_eq!(
        faulty.query("_kestrel/runs", runs),
        clean.query("_kestrel/runs", runs)
    );
}

/// A tmpfs mounted for the test's warehouse, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mount a tmpfs of `mib` MiB at `dir`; None (with a message) when this process may
    /// not mount (not root, or no mount permission in the container).
    fn mount(dir: &Path, mib: u64) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("cannot mount a tmpfs here (not root?): skipping the full-disk test");
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Free bytes of the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> u64 {
    let out = std::process::Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .unwrap()
}

/// The warehouse's disk fills up in the middle of a run: a one-line error naming the
/// path, a non-zero exit and no broken table; once space is freed, the next run completes
/// and its tables equal a run that never ran out of space.
#[test]
fn a_full_disk_fails_cleanly_and_the_next_run_completes() {
    let clean = Env::new();
    clean.run_ok(&["demo", "--hours", "1", "--scale", "0.2"], 0);
    let env = Env::new();
    let Some(_disk) = Tmpfs::mount(&env.warehouse(), 64) else {
        return;
    };
    land_copies(&clean, &env, &files_by_mtime(&clean.landing()));
    clean.run_ok(&["run"], 0);
    // Leave ~300 KiB: bronze fits partly, the rest does not.
    let filler = env.warehouse().join("filler");
    let leave = 300 << 10;
    let size = free_bytes(&env.warehouse()).saturating_sub(leave);
    std::fs::write(&filler, vec![0u8; size as usize]).unwrap();
    let out = env.kestrel(&["run"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kestrel: ") && last.contains("No space left on device"),
        "{stderr}"
    );
    assert!(
        last.contains(&env.warehouse().display().to_string()),
        "names the path: {last}"
    );
    eprintln!("full disk: {last}");
    // Space again: the next run completes, and equals the run that had room.
    std::fs::remove_file(&filler).unwrap();
    env.run_ok(&["run"], 0);
    let tables = replay_tables();
    for t in &tables {
        assert_eq!(env.snapshot(t, &SKIP), clean.snapshot(t, &SKIP), "{t}");
    }
}
