//! The shipped `customers` change-data-capture source and its mirror job end to end
//! against Delta tables: the demo's change stream landed in drops (in order, and the same
//! files in reverse order) gives the same mirror and history; kill -9 at every step of
//! ingestion and of the job's three commits, then a rerun, gives identical tables; a
//! redelivered file changes nothing; a late older change after a delete is ignored by the
//! mirror and placed in history; the result equals a batch truth computed from the landed
//! files by another program (Python), as read by three independent Delta readers.

use crate::common::*;

const TABLES: [&str; 4] = [
    "gold/customers",
    "gold/customers_history",
    "_kestrel/mirror/customers/deletes",
    "bronze/customers",
];
const SKIP: [&str; 2] = ["_ingested_at", "_batch_id"];

/// The demo's `customers` files (path under the landing zone, bytes, arrival second) in
/// arrival order.
fn demo_changes() -> Vec<(String, Vec<u8>, i64)> {
    let staging = Env::new();
    staging.run_ok(&["demo", "--hours", "3", "--seed", "11"], 0);
    let root = staging.landing();
    let mut files = Vec::new();
    let mut dirs = vec![root.join("customers")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            let mtime = filetime::FileTime::from_last_modification_time(&p.metadata().unwrap());
            let rel = p
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            files.push((rel, std::fs::read(&p).unwrap(), mtime.unix_seconds()));
        }
    }
    files.sort_by(|a, b| (a.2, &a.0).cmp(&(b.2, &b.0)));
    files
}

/// Six drops of consecutive files.
fn drops(files: &[(String, Vec<u8>, i64)]) -> Vec<&[(String, Vec<u8>, i64)]> {
    let n = files.len().div_ceil(6);
    files.chunks(n).collect()
}

fn land_all(env: &Env, drop: &[(String, Vec<u8>, i64)]) {
    for (rel, bytes, at) in drop {
        env.land(rel, bytes, *at);
    }
}

fn run(env: &Env) {
    env.run_ok(&["run", "--job", "customers"], 0);
}

/// A change line of customer `id` (string fields only what the test reads).
fn change(op: &str, id: &str, lsn: i64, ts_ms: i64, credit: i64) -> String {
    let row = format!(
        r#"{{"customer_id":"{id}","email":"{id}@t","name":"T","tier":"gold","credit_cents":{credit},"updated_at":{ts_ms}}}"#
    );
    let (before, after) = if op == "d" {
        (row, "null".to_string())
    } else {
        ("null".to_string(), row)
    };
    format!(
        r#"{{"op":"{op}","ts_ms":{ts_ms},"before":{before},"after":{after},"source":{{"lsn":{lsn},"db":"shop"}}}}"#
    )
}

