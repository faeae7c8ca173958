//! Compaction of open partitions between batches (`[maintain] open_partition_files`):
//! it changes no table, a kill -9 in the middle of one leaves every table equal to a
//! clean run, and a job batch whose gold commit races a compaction of the same table is
//! planned again and ends equal.

use std::path::PathBuf;

use crate::common::*;

const SOURCES: [&str; 4] = ["clickstream", "inventory", "orders", "payments"];
const JOBS: [&str; 7] = [
    "clickstream_5m",
    "payment_reconciliation",
    "payments_fast",
    "revenue_1h",
    "revenue_5m",
    "sessions",
    "stockout",
];

/// Processing-time columns (they differ between two runs of the same input).
pub(crate) const SKIP: [&str; 5] = [
    "_updated_at",
    "_ingested_at",
    "_recorded_at",
    "detected_at",
    "recorded_at",
];

/// Every table a replay writes.
pub(crate) fn tables() -> Vec<String> {
    let mut t = Vec::new();
    for s in SOURCES {
        t.push(format!("bronze/{s}"));
        t.push(format!("quarantine/{s}"));
    }
    for j in JOBS {
        t.push(format!("gold/{j}"));
        t.push(format!("late/{j}"));
    }
    t.push("gold/sku_availability".into());
    t
}

/// One demo landing zone (an hour), as (arrival s, path under the landing zone, bytes).
pub(crate) fn demo_files() -> Vec<(i64, String, Vec<u8>)> {
    let src = Env::new();
    src.run_ok(&["demo", "--hours", "1"], 0);
    let mut files = Vec::new();
    collect(&src.landing(), &src.landing(), &mut files);
    files.sort();
    files
}

fn collect(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<(i64, String, Vec<u8>)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p: PathBuf = e.unwrap().path();
        if p.is_dir() {
            collect(root, &p, out);
        } else {
            let m = std::fs::metadata(&p).unwrap().modified().unwrap();
            let s = m.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            out.push((s, rel, std::fs::read(&p).unwrap()));
        }
    }
}

/// The arrival buckets (15 minutes) of `files`, in order.
pub(crate) fn buckets(files: &[(i64, String, Vec<u8>)]) -> Vec<Vec<&(i64, String, Vec<u8>)>> {
    let mut out: Vec<Vec<&(i64, String, Vec<u8>)>> = Vec::new();
    let mut current = i64::MIN;
    for f in files {
        let b = f.0.div_euclid(900);
        if b != current {
            out.push(Vec::new());
            current = b;
        }
        if let Some(last) = out.last_mut() {
            last.push(f);
        }
    }
    out
}

pub(crate) fn land_all(env: &Env, bucket: &[&(i64, String, Vec<u8>)]) {
    for (at, rel, body) in bucket {
        env.land(rel, body, *at);
    }
}

pub(crate) fn assert_same_tables(a: &Env, b: &Env) {
    for t in tables() {
        let (x, y) = (a.snapshot(&t, &SKIP), b.snapshot(&t, &SKIP));
        assert_eq!(x.len(), y.len(), "{t}: row count");
        assert_eq!(x, y, "{t}");
    }
    let runs = "SELECT kind, name, batch_id, files, rows_in, rows_written, duplicates, quarantined, rows_applied, too_late, windows_recomputed, windows_deleted, corrections, to_unixtime(watermark) FROM t ORDER BY kind, name, batch_id";
    assert_eq!(
        a.query("_kestrel/runs", runs),
        b.query("_kestrel/runs", runs)
    );
}

fn active_files(env: &Env, table: &str) -> usize {
    rt().block_on(async {
        match env.wh().open(table).await.unwrap() {
            Some(t) => t.snapshot().unwrap().log_data().num_files(),
            None => 0,
        }
    })
}

const EAGER: &str = "[maintain]\nopen_partition_files = 2\n";
const NEVER: &str = "[maintain]\nopen_partition_files = 0\n";

