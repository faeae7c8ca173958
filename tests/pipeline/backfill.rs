//! `kestrel backfill`: a restatement from bronze that includes rows too late for the
//! live job, equal to the incremental result everywhere else; idempotent, resumable
//! after kill -9, serialised with the job's other writers by its lease.

use crate::common::*;

const DAY: i64 = 86_400;
/// T0's date (2025-11-20) and four days later.
const D0: &str = "2025-11-20";
const D4: &str = "2025-11-24";

fn payment(id: &str, event_s: i64, order_id: &str, cents: i64) -> String {
    format!(
        r#"{{"event_id":"{id}","event_ts":"{}","payment_id":"p-{id}","order_id":"{order_id}","amount_cents":{cents},"status":"captured"}}"#,
        ts(event_s)
    )
}

fn stock(id: &str, event_s: i64, sku: &str, kind: &str, qty: i64) -> String {
    format!(
        r#"{{"event_id":"{id}","event_ts":"{}","sku":"{sku}","warehouse_id":"w1","kind":"{kind}","quantity":{qty}}}"#,
        ts(event_s)
    )
}

/// One landed file per source.
struct Files {
    orders: Vec<String>,
    clicks: Vec<String>,
    payments: Vec<String>,
    inventory: Vec<String>,
}

fn click(id: &str, event_s: i64, anon: &str) -> String {
    format!(
        r#"{{"event_id":"{id}","event_ts":"{}","anonymous_id":"{anon}","event_type":"page_view","page":"/p"}}"#,
        ts(event_s)
    )
}

/// Day 0: orders, a payment and clicks, one visitor's session running over midnight.
/// Day 4: more of each, which moves the watermark past the 3-day lookback of day 0.
fn first() -> Files {
    Files {
        orders: vec![
            order("o1", T0 + 10, "ord-1", "A", 1, 100),
            order("o2", T0 + 100, "ord-2", "B", 2, 200),
            order("o3", T0 + 3600, "ord-3", "A", 1, 100),
        ],
        payments: vec![payment("p1", T0 + 40, "ord-1", 100)],
        // X: counted 5, sold out at 12:01:40 (an alert), then restocked.
        inventory: vec![
            stock("i0", T0 - DAY, "X", "receipt", 2),
            stock("i1", T0 + 10, "X", "count", 5),
            stock("i2", T0 + 100, "X", "sale", -5),
            stock("i3", T0 + 7200, "X", "receipt", 4),
        ],
        clicks: vec![
            click("c1", T0 + 42_600, "v1"), // 23:50
            click("c2", T0 + 43_800, "v1"), // 00:10 the next day: same session
            click("c3", T0 + 45_000, "v1"),
            click("c4", T0 + 50, "v2"),
        ],
    }
}

fn day4() -> Files {
    Files {
        orders: vec![order("o4", T0 + 4 * DAY, "ord-4", "A", 1, 100)],
        payments: vec![payment("p4", T0 + 4 * DAY, "ord-4", 100)],
        // X sells out again on day 4 (a day whose replay starts at day 0's count).
        inventory: vec![
            stock("i4", T0 + 4 * DAY, "Y", "receipt", 1),
            stock("i6", T0 + 4 * DAY + 10, "X", "sale", -4),
        ],
        clicks: vec![click("c5", T0 + 4 * DAY, "v3")],
    }
}

/// Too late once day 4 has been seen (W − 3 d is past them): an order line, the
/// capture of ord-2 (30 s before its order: a fast payment), a click and a receipt of X
/// before its sale (which then leaves 3 on hand: no stock-out).
fn stragglers() -> Files {
    Files {
        orders: vec![order("o5", T0 + 20, "ord-5", "A", 5, 500)],
        payments: vec![payment("p2", T0 + 70, "ord-2", 200)],
        inventory: vec![stock("i5", T0 + 50, "X", "receipt", 3)],
        clicks: vec![click("c6", T0 + 60, "v2")],
    }
}

fn land_pair(env: &Env, k: usize, f: &Files, at: i64) {
    env.land(&format!("orders/f{k}.ndjson"), &lines(&f.orders), at);
    env.land(&format!("payments/f{k}.ndjson"), &lines(&f.payments), at);
    env.land(&format!("clickstream/f{k}.ndjson"), &lines(&f.clicks), at);
    env.land(&format!("inventory/f{k}.ndjson"), &lines(&f.inventory), at);
}

/// The live run: the stragglers arrive after day 4 and are too late for every job.
fn live() -> Env {
    let env = Env::new();
    land_pair(&env, 1, &first(), T0 + 120);
    env.run_ok(&["run"], 0);
    land_pair(&env, 2, &day4(), T0 + 4 * DAY + 60);
    env.run_ok(&["run"], 0);
    land_pair(&env, 3, &stragglers(), T0 + 4 * DAY + 120);
    env.run_ok(&["run"], 0);
    env
}

