//! Windowed aggregate jobs driven by event time: the five streaming cases for each of the
//! four shipped jobs (clickstream_5m, sessions, revenue_5m, revenue_1h), idleness,
//! equivalence of replay and one-shot runs.
//!
//! Each test lands files with chosen event times and arrival times, runs `kestrel run`,
//! and compares every gold table with an independent oracle: a few lines of plain Rust
//! that compute the expected windows, sessions and `is_final` flags from the events the
//! job should have applied and the watermark it should have reached.

use std::collections::BTreeMap;

use crate::common::*;

const DAY: i64 = 86_400;

#[derive(Clone)]
struct O {
    id: String,
    ts: i64,
    sku: &'static str,
    qty: i64,
    amount: i64,
}

#[derive(Clone)]
struct C {
    id: String,
    ts: i64,
    anon: &'static str,
    typ: &'static str,
}

fn o(id: &str, ts: i64, sku: &'static str, qty: i64, amount: i64) -> O {
    O {
        id: id.into(),
        ts,
        sku,
        qty,
        amount,
    }
}

fn c(id: &str, ts: i64, anon: &'static str, typ: &'static str) -> C {
    C {
        id: id.into(),
        ts,
        anon,
        typ,
    }
}

/// One landed file per source (either may be empty), arriving at `landed`.
#[derive(Clone)]
struct Drop {
    landed: i64,
    orders: Vec<O>,
    clicks: Vec<C>,
}

fn click_line(e: &C) -> String {
    format!(
        r#"{{"event_id":"{}","event_ts":"{}","anonymous_id":"{}","event_type":"{}","page":"/p"}}"#,
        e.id,
        ts(e.ts),
        e.anon,
        e.typ
    )
}

fn land(env: &Env, k: usize, d: &Drop) {
    if !d.orders.is_empty() {
        let ls: Vec<String> = d
            .orders
            .iter()
            .map(|e| {
                order(
                    &e.id,
                    e.ts,
                    &format!("ord-{}", e.id),
                    e.sku,
                    e.qty,
                    e.amount,
                )
            })
            .collect();
        env.land(&format!("orders/f{k:03}.ndjson"), &lines(&ls), d.landed);
    }
    if !d.clicks.is_empty() {
        let ls: Vec<String> = d.clicks.iter().map(click_line).collect();
        env.land(
            &format!("clickstream/f{k:03}.ndjson"),
            &lines(&ls),
            d.landed,
        );
    }
}

// The scenario, T0 = 2025-11-20T12:00:00Z (aligned to 5 minutes and to the hour).
fn f1() -> Drop {
    Drop {
        landed: T0 + 320,
        orders: vec![
            o("o1", T0 + 10, "A", 1, 100),
            o("o2", T0 + 70, "A", 2, 200),
            o("o3", T0 + 310, "B", 1, 150),
        ],
        clicks: vec![
            c("c1", T0 + 10, "u1", "page_view"),
            c("c2", T0 + 70, "u1", "add_to_cart"),
            c("c3", T0 + 310, "u2", "page_view"),
        ],
    }
}
/// Moves the watermark to T0 + 3970: every window and session of f1 turns final.
fn f2() -> Drop {
    Drop {
        landed: T0 + 4010,
        orders: vec![o("o4", T0 + 4000, "A", 1, 100)],
        clicks: vec![c("c4", T0 + 4000, "u1", "page_view")],
    }
}
/// Late but within the lookback: corrects final windows; c5 extends u1's final session.
fn late1() -> Drop {
    Drop {
        landed: T0 + 4100,
        orders: vec![o("o5", T0 + 20, "A", 1, 100)],
        clicks: vec![c("c5", T0 + 1500, "u1", "page_view")],
    }
}
/// c6 bridges u1's sessions [T0+10, T0+1500] and [T0+4000]: they merge into one.
fn late2() -> Drop {
    Drop {
        landed: T0 + 4150,
        orders: vec![],
        clicks: vec![c("c6", T0 + 2700, "u1", "page_view")],
    }
}
/// W = T0 + 3970, lookback 3 days: cut-off T0 − 255 230 s. o6/c7 are days too late; o7
/// is 20 s too late and shares its 5-minute window with o8, which is applied: the
/// recompute of that window must leave o7 out.
fn too_late() -> Drop {
    Drop {
        landed: T0 + 4200,
        orders: vec![
            o("o6", T0 - 4 * DAY, "A", 5, 500),
            o("o7", T0 - 255_250, "A", 7, 700),
            o("o8", T0 - 255_100, "A", 1, 100),
        ],
        clicks: vec![c("c7", T0 - 4 * DAY, "u9", "page_view")],
    }
}

