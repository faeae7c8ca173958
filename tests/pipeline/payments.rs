//! Order/payment jobs driven by event time: `payment_reconciliation` statuses moving from
//! pending to matched / unmatched / mismatch as the watermark crosses each order's 3-day
//! deadline, orphan payments, corrections and too-late payments, and `payments_fast`;
//! then kill -9 at every step of the job protocol and a rerun.
//!
//! T0 = 2025-11-20T12:00:00Z. Both sources land in the same drops, so the watermark W is
//! min(max order event, max payment event) − 30 s.

use crate::common::*;

const DAY: i64 = 86_400;
const JOBS: [&str; 2] = ["payment_reconciliation", "payments_fast"];

fn pay(id: &str, event_s: i64, order_id: &str, amount: i64, status: &str) -> String {
    format!(
        r#"{{"event_id":"{id}","event_ts":"{}","payment_id":"pay-{id}","order_id":"{order_id}","amount_cents":{amount},"status":"{status}"}}"#,
        ts(event_s)
    )
}

/// An order line (one order may have several).
fn line(id: &str, event_s: i64, order_id: &str, amount: i64) -> String {
    order(id, event_s, order_id, "SKU-1", 1, amount)
}

struct Drop {
    landed: i64,
    orders: Vec<String>,
    payments: Vec<String>,
}

/// The scenario, one drop per run. Orders: A paid within a minute; B failed then captured
/// two days later; C never paid; D captured 100 short; E captured then refunded; G two
/// lines; H its capture delivered twice; I paid before its order arrived; L an earlier
/// line arrives late (it leaves `payments_fast`); M paid late (a correction); `ghost` a
/// payment without an order.
fn drops() -> Vec<Drop> {
    vec![
        // W = T0 + 970 (orders max T0 + 1000).
        Drop {
            landed: T0 + 1300,
            orders: vec![
                line("a1", T0, "A", 1000),
                line("b1", T0, "B", 2000),
                line("c1", T0, "C", 3000),
                line("d1", T0, "D", 4000),
                line("e1", T0, "E", 5000),
                line("g1", T0, "G", 600),
                line("g2", T0 + 2, "G", 400),
                line("h1", T0, "H", 800),
                line("m1", T0, "M", 3000),
                line("l1", T0 + 1000, "L", 100),
            ],
            payments: vec![
                pay("pa", T0 + 30, "A", 1000, "captured"),
                pay("pb", T0 + 20, "B", 2000, "failed"),
                pay("pd", T0 + 40, "D", 3900, "captured"),
                pay("pe", T0 + 30, "E", 5000, "captured"),
                pay("pf", T0 + 10, "ghost", 999, "captured"),
                pay("pi", T0 + 50, "I", 700, "captured"),
                pay("pg", T0 + 100, "G", 1000, "captured"),
                pay("ph", T0 + 30, "H", 800, "captured"),
                pay("pl", T0 + 1200, "L", 100, "captured"),
            ],
        },
        // W = T0 + 2d − 30.
        Drop {
            landed: T0 + 2 * DAY + 100,
            orders: vec![
                line("i1", T0 + 45, "I", 700),
                line("l0", T0 + 800, "L", 50),
                line("j1", T0 + 2 * DAY, "J", 100),
            ],
            payments: vec![
                pay("ph", T0 + 30, "H", 800, "captured"),
                pay("pe2", T0 + DAY, "E", 5000, "refunded"),
                pay("pb2", T0 + 2 * DAY, "B", 2000, "captured"),
            ],
        },
        // W = T0 + 3d + 970: the deadlines of every order at or before T0 + 970 pass.
        Drop {
            landed: T0 + 3 * DAY + 1100,
            orders: vec![line("k1", T0 + 3 * DAY + 1000, "K", 100)],
            payments: vec![pay("pk", T0 + 3 * DAY + 1000, "K", 100, "captured")],
        },
        // W unchanged; cut-off W − 3d = T0 + 970. pm (T0 + 2d + 500) is late but inside
        // the lookback: M turns matched. pd2 (T0 + 500) is beyond it: late ledger only.
        Drop {
            landed: T0 + 3 * DAY + 1200,
            orders: vec![],
            payments: vec![
                pay("pm", T0 + 2 * DAY + 500, "M", 3000, "captured"),
                pay("pd2", T0 + 500, "D", 100, "captured"),
            ],
        },
    ]
}

fn land(env: &Env, k: usize, d: &Drop) {
    if !d.orders.is_empty() {
        env.land(
            &format!("orders/f{k:03}.ndjson"),
            &lines(&d.orders),
            d.landed,
        );
    }
    if !d.payments.is_empty() {
        env.land(
            &format!("payments/f{k:03}.ndjson"),
            &lines(&d.payments),
            d.landed,
        );
    }
}

