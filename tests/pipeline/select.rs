//! The `select` operator (a filtered projection of one source) end to end against Delta
//! tables: exactly the applied events that pass its predicate, too-late ones in the late
//! ledger and the counter, kill -9 at every job step then rerun gives identical tables,
//! and a backfill restates the too-late row and says so.

use crate::common::*;

const DAY: i64 = 86_400;

const JOB: &str = r#"# Orders of 1.50 or more (a select job).
name = "big_orders"
schedule = "0 */5 * * * *"
sources = ["orders"]
operator = "select"
[params]
columns = ["sku", "amount_cents"]
where = "amount_cents >= 150"
[time]
watermark_delay = "30s"
idle_timeout = "5m"
lookback = "3d"
late_policy = "side_output"
[sink]
merge_keys = ["event_id"]
"#;

fn with_job() -> Env {
    let env = Env::new();
    std::fs::create_dir_all(env.path().join("jobs")).unwrap();
    std::fs::write(env.path().join("jobs/big_orders.toml"), JOB).unwrap();
    env
}

/// (landed at, order lines): day 0; day 4 (W passes day 0 + 3 d); stragglers: o5 too late
/// (day 0), o6 out of order within the delay, o7 late inside the lookback but under the
/// threshold.
fn drops() -> Vec<(i64, Vec<String>)> {
    vec![
        (
            T0 + 320,
            vec![
                order("o1", T0 + 10, "ord-1", "A", 1, 100),
                order("o2", T0 + 70, "ord-2", "A", 2, 200),
                order("o3", T0 + 310, "ord-3", "B", 1, 150),
            ],
        ),
        (
            T0 + 4 * DAY + 60,
            vec![order("o4", T0 + 4 * DAY, "ord-4", "C", 1, 900)],
        ),
        (
            T0 + 4 * DAY + 120,
            vec![
                order("o5", T0 + 20, "ord-5", "A", 5, 500),
                order("o6", T0 + 4 * DAY - 10, "ord-6", "B", 1, 160),
                order("o7", T0 + 2 * DAY, "ord-7", "B", 1, 90),
            ],
        ),
    ]
}

const GOLD: &str = "SELECT event_id, sku, amount_cents, CAST(event_date AS VARCHAR) FROM t \
                    ORDER BY event_id";

fn row(id: &str, sku: &str, cents: i64, day: &str) -> Vec<String> {
    vec![id.into(), sku.into(), cents.to_string(), day.into()]
}

#[test]
fn select_jobs_keep_the_applied_events_that_pass_exactly_once() {
    let clean = with_job();
    for (k, (at, ls)) in drops().iter().enumerate() {
        clean.land(&format!("orders/f{k}.ndjson"), &lines(ls), *at);
        clean.run_ok(&["run", "--job", "big_orders"], 0);
    }
    assert_eq!(
        clean.query("gold/big_orders", GOLD),
        [
            row("o2", "A", 200, "2025-11-20"),
            row("o3", "B", 150, "2025-11-20"),
            row("o4", "C", 900, "2025-11-24"),
            row("o6", "B", 160, "2025-11-24"),
        ]
    );
    assert_eq!(
        clean.query("late/big_orders", "SELECT event_id FROM t"),
        [vec!["o5".to_string()]]
    );
    let counts = "SELECT batch_id, rows_in, rows_applied, too_late, windows_recomputed FROM t \
                  WHERE kind = 'job' AND name = 'big_orders' ORDER BY batch_id";
    let n = |v: &[i64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        clean.query("_kestrel/runs", counts),
        [
            n(&[1, 3, 3, 0, 2]),
            n(&[2, 1, 1, 0, 1]),
            n(&[3, 3, 2, 1, 1])
        ]
    );
    // Nothing new: no batch, nothing written.
    clean.run_ok(&["run", "--job", "big_orders"], 0);
    assert_eq!(
        clean.count(
            "_kestrel/runs",
            "SELECT count(*) FROM t WHERE name = 'big_orders'"
        ),
        3
    );

    // kill -9 at every step of the job protocol (the batch resumed after each), then a
    // rerun: identical tables.
    const POINTS: [&str; 5] = [
        "job_after_plan",
        "job_after_compute",
        "job_after_late",
        "job_after_gold",
        "job_after_runlog",
    ];
    let env = with_job();
    for (k, (at, ls)) in drops().iter().enumerate() {
        env.land(&format!("orders/f{k}.ndjson"), &lines(ls), *at);
        // Two kills per batch, the second at a later step of the resumed batch.
        for point in [POINTS[k], POINTS[k + 2]] {
            env.killed_at(&["run", "--job", "big_orders"], point);
        }
        env.run_ok(&["run", "--job", "big_orders"], 0);
    }
    let skip = ["_updated_at", "_recorded_at", "_ingested_at"];
    for t in ["gold/big_orders", "late/big_orders"] {
        assert_eq!(env.snapshot(t, &skip), clean.snapshot(t, &skip), "{t}");
    }
    assert_eq!(
        env.query("_kestrel/runs", counts),
        clean.query("_kestrel/runs", counts)
    );

    // A backfill adds the too-late row, names it, and a second one changes nothing.
    let args = [
        "backfill",
        "--job",
        "big_orders",
        "--from",
        "2025-11-20",
        "--to",
        "2025-11-24",
        "--json",
    ];
    let r: serde_json::Value = serde_json::from_str(&clean.run_ok(&args, 0)).unwrap();
    let days = r["days"].as_array().unwrap();
    let changed: u64 = days.iter().map(|d| d["changed"].as_u64().unwrap()).sum();
    let late: Vec<&str> = days
        .iter()
        .flat_map(|d| d["with_too_late_rows"].as_array().unwrap())
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!((changed, late), (1, vec!["o5 @ 2025-11-20"]));
    let mut want = clean.query("gold/big_orders", GOLD);
    assert!(
        want.contains(&row("o5", "A", 500, "2025-11-20")),
        "{want:?}"
    );
    want.retain(|r| r[0] != "o5");
    assert_eq!(want, env.query("gold/big_orders", GOLD));
    let r: serde_json::Value = serde_json::from_str(&clean.run_ok(&args, 0)).unwrap();
    let changed: u64 = r["days"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["changed"].as_u64().unwrap())
        .sum();
    assert_eq!(changed, 0, "idempotent");
}