const W1: i64 = T0 + 280;
const W2: i64 = T0 + 3970;

// ---- the oracle ----------------------------------------------------------------------

type Rows = Vec<Vec<String>>;

fn revenue(orders: &[O], size: i64, slide: i64, w: i64) -> Rows {
    let mut m: BTreeMap<(String, i64), (i64, i64, i64)> = BTreeMap::new();
    for e in orders {
        let last = e.ts.div_euclid(slide) * slide;
        for k in 0..size / slide {
            let a = m.entry((e.sku.to_string(), last - k * slide)).or_default();
            a.0 += 1;
            a.1 += e.qty;
            a.2 += e.amount;
        }
    }
    m.into_iter()
        .map(|((sku, s), (n, u, r))| {
            vec![
                sku,
                s.to_string(),
                (s + size).to_string(),
                n.to_string(),
                u.to_string(),
                r.to_string(),
                (s + size <= w).to_string(),
            ]
        })
        .collect()
}

fn clickstream(clicks: &[C], w: i64) -> Rows {
    let mut m: BTreeMap<(String, i64), Vec<&str>> = BTreeMap::new();
    for e in clicks {
        m.entry((e.typ.to_string(), e.ts.div_euclid(300) * 300))
            .or_default()
            .push(e.anon);
    }
    m.into_iter()
        .map(|((t, s), mut anons)| {
            let n = anons.len();
            anons.sort();
            anons.dedup();
            vec![
                t,
                s.to_string(),
                (s + 300).to_string(),
                n.to_string(),
                anons.len().to_string(),
                (s + 300 <= w).to_string(),
            ]
        })
        .collect()
}

fn sessions(clicks: &[C], w: i64) -> Rows {
    let mut per: BTreeMap<&str, Vec<&C>> = BTreeMap::new();
    for e in clicks {
        per.entry(e.anon).or_default().push(e);
    }
    let mut out = Vec::new();
    for (anon, mut es) in per {
        es.sort_by_key(|e| e.ts);
        let mut cur: Vec<&C> = Vec::new();
        let mut flush = |cur: &mut Vec<&C>| {
            if let (Some(f), Some(l)) = (cur.first(), cur.last()) {
                let pv = cur.iter().filter(|e| e.typ == "page_view").count();
                out.push(vec![
                    anon.to_string(),
                    f.ts.to_string(),
                    l.ts.to_string(),
                    cur.len().to_string(),
                    pv.to_string(),
                    (l.ts + 1800 <= w).to_string(),
                ]);
            }
            cur.clear();
        };
        for e in es {
            if cur.last().is_some_and(|l| e.ts - l.ts >= 1800) {
                flush(&mut cur);
            }
            cur.push(e);
        }
        flush(&mut cur);
    }
    out
}

const Q_REVENUE: &str = "SELECT sku, to_unixtime(window_start), to_unixtime(window_end), orders, units, revenue_cents, is_final FROM t ORDER BY sku, window_start";
const Q_CLICKS: &str = "SELECT event_type, to_unixtime(window_start), to_unixtime(window_end), events, visitors, is_final FROM t ORDER BY event_type, window_start";
const Q_SESSIONS: &str = "SELECT anonymous_id, to_unixtime(session_start), to_unixtime(session_end), events, page_views, is_final FROM t ORDER BY anonymous_id, session_start";

fn sorted(mut r: Rows) -> Rows {
    r.sort_by(|a, b| {
        (&a[0], a[1].parse::<i64>().unwrap()).cmp(&(&b[0], b[1].parse::<i64>().unwrap()))
    });
    r
}

fn gold(env: &Env, job: &str, q: &str) -> Rows {
    if env.version(&format!("gold/{job}")).is_none() {
        return Vec::new();
    }
    sorted(env.query(&format!("gold/{job}"), q))
}