fn run(env: &Env) -> String {
    env.run_ok(
        &[
            "run",
            "--job",
            "payment_reconciliation",
            "--job",
            "payments_fast",
        ],
        0,
    )
}

/// `order_id status captured amount is_final` per row of the reconciliation table.
fn recon(env: &Env) -> Vec<String> {
    env.query(
        "gold/payment_reconciliation",
        "SELECT order_id, status, captured_cents, amount_cents, is_final FROM t ORDER BY order_id",
    )
    .into_iter()
    .map(|r| r.join(" "))
    .collect()
}

/// `order_id lag_s amount` per row of the fast table.
fn fast(env: &Env) -> Vec<String> {
    env.query(
        "gold/payments_fast",
        "SELECT order_id, lag_s, amount_cents, to_unixtime(order_ts), to_unixtime(first_capture_ts) FROM t ORDER BY order_id",
    )
    .into_iter()
    .map(|r| r.join(" "))
    .collect()
}

fn job_counts(env: &Env, job: &str, batch: i64) -> Vec<String> {
    env.query(
        "_kestrel/runs",
        &format!(
            "SELECT rows_in, rows_applied, too_late, windows_recomputed, windows_deleted, corrections, to_unixtime(watermark) FROM t WHERE kind = 'job' AND name = '{job}' AND batch_id = {batch}"
        ),
    )
    .remove(0)
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn statuses_follow_the_watermark_through_the_business_window() {
    let env = Env::new();
    let d = drops();

    // Run 1: nothing is final; B (only a failed attempt), C (nothing), D (short) are
    // pending; no row for the ghost payment (deadline not reached) nor for I (no order).
    land(&env, 1, &d[0]);
    run(&env);
    assert_eq!(
        recon(&env),
        strs(&[
            "A matched 1000 1000 false",
            "B pending 0 2000 false",
            "C pending 0 3000 false",
            "D pending 3900 4000 false",
            "E matched 5000 5000 false",
            "G matched 1000 1000 false",
            "H matched 800 800 false",
            "L matched 100 100 false",
            "M pending 0 3000 false",
        ]),
        "after run 1"
    );
    let f = |id: &str, lag: f64, amount: i64, o: i64, c: i64| -> String {
        format!("{id} {lag:?} {amount} {} {}", T0 + o, T0 + c)
    };
    assert_eq!(
        fast(&env),
        vec![
            f("A", 30.0, 1000, 0, 30),
            f("D", 40.0, 4000, 0, 40),
            f("E", 30.0, 5000, 0, 30),
            f("G", 100.0, 1000, 0, 100),
            f("H", 30.0, 800, 0, 30),
            f("L", 200.0, 100, 1000, 1200),
        ],
        "payments_fast after run 1"
    );
    let w1 = (T0 + 970).to_string();
    // 10 order lines + 9 payments in; 11 orders re-evaluated (9 with lines, ghost, I).
    assert_eq!(
        job_counts(&env, "payment_reconciliation", 1),
        strs(&["19", "19", "0", "9", "0", "0", &w1])
    );

    // Run 2: B's capture two days after its failed attempt matches it; E's refund leaves
    // nothing captured; I's order arrives after its payment; H's redelivered capture is
    // counted once; L's earlier line moves order_ts to T0 + 800 (lag 400 s: out of
    // payments_fast) and its amount to 150.
    land(&env, 2, &d[1]);
    run(&env);
    assert_eq!(
        recon(&env),
        strs(&[
            "A matched 1000 1000 false",
            "B matched 2000 2000 false",
            "C pending 0 3000 false",
            "D pending 3900 4000 false",
            "E pending 0 5000 false",
            "G matched 1000 1000 false",
            "H matched 800 800 false",
            "I matched 700 700 false",
            "J pending 0 100 false",
            "L pending 100 150 false",
            "M pending 0 3000 false",
        ]),
        "after run 2"
    );
    assert_eq!(
        fast(&env),
        vec![
            f("A", 30.0, 1000, 0, 30),
            f("D", 40.0, 4000, 0, 40),
            f("E", 30.0, 5000, 0, 30),
            f("G", 100.0, 1000, 0, 100),
            f("H", 30.0, 800, 0, 30),
            f("I", 5.0, 700, 45, 50),
        ],
        "payments_fast after run 2"
    );
    assert_eq!(
        env.count(
            "bronze/payments",
            "SELECT count(*) FROM t WHERE event_id = 'ph'"
        ),
        1,
        "the redelivered capture is in bronze once"
    );
    let fast2 = job_counts(&env, "payments_fast", 2);
    assert_eq!(
        fast2[4], "1",
        "L's row deleted from payments_fast: {fast2:?}"
    );

    // Run 3: W passes T0 + 3d + 970: every order at or before T0 + 970 is final; C was
    // never paid (unmatched), D and L are short (mismatch), E was refunded (unmatched);
    // the ghost payment's deadline passed: an orphan_payment row.
    land(&env, 3, &d[2]);
    run(&env);
    assert_eq!(
        recon(&env),
        strs(&[
            "A matched 1000 1000 true",
            "B matched 2000 2000 true",
            "C unmatched 0 3000 true",
            "D mismatch 3900 4000 true",
            "E unmatched 0 5000 true",
            "G matched 1000 1000 true",
            "H matched 800 800 true",
            "I matched 700 700 true",
            "J pending 0 100 false",
            "K matched 100 100 false",
            "L mismatch 100 150 true",
            "M unmatched 0 3000 true",
            "ghost orphan_payment 999 ∅ true",
        ]),
        "after run 3"
    );
    assert_eq!(
        env.query(
            "gold/payment_reconciliation",
            "SELECT order_ts IS NULL, to_unixtime(first_capture_ts), CAST(order_date AS VARCHAR) FROM t WHERE order_id = 'ghost'"
        ),
        vec![strs(&["true", &(T0 + 10).to_string(), "2025-11-20"])]
    );
    // Hourly cost stays bounded: run 3 re-evaluated the deadline crossings and K only.
    let c3 = job_counts(&env, "payment_reconciliation", 3);
    assert_eq!(c3[3], "12", "{c3:?}");

    // Run 4: M's capture (inside the lookback) corrects a final row; D's extra capture is
    // beyond the lookback: counted, written to late/payment_reconciliation, D unchanged.
    land(&env, 4, &d[3]);
    run(&env);
    let r = recon(&env);
    assert!(r.contains(&"M matched 3000 3000 true".to_string()), "{r:?}");
    assert!(
        r.contains(&"D mismatch 3900 4000 true".to_string()),
        "{r:?}"
    );
    let c4 = job_counts(&env, "payment_reconciliation", 4);
    let w3 = (T0 + 3 * DAY + 970).to_string();
    assert_eq!(c4, strs(&["2", "1", "1", "1", "0", "1", &w3]));
    let late = env.query(
        "late/payment_reconciliation",
        "SELECT _source, event_id, order_id, to_unixtime(_watermark), _reason FROM t",
    );
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0][..4], strs(&["payments", "pd2", "D", &w3]));
    assert!(late[0][4].contains("lookback"), "{late:?}");
    // The late ledger has both sources' columns: an order line's would fit as well.
    let cols = env.query(
        "late/payment_reconciliation",
        "SELECT sku IS NULL, status FROM t",
    );
    assert_eq!(cols, vec![strs(&["true", "captured"])]);
    // A further run with nothing new commits nothing.
    let v = env.version("gold/payment_reconciliation");
    run(&env);
    assert_eq!(env.version("gold/payment_reconciliation"), v);
}

