//! The `stockout` micro-batch job driven by event time: the five cases (in order, out
//! of order, late within the lookback cancelling an alert, late beyond it, kill -9 and
//! restart) and a many-batch run with late events everywhere, each compared with an
//! oracle — plain Rust in this file that applies the events the job should have applied
//! in (event_ts, event_id) order.

use std::collections::BTreeMap;

use crate::common::*;

const DAY: i64 = 86_400;

#[derive(Clone, Debug)]
struct Ev {
    id: String,
    ts: i64,
    sku: String,
    kind: &'static str,
    qty: i64,
}

fn ev(id: &str, ts: i64, sku: &str, kind: &'static str, qty: i64) -> Ev {
    Ev {
        id: id.into(),
        ts,
        sku: sku.into(),
        kind,
        qty,
    }
}

fn line(e: &Ev) -> String {
    format!(
        r#"{{"event_id":"{}","event_ts":"{}","sku":"{}","warehouse_id":"WH-1","kind":"{}","quantity":{}}}"#,
        e.id,
        ts(e.ts),
        e.sku,
        e.kind,
        e.qty
    )
}

fn land(env: &Env, k: usize, landed: i64, evs: &[Ev]) {
    let ls: Vec<String> = evs.iter().map(line).collect();
    env.land(&format!("inventory/f{k:04}.ndjson"), &lines(&ls), landed);
}

/// How a test drives the job: `kestrel run` (micro-batch) or one poll of `kestrel
/// stream` (always-on, fed file by file).
#[derive(Clone, Copy, Debug)]
enum Mode {
    Batch,
    Stream,
}

impl Mode {
    fn args(self) -> Vec<&'static str> {
        match self {
            Mode::Batch => vec!["run", "--job", "stockout"],
            Mode::Stream => vec![
                "stream",
                "--job",
                "stockout",
                "--max-polls",
                "1",
                "--interval",
                "1ms",
            ],
        }
    }
}

fn step(env: &Env, mode: Mode) -> String {
    env.run_ok(&mode.args(), 0)
}

fn run(env: &Env) -> String {
    step(env, Mode::Batch)
}

/// Expected (alerts, availability) rows, formatted as the queries below print them.
fn oracle(evs: &[Ev]) -> (Vec<String>, Vec<String>) {
    let mut by_sku: BTreeMap<&str, Vec<&Ev>> = BTreeMap::new();
    for e in evs {
        by_sku.entry(&e.sku).or_default().push(e);
    }
    let (mut alerts, mut avail) = (Vec::new(), Vec::new());
    for (sku, mut v) in by_sku {
        v.sort_by(|a, b| (a.ts, &a.id).cmp(&(b.ts, &b.id)));
        let mut on_hand = 0i64;
        let mut minutes: BTreeMap<i64, (i64, i64)> = BTreeMap::new();
        for e in &v {
            let next = if e.kind == "count" {
                e.qty
            } else {
                on_hand + e.qty
            };
            if on_hand > 0 && next <= 0 {
                minutes.entry(e.ts / 60 * 60).or_insert((e.ts, next));
            }
            on_hand = next;
        }
        for (m, (first, oh)) in minutes {
            alerts.push(format!("{sku} {m} {first} {oh}"));
        }
        let last = v.last().map(|e| e.ts).unwrap_or_default();
        avail.push(format!("{sku} {on_hand} {} {last}", on_hand > 0));
    }
    (alerts, avail)
}

fn gold(env: &Env) -> (Vec<String>, Vec<String>) {
    let j = |rows: Vec<Vec<String>>| rows.into_iter().map(|r| r.join(" ")).collect();
    let alerts = if env.version("gold/stockout_alerts").is_some() {
        j(env.query(
            "gold/stockout_alerts",
            "SELECT sku, CAST(to_unixtime(minute) AS BIGINT), CAST(to_unixtime(first_stockout_ts) AS BIGINT), on_hand FROM t ORDER BY 1, 2",
        ))
    } else {
        Vec::new()
    };
    let avail = j(env.query(
        "gold/sku_availability",
        "SELECT sku, on_hand, available, CAST(to_unixtime(as_of) AS BIGINT) FROM t ORDER BY 1",
    ));
    (alerts, avail)
}