/// Every gold table equals the oracle over the applied events at watermark `w`.
fn check_gold(env: &Env, orders: &[O], clicks: &[C], w: i64) {
    assert_eq!(
        gold(env, "revenue_5m", Q_REVENUE),
        sorted(revenue(orders, 300, 300, w)),
        "revenue_5m"
    );
    assert_eq!(
        gold(env, "revenue_1h", Q_REVENUE),
        sorted(revenue(orders, 3600, 300, w)),
        "revenue_1h"
    );
    assert_eq!(
        gold(env, "clickstream_5m", Q_CLICKS),
        sorted(clickstream(clicks, w)),
        "clickstream_5m"
    );
    assert_eq!(
        gold(env, "sessions", Q_SESSIONS),
        sorted(sessions(clicks, w)),
        "sessions"
    );
    // State as data: the sessions open at W are a table of their own.
    let open: Rows = sessions(clicks, w)
        .into_iter()
        .filter(|r| r[5] == "false")
        .map(|mut r| {
            r[5] = w.to_string();
            r
        })
        .collect();
    assert_eq!(
        gold(env, "sessions_open", Q_OPEN),
        sorted(open),
        "sessions_open"
    );
}

const Q_OPEN: &str = "SELECT anonymous_id, to_unixtime(session_start), to_unixtime(session_end), events, page_views, to_unixtime(watermark) FROM t ORDER BY anonymous_id, session_start";

fn all_of(drops: &[Drop]) -> (Vec<O>, Vec<C>) {
    let mut os = Vec::new();
    let mut cs = Vec::new();
    for d in drops {
        os.extend(d.orders.iter().cloned());
        cs.extend(d.clicks.iter().cloned());
    }
    (os, cs)
}

const JOBS: [&str; 4] = ["clickstream_5m", "revenue_1h", "revenue_5m", "sessions"];

/// Run-log counters of a job's last batch: (too_late, corrections, windows_deleted).
fn last_counts(env: &Env, job: &str) -> (i64, i64, i64) {
    let r = env.query(
        "_kestrel/runs",
        &format!(
            "SELECT too_late, corrections, windows_deleted FROM t WHERE kind = 'job' AND name = '{job}' ORDER BY batch_id DESC LIMIT 1"
        ),
    );
    let p = |s: &str| s.parse::<i64>().unwrap();
    (p(&r[0][0]), p(&r[0][1]), p(&r[0][2]))
}

fn sum_counter(env: &Env, job: &str, col: &str) -> i64 {
    env.count(
        "_kestrel/runs",
        &format!("SELECT coalesce(sum({col}), 0) FROM t WHERE kind = 'job' AND name = '{job}'"),
    )
}

fn run(env: &Env) -> String {
    env.run_ok(&["run"], 0)
}

// ---- the five cases -------------------------------------------------------------------

/// Case 1, in order: windows fill, then turn final once the watermark passes their end —
/// also windows no new event touched in that batch. A second run changes nothing.
#[test]
fn in_order_events_fill_windows_and_finalise_them() {
    let env = Env::new();
    land(&env, 1, &f1());
    let out = run(&env);
    for j in JOBS {
        assert!(out.contains(j), "summary names {j}: {out}");
    }
    let (os, cs) = all_of(&[f1()]);
    check_gold(&env, &os, &cs, W1);
    land(&env, 2, &f2());
    run(&env);
    let (os, cs) = all_of(&[f1(), f2()]);
    check_gold(&env, &os, &cs, W2);
    for j in JOBS {
        assert_eq!(sum_counter(&env, j, "corrections"), 0, "{j}");
        assert_eq!(sum_counter(&env, j, "too_late"), 0, "{j}");
    }
    // Nothing new: no table gains a version.
    let before: Vec<_> = JOBS
        .iter()
        .map(|j| env.version(&format!("gold/{j}")))
        .chain([env.version("_kestrel/runs")])
        .collect();
    run(&env);
    let after: Vec<_> = JOBS
        .iter()
        .map(|j| env.version(&format!("gold/{j}")))
        .chain([env.version("_kestrel/runs")])
        .collect();
    assert_eq!(before, after, "a run with nothing new commits nothing");
}