/// Restart mid-window: kill -9 at each step of the job protocol (crash between compute
/// and commit among them), rotated over the jobs and the drops, then rerun: the tables
/// and the run log equal a clean run's.
#[test]
fn kill_9_between_compute_and_commit_then_rerun_gives_identical_tables() {
    const POINTS: [&str; 5] = [
        "job_after_plan",
        "job_after_compute",
        "job_after_late",
        "job_after_gold",
        "job_after_runlog",
    ];
    let clean = Env::new();
    let env = Env::new();
    for (k, d) in drops().iter().enumerate() {
        land(&clean, k + 1, d);
        run(&clean);
        land(&env, k + 1, d);
        for (j, job) in JOBS.iter().enumerate() {
            let point = POINTS[(2 * k + j) % POINTS.len()];
            env.killed_at(&["run", "--job", job], point);
        }
        run(&env);
    }
    let skip = ["_updated_at", "_recorded_at", "_ingested_at"];
    env.assert_same_tables(
        &clean,
        &[
            "gold/payment_reconciliation",
            "gold/payments_fast",
            "late/payment_reconciliation",
        ],
        &skip,
    );
    let runs = "SELECT name, batch_id, rows_in, rows_written, rows_applied, too_late, windows_recomputed, windows_deleted, corrections, to_unixtime(watermark) FROM t WHERE kind = 'job' ORDER BY name, batch_id";
    assert_eq!(
        env.query("_kestrel/runs", runs),
        clean.query("_kestrel/runs", runs)
    );
}