fn counts(env: &Env, batch: i64) -> Vec<String> {
    env.query(
        "_kestrel/runs",
        &format!("SELECT rows_applied, too_late, windows_recomputed, windows_deleted, corrections FROM t WHERE kind = 'job' AND name = 'stockout' AND batch_id = {batch}"),
    )
    .remove(0)
}

/// The scenario: one drop per run, with its arrival time.
fn drops() -> Vec<(i64, Vec<Ev>)> {
    vec![
        // In order. X: count 5, −3, −2 → stock-out at T0+100 (on_hand 0). Y: +2, −2 →
        // stock-out at T0+40; −1 more is no new stock-out. Z: count 3. W = T0 + 70.
        (
            T0 + 200,
            vec![
                ev("x1", T0 + 10, "X", "count", 5),
                ev("x2", T0 + 20, "X", "sale", -3),
                ev("x3", T0 + 100, "X", "sale", -2),
                ev("y1", T0 + 30, "Y", "receipt", 2),
                ev("y2", T0 + 40, "Y", "sale", -2),
                ev("y3", T0 + 45, "Y", "sale", -1),
                ev("z1", T0 + 50, "Z", "count", 3),
            ],
        ),
        // Out of order within the file; Z sells out at T0+290. W = T0 + 270.
        (
            T0 + 400,
            vec![
                ev("z2", T0 + 290, "Z", "sale", -3),
                ev("x4", T0 + 300, "X", "receipt", 4),
                ev("y4", T0 + 250, "Y", "receipt", 5),
            ],
        ),
        // Late within the lookback: a receipt at T0+90 lands before X's sale at T0+100,
        // so X never reaches 0 — the (closed) T0+60 minute's alert is deleted.
        (T0 + 600, vec![ev("x5", T0 + 90, "X", "receipt", 1)]),
        // Four days on: W = T0 + 4d − 30; the cut-off passes every event above, so
        // every sku's base moves.
        (
            T0 + 4 * DAY + 60,
            vec![
                ev("x6", T0 + 4 * DAY, "X", "sale", -1),
                ev("y5", T0 + 4 * DAY, "Y", "sale", -4),
            ],
        ),
        // y6 is beyond the lookback (cut-off T0 + 1d − 30): late ledger only. x7 is late
        // but within it, before X's last event: X replays from its base.
        (
            T0 + 4 * DAY + 120,
            vec![
                ev("y6", T0 + 35, "Y", "sale", -9),
                ev("x7", T0 + 2 * DAY, "X", "receipt", 10),
                ev("x8", T0 + 2 * DAY + 10, "X", "sale", -15),
            ],
        ),
    ]
}

#[test]
fn stockout_follows_event_time_and_late_events_correct_alerts() {
    five_cases(Mode::Batch);
}

#[test]
fn the_stream_follows_event_time_and_late_events_correct_alerts() {
    five_cases(Mode::Stream);
}

fn five_cases(mode: Mode) {
    let env = Env::new();
    let mut applied: Vec<Ev> = Vec::new();
    for (k, (landed, evs)) in drops().into_iter().enumerate() {
        land(&env, k + 1, landed, &evs);
        step(&env, mode);
        applied.extend(evs.into_iter().filter(|e| e.id != "y6"));
        assert_eq!(gold(&env), oracle(&applied), "after drop {}", k + 1);
        if k == 0 {
            let (alerts, _) = gold(&env);
            assert_eq!(
                alerts,
                vec![
                    format!("X {} {} 0", T0 + 60, T0 + 100),
                    format!("Y {} {} 0", T0, T0 + 40)
                ]
            );
        }
    }
    // Drop 3 cancelled X's alert in a minute that was already closed: one deletion, one
    // correction.
    assert_eq!(counts(&env, 3), vec!["1", "0", "0", "1", "1"]);
    // Drop 5: y6 was too late (late ledger + counter); x8 sells X out again at T0+2d+10.
    assert_eq!(counts(&env, 5)[..2], ["2".to_string(), "1".to_string()]);
    let late = env.query("late/stockout", "SELECT event_id, sku, _reason FROM t");
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0][..2], ["y6".to_string(), "Y".to_string()]);
    assert!(late[0][2].contains("lookback"), "{late:?}");
    // detected_at is the processing time of the first emission, kept by later MERGEs:
    // Y's alert was written in run 1 and rewritten by none since.
    let d = env.query(
        "gold/stockout_alerts",
        "SELECT _batch_id FROM t WHERE sku = 'Y' ORDER BY minute",
    );
    assert_eq!(d[0], vec!["1".to_string()]);
    // A further run commits nothing.
    let v = (
        env.version("gold/stockout_alerts"),
        env.version("gold/sku_availability"),
    );
    step(&env, mode);
    assert_eq!(
        (
            env.version("gold/stockout_alerts"),
            env.version("gold/sku_availability")
        ),
        v
    );
}