/// Case 2, out of order within the delay: the same events in another order and split
/// across files give the same gold tables, with no corrections.
#[test]
fn out_of_order_within_the_delay_gives_the_same_answer() {
    let in_order = Env::new();
    land(&in_order, 1, &f1());
    run(&in_order);
    land(&in_order, 2, &f2());
    run(&in_order);

    let env = Env::new();
    let base = f1();
    let a = Drop {
        landed: T0 + 320,
        orders: vec![base.orders[2].clone(), base.orders[0].clone()],
        clicks: vec![base.clicks[2].clone(), base.clicks[0].clone()],
    };
    let b = Drop {
        landed: T0 + 330,
        orders: vec![base.orders[1].clone()],
        clicks: vec![base.clicks[1].clone()],
    };
    land(&env, 1, &a);
    run(&env);
    land(&env, 2, &b);
    run(&env);
    land(&env, 3, &f2());
    run(&env);
    let (os, cs) = all_of(&[f1(), f2()]);
    check_gold(&env, &os, &cs, W2);
    for j in JOBS {
        assert_eq!(sum_counter(&env, j, "corrections"), 0, "{j}");
        let t = format!("gold/{j}");
        let skip = ["_updated_at", "_batch_id"];
        assert_eq!(env.snapshot(&t, &skip), in_order.snapshot(&t, &skip), "{j}");
    }
}

/// Case 3, late within the lookback: final windows are recomputed (is_final kept) and
/// the corrections are counted; a late click that bridges two sessions merges them and
/// the stale session row is deleted in the same commit.
#[test]
fn late_within_lookback_corrects_final_windows_and_merges_sessions() {
    let env = Env::new();
    for (k, d) in [f1(), f2(), late1()].iter().enumerate() {
        land(&env, k + 1, d);
        run(&env);
    }
    let (os, cs) = all_of(&[f1(), f2(), late1()]);
    check_gold(&env, &os, &cs, W2);
    // o5 lands in A's final [T0, T0+5m) window; in 12 final sliding hours; c5 in a new,
    // already final click window and in u1's final first session (still final after).
    assert_eq!(last_counts(&env, "revenue_5m"), (0, 1, 0));
    assert_eq!(last_counts(&env, "revenue_1h"), (0, 12, 0));
    assert_eq!(last_counts(&env, "clickstream_5m"), (0, 1, 0));
    assert_eq!(last_counts(&env, "sessions"), (0, 1, 0));
    let a = env.query(
        "gold/revenue_5m",
        &format!(
            "SELECT orders, is_final FROM t WHERE sku = 'A' AND to_unixtime(window_start) = {T0}"
        ),
    );
    assert_eq!(a, vec![vec!["3".to_string(), "true".to_string()]]);

    land(&env, 4, &late2());
    run(&env);
    let (os, cs) = all_of(&[f1(), f2(), late1(), late2()]);
    check_gold(&env, &os, &cs, W2);
    let u1 = env.query(
        "gold/sessions",
        "SELECT to_unixtime(session_start), to_unixtime(session_end), events FROM t WHERE anonymous_id = 'u1'",
    );
    assert_eq!(
        u1,
        vec![vec![
            (T0 + 10).to_string(),
            (T0 + 4000).to_string(),
            "5".to_string()
        ]],
        "one merged session"
    );
    assert_eq!(
        last_counts(&env, "sessions"),
        (0, 1, 1),
        "one stale session deleted"
    );
}

/// Case 4, late beyond the lookback: not in gold, a row in late/<job> with the watermark
/// and the reason, and the counter incremented. A too-late row sharing a window with an
/// applied one stays out of that window's recompute. With `late_policy = "drop"` the row
/// is only counted.
#[test]
fn too_late_events_go_to_the_late_ledger_and_are_counted() {
    let env = Env::new();
    let drop_job = include_str!("../../jobs/revenue_5m.toml")
        .replace("name = \"revenue_5m\"", "name = \"revenue_drop\"")
        .replace("late_policy = \"side_output\"", "late_policy = \"drop\"");
    std::fs::create_dir_all(env.path().join("jobs")).unwrap();
    std::fs::write(env.path().join("jobs/revenue_drop.toml"), drop_job).unwrap();
    for (k, d) in [f1(), f2(), too_late()].iter().enumerate() {
        land(&env, k + 1, d);
        run(&env);
    }
    let (mut os, cs) = all_of(&[f1(), f2()]);
    os.push(too_late().orders[2].clone()); // o8 is applied
    check_gold(&env, &os, &cs, W2);
    assert_eq!(last_counts(&env, "revenue_5m"), (2, 1, 0));
    assert_eq!(last_counts(&env, "revenue_1h").0, 2);
    assert_eq!(last_counts(&env, "clickstream_5m").0, 1);
    assert_eq!(last_counts(&env, "sessions").0, 1);
    assert_eq!(last_counts(&env, "revenue_drop").0, 2, "drop still counts");
    assert_eq!(
        env.version("late/revenue_drop"),
        None,
        "drop writes no late rows"
    );
    let late = env.query(
        "late/revenue_5m",
        "SELECT event_id, to_unixtime(_watermark), _reason FROM t ORDER BY event_id",
    );
    assert_eq!(late.len(), 2);
    assert_eq!(late[0][0], "o6");
    assert_eq!(late[1][0], "o7");
    assert_eq!(late[0][1], W2.to_string());
    assert!(late[0][2].contains("lookback"), "{late:?}");
    let s = env.query("late/sessions", "SELECT event_id, anonymous_id FROM t");
    assert_eq!(s, vec![vec!["c7".to_string(), "u9".to_string()]]);
    // Bronze keeps every event.
    assert_eq!(env.count("bronze/orders", "SELECT count(*) FROM t"), 7);
}