/// A replay with compaction after (almost) every batch gives the same tables — every
/// bronze, quarantine, gold and late table and the run log — as one without, with fewer
/// files.
#[test]
fn open_partition_compaction_changes_no_table() {
    let files = demo_files();
    let (eager, never) = (Env::with_config(EAGER), Env::with_config(NEVER));
    let bs = buckets(&files);
    assert!(bs.len() >= 4, "{} buckets", bs.len());
    for (i, b) in bs.iter().enumerate() {
        for env in [&eager, &never] {
            land_all(env, b);
            // A malformed line in every bucket: its run appends to the quarantine table.
            // Named to sort after the files landed before (discovery lists after the last
            // name seen; the hourly full listing would catch others only later).
            let bad = format!("orders/partition=0/x-{i:03}-bad.ndjson");
            env.land(&bad, b"{\"event_id\": \"not closed\n", b[0].0);
            // From the second bucket on, an order 30 days older than the watermark: too
            // late for the revenue jobs (lookback 3 d), so every run sends one to their
            // late ledgers.
            if i > 0 {
                let line = late_order(b, i);
                let late = format!("orders/partition=0/x-{i:03}-late.ndjson");
                env.land(&late, line.as_bytes(), b[0].0);
            }
            env.run_ok(&["run"], 0);
        }
    }
    assert_same_tables(&eager, &never);
    for t in ["bronze/clickstream", "_kestrel/runs", "_kestrel/ledger"] {
        let (e, n) = (active_files(&eager, t), active_files(&never, t));
        assert!(e < n, "{t}: {e} files with compaction, {n} without");
    }
    // A quarantine table is compacted by the runs that write to it (only those look).
    let q = "quarantine/orders";
    let (e, n) = (active_files(&eager, q), active_files(&never, q));
    assert!(
        n >= bs.len() && e < n,
        "{q}: {e} files with compaction, {n} without"
    );
    // So is a late ledger: only runs that send events to it look at it.
    let late = "late/revenue_5m";
    let (e, n) = (active_files(&eager, late), active_files(&never, late));
    assert!(
        n >= bs.len() - 1 && e < n,
        "{late}: {e} files with compaction, {n} without"
    );
    // Gold's compaction keeps its files clustered: each holds one hour of windows.
    for env in [&eager, &never] {
        rt().block_on(async {
            let t = env.wh().open("gold/revenue_5m").await.unwrap().unwrap();
            let snap = t.snapshot().unwrap();
            assert_eq!(snap.metadata().partition_columns(), &["window_date"]);
            for f in snap.log_data().iter() {
                let stats: serde_json::Value = serde_json::from_str(&f.stats().unwrap()).unwrap();
                let hour = |b: &str| stats[b]["window_hour"].as_i64().unwrap();
                assert_eq!(hour("minValues"), hour("maxValues"), "{stats}");
            }
        });
    }
}

/// The first well-formed order line of `bucket`, 30 days earlier and with an event id
/// of its own (the demo lands some malformed and re-delivered lines on purpose).
pub(crate) fn late_order(bucket: &[&(i64, String, Vec<u8>)], i: usize) -> String {
    let lines = bucket
        .iter()
        .filter(|(_, rel, _)| rel.starts_with("orders/"))
        .flat_map(|(_, _, body)| body.split(|b| *b == b'\n'));
    for line in lines {
        let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(line) else {
            continue;
        };
        let Some(Ok(ts)) = v["event_ts"]
            .as_str()
            .map(chrono::DateTime::parse_from_rfc3339)
        else {
            continue;
        };
        v["event_ts"] = (ts - chrono::Duration::days(30)).to_rfc3339().into();
        v["event_id"] = format!("late-order-{i}").into();
        return format!("{v}\n");
    }
    panic!("bucket {i} lands no well-formed order line");
}