/// Restart mid-window: kill -9 at each step of the job protocol (between the two gold
/// MERGEs among them), then
/// rerun: both gold tables, the late ledger and the run log equal a clean run's.
#[test]
fn kill_9_at_every_step_then_rerun_gives_identical_stockout_tables() {
    kill_9_then_restart(Mode::Batch);
}

#[test]
fn kill_9_of_the_stream_then_restart_gives_identical_stockout_tables() {
    kill_9_then_restart(Mode::Stream);
}

fn kill_9_then_restart(mode: Mode) {
    const POINTS: [&str; 6] = [
        "job_after_plan",
        "job_after_compute",
        "job_after_late",
        "job_between_merges",
        "job_after_gold",
        "job_after_runlog",
    ];
    let clean = Env::new();
    let env = Env::new();
    for (k, (landed, evs)) in drops().into_iter().enumerate() {
        land(&clean, k + 1, landed, &evs);
        run(&clean);
        land(&env, k + 1, landed, &evs);
        let point = POINTS[k % POINTS.len()];
        env.killed_at(&mode.args(), point);
        step(&env, mode);
    }
    let skip = ["_updated_at", "_recorded_at", "_ingested_at", "detected_at"];
    env.assert_same_tables(
        &clean,
        &[
            "gold/stockout_alerts",
            "gold/sku_availability",
            "late/stockout",
        ],
        &skip,
    );
    // A stream commits availability itself, so its batches' rows_written leave it out;
    // a batch resumed by `run` reports what the killed run's commits wrote.
    let written = match mode {
        Mode::Batch => "rows_written",
        Mode::Stream => "0",
    };
    let runs = format!("SELECT batch_id, rows_in, {written}, rows_applied, too_late, windows_recomputed, windows_deleted, corrections, to_unixtime(watermark) FROM t WHERE kind = 'job' ORDER BY batch_id");
    assert_eq!(
        env.query("_kestrel/runs", &runs),
        clean.query("_kestrel/runs", &runs)
    );
}

/// Many batches, every sku with events arriving up to 30 minutes late (replays), then a
/// jump of three days (every base moves) and more late events (replays from the base):
/// the tables equal the oracle over every event not in the late ledger.
#[test]
fn many_batches_with_late_events_equal_the_oracle() {
    let env = Env::new();
    let all = scenario(true);
    // Land in 10-minute arrival buckets, one run each.
    for (k, (landed, evs)) in buckets(&all).iter().enumerate() {
        land(&env, k + 1, *landed, evs);
        run(&env);
    }
    let late: Vec<String> = env
        .query("late/stockout", "SELECT event_id FROM t ORDER BY 1")
        .into_iter()
        .map(|r| r[0].clone())
        .collect();
    assert_eq!(late.len(), 3, "{late:?}");
    let applied: Vec<Ev> = all
        .into_iter()
        .map(|(_, e)| e)
        .filter(|e| !late.contains(&e.id))
        .collect();
    let (alerts, avail) = oracle(&applied);
    assert!(
        alerts.len() > 20,
        "the scenario sells out often: {alerts:?}"
    );
    assert_eq!(gold(&env), (alerts, avail));
    let replays = env.count(
        "_kestrel/runs",
        "SELECT count(*) FROM t WHERE kind = 'job' AND corrections > 0",
    );
    assert!(replays > 0, "late events corrected closed minutes");
}