/// Case 5, restart mid-window: kill -9 at every step of the job protocol (between compute
/// and commit among them), rerun, and the tables equal a clean run's.
#[test]
fn kill_9_at_every_job_step_then_rerun_gives_identical_tables() {
    let drops = [f1(), f2(), late1(), late2(), too_late()];
    let clean = Env::new();
    for (k, d) in drops.iter().enumerate() {
        land(&clean, k + 1, d);
        run(&clean);
    }
    const POINTS: [&str; 5] = [
        "job_after_plan",
        "job_after_compute",
        "job_after_late",
        "job_after_gold",
        "job_after_runlog",
    ];
    let env = Env::new();
    for (k, d) in drops.iter().enumerate() {
        land(&env, k + 1, d);
        for (j, job) in JOBS.iter().enumerate() {
            let has_input = if job.starts_with("revenue") {
                !d.orders.is_empty()
            } else {
                !d.clicks.is_empty()
            };
            if !has_input {
                continue;
            }
            let point = POINTS[(k + j) % POINTS.len()];
            env.killed_at(&["run", "--job", job], point);
        }
        run(&env);
    }
    let (os, cs) = all_of(&drops[..4]);
    let mut os = os;
    os.push(too_late().orders[2].clone());
    check_gold(&env, &os, &cs, W2);
    let skip = ["_updated_at", "_recorded_at", "_ingested_at"];
    for j in JOBS {
        for t in [format!("gold/{j}"), format!("late/{j}")] {
            assert_eq!(env.snapshot(&t, &skip), clean.snapshot(&t, &skip), "{t}");
        }
    }
    let runs = "SELECT name, batch_id, rows_in, rows_written, rows_applied, too_late, windows_recomputed, windows_deleted, corrections, to_unixtime(watermark) FROM t WHERE kind = 'job' ORDER BY name, batch_id";
    assert_eq!(
        env.query("_kestrel/runs", runs),
        clean.query("_kestrel/runs", runs)
    );
}

// ---- idleness -------------------------------------------------------------------------

/// Partition 1 delivers once and goes quiet: after `idle_timeout` (5 min of arrival time)
/// it no longer holds the watermark back, and windows turn final. The same job with an
/// idle timeout too long to matter stalls: nothing is ever final.
#[test]
fn an_idle_partition_does_not_stall_finalisation() {
    let env = Env::new();
    let stalled = include_str!("../../jobs/revenue_5m.toml")
        .replace("name = \"revenue_5m\"", "name = \"revenue_noidle\"")
        .replace("idle_timeout = \"5m\"", "idle_timeout = \"1000d\"");
    std::fs::create_dir_all(env.path().join("jobs")).unwrap();
    std::fs::write(env.path().join("jobs/revenue_noidle.toml"), stalled).unwrap();
    let quiet = o("p1", T0 + 10, "A", 1, 100);
    env.land(
        "orders/partition=1/a.ndjson",
        &lines(&[order(&quiet.id, quiet.ts, "x", quiet.sku, 1, 100)]),
        T0 + 20,
    );
    run(&env);
    let mut os = vec![quiet];
    for (i, t) in [100, 400, 700].into_iter().enumerate() {
        let e = o(&format!("p0-{i}"), T0 + t, "B", 1, 10);
        env.land(
            &format!("orders/partition=0/{i}.ndjson"),
            &lines(&[order(&e.id, e.ts, "y", e.sku, 1, 10)]),
            T0 + t + 10,
        );
        os.push(e);
        run(&env);
    }
    let w = T0 + 700 - 30;
    assert_eq!(
        gold(&env, "revenue_5m", Q_REVENUE),
        sorted(revenue(&os, 300, 300, w))
    );
    let finals = env.count("gold/revenue_5m", "SELECT count(*) FROM t WHERE is_final");
    assert_eq!(finals, 3, "A@T0, B@T0, B@T0+5m are final");
    // Without the idleness rule the quiet partition pins W at T0 + 10 − 30 s.
    assert_eq!(
        env.count(
            "gold/revenue_noidle",
            "SELECT count(*) FROM t WHERE is_final"
        ),
        0,
        "stalled watermark: nothing final"
    );
    assert_eq!(
        gold(&env, "revenue_noidle", Q_REVENUE),
        sorted(revenue(&os, 300, 300, T0 + 10 - 30))
    );
}

