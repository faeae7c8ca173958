//! `kestrel status`: last runs, watermarks and gold-table freshness, as JSON for
//! machines, and `--check --max-age` exit codes for cron and monitors; each job's
//! service levels against its `[slo]` objectives.

use crate::common::*;

/// Every service level against a scenario with known values: two batches whose oldest
/// files landed 3600 s and 1800 s before they ran (latency p50 1800 s, p99 3600 s), two
/// partitions whose newest events are 600 s apart (skew), one too-late event of four
/// (late rate), a batch resumed after kill -9 (recovery), a file landed 120 s ago and
/// not yet ingested (consumer lag); `--check` names exactly the objectives breached.
#[test]
fn service_levels_are_measured_and_checked_against_objectives() {
    let env = Env::new();
    std::fs::create_dir_all(env.path().join("jobs")).unwrap();
    let shipped =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/jobs/revenue_5m.toml"))
            .unwrap();
    std::fs::write(
        env.path().join("jobs/revenue_5m.toml"),
        format!(
            "{shipped}\n[slo]\nmax_latency = \"60s\"\nmax_consumer_lag = \"1h\"\nmax_skew = \"5m\"\n\
             max_late_rate = 0.5\nmax_state_bytes = 1\nmax_recovery = \"1h\"\n\
             max_cpu_s_per_million = 1000000000\n"
        ),
    )
    .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let e0 = now - 3700;
    env.land(
        "orders/partition=0/a.ndjson",
        &lines(&[
            order("o1", e0, "ord-1", "A", 1, 100),
            order("o2", e0 - 5, "ord-2", "B", 1, 100),
        ]),
        now - 3600,
    );
    env.land(
        "orders/partition=1/a.ndjson",
        &lines(&[order("o3", e0 - 600, "ord-3", "A", 1, 100)]),
        now - 3600,
    );
    env.run_ok(&["run", "--job", "revenue_5m"], 0);
    // Batch 2: a too-late event (4 days before W); killed after compute, then resumed.
    env.land(
        "orders/partition=0/b.ndjson",
        &lines(&[order("o4", e0 - 4 * 86_400, "ord-4", "A", 1, 100)]),
        now - 1800,
    );
    let out = env.kestrel_env(
        &["run", "--job", "revenue_5m"],
        &[("KESTREL_FAULT", "job_after_compute")],
    );
    assert_eq!(out.status.code(), None, "killed");
    env.run_ok(&["run", "--job", "revenue_5m"], 0);
    let unread = lines(&[order("o5", now - 130, "ord-5", "C", 1, 100)]);
    env.land("orders/partition=0/c.ndjson", &unread, now - 120);

    let st: serde_json::Value =
        serde_json::from_str(&env.run_ok(&["status", "--json", "--job", "revenue_5m"], 0)).unwrap();
    let l = &st["jobs"][0]["slo"];
    let f = |k: &str| l[k].as_f64().unwrap_or_else(|| panic!("{k}: {l}"));
    assert_eq!(l["latency_batches"], 2, "{l}");
    assert!((1800.0..1900.0).contains(&f("latency_p50_s")), "{l}");
    assert!((3600.0..3700.0).contains(&f("latency_p99_s")), "{l}");
    assert_eq!(f("skew_s"), 600.0, "{l}");
    assert_eq!(f("late_rate"), 0.25, "{l}");
    assert_eq!(
        (l["lag_files"].as_i64(), l["lag_bytes"].as_i64()),
        (Some(1), Some(unread.len() as i64))
    );
    assert!((120.0..200.0).contains(&f("lag_oldest_s")), "{l}");
    assert!(f("recovery_s") > 0.0, "{l}");
    assert!(f("cpu_s_per_million") > 0.0, "{l}");
    assert!(f("state_bytes") > 1.0, "{l}");
    let breached: Vec<&str> = l["breaches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap().split(':').next().unwrap())
        .collect();
    assert_eq!(breached, ["max_latency", "max_skew", "max_state_bytes"]);
    // `--check` exits 4 naming each breach on one line; a job without objectives passes.
    let err = env.fails_with(&["status", "--check", "--job", "revenue_5m"], 4);
    for want in [
        "3 service-level objective(s) breached",
        "revenue_5m: max_latency: p99 ",
        "revenue_5m: max_skew: 600.000 s > 300 s",
        "revenue_5m: max_state_bytes",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    env.run_ok(&["status", "--check", "--job", "revenue_1h"], 0);
}

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

/// Orders spread over one closed day, landed one file per run: many small files per
/// partition, which `maintain` compacts to one without changing a row; the next run
/// reads only its new rows (compaction commits carry no new ingestion batch), and a late
/// correction MERGEs into the compacted partition.
#[test]
fn maintain_compacts_closed_partitions_checkpoints_and_vacuums_without_changing_data() {
    let env = Env::new();
    for k in 0..6 {
        env.land(
            &format!("orders/f{k}.ndjson"),
            &lines(&[
                order(
                    &format!("o{k}a"),
                    T0 + k * 300 + 10,
                    &format!("ord-{k}"),
                    "A",
                    1,
                    100,
                ),
                order(
                    &format!("o{k}b"),
                    T0 + k * 300 + 20,
                    &format!("ord-{k}b"),
                    "B",
                    2,
                    250,
                ),
            ]),
            T0 + k * 300 + 60,
        );
        env.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    }
    let skip = ["_updated_at", "_ingested_at", "_recorded_at"];
    let tables = ["bronze/orders", "gold/revenue_5m", "_kestrel/runs"];
    let before: Vec<Vec<String>> = tables.iter().map(|t| env.snapshot(t, &skip)).collect();
    let parquet = |rel: &str| {
        walk(&env.warehouse().join(rel))
            .into_iter()
            .filter(|p| {
                p.extension().is_some_and(|e| e == "parquet")
                    && !p.to_string_lossy().contains("_delta_log")
            })
            .count()
    };
    let bronze_files = parquet("bronze/orders");
    assert!(bronze_files >= 6, "{bronze_files}");

    let table = maintain_report(&env);
    // Gold's day is beyond the job's lookback (3 days): compacted whole, its hours in
    // one file.
    let g = table("gold/revenue_5m");
    assert_eq!(g["files_after"], 1, "{g}");
    let b = table("bronze/orders");
    assert_eq!(b["files_before"], bronze_files as u64, "{b}");
    assert_eq!(b["files_after"], 1, "{b}");
    assert_eq!(b["partitions_compacted"], 1, "{b}");
    assert!(b["files_vacuumed"].as_u64().unwrap() >= 6, "{b}");
    assert!(b["checkpoint_version"].as_i64().is_some(), "{b}");
    // The file ledger's partitions are dated by arrival (the fixtures' 2025 dates: closed);
    // the run log's by processing time (today: left to the compaction between batches).
    assert_eq!(table("_kestrel/ledger")["files_after"], 1);
    let runs = table("_kestrel/runs");
    assert_eq!(runs["files_after"], runs["files_before"], "{runs}");
    assert_eq!(table("gold/sessions")["skipped"], "not written yet");
    // Vacuum with retention 0 deleted the compacted-away files from storage.
    assert_eq!(parquet("bronze/orders"), 1);
    let after: Vec<Vec<String>> = tables.iter().map(|t| env.snapshot(t, &skip)).collect();
    assert_eq!(before, after, "maintenance changed data");

    // A late order inside the lookback: the next run reads only it and corrects a window
    // of the compacted partition.
    env.land(
        "orders/late.ndjson",
        &lines(&[order("late", T0 + 15, "ord-late", "A", 3, 300)]),
        T0 + 2000,
    );
    env.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    let last = env.query(
        "_kestrel/runs",
        "SELECT rows_in, rows_applied, corrections FROM t WHERE kind = 'job' AND name = 'revenue_5m' ORDER BY batch_id DESC LIMIT 1",
    );
    assert_eq!(last, vec![vec!["1", "1", "1"]]);
    assert_eq!(
        env.query(
            "gold/revenue_5m",
            &format!("SELECT units, revenue_cents FROM t WHERE sku = 'A' AND window_start = to_timestamp({T0})")
        ),
        vec![vec!["4", "400"]]
    );
    // Freshness ignores maintenance commits: the table's age is its last data commit's.
    let st: serde_json::Value =
        serde_json::from_str(&env.run_ok(&["status", "--json"], 0)).unwrap();
    assert!(st["tables"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["table"] == "gold/revenue_5m" && t["age_s"].as_f64().is_some()));
}

/// Yesterday's gold (by the wall clock), held in hour files, is compacted by
/// `maintain` into one file for the day without changing a row, and a late correction
/// to one of its hours afterwards rewrites that file and leaves one file per hour it
/// wrote.
#[test]
fn maintain_compacts_a_closed_gold_day_into_one_file() {
    let env = Env::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let noon = (now / 86_400 - 1) * 86_400 + 12 * 3_600;
    for k in 0..6i64 {
        // Three drops in each of two hours of yesterday.
        let t = noon + (k / 3) * 3_600 + (k % 3) * 300;
        env.land(
            &format!("orders/y{k}.ndjson"),
            &lines(&[order(
                &format!("y{k}"),
                t + 10,
                &format!("ord-y{k}"),
                "A",
                1,
                100,
            )]),
            t + 60,
        );
        env.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    }
    let skip = ["_updated_at", "_ingested_at", "_recorded_at"];
    let before = env.snapshot("gold/revenue_5m", &skip);
    let table = maintain_report(&env);
    let g = table("gold/revenue_5m");
    assert!(g["files_before"].as_u64().unwrap() >= 2, "{g}");
    assert_eq!(g["files_after"], 1, "{g}");
    assert_eq!(table("bronze/orders")["files_after"], 1);
    assert_eq!(env.snapshot("gold/revenue_5m", &skip), before);
    let hours = env.query(
        "gold/revenue_5m",
        "SELECT DISTINCT window_hour FROM t ORDER BY window_hour",
    );
    assert_eq!(hours, vec![vec!["12"], vec!["13"]]);
    // A late order in the first hour: the day's file is rewritten, one file per hour.
    env.land(
        "orders/z-late.ndjson",
        &lines(&[order("late", noon + 20, "ord-late", "A", 2, 200)]),
        noon + 3 * 3_600,
    );
    env.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    assert_eq!(
        env.query(
            "gold/revenue_5m",
            &format!(
                "SELECT units, revenue_cents FROM t WHERE window_start = to_timestamp({noon})"
            )
        ),
        vec![vec!["3", "300"]]
    );
    let files = rt().block_on(async {
        let t = env.wh().open("gold/revenue_5m").await.unwrap().unwrap();
        t.snapshot().unwrap().log_data().num_files()
    });
    assert_eq!(files, 2);
}

/// Run `kestrel maintain --retention 0s --json`: its report of a table, by name.
fn maintain_report(env: &Env) -> impl Fn(&str) -> serde_json::Value {
    let out = env.run_ok(&["maintain", "--retention", "0s", "--json"], 0);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    move |name: &str| {
        report["tables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["table"] == name)
            .unwrap_or_else(|| panic!("{name} in {out}"))
            .clone()
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A `kestrel schedule` process whose output lines are collected as they come.
pub(crate) struct Daemon {
    pub(crate) child: std::process::Child,
    rx: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Daemon {
    pub(crate) fn start(env: &Env, args: &[&str], vars: &[(&str, &str)]) -> Daemon {
        let mut c = std::process::Command::new(BIN);
        c.arg("--config")
            .arg(env.path().join("kestrel.toml"))
            .arg("schedule")
            .args(args)
            .env_remove("KESTREL_FAULT")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in vars {
            c.env(k, v);
        }
        let mut child = c.spawn().expect("start kestrel schedule");
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        for (stream, prefix) in [
            (Box::new(out) as Box<dyn std::io::Read + Send>, ""),
            (Box::new(err), "stderr: "),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(stream)
                    .lines()
                    .map_while(Result::ok)
                {
                    let _ = tx.send(format!("{prefix}{line}"));
                }
            });
        }
        Daemon {
            child,
            rx,
            seen: Vec::new(),
        }
    }

    /// The first line (from now on, or already seen) containing `pat`.
    pub(crate) fn wait_for(&mut self, pat: &str) -> String {
        if let Some(l) = self.seen.iter().find(|l| l.contains(pat)) {
            return l.clone();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(pat) {
                        return l;
                    }
                }
                Err(_) => panic!("no line with {pat:?}; output:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// Wait until `n` lines containing `pat` have been seen.
    pub(crate) fn wait_for_count(&mut self, pat: &str, n: usize) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
        while self.seen.iter().filter(|l| l.contains(pat)).count() < n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!(
                    "not {n} lines with {pat:?}; output:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    pub(crate) fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Wait up to `limit` for exit, else kill it and panic with its output; returns the
    /// exit code and every line.
    pub(crate) fn finish_within(mut self, limit: std::time::Duration) -> (Option<i32>, String) {
        let deadline = std::time::Instant::now() + limit;
        while self.child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let (_, out) = self.finish();
                panic!("kestrel schedule did not stop within {limit:?}:\n{out}");
            }
            while let Ok(l) = self.rx.try_recv() {
                self.seen.push(l);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        self.finish()
    }

    /// Wait for exit; returns the exit code and every line.
    pub(crate) fn finish(mut self) -> (Option<i32>, String) {
        let status = self.child.wait().unwrap();
        while let Ok(l) = self.rx.recv_timeout(std::time::Duration::from_secs(2)) {
            self.seen.push(l);
        }
        (status.code(), self.seen.join("\n"))
    }
}

/// Schedules that never fire during a test (1 January, midnight).
const QUIET: &str = "[schedule]\ningest = \"0 0 0 1 1 *\"\nmaintenance = \"0 0 0 1 1 *\"\n";

/// revenue_5m every second, so a batch that takes longer overlaps the next tick.
fn every_second(env: &Env) {
    shipped_job_on(&env.path().join("jobs"), "revenue_5m.toml", "* * * * * *");
}

/// Every tenth commit of a table writes a Delta checkpoint, and maintenance checkpoints
/// every table. Inside the daemon's runs both panicked (delta-kernel reads the log with
/// `block_in_place`, which a `LocalSet` does not allow): the run died, its task stayed
/// "still going" for ever, every later tick was skipped and SIGTERM waited for ever.
/// Now the runs complete, the checkpoints are there and SIGTERM stops the daemon.
#[test]
fn the_daemon_checkpoints_and_maintains_its_tables_and_stops() {
    let env = Env::with_config(
        "[ingest]\nmax_files_per_batch = 1\n\
         [schedule]\ningest = \"* * * * * *\"\nmaintenance = \"*/3 * * * * *\"\n",
    );
    every_second(&env);
    for k in 0..12 {
        let o = order(
            &format!("o{k}"),
            T0 + 60 * k,
            &format!("ord-{k}"),
            "A",
            1,
            100,
        );
        env.land(
            &format!("orders/f{k:02}.ndjson"),
            &lines(&[o]),
            T0 + 100 + k,
        );
    }
    let mut d = Daemon::start(&env, &[], &[]);
    d.wait_for("ingest: ok");
    d.wait_for("maintenance: ok");
    let log = env.warehouse().join("bronze/orders/_delta_log");
    let names: Vec<String> = std::fs::read_dir(&log)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().any(|n| n.ends_with(".checkpoint.parquet")),
        "bronze/orders has no checkpoint: {names:?}"
    );
    // Runs still come after the checkpoints and maintenance: two more of each.
    for pat in ["revenue_5m: ok", "maintenance: ok"] {
        let n = d.seen.iter().filter(|l| l.contains(pat)).count();
        d.wait_for_count(pat, n + 2);
    }
    d.signal(libc::SIGTERM);
    let (code, out) = d.finish_within(std::time::Duration::from_secs(60));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        !out.contains("panicked") && !out.contains("FAILED"),
        "{out}"
    );
    assert_eq!(env.count("bronze/orders", "SELECT count(*) FROM t"), 12);
    assert_eq!(
        env.count("gold/revenue_5m", "SELECT sum(orders) FROM t"),
        12
    );
}

fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

/// The daemon runs a job every second while each batch takes 3 s: ticks that come while
/// a run is going are skipped and counted, never run twice at once. `/metrics` is valid
/// OpenMetrics text (parsed by prometheus_client's OpenMetrics parser) with the counters, the batch
/// histogram and the gauges; SIGTERM in the middle of a batch lets it finish and commit,
/// then the daemon exits 0, and its tables equal a clean `kestrel run`'s.
#[test]
fn schedule_skips_overlapping_runs_serves_metrics_and_finishes_the_batch_on_sigterm() {
    let env = Env::with_config(&format!("{QUIET}http = \"127.0.0.1:0\"\n"));
    every_second(&env);
    let first = lines(&[
        order("o1", T0 + 10, "ord-1", "A", 1, 100),
        order("o2", T0 + 100, "ord-2", "B", 2, 200),
    ]);
    env.land("orders/f1.ndjson", &first, T0 + 120);
    let mut d = Daemon::start(&env, &[], &[("KESTREL_DELAY", "job_after_compute:3000")]);
    let serving = d.wait_for("serving http://");
    let addr = serving
        .split("http://")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    d.wait_for("revenue_5m: skipped");
    d.wait_for("revenue_5m: ok in");
    let (code, body) = http_get(&addr, "/healthz");
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    assert_eq!(http_get(&addr, "/nope").0, 404);
    let (code, metrics) = http_get(&addr, "/metrics");
    assert_eq!(code, 200);
    if let Some(py) = python_for_interop() {
        let f = env.path().join("metrics.txt");
        std::fs::write(&f, &metrics).unwrap();
        let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for fam in text_string_to_metric_families(open(sys.argv[1]).read()):
    for s in fam.samples:
        out.append([fam.type, s.name, s.labels, s.value])
print(json.dumps(out))
"#;
        let o = std::process::Command::new(py)
            .args(["-c", script, f.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let samples: Vec<(String, String, serde_json::Value, f64)> =
            serde_json::from_slice(&o.stdout).unwrap();
        let value = |name: &str, labels: &[(&str, &str)]| {
            samples
                .iter()
                .find(|(_, n, l, _)| n == name && labels.iter().all(|(k, v)| l[k] == *v))
                .map(|s| s.3)
                .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{metrics}"))
        };
        assert!(
            value(
                "kestrel_runs_total",
                &[("task", "revenue_5m"), ("result", "skipped")]
            ) >= 1.0
        );
        assert!(
            value(
                "kestrel_runs_total",
                &[("task", "revenue_5m"), ("result", "ok")]
            ) >= 1.0
        );
        assert_eq!(
            value("kestrel_rows_ingested_total", &[("source", "orders")]),
            2.0
        );
        assert_eq!(
            value("kestrel_rows_applied_total", &[("job", "revenue_5m")]),
            2.0
        );
        assert_eq!(
            value("kestrel_rows_late_total", &[("job", "revenue_5m")]),
            0.0
        );
        let h = [("kind", "job"), ("name", "revenue_5m")];
        assert_eq!(value("kestrel_batch_duration_seconds_count", &h), 1.0);
        // The batch paused 3 s: it is in the 5 s bucket, not the 2.5 s one.
        assert_eq!(
            value(
                "kestrel_batch_duration_seconds_bucket",
                &[h[0], h[1], ("le", "2.5")]
            ),
            0.0
        );
        assert_eq!(
            value(
                "kestrel_batch_duration_seconds_bucket",
                &[h[0], h[1], ("le", "5.0")]
            ),
            1.0
        );
        assert_eq!(
            value("kestrel_watermark_lag_seconds", &[("job", "revenue_5m")]),
            30.0
        );
        assert!(
            value(
                "kestrel_gold_freshness_seconds",
                &[("table", "gold/revenue_5m")]
            ) < 600.0
        );
        // Service levels: the batch read one file (landed at T0 + 120, long ago).
        let rev = [("job", "revenue_5m")];
        assert!(
            value(
                "kestrel_e2e_latency_seconds",
                &[rev[0], ("quantile", "0.99")]
            ) > 3600.0
        );
        assert_eq!(value("kestrel_consumer_lag_files", &rev), 0.0);
        assert_eq!(value("kestrel_late_event_ratio", &rev), 0.0);
        assert!(value("kestrel_state_bytes", &rev) > 0.0);
        assert_eq!(value("kestrel_slo_breaches", &rev), 0.0);
        assert_eq!(value("kestrel_up", &[]), 1.0);
        assert!(samples.iter().all(|s| s.0 != "unknown"), "{metrics}");
    }

    // A second file: SIGTERM while its batch is between compute and commit.
    env.land(
        "orders/f2.ndjson",
        &lines(&[order("o3", T0 + 400, "ord-3", "A", 5, 500)]),
        T0 + 420,
    );
    let result2 = env
        .warehouse()
        .join("_kestrel/plans/job/revenue_5m/00000000000000000002.result.json");
    let t = std::time::Instant::now();
    while !result2.exists() {
        assert!(t.elapsed().as_secs() < 60, "batch 2 never computed");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    d.signal(libc::SIGTERM);
    let (code, out) = d.finish();
    assert_eq!(code, Some(0), "{out}");
    // revenue_5m is among the batches waited for; other jobs' five-minute ticks may
    // have fired beside it (a test that crosses hh:m0 / hh:m5 waits for them too).
    assert!(
        out.lines().any(|l| l.contains("stopping: waiting for")
            && l.contains("revenue_5m")
            && l.ends_with("to finish its batch")),
        "{out}"
    );
    assert!(out.contains("scheduler stopped:"), "{out}");
    // Batch 2 committed before the exit, and the lease is gone.
    assert_eq!(
        env.count("_kestrel/runs", "SELECT count(*) FROM t WHERE kind = 'job' AND name = 'revenue_5m' AND batch_id = 2 AND status = 'ok'"),
        1
    );
    assert!(!env
        .warehouse()
        .join("_kestrel/leases/scheduler.json")
        .exists());
    let clean = Env::new();
    clean.land("orders/f1.ndjson", &first, T0 + 120);
    clean.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    clean.land(
        "orders/f2.ndjson",
        &lines(&[order("o3", T0 + 400, "ord-3", "A", 5, 500)]),
        T0 + 420,
    );
    clean.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    let skip = ["_updated_at", "_batch_id"];
    assert_eq!(
        env.snapshot("gold/revenue_5m", &skip),
        clean.snapshot("gold/revenue_5m", &skip)
    );
}

/// One daemon per warehouse: a second one exits with a message naming the holder; after
/// kill -9 of the first, the next one takes over at once (same host, dead pid); a lease
/// of a daemon on another host is waited out (`--wait`) until it expires.
#[test]
fn schedule_lease_turns_a_second_daemon_away_and_expires_after_kill_9() {
    let env = Env::with_config(QUIET);
    let mut a = Daemon::start(&env, &[], &[]);
    let started = a.wait_for("started;");
    let pid = a.child.id();
    assert!(started.contains(&format!(":{pid} started")), "{started}");
    let out = env.kestrel(&["schedule"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("another kestrel schedule") && err.contains(&format!(":{pid})")),
        "{err}"
    );
    a.signal(libc::SIGKILL);
    let (code, _) = a.finish();
    assert_eq!(code, None, "killed by a signal");
    // The lease file of the killed daemon is still there; the next one takes it over.
    assert!(env
        .warehouse()
        .join("_kestrel/leases/scheduler.json")
        .exists());
    let mut b = Daemon::start(&env, &[], &[]);
    b.wait_for("started;");
    b.signal(libc::SIGTERM);
    assert_eq!(b.finish().0, Some(0));

    // A daemon on another host holds the lease for 3 more seconds: --wait waits it out.
    let until = chrono::Utc::now() + chrono::Duration::seconds(3);
    let lease = serde_json::json!({
        "owner": "other-host:4242",
        "host": "other-host",
        "pid": 4242,
        "acquired_at": chrono::Utc::now().to_rfc3339(),
        "expires_at": until.to_rfc3339(),
    });
    std::fs::write(
        env.warehouse().join("_kestrel/leases/scheduler.json"),
        lease.to_string(),
    )
    .unwrap();
    let mut c = Daemon::start(&env, &["--wait"], &[]);
    c.wait_for("waiting for the running scheduler (other-host:4242) to stop");
    c.wait_for("started;");
    assert!(chrono::Utc::now() >= until);
    c.signal(libc::SIGTERM);
    assert_eq!(c.finish().0, Some(0));
}

/// Lateness 1, 2, …, 1000 s, one event each, shuffled over 100 files of 10 (so events
/// arrive out of order): the percentiles are known exactly; the suggested delay meets the
/// target in the replay and a zero delay does not; --png draws the histogram.
#[test]
fn lag_reports_percentiles_of_a_known_distribution_and_a_delay_that_meets_the_target() {
    let env = Env::new();
    for k in 0..100 {
        let landed = T0 + 10_000 + 100 * k;
        let evs: Vec<String> = (1..=10)
            .map(|j| {
                // i ↦ i·7919 mod 1000 is a permutation of 0..1000 (7919 is coprime to 1000).
                let d = ((10 * k + j - 1) * 7919) % 1000 + 1;
                order(
                    &format!("e{d}"),
                    landed - d,
                    &format!("ord-{d}"),
                    "A",
                    1,
                    100,
                )
            })
            .collect();
        let part = k % 2;
        env.land(
            &format!("orders/partition={part}/f{k:03}.ndjson"),
            &lines(&evs),
            landed,
        );
    }
    env.run_ok(&["run", "--source", "orders", "--job", "revenue_5m"], 0);
    let png = env.path().join("lag.png");
    let out = env.run_ok(
        &[
            "lag",
            "--source",
            "orders",
            "--target",
            "0.01",
            "--png",
            png.to_str().unwrap(),
            "--json",
        ],
        0,
    );
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    let q = &r["overall"];
    assert_eq!(q["events"], 1000);
    assert_eq!(q["p50_s"], 500.0);
    assert_eq!(q["p90_s"], 900.0);
    assert_eq!(q["p99_s"], 990.0);
    assert_eq!(q["p999_s"], 999.0);
    assert_eq!(q["max_s"], 1000.0);
    // Per partition: the even files in partition 0, the odd ones in 1.
    let parts = r["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 2);
    let total: u64 = parts.iter().map(|p| p[1]["events"].as_u64().unwrap()).sum();
    assert_eq!(total, 1000);
    assert!(parts.iter().any(|p| p[1]["max_s"] == 1000.0), "{r}");
    // The suggestion: its replayed corrections meet the target; no delay misses it.
    let suggested = r["suggested_delay_s"].as_f64().unwrap();
    let cands = r["candidates"].as_array().unwrap();
    let at = cands
        .iter()
        .find(|c| c["delay_s"].as_f64() == Some(suggested))
        .unwrap();
    assert!(at["correction_fraction"].as_f64().unwrap() <= 0.01, "{at}");
    assert!(suggested > 0.0, "these arrivals need a delay: {r}");
    let zero = cands.iter().find(|c| c["delay_s"] == 0.0).unwrap();
    assert!(
        zero["correction_fraction"].as_f64().unwrap() > 0.01,
        "{zero}"
    );
    // A stricter target needs at least as long a delay.
    let strict = env.run_ok(
        &["lag", "--source", "orders", "--target", "0.001", "--json"],
        0,
    );
    let strict: serde_json::Value = serde_json::from_str(&strict).unwrap();
    assert!(strict["suggested_delay_s"].as_f64().unwrap() >= suggested);
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 10_000, "{}", bytes.len());
    // Text output names the suggestion; --since excludes these 2025 arrivals.
    let text = env.run_ok(&["lag", "--source", "orders", "--target", "0.01"], 0);
    assert!(
        text.contains("<- suggested") && text.contains("p99.9"),
        "{text}"
    );
    let err = env.fails_one_line(&["lag", "--source", "orders", "--since", "1h"]);
    assert!(
        err.contains("no events of orders in bronze since --since"),
        "{err}"
    );
    let err = env.fails_one_line(&["lag", "--source", "nope"]);
    assert!(err.contains("unknown source `nope`"), "{err}");

    // The decision record: these percentiles, the replay, and each job reading orders
    // replayed with its own window, delay and lookback; the histogram beside it.
    let md = env.path().join("record.md");
    let text = env.run_ok(
        &[
            "lag",
            "--source",
            "orders",
            "--target",
            "0.01",
            "--markdown",
            md.to_str().unwrap(),
        ],
        0,
    );
    assert!(text.contains("decision record written to"), "{text}");
    let doc = std::fs::read_to_string(&md).unwrap();
    assert!(
        doc.starts_with("# Watermark decision record: `orders`"),
        "{doc}"
    );
    assert!(
        doc.contains("| (all) | 1000 | 500 s | 900 s | 990 s | 999 s | 1000 s |"),
        "{doc}"
    );
    assert!(doc.contains("(record.png)"), "{doc}");
    let png = std::fs::read(env.path().join("record.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    // revenue_5m is judged exactly as the command's default 5m window and 3d lookback:
    // its row shows the replay's corrections at its 30 s delay.
    let at30 = cands.iter().find(|c| c["delay_s"] == 30.0).unwrap();
    let row = doc
        .lines()
        .find(|l| l.starts_with("| `revenue_5m` |"))
        .unwrap_or_else(|| panic!("{doc}"));
    let want = format!(
        "| `revenue_5m` | tumbling 5m window | 30s | 3d | `late/revenue_5m` + counter | {} (",
        at30["corrections"]
    );
    assert!(row.starts_with(&want), "{row}\nwant {want}");
    for job in ["revenue_1h", "payments_fast", "payment_reconciliation"] {
        assert!(doc.contains(&format!("| `{job}` |")), "{job}: {doc}");
    }
    assert!(
        !doc.contains("| `sessions` |"),
        "sessions reads clickstream: {doc}"
    );
    assert!(
        doc.contains(&format!(
            "- `revenue_5m`: `watermark_delay = \"30s\"` is below the suggested {}",
            suggested_human(suggested)
        )),
        "{doc}"
    );
}

/// The decision record writes a delay as a job's TOML would (`90s`, `5m`).
fn suggested_human(s: f64) -> String {
    let s = s as i64;
    if s % 60 == 0 {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

fn stock(id: &str, event_s: i64, sku: &str, kind: &str, qty: i64) -> String {
    format!(
        r#"{{"event_id":"{id}","event_ts":"{}","sku":"{sku}","warehouse_id":"w1","kind":"{kind}","quantity":{qty}}}"#,
        ts(event_s)
    )
}

/// The always-on stream maintains its own tables between polls (`kestrel maintain`
/// leaves them to it while it runs): one alert file per batch in a closed day becomes
/// one, without changing an alert.
#[test]
fn the_stream_compacts_its_tables_between_polls() {
    let files = [
        vec![stock("i1", T0 + 10, "S1", "count", 5)],
        vec![stock("i2", T0 + 20, "S1", "sale", -5)],
        vec![stock("i3", T0 + 30, "S1", "receipt", 5)],
        vec![stock("i4", T0 + 90, "S1", "sale", -5)],
        vec![
            stock("i5", T0 + 100, "S2", "count", 1),
            stock("i6", T0 + 110, "S2", "sale", -1),
        ],
    ];
    let cfg = "[ingest]\nmax_files_per_batch = 1\n";
    let (env, clean) = (Env::with_config(cfg), Env::with_config(cfg));
    for (k, f) in files.iter().enumerate() {
        for e in [&env, &clean] {
            e.land(
                &format!("inventory/f{k}.ndjson"),
                &lines(f),
                T0 + 200 + k as i64,
            );
        }
    }
    let out = env.run_ok(
        &[
            "stream",
            "--job",
            "stockout",
            "--interval",
            "100ms",
            "--idle-polls",
            "2",
            "--maintain-every",
            "0s",
        ],
        0,
    );
    let line = out
        .lines()
        .find(|l| l.contains("maintenance: 3 tables"))
        .unwrap_or_else(|| panic!("{out}"));
    // "… maintenance: 3 tables, B files compacted to A, …": fewer files after.
    let nums: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let (before, after) = (nums[nums.len() - 4], nums[nums.len() - 3]);
    assert!(after < before, "{line}");
    let report = env.run_ok(&["maintain", "--no-compact", "--no-vacuum", "--json"], 0);
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    let alerts = report["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["table"] == "gold/stockout_alerts")
        .unwrap()
        .clone();
    assert_eq!(alerts["files_before"], 1, "{alerts}");
    clean.run_ok(&["run"], 0);
    let skip = ["detected_at", "_updated_at", "_batch_id"];
    let got = env.snapshot("gold/stockout_alerts", &skip);
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got, clean.snapshot("gold/stockout_alerts", &skip));
}