/// Equivalence: the stream fed file by file (one poll per landed file) and the
/// micro-batch job over the whole landing zone at once give identical tables, hidden
/// state columns included (ignoring processing-time and batch columns).
#[test]
fn the_stream_file_by_file_equals_the_micro_batch_job() {
    let all = scenario(false);
    let stream = Env::new();
    let batch = Env::new();
    let bs = buckets(&all);
    for (k, (landed, evs)) in bs.iter().enumerate() {
        land(&stream, k + 1, *landed, evs);
        step(&stream, Mode::Stream);
        land(&batch, k + 1, *landed, evs);
    }
    run(&batch);
    assert!(
        stream.count("_kestrel/runs", "SELECT count(*) FROM t WHERE kind = 'job'") > 10,
        "the stream ran one job batch per file"
    );
    assert_eq!(
        batch.count("_kestrel/runs", "SELECT count(*) FROM t WHERE kind = 'job'"),
        1
    );
    let skip = ["detected_at", "_updated_at", "_batch_id"];
    stream.assert_same_tables(
        &batch,
        &["gold/stockout_alerts", "gold/sku_availability"],
        &skip,
    );
}

/// Events for 12 skus over two hours, a quarter of them up to 30 minutes late; three
/// days on, one event per sku moves the cut-off past all of them, then late events
/// inside the lookback (replays from the base) and, with `too_late`, three beyond it.
/// Returns (arrival time, event).
fn scenario(too_late: bool) -> Vec<(i64, Ev)> {
    // A small deterministic generator (no extra dependency).
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let skus: Vec<String> = (0..12).map(|i| format!("S{i:02}")).collect();
    let mut all: Vec<(i64, Ev)> = Vec::new(); // (landed, event)
    let mut id = 0;
    let mut add = |ts: i64, landed: i64, sku: &str, kind: &'static str, qty: i64| {
        id += 1;
        all.push((landed, ev(&format!("e{id:05}"), ts, sku, kind, qty)));
    };
    for s in &skus {
        add(T0, T0 + 60, s, "count", 3);
    }
    for _ in 0..400 {
        let ts = T0 + 60 + rnd(7200) as i64;
        let delay = if rnd(4) == 0 { rnd(1800) } else { rnd(90) } as i64;
        let sku = &skus[rnd(skus.len() as u64) as usize];
        let (kind, qty) = match rnd(10) {
            0..=5 => ("sale", -(1 + rnd(2) as i64)),
            6..=8 => ("receipt", 1 + rnd(3) as i64),
            _ => ("count", rnd(3) as i64),
        };
        add(ts, ts + 30 + delay, sku, kind, qty);
    }
    // Three days later, one event per sku moves the cut-off past all of the above…
    for s in &skus {
        add(T0 + 3 * DAY + 7300, T0 + 3 * DAY + 7400, s, "sale", -1);
    }
    // …then late events, inside the lookback but before each sku's last event.
    for (i, s) in skus.iter().enumerate() {
        let ts = T0 + DAY + 600 * i as i64;
        add(
            ts,
            T0 + 3 * DAY + 8000,
            s,
            if i % 2 == 0 { "receipt" } else { "sale" },
            if i % 2 == 0 { 2 } else { -3 },
        );
    }
    // …and a few beyond it.
    if too_late {
        for s in skus.iter().take(3) {
            add(T0 + 100, T0 + 3 * DAY + 8000, s, "receipt", 50);
        }
    }
    all
}