// ---- equivalence ----------------------------------------------------------------------

/// A demo landing zone replayed one arrival bucket (15 minutes) at a time gives the same
/// gold tables as everything in one batch; a further run with nothing new commits nothing.
#[test]
fn replay_by_arrival_bucket_equals_one_batch() {
    let once = Env::new();
    once.run_ok(&["demo", "--hours", "1"], 0);
    run(&once);

    let replay = Env::new();
    let mut files: Vec<(i64, std::path::PathBuf)> = Vec::new();
    collect_files(&once.landing(), &mut files);
    let first = files.iter().map(|f| f.0).min().unwrap();
    let last = files.iter().map(|f| f.0).max().unwrap();
    let mut bucket_end = first - first.rem_euclid(900) + 900;
    let mut runs = 0;
    while bucket_end <= last + 900 {
        for (mtime, p) in files
            .iter()
            .filter(|f| f.0 < bucket_end && f.0 >= bucket_end - 900)
        {
            let rel = p.strip_prefix(once.landing()).unwrap();
            let body = std::fs::read(p).unwrap();
            replay.land(rel.to_str().unwrap(), &body, *mtime);
        }
        run(&replay);
        runs += 1;
        bucket_end += 900;
    }
    assert!(runs >= 4, "{runs} buckets");
    let skip = ["_updated_at", "_batch_id"];
    for j in JOBS {
        let t = format!("gold/{j}");
        let a = once.snapshot(&t, &skip);
        assert!(a.len() > 10, "{t}");
        assert_eq!(sum_counter(&replay, j, "too_late"), 0, "{j}");
        let b = replay.snapshot(&t, &skip);
        assert_eq!(a.len(), b.len(), "{t}: row count");
        assert_eq!(a, b, "{t}");
        assert!(sum_counter(&replay, j, "corrections") >= sum_counter(&once, j, "corrections"));
    }
    let v: Vec<_> = JOBS
        .iter()
        .map(|j| once.version(&format!("gold/{j}")))
        .collect();
    run(&once);
    let v2: Vec<_> = JOBS
        .iter()
        .map(|j| once.version(&format!("gold/{j}")))
        .collect();
    assert_eq!(v, v2, "nothing new: no new Delta version");
}

fn collect_files(dir: &std::path::Path, out: &mut Vec<(i64, std::path::PathBuf)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            collect_files(&p, out);
        } else {
            let m = std::fs::metadata(&p).unwrap().modified().unwrap();
            let s = m.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
            out.push((s, p));
        }
    }
}

// ---- user-defined jobs ----------------------------------------------------------------