/// kill -9 after an open-partition compaction wrote its files and before its commit:
/// the rerun completes, every table equals a clean run's, and the daily vacuum removes
/// the compaction's orphaned files.
#[test]
fn kill_9_during_open_compaction_then_rerun_equals_a_clean_run() {
    let files = demo_files();
    let (killed, clean) = (Env::with_config(EAGER), Env::with_config(EAGER));
    let mut kills = 0;
    for (k, b) in buckets(&files).iter().enumerate() {
        land_all(&killed, b);
        land_all(&clean, b);
        if k >= 1 {
            let out = killed.kestrel_env(&["run"], &[("KESTREL_FAULT", "compaction_commit")]);
            assert_eq!(
                out.status.code(),
                None,
                "bucket {k}: expected a SIGKILL inside a compaction; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            kills += 1;
        }
        killed.run_ok(&["run"], 0);
        clean.run_ok(&["run"], 0);
    }
    assert!(kills >= 3, "{kills}");
    assert_same_tables(&killed, &clean);
    // The killed compactions left files no table references; vacuum deletes them.
    let orphans = |env: &Env, table: &str| {
        let on_disk = parquet_files(&env.warehouse().join(table));
        on_disk - active_files(env, table)
    };
    assert!(orphans(&killed, "bronze/clickstream") > 0);
    killed.run_ok(&["maintain", "--retention", "0s", "--no-compact"], 0);
    assert_eq!(orphans(&killed, "bronze/clickstream"), 0);
    assert_same_tables(&killed, &clean);
}

fn parquet_files(dir: &std::path::Path) -> usize {
    let mut n = 0;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in rd {
        let p = e.unwrap().path();
        if p.is_dir() {
            if !p.ends_with("_delta_log") {
                n += parquet_files(&p);
            }
        } else if p.extension().is_some_and(|x| x == "parquet") {
            n += 1;
        }
    }
    n
}

/// Order lines of one hour, three drops: each drop's windows are new, so each MERGE adds
/// a file to the hour's partition; the third also corrects the first window (a row of
/// the first file, so its MERGE rewrites that file).
fn orders_drop(env: &Env, k: i64) {
    let mut ls: Vec<String> = (0..4)
        .map(|i| {
            order(
                &format!("o{k}-{i}"),
                T0 + k * 600 + i * 30,
                &format!("ord-{k}-{i}"),
                if i % 2 == 0 { "A" } else { "B" },
                1 + i,
                100 * (1 + i),
            )
        })
        .collect();
    if k == 2 {
        ls.push(order("late-0", T0 + 5, "ord-late", "A", 7, 700));
    }
    env.land(
        &format!("orders/f{k}.ndjson"),
        &lines(&ls),
        T0 + k * 600 + 200,
    );
}

/// A job's gold commit that loses a race with a compaction of the same partition (it
/// opened the table, then the compaction committed) is planned again against the
/// compacted table, and the batch ends with the same table as a run without the race.
#[test]
fn a_gold_commit_racing_a_compaction_is_planned_again() {
    let (raced, clean) = (Env::with_config(NEVER), Env::with_config(NEVER));
    // A watermark far behind: no window turns final, so each batch only adds windows
    // (a file each) to the hour's partition instead of rewriting the earlier ones.
    for env in [&raced, &clean] {
        let jobs = env.path().join("jobs");
        std::fs::create_dir_all(&jobs).unwrap();
        let toml = include_str!("../../jobs/revenue_5m.toml")
            .replace("watermark_delay = \"30s\"", "watermark_delay = \"2h\"");
        assert!(toml.contains("\"2h\""));
        std::fs::write(jobs.join("revenue_5m.toml"), toml).unwrap();
    }
    for k in 0..2 {
        for env in [&raced, &clean] {
            orders_drop(env, k);
            env.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
        }
    }
    let before = active_files(&raced, "gold/revenue_5m");
    assert!(before >= 2, "the hour's partition holds {before} files");
    for env in [&raced, &clean] {
        orders_drop(env, 2);
    }
    // The batch pauses after opening gold for its commit; meanwhile gold is compacted.
    let child = std::process::Command::new(BIN)
        .arg("--config")
        .arg(raced.path().join("kestrel.toml"))
        .args(["run", "--source", "orders", "--job", "revenue_5m"])
        .env("KESTREL_DELAY", "job_before_gold_commit:4000")
        .env("RUST_LOG", "kestrel=warn")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let result = raced
        .warehouse()
        .join("_kestrel/plans/job/revenue_5m/00000000000000000003.result.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !result.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "batch 3 never computed"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let compacted = rt().block_on(async {
        let open = kestrel::sink::compact::OpenCompaction {
            min_files: 2,
            target_size: 1 << 30,
        };
        kestrel::sink::compact::open_partitions(
            &raced.wh(),
            "gold/revenue_5m",
            &open,
            &[],
            None,
            false,
        )
        .await
        .unwrap()
    });
    assert!(compacted.is_some(), "the compaction committed");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("lost a race"), "{stderr}");
    clean.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    let skip = ["_updated_at"];
    assert_eq!(
        raced.snapshot("gold/revenue_5m", &skip),
        clean.snapshot("gold/revenue_5m", &skip)
    );
    let runs =
        "SELECT batch_id, rows_in, windows_recomputed FROM t WHERE kind = 'job' ORDER BY batch_id";
    assert_eq!(
        raced.query("_kestrel/runs", runs),
        clean.query("_kestrel/runs", runs)
    );
}