#[test]
fn the_customers_mirror_equals_the_last_change_per_key_exactly_once() {
    let files = demo_changes();
    assert!(files.len() >= 12, "{} files", files.len());
    let last = files.last().unwrap().2;

    // In order, drop by drop.
    let clean = Env::new();
    for d in drops(&files) {
        land_all(&clean, d);
        run(&clean);
    }
    // The demo's bad change is quarantined with its reasons; redeliveries were dropped
    // at ingestion.
    let q = clean.query("quarantine/customers", "SELECT reason FROM t");
    assert!(
        q.iter()
            .any(|r| r[0].contains("field `op`: unknown value \"x\"")
                && r[0].contains("field `source.lsn`: expected an integer")),
        "{q:?}"
    );
    let dups = clean.count(
        "_kestrel/runs",
        "SELECT coalesce(sum(duplicates), 0) FROM t WHERE kind = 'ingest' AND name = 'customers'",
    );
    assert!(dups > 0, "the demo re-delivers some changes");

    // The same changes landed in reverse order of the drops (later lsns first; each drop
    // one file, named in landing order as the landing contract asks): the same mirror
    // and history.
    let reversed = Env::new();
    for (k, d) in drops(&files).into_iter().rev().enumerate() {
        let mut text = Vec::new();
        for (rel, bytes, _) in d {
            if rel.ends_with(".gz") {
                use std::io::Read;
                flate2::read::MultiGzDecoder::new(&bytes[..])
                    .read_to_end(&mut text)
                    .unwrap();
            } else {
                text.extend_from_slice(bytes);
            }
        }
        reversed.land(
            &format!("customers/partition=0/reversed-{k:02}.ndjson"),
            &text,
            last + 60 * k as i64,
        );
        run(&reversed);
    }
    for t in &TABLES[..3] {
        assert_eq!(reversed.snapshot(t, &SKIP), clean.snapshot(t, &SKIP), "{t}");
    }

    // kill -9 at each step of ingestion and of the job's commits (two per drop, the
    // second later in the resumed run), then a rerun: identical tables.
    const KILLS: [[&str; 2]; 6] = [
        ["after_bronze", "after_ledger"],
        ["after_ledger", "job_after_compute"],
        ["job_after_plan", "job_between_merges"],
        ["job_after_compute", "job_after_gold"],
        ["job_between_merges", "job_after_runlog"],
        ["job_between_merges", "job_before_completing_merge"],
    ];
    let killed = Env::new();
    for (k, d) in drops(&files).into_iter().enumerate() {
        land_all(&killed, d);
        for point in KILLS[k % KILLS.len()] {
            killed.killed_at(&["run", "--job", "customers"], point);
        }
        run(&killed);
    }
    for t in TABLES {
        let (k, c) = (killed.snapshot(t, &SKIP), clean.snapshot(t, &SKIP));
        let only_k: Vec<&String> = k.iter().filter(|r| !c.contains(r)).collect();
        let only_c: Vec<&String> = c.iter().filter(|r| !k.contains(r)).collect();
        assert!(
            only_k.is_empty() && only_c.is_empty(),
            "{t}: only after kills {only_k:#?}\nonly clean {only_c:#?}"
        );
    }

    // A redelivered file (same changes, new name) changes nothing.
    let (rel, bytes, _) = &files[files.len() / 2];
    let before: Vec<Vec<String>> = TABLES[..3]
        .iter()
        .map(|t| clean.snapshot(t, &SKIP))
        .collect();
    let (dir, name) = rel.rsplit_once('/').unwrap();
    clean.land(&format!("{dir}/again-{name}"), bytes, last + 60);
    run(&clean);
    let after: Vec<Vec<String>> = TABLES[..3]
        .iter()
        .map(|t| clean.snapshot(t, &SKIP))
        .collect();
    assert_eq!(after, before);

    // A key inserted and deleted, then a late older update of it: not in the mirror;
    // in history between the two.
    let base = (last + 120) * 1000;
    let t1 = 5_000_000_000_i64;
    clean.land(
        "customers/partition=0/late-1.ndjson",
        &lines(&[
            change("c", "C-LATE", t1, base, 1),
            change("d", "C-LATE", t1 + 2, base + 2000, 0),
        ]),
        last + 180,
    );
    run(&clean);
    clean.land(
        "customers/partition=0/late-2.ndjson",
        &lines(&[change("u", "C-LATE", t1 + 1, base + 1000, 7)]),
        last + 240,
    );
    run(&clean);
    let sql =
        "SELECT credit_cents, CAST(valid_from AS VARCHAR), CAST(valid_to AS VARCHAR), is_current \
               FROM t WHERE customer_id = 'C-LATE' ORDER BY _lsn";
    let h = clean.query("gold/customers_history", sql);
    assert_eq!(h.len(), 2, "{h:?}");
    assert_eq!((h[0][0].as_str(), h[1][0].as_str()), ("1", "7"));
    assert_eq!(
        h[0][2], h[1][1],
        "the late version starts where the first ends"
    );
    assert_eq!(h[1][3], "false");
    assert_eq!(
        clean.count(
            "gold/customers",
            "SELECT count(*) FROM t WHERE customer_id = 'C-LATE'"
        ),
        0
    );
    let superseded = clean.query(
        "_kestrel/runs",
        "SELECT corrections FROM t WHERE kind = 'job' AND name = 'customers' ORDER BY batch_id DESC LIMIT 1",
    );
    assert_eq!(superseded, [vec!["1".to_string()]]);

    // A mirror has no event-time days: a backfill says so in one line.
    let e = clean.fails_one_line(&[
        "backfill",
        "--job",
        "customers",
        "--from",
        "2025-11-20",
        "--to",
        "2025-11-21",
    ]);
    assert!(e.contains("cannot be backfilled"), "{e}");

    // The batch truth, computed by another program from the landed files, read back by
    // three independent Delta readers.
    let Some(python) = python_for_interop() else {
        return;
    };
    let out = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/interop/cdc_truth.py"
        ))
        .arg(clean.landing())
        .arg(clean.warehouse())
        .args(["customers", "gold/customers"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cdc_truth.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["truth"]["rows"].as_i64().unwrap() > 10, "{json}");
    for reader in ["deltalake", "polars", "duckdb"] {
        assert_eq!(json[reader]["current"], true, "{reader}: {json}");
        assert_eq!(json[reader]["history"], true, "{reader}: {json}");
    }
}