/// A user job keyed by two columns, one of them nullable (`page`): null keys are one
/// group, and a second batch into the same windows updates those rows (the MERGE matches
/// null keys with IS NOT DISTINCT FROM) instead of inserting duplicates.
#[test]
fn a_user_job_with_a_nullable_composite_key_merges_null_keys() {
    let env = Env::new();
    std::fs::create_dir_all(env.path().join("jobs")).unwrap();
    std::fs::write(
        env.path().join("jobs/pages_5m.toml"),
        r#"name = "pages_5m"
schedule = "0 */5 * * * *"
sources = ["clickstream"]
keys = ["event_type", "page"]

[window]
kind = "tumbling"
size = "5m"

[aggregates]
events = "count(*)"
visitors = "count(DISTINCT anonymous_id)"
"#,
    )
    .unwrap();
    let line = |id: &str, t: i64, anon: &str, page: Option<&str>| {
        let page = page.map_or("null".to_string(), |p| format!("\"{p}\""));
        format!(
            r#"{{"event_id":"{id}","event_ts":"{}","anonymous_id":"{anon}","event_type":"page_view","page":{page}}}"#,
            ts(t)
        )
    };
    env.land(
        "clickstream/a.ndjson",
        &lines(&[
            line("k1", T0 + 10, "u1", None),
            line("k2", T0 + 20, "u2", Some("/a")),
            line("k3", T0 + 30, "u3", None),
        ]),
        T0 + 40,
    );
    env.run_ok(&["run", "--job", "pages_5m"], 0);
    env.land(
        "clickstream/b.ndjson",
        &lines(&[
            line("k4", T0 + 50, "u1", None),
            line("k5", T0 + 60, "u4", Some("/a")),
            line("k6", T0 + 400, "u4", None),
        ]),
        T0 + 410,
    );
    env.run_ok(&["run", "--job", "pages_5m"], 0);
    let got = env.query(
        "gold/pages_5m",
        "SELECT coalesce(page, '∅'), to_unixtime(window_start), events, visitors, is_final FROM t ORDER BY 2, 1",
    );
    let row = |p: &str, s: i64, e: i64, v: i64, f: bool| {
        vec![
            p.to_string(),
            s.to_string(),
            e.to_string(),
            v.to_string(),
            f.to_string(),
        ]
    };
    assert_eq!(
        got,
        vec![
            row("/a", T0, 2, 2, true),
            row("∅", T0, 3, 2, true),
            row("∅", T0 + 300, 1, 1, false),
        ]
    );
}

/// Processing time is passed in: with a fixed clock, bronze's `_ingested_at` and gold's
/// `_updated_at` are exactly that clock, and event-time results are as without it.
#[test]
fn processing_time_stamps_come_from_the_clock_passed_in() {
    use kestrel::app::App;
    use kestrel::runner::ingest::IngestOptions;
    use kestrel::time::clock::Clock;
    let env = Env::new();
    land(&env, 1, &f1());
    let at = 1_800_000_000_000_000; // 2027-01-15T08:00:00Z, not today
    rt().block_on(async {
        let cfg = kestrel::config::Config::load(Some(&env.path().join("kestrel.toml"))).unwrap();
        let app = App::load(cfg, IngestOptions::default())
            .await
            .unwrap()
            .with_clock(Clock::fixed(at));
        let out = app.run(&[], &["revenue_5m".to_string()]).await.unwrap();
        assert!(out.ingest_failures.is_empty() && out.job_failures.is_empty());
        assert_eq!(out.jobs.len(), 1);
    });
    let stamp = "2027-01-15T08:00:00Z";
    let ingested = env.query(
        "bronze/orders",
        "SELECT DISTINCT CAST(_ingested_at AS VARCHAR) FROM t",
    );
    assert_eq!(ingested.len(), 1, "{ingested:?}");
    assert!(
        ingested[0][0].starts_with("2027-01-15T08:00:00"),
        "{ingested:?}"
    );
    let updated = env.query(
        "gold/revenue_5m",
        "SELECT DISTINCT CAST(_updated_at AS VARCHAR) FROM t",
    );
    assert_eq!(updated.len(), 1, "{updated:?}");
    assert!(
        updated[0][0].starts_with("2027-01-15T08:00:00"),
        "{stamp} vs {updated:?}"
    );
    // The same landing run by the binary on the system clock: the same rows otherwise.
    let cli = Env::new();
    land(&cli, 1, &f1());
    cli.run_ok(&["run", "--job", "revenue_5m"], 0);
    let skip = ["_updated_at"];
    let gold = env.snapshot("gold/revenue_5m", &skip);
    assert!(!gold.is_empty());
    assert_eq!(gold, cli.snapshot("gold/revenue_5m", &skip));
}