/// The stream's deferred state (`sku_availability` committed a bucket per poll, the
/// rest held in memory and in a file per batch): one poll of many batches (one file per
/// ingestion batch) reads the states its earlier batches left uncommitted; a kill -9
/// with states pending loses none of them — the restarted stream commits them first —
/// and a `run` after a second kill does the same; the tables, late rows included, then
/// equal the micro-batch job's run file by file (the same batches, so the same
/// watermarks).
#[test]
fn a_killed_stream_loses_no_deferred_state_and_equals_the_micro_batch_job() {
    let bs = buckets(&scenario(true));
    let env = Env::with_config("[ingest]\nmax_files_per_batch = 1\n");
    let batch = Env::new();
    let stream = |polls: &'static str| {
        vec![
            "stream",
            "--job",
            "stockout",
            "--max-polls",
            polls,
            "--interval",
            "1ms",
        ]
    };
    let marker = env
        .warehouse()
        .join("_kestrel/plans/job/stockout/deferred.json");
    let half = bs.len() / 2;
    for (k, (landed, evs)) in bs[..half].iter().enumerate() {
        land(&env, k + 1, *landed, evs);
        land(&batch, k + 1, *landed, evs);
        run(&batch);
    }
    // Two polls (the first runs a batch per file, the second is idle), each committing
    // one bucket; killed before the rest is committed.
    env.killed_at(&stream("2"), "stream_before_finish");
    let jobs = |env: &Env| env.count("_kestrel/runs", "SELECT count(*) FROM t WHERE kind = 'job'");
    assert_eq!(jobs(&env), half as i64, "one job batch per file");
    assert!(marker.exists(), "a killed stream leaves its marker");
    let committed = env.snapshot("gold/sku_availability", &[]).len();
    assert!(
        committed < 12,
        "states were pending at the kill ({committed} of 12 skus committed)"
    );
    for (k, (landed, evs)) in bs.iter().enumerate().skip(half) {
        land(&env, k + 1, *landed, evs);
        land(&batch, k + 1, *landed, evs);
        run(&batch);
    }
    // The restarted stream commits the killed one's states, then runs the rest; killed
    // after its first bucket commit.
    env.killed_at(&stream("5"), "stream_after_state_commit");
    assert_eq!(jobs(&env), bs.len() as i64);
    assert!(marker.exists());
    // `run` commits what the stream left before its batches (it has none).
    run(&env);
    assert!(
        !marker.exists(),
        "`run` committed the deferred state and dropped the marker"
    );
    // Processing-time and batch columns differ between the two sites.
    let skip = [
        "detected_at",
        "_updated_at",
        "_batch_id",
        "_ingested_at",
        "_recorded_at",
    ];
    env.assert_same_tables(
        &batch,
        &[
            "gold/stockout_alerts",
            "gold/sku_availability",
            "late/stockout",
        ],
        &skip,
    );
    // Every batch's deferred rows are a file next to its plan.
    let files = std::fs::read_dir(env.warehouse().join("_kestrel/plans/job/stockout"))
        .unwrap()
        .filter(|e| {
            e.as_ref().is_ok_and(|e| {
                e.file_name()
                    .to_string_lossy()
                    .ends_with(".deferred.parquet")
            })
        })
        .count();
    assert_eq!(files, bs.len(), "one deferred file per batch");
}

/// Events grouped into 10-minute arrival buckets: (file arrival time, events).
fn buckets(all: &[(i64, Ev)]) -> Vec<(i64, Vec<Ev>)> {
    let mut b: BTreeMap<i64, Vec<Ev>> = BTreeMap::new();
    for (landed, e) in all {
        b.entry(landed / 600).or_default().push(e.clone());
    }
    b.into_iter().map(|(k, v)| (k * 600 + 599, v)).collect()
}

