//! A store that fails: every object-store call of a `kestrel run` fails with a transient
//! error at 5 %, and 5 % of the put-if-absent writes that land report an error anyway
//! (`KESTREL_STORE_FAULTS`, see `fault.rs`). A replay of a few hours of drops under those
//! faults gives the tables of a clean replay; a run that fails anyway says so in one line
//! and exits non-zero, and the next run completes.

use std::path::{Path, PathBuf};

use crate::common::*;

/// Every file under `dir`, with its mtime, oldest first.
fn files_by_mtime(dir: &Path) -> Vec<(PathBuf, i64)> {
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
            for (p, mtime) in chunk {
                let rel = p.strip_prefix(source.landing()).unwrap();
                let to = env.landing().join(rel);
                std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                std::fs::copy(p, &to).unwrap();
                set_mtime(&to, *mtime);
            }
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
    let mut tables = vec!["_kestrel/ledger".to_string()];
    for s in ["clickstream", "orders", "payments", "inventory"] {
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
    ] {
        tables.push(format!("gold/{j}"));
        tables.push(format!("late/{j}"));
    }
    tables.extend([
        "gold/stockout_alerts".into(),
        "gold/sku_availability".into(),
    ]);
    let skip = [
        "_ingested_at",
        "_updated_at",
        "_recorded_at",
        "recorded_at",
        "detected_at",
        "e_tag",
    ];
    for t in &tables {
        assert_eq!(faulty.snapshot(t, &skip), clean.snapshot(t, &skip), "{t}");
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
