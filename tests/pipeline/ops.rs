//! `kestrel status`: last runs, watermarks and gold-table freshness, as JSON for
//! machines, and `--check --max-age` exit codes for cron and monitors.

use crate::common::*;

#[test]
fn status_reports_runs_watermarks_and_freshness_and_checks_it() {
    let env = Env::new();
    env.land(
        "orders/f1.ndjson",
        &lines(&[
            order("o1", T0 + 10, "ord-1", "A", 1, 100),
            order("o2", T0 + 100, "ord-2", "B", 2, 200),
        ]),
        T0 + 120,
    );
    env.run_ok(&["run"], 0);
    let out = env.run_ok(&["status", "--json"], 0);
    let st: serde_json::Value = serde_json::from_str(&out).unwrap();
    let source = st["sources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["source"] == "orders")
        .unwrap();
    assert_eq!(source["last_batch"], 1);
    assert_eq!(source["last_status"], "ok");
    assert_eq!(source["rows_written_day"], 2);
    let job = st["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job"] == "revenue_5m")
        .unwrap();
    assert_eq!(job["last_batch"], 1);
    // W = newest event (T0 + 100) − 30 s delay.
    assert_eq!(job["watermark"], ts(T0 + 70));
    assert_eq!(job["newest_event"], ts(T0 + 100));
    assert_eq!(job["watermark_lag_s"], 30.0);
    let table = st["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["table"] == "gold/revenue_5m")
        .unwrap();
    assert!(table["age_s"].as_f64().unwrap() < 600.0, "{table}");
    let never = st["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["table"] == "gold/sessions")
        .unwrap();
    assert!(never["last_commit_at"].is_null(), "{never}");

    // Fresh enough: exit 0. A table never written, or older than the limit: exit 4 with
    // the tables named on one line.
    env.run_ok(
        &[
            "status",
            "--check",
            "--max-age",
            "1h",
            "--job",
            "revenue_5m",
        ],
        0,
    );
    let out = env.kestrel(&["status", "--check", "--max-age", "1h", "--job", "sessions"]);
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gold/sessions (never written)"), "{err}");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let out = env.kestrel(&[
        "status",
        "--check",
        "--max-age",
        "1s",
        "--job",
        "revenue_5m",
    ]);
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("gold/revenue_5m ("), "{err}");
}