/// The always-on process: it picks files up as they land, `kestrel run` leaves the
/// inventory source and the job to it (exit 0), SIGTERM stops it cleanly after the
/// current poll, and then `run` owns the source again.
#[test]
fn a_running_stream_owns_inventory_and_stops_cleanly_on_sigterm() {
    let env = Env::new();
    let child = std::process::Command::new(BIN)
        .arg("--config")
        .arg(env.path().join("kestrel.toml"))
        .args(["stream", "--job", "stockout", "--interval", "100ms"])
        .env_remove("KESTREL_FAULT")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the stream");
    let wait_for = |what: &str, f: &dyn Fn() -> bool| {
        let t = std::time::Instant::now();
        while !f() {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(60),
                "timed out waiting for {what}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    let d = drops();
    land(&env, 1, d[0].0, &d[0].1);
    let alerts = |env: &Env| {
        if env.version("gold/stockout_alerts").is_none() {
            return 0;
        }
        env.count("gold/stockout_alerts", "SELECT count(*) FROM t")
    };
    wait_for("the first file's alerts", &|| alerts(&env) == 2);
    // Orders land too: `run` ingests them, leaves inventory and stockout to the stream.
    env.land(
        "orders/o1.ndjson",
        &lines(&[order("o1", T0 + 10, "ord-1", "X", 1, 100)]),
        T0 + 100,
    );
    let out = env.run_ok(&["run"], 0);
    assert!(
        out.contains("inventory: left to the running stream of stockout"),
        "{out}"
    );
    assert!(
        out.contains("stockout") && out.contains("running always-on"),
        "{out}"
    );
    assert_eq!(env.count("bronze/orders", "SELECT count(*) FROM t"), 1);
    land(&env, 2, d[1].0, &d[1].1);
    wait_for("the second file's alert", &|| alerts(&env) == 3);
    // SIGTERM: the stream finishes its poll and exits 0.
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("stopped after"), "{stdout}");
    assert!(stdout.contains("final checkpoint"), "{stdout}");
    // The lease is gone: `run` owns inventory again (and finds nothing new there).
    land(&env, 3, d[2].0, &d[2].1);
    let out = env.run_ok(&["run", "--job", "stockout"], 0);
    assert!(!out.contains("left to the running stream"), "{out}");
    let mut applied: Vec<Ev> = Vec::new();
    for (_, evs) in &d[..3] {
        applied.extend(evs.iter().cloned());
    }
    assert_eq!(gold(&env), oracle(&applied));
}

/// An idle partition stops holding the watermark back once its newest file is older
/// than `idle_timeout` (5 min) in arrival time — in both modes. Partition 1 lands once;
/// partition 0 keeps landing for 10 minutes.
#[test]
fn an_idle_inventory_partition_does_not_stall_the_watermark() {
    for mode in [Mode::Batch, Mode::Stream] {
        let env = Env::new();
        let file = |p: u32, k: usize, landed: i64, evs: &[Ev]| {
            let ls: Vec<String> = evs.iter().map(line).collect();
            env.land(
                &format!("inventory/partition={p}/f{k:04}.ndjson"),
                &lines(&ls),
                landed,
            );
        };
        file(1, 0, T0 + 60, &[ev("p1", T0 + 50, "B", "count", 5)]);
        for k in 0..10 {
            let t = T0 + 60 * (k as i64 + 1);
            file(0, k, t + 10, &[ev(&format!("a{k}"), t, "A", "count", 5)]);
            step(&env, mode);
        }
        let w = env.count(
            "_kestrel/runs",
            "SELECT CAST(to_unixtime(max(watermark)) AS BIGINT) FROM t WHERE kind = 'job'",
        );
        // Partition 0's newest event (T0 + 600) − 30 s: partition 1 (max T0 + 50) was
        // idle for more than 5 minutes of arrival time.
        assert_eq!(w, T0 + 570, "{mode:?}");
    }
}

/// The stream's dedup set: a redelivery within `--dedup-ttl` of arrival time is dropped
/// (counted in the run log), one after it is a new delivery. Every invocation is a new
/// process, so the set is rebuilt from bronze each time.
#[test]
fn the_stream_dedups_within_its_ttl_and_forgets_after_it() {
    let env = Env::new();
    let poll = |env: &Env| {
        env.run_ok(
            &[
                "stream",
                "--job",
                "stockout",
                "--max-polls",
                "1",
                "--interval",
                "1ms",
                "--dedup-ttl",
                "1h",
            ],
            0,
        )
    };
    let e1 = ev("e1", T0, "A", "count", 5);
    land(&env, 1, T0 + 10, std::slice::from_ref(&e1));
    let out = poll(&env);
    assert!(out.contains("dedup set 1 ids"), "{out}");
    assert!(
        out.contains("dedup set started with 0 ids (rebuilt from bronze"),
        "{out}"
    );
    assert!(out.contains("final checkpoint"), "{out}");
    // 30 minutes later: e1 again (a duplicate) and e2.
    land(
        &env,
        2,
        T0 + 1800,
        &[e1.clone(), ev("e2", T0 + 1700, "A", "sale", -1)],
    );
    let out = poll(&env);
    assert!(out.contains("dedup set 2 ids"), "{out}");
    // The restart loaded the previous run's checkpoint: nothing to read from bronze.
    assert!(
        out.contains("dedup set started with 1 ids (from its checkpoint; 0 read from bronze)"),
        "{out}"
    );
    // Three hours later e1 once more: its hour is past the 1 h TTL, so it is new.
    land(&env, 3, T0 + 3 * 3600, std::slice::from_ref(&e1));
    poll(&env);
    // State as data: each checkpoint (one per stream run here, when it stops) is a
    // run-log row with the state's size, numbered across restarts; status shows the last.
    let ckpts = env.query(
        "_kestrel/runs",
        "SELECT batch_id, state_ids, state_bytes > 0, checkpoint_bytes > 0, duration_ms >= 0 \
         FROM t WHERE kind = 'checkpoint' AND name = 'stockout' ORDER BY batch_id",
    );
    let row = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(ckpts.len(), 3, "{ckpts:?}");
    assert_eq!(ckpts[0], row(&["1", "1", "true", "true", "true"]));
    assert_eq!(ckpts[1], row(&["2", "2", "true", "true", "true"]));
    let st: serde_json::Value =
        serde_json::from_str(&env.run_ok(&["status", "--json", "--job", "stockout"], 0)).unwrap();
    let job = &st["jobs"][0];
    assert_eq!(job["stream_state"]["checkpoint"], 3, "{job}");
    assert_eq!(job["stream_state"]["ids"].to_string(), ckpts[2][1], "{job}");
    assert!(job["state_bytes"].as_u64().unwrap() > 0, "{job}");
    let text = env.run_ok(&["status", "--job", "stockout"], 0);
    assert!(
        text.contains("stream: ") && text.contains("(checkpoint 3 at "),
        "{text}"
    );
    let dups = env.query(
        "_kestrel/runs",
        "SELECT batch_id, duplicates FROM t WHERE kind = 'ingest' ORDER BY batch_id",
    );
    assert_eq!(
        dups,
        vec![
            vec!["1".to_string(), "0".to_string()],
            vec!["2".to_string(), "1".to_string()],
            vec!["3".to_string(), "0".to_string()]
        ]
    );
    assert_eq!(
        env.count(
            "bronze/inventory",
            "SELECT count(*) FROM t WHERE event_id = 'e1'"
        ),
        2
    );
    // Ids ingested by `run` after the checkpoint are topped up from bronze at restart.
    land(
        &env,
        4,
        T0 + 3 * 3600 + 60,
        &[ev("e3", T0 + 3 * 3600, "A", "sale", -1)],
    );
    env.run_ok(&["run", "--job", "stockout"], 0);
    land(
        &env,
        5,
        T0 + 3 * 3600 + 120,
        &[ev("e3", T0 + 3 * 3600, "A", "sale", -1)],
    );
    let out = poll(&env);
    assert!(
        out.contains("(from its checkpoint; 1 read from bronze)"),
        "{out}"
    );
    let dups = env.count(
        "_kestrel/runs",
        "SELECT duplicates FROM t WHERE kind = 'ingest' AND batch_id = 5",
    );
    assert_eq!(
        dups, 1,
        "e3 redelivered after the checkpoint is still caught"
    );
    // A checkpoint from a newer binary is refused with a one-line reason, not misread.
    let ck = env
        .warehouse()
        .join("_kestrel/state/stockout/inventory.ckpt");
    let mut bytes = std::fs::read(&ck).unwrap();
    bytes[11..15].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&ck, bytes).unwrap();
    let err = env.fails_one_line(&["stream", "--job", "stockout", "--max-polls", "1"]);
    assert!(
        err.contains("inventory.ckpt") && err.contains("format 99 by a newer kestrel"),
        "{err}"
    );
}