const JOBS: [&str; 7] = [
    "revenue_5m",
    "revenue_1h",
    "sessions",
    "clickstream_5m",
    "payment_reconciliation",
    "payments_fast",
    "stockout",
];
const SKIP: [&str; 3] = ["_updated_at", "_batch_id", "detected_at"];

fn gold(job: &str) -> String {
    match job {
        "stockout" => "gold/stockout_alerts".into(),
        j => format!("gold/{j}"),
    }
}

fn backfill(env: &Env, job: &str, from: &str, to: &str) -> serde_json::Value {
    let out = env.run_ok(
        &[
            "backfill", "--job", job, "--from", from, "--to", to, "--json",
        ],
        0,
    );
    serde_json::from_str(&out).unwrap()
}

fn changed(r: &serde_json::Value) -> u64 {
    r["days"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["changed"].as_u64().unwrap())
        .sum()
}

fn too_late_windows(r: &serde_json::Value) -> Vec<String> {
    r["days"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| d["with_too_late_rows"].as_array().unwrap().clone())
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn backfill_restates_too_late_rows_equals_incremental_elsewhere_and_is_idempotent() {
    let env = live();
    assert_eq!(env.count("late/revenue_5m", "SELECT count(*) FROM t"), 1);
    assert_eq!(env.count("late/sessions", "SELECT count(*) FROM t"), 1);
    // Reference: the same events where the stragglers were on time (no too-late rows):
    // what a restatement must produce.
    let clean = Env::new();
    let mut on_time = first();
    let late = stragglers();
    on_time.orders.extend(late.orders);
    on_time.payments.extend(late.payments);
    on_time.clicks.extend(late.clicks);
    on_time.inventory.extend(late.inventory);
    land_pair(&clean, 1, &on_time, T0 + 120);
    clean.run_ok(&["run"], 0);
    land_pair(&clean, 2, &day4(), T0 + 4 * DAY + 60);
    clean.run_ok(&["run"], 0);

    let before: Vec<Vec<String>> = JOBS.iter().map(|j| env.snapshot(&gold(j), &SKIP)).collect();
    let expect_late = |job: &str| -> Vec<String> {
        match job {
            "revenue_5m" => vec!["A @ 2025-11-20T12:00:00Z".to_string()],
            // A sliding 1 h window every 5 min: the straggler at 12:00:20 is in the 12
            // windows starting 11:05 … 12:00.
            "revenue_1h" => (0..12)
                .map(|k| format!("A @ 2025-11-20T{}Z", hm(T0 - 3300 + k * 300)))
                .collect(),
            "sessions" => vec!["v2 @ 2025-11-20T12:00:50Z".to_string()],
            // ord-2 is matched now (and fast); ord-5 gets its row (unmatched).
            "payment_reconciliation" => vec![
                "ord-2 @ 2025-11-20".to_string(),
                "ord-5 @ 2025-11-20".to_string(),
            ],
            "payments_fast" => vec!["ord-2 @ 2025-11-20".to_string()],
            // The receipt cancels X's alert (a deletion).
            "stockout" => vec![
                "X @ 2025-11-20T12:01:00Z".to_string(),
                "X @ 2025-11-24T12:00:00Z".to_string(),
            ],
            _ => vec!["page_view @ 2025-11-20T12:00:00Z".to_string()],
        }
    };
    for (i, job) in JOBS.iter().enumerate() {
        let r = backfill(&env, job, D0, D4);
        let mut late = too_late_windows(&r);
        late.sort();
        let mut want = expect_late(job);
        want.sort();
        assert_eq!(late, want, "{job}: {r}");
        assert_eq!(changed(&r), want.len() as u64, "{job}: {r}");
        assert_eq!(r["days"].as_array().unwrap().len(), 5);
        let t = gold(job);
        let after = env.snapshot(&t, &SKIP);
        assert_eq!(
            after,
            clean.snapshot(&t, &SKIP),
            "{job}: restated = on-time run"
        );
        // Outside the windows holding too-late rows, nothing changed: the rows that are
        // new or different are exactly those windows (none disappeared).
        let new_or_changed = after.iter().filter(|r| !before[i].contains(r)).count();
        let replaced_or_gone = before[i].iter().filter(|r| !after.contains(r)).count();
        assert_eq!(new_or_changed.max(replaced_or_gone), want.len(), "{job}");
        assert!(!after.is_empty() || *job == "stockout", "{job}");
        // Idempotent: a second run changes nothing.
        let again = backfill(&env, job, D0, D4);
        assert_eq!(changed(&again), 0, "{job}: {again}");
        assert_eq!(env.snapshot(&t, &SKIP), after, "{job}");
    }
    // Sessions are whole: day 1 alone holds no session (v1's began at 23:50 on day 0),
    // so it neither creates one at 00:10 nor deletes day 0's.
    let r = backfill(&env, "sessions", "2025-11-21", "2025-11-21");
    assert_eq!(r["days"][0]["windows"], 0);
    assert_eq!(changed(&r), 0);
    // The next live run keeps the restatement (day 0 is beyond the lookback).
    env.land(
        "orders/f4.ndjson",
        &lines(&[order("o6", T0 + 4 * DAY + 10, "ord-6", "B", 1, 100)]),
        T0 + 4 * DAY + 180,
    );
    env.run_ok(&["run", "--job", "revenue_5m"], 0);
    assert_eq!(
        env.query(
            "gold/revenue_5m",
            &format!("SELECT units FROM t WHERE sku = 'A' AND window_start = to_timestamp({T0})")
        ),
        vec![vec!["6"]]
    );
    // Before: X's two alerts; after: none (the stock-outs never happened).
    assert_eq!(before[6].len(), 2, "{:?}", before[6]);
    assert!(env.snapshot("gold/stockout_alerts", &SKIP).is_empty());
    let err = env.fails_one_line(&["backfill", "--job", "nope", "--from", D0, "--to", D0]);
    assert!(err.contains("unknown job `nope`"), "{err}");
    let err = env.fails_one_line(&[
        "backfill",
        "--job",
        "revenue_5m",
        "--from",
        "2025-13-01",
        "--to",
        D0,
    ]);
    assert!(
        err.contains("--from") && err.contains("YYYY-MM-DD"),
        "{err}"
    );
}

fn hm(s: i64) -> String {
    chrono::DateTime::from_timestamp(s, 0)
        .unwrap()
        .format("%H:%M:%S")
        .to_string()
}

/// kill -9 after the first day: the progress file stays, the same command resumes with
/// the second day and the result equals an uninterrupted backfill. A held job lease is
/// waited for; `--reingest` ingests a landed file the incremental listing skipped.
#[test]
fn backfill_resumes_after_kill_9_waits_for_the_job_lease_and_reingests() {
    let env = live();

    let args = ["backfill", "--job", "revenue_5m", "--from", D0, "--to", D4];
    let out = env.kestrel_env(&args, &[("KESTREL_FAULT", "backfill_after_day")]);
    assert_eq!(out.status.code(), None, "killed");
    let progress = env.warehouse().join("_kestrel/backfill/revenue_5m.json");
    assert!(progress.exists());
    let out = env.kestrel(&args);
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("resuming: 1 day(s) already done"), "{err}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("(done before the interruption)"),
        "{stdout}"
    );
    assert!(!progress.exists());
    assert_eq!(
        env.query(
            "gold/revenue_5m",
            &format!("SELECT units FROM t WHERE sku = 'A' AND window_start = to_timestamp({T0})")
        ),
        vec![vec!["6"]]
    );

    // A batch of revenue_1h "running" on another host for 2 more seconds: wait for it.
    let until = chrono::Utc::now() + chrono::Duration::seconds(2);
    let lease = serde_json::json!({
        "owner": "other-host:7", "host": "other-host", "pid": 7,
        "acquired_at": chrono::Utc::now().to_rfc3339(), "expires_at": until.to_rfc3339(),
    });
    std::fs::create_dir_all(env.warehouse().join("_kestrel/leases")).unwrap();
    std::fs::write(
        env.warehouse().join("_kestrel/leases/job-revenue_1h.json"),
        lease.to_string(),
    )
    .unwrap();
    let out = env.kestrel(&["backfill", "--job", "revenue_1h", "--from", D0, "--to", D0]);
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("waiting for the running batch of revenue_1h (other-host:7)"),
        "{err}"
    );
    assert!(chrono::Utc::now() >= until);

    // A file whose name sorts before those already processed: `run` does not list it,
    // `backfill --reingest` does, the job takes it (too late), and the restatement has it.
    env.land(
        "orders/a_missed.ndjson",
        &lines(&[order("m1", T0 + 30, "ord-m", "C", 2, 900)]),
        T0 + 4 * DAY + 300,
    );
    let out = env.run_ok(&["run", "--source", "orders"], 0);
    assert!(out.contains("nothing new landed"), "{out}");
    let out = env.run_ok(
        &[
            "backfill",
            "--job",
            "revenue_5m",
            "--from",
            D0,
            "--to",
            D0,
            "--reingest",
        ],
        0,
    );
    assert!(out.contains("C @ 2025-11-20T12:00:00Z"), "{out}");
    assert_eq!(
        env.count("late/revenue_5m", "SELECT count(*) FROM t WHERE sku = 'C'"),
        1
    );
    assert_eq!(
        env.query(
            "gold/revenue_5m",
            &format!("SELECT units, revenue_cents FROM t WHERE sku = 'C' AND window_start = to_timestamp({T0})")
        ),
        vec![vec!["2", "900"]]
    );
}