/// A run's sources and jobs at once (`parallel_jobs`; a job once its sources are
/// ingested) give the tables of the same sources and jobs run one after another, batch
/// for batch: three drops of the demo's events, each followed by a run.
#[test]
fn sources_and_jobs_at_once_give_the_tables_of_one_by_one() {
    use crate::faults::{files_by_mtime, land_copies, replay_tables, SKIP};
    let source = Env::new();
    source.run_ok(&["demo", "--hours", "2", "--scale", "0.1"], 0);
    let files = files_by_mtime(&source.landing());
    let serial = Env::with_config("parallel_jobs = 1");
    let parallel = Env::with_config("parallel_jobs = 8");
    let third = files.len().div_ceil(3);
    for drop in files.chunks(third) {
        for env in [&serial, &parallel] {
            land_copies(&source, env, drop);
            env.run_ok(&["run"], 0);
        }
    }
    for t in replay_tables() {
        assert_eq!(
            parallel.snapshot(&t, &SKIP),
            serial.snapshot(&t, &SKIP),
            "{t}"
        );
    }
    let runs = "SELECT name, batch_id, rows_in, rows_applied, too_late, windows_recomputed, corrections FROM t WHERE kind = 'job' ORDER BY name, batch_id";
    let (p, s) = (
        parallel.query("_kestrel/runs", runs),
        serial.query("_kestrel/runs", runs),
    );
    assert_eq!(
        p.len(),
        3 * 8,
        "each of the 8 jobs ran a batch per drop: {p:?}"
    );
    assert_eq!(p, s);
    // Each source ingested a batch per drop, the same rows whether or not the others
    // and the jobs ran beside it.
    let ingests = "SELECT name, batch_id, files, rows_in, rows_written, duplicates, quarantined FROM t WHERE kind = 'ingest' ORDER BY name, batch_id";
    let (p, s) = (
        parallel.query("_kestrel/runs", ingests),
        serial.query("_kestrel/runs", ingests),
    );
    assert_eq!(p.len(), 3 * 5, "each of the 5 sources per drop: {p:?}");
    assert_eq!(p, s);
    assert!(!parallel.snapshot("gold/revenue_5m", &SKIP).is_empty());
}

/// A job that reads one source takes that source's batches as its ingestion completes
/// them (`runner::follow`): with a slot for every source and job and the ingestion slowed
/// after every batch, the job's first batch starts before the ingestion's last ends —
/// and every table and run-log count equals a run that did one thing at a time.
#[test]
fn a_job_that_reads_one_source_follows_its_ingestion_and_gives_the_tables_of_one_by_one() {
    use crate::faults::{files_by_mtime, land_copies, replay_tables, SKIP};
    let source = Env::new();
    source.run_ok(&["demo", "--hours", "1", "--scale", "0.05"], 0);
    let batches = "[ingest]\nmax_files_per_batch = 10";
    let serial = Env::with_config(&format!("parallel_jobs = 1\n{batches}"));
    let parallel = Env::with_config(&format!("parallel_jobs = 8\n{batches}"));
    let files = files_by_mtime(&source.landing());
    for env in [&serial, &parallel] {
        land_copies(&source, env, &files);
    }
    serial.run_ok(&["run"], 0);
    let out = parallel.kestrel_env(&["run"], &[("KESTREL_DELAY", "ingest_after_batch:300")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for t in replay_tables() {
        assert_eq!(
            parallel.snapshot(&t, &SKIP),
            serial.snapshot(&t, &SKIP),
            "{t}"
        );
    }
    let runs = "SELECT kind, name, batch_id, files, rows_in, rows_written, duplicates, \
                rows_applied, too_late, windows_recomputed, corrections \
                FROM t ORDER BY kind, name, batch_id";
    let p = parallel.query("_kestrel/runs", runs);
    assert_eq!(p, serial.query("_kestrel/runs", runs));
    // Several batches per source, so there was something to follow.
    let orders = p
        .iter()
        .filter(|r| r[0] == "ingest" && r[1] == "orders")
        .count();
    assert!(orders >= 3, "{p:?}");
    // Each single-source job started before its source's ingestion ended; the payments
    // jobs (two sources) after both ended.
    let when = |sql: &str| {
        parallel.query("_kestrel/runs", sql)[0][0]
            .parse::<i64>()
            .unwrap()
    };
    let ingest_end = |s: &str| {
        when(&format!(
            "SELECT CAST(max(finished_at) AS BIGINT) FROM t WHERE kind = 'ingest' AND name = '{s}'"
        ))
    };
    let job_start = |j: &str| {
        when(&format!(
            "SELECT CAST(min(started_at) AS BIGINT) FROM t WHERE kind = 'job' AND name = '{j}'"
        ))
    };
    for (job, src) in [
        ("revenue_5m", "orders"),
        ("clickstream_5m", "clickstream"),
        ("sessions", "clickstream"),
    ] {
        assert!(
            job_start(job) < ingest_end(src),
            "{job} did not follow {src}"
        );
    }
    let both = ingest_end("orders").max(ingest_end("payments"));
    assert!(job_start("payments_fast") >= both);
}
