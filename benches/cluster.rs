//! Cluster benchmark (not a test): `cargo bench --bench cluster -- [EVENTS] [DAYS] [ROUNDS]`.
//!
//! Runs the same work locally (DataFusion in this process, the embedded default) and on
//! Ballista clusters started from the kestrel binary on this machine — one executor
//! with one task slot, then two — side by side in one run, and prints times, peak
//! memory and their ratios:
//! 1. ingestion of EVENTS order events (default 5,000,000; random UUID ids, 0.5%
//!    re-deliveries) landed as 10,000-event NDJSON files: discovery, plan, decode,
//!    validation, dedup, bronze, quarantine, ledger and run log. Locally in this
//!    process; on a cluster decode, dedup and the bronze files run on the executors
//!    and this process commits ([`kestrel::engine::ingest`]).
//! 2. `kestrel backfill --job revenue_5m` over DAYS days (default 7) of orders, from
//!    the same warehouse copied for each engine (days in parallel on the cluster).
//! 3. the per-batch overhead: ROUNDS (default 5) five-minute demo drops, each followed
//!    by `kestrel run` (all sources and jobs), median and spread per engine.
//!
//! On a 2-core machine the coordinator, the scheduler and the executors share the same
//! two cores: read the cluster figures as overhead and scaling from one worker to two,
//! not as what a cluster of machines would do.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use kestrel::config::Config;
use kestrel::runner::ingest::{IngestOptions, Ingestor};

const BIN: &str = env!("CARGO_BIN_EXE_kestrel");
const EVENTS_PER_FILE: usize = 10_000;
/// 2025-11-20T12:00:00Z.
const T0_S: i64 = 1_763_640_000;

#[path = "common/peak.rs"]
mod peak;
use peak::peak_mib;

/// A process of a cluster, killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start `kestrel ARGS…` and return it with its first line of output.
fn spawn(args: &[&str]) -> (Proc, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start a cluster process");
    let out = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(out).lines();
    let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    std::thread::spawn(move || for _ in lines.by_ref() {});
    (Proc(child), first)
}

/// A scheduler and `executors` one-task executors on loopback.
struct Cluster {
    url: String,
    _scheduler: Proc,
    executors: Vec<Proc>,
}

impl Cluster {
    fn start(executors: usize) -> Cluster {
        let (scheduler, line) = spawn(&["cluster", "scheduler", "--bind", "127.0.0.1:0"]);
        let url = line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let addr = url.trim_start_matches("df://").to_string();
        let executors = (0..executors)
            .map(|_| {
                spawn(&[
                    "cluster",
                    "executor",
                    "--scheduler",
                    &addr,
                    "--bind",
                    "127.0.0.1:0",
                    "--concurrent-tasks",
                    "1",
                ])
                .0
            })
            .collect();
        wait_ready(&addr);
        Cluster {
            url,
            _scheduler: scheduler,
            executors,
        }
    }

    /// The largest peak RSS among the executors, MiB.
    fn executor_peak(&self) -> f64 {
        self.executors
            .iter()
            .map(|p| peak_mib(&p.0.id().to_string()))
            .fold(0.0, f64::max)
    }
}

fn wait_ready(addr: &str) {
    use std::io::Read;
    for _ in 0..600 {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            let req = format!("GET /readyz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
            let mut answer = String::new();
            if s.write_all(req.as_bytes()).is_ok()
                && s.read_to_string(&mut answer).is_ok()
                && answer.starts_with("HTTP/1.1 200")
            {
                return;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("no executor registered at {addr}");
}

/// The engines compared: local, then clusters of one and two executors.
#[derive(Clone, Copy)]
enum Engine {
    Local,
    Cluster(usize),
}

impl Engine {
    const ALL: [Engine; 3] = [Engine::Local, Engine::Cluster(1), Engine::Cluster(2)];

    fn name(self) -> String {
        match self {
            Engine::Local => "local".into(),
            Engine::Cluster(n) => format!("{n} executor{}", if n == 1 { "" } else { "s" }),
        }
    }
}

/// `kestrel.toml` text for `landing` and `warehouse`, on the cluster at `url` if any.
fn config_text(landing: &Path, warehouse: &Path, url: Option<&str>) -> String {
    let mut t = format!(
        "landing = \"{}\"\nwarehouse = \"{}\"\n",
        landing.display(),
        warehouse.display()
    );
    if let Some(url) = url {
        t.push_str(&format!(
            "[engine]\nkind = \"ballista\"\nscheduler = \"{url}\"\n"
        ));
    }
    t
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("kestrel.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// `events` orders over `span_s` seconds of event time ending at `end_s`, landed as files
/// of 10,000 in four partitions, each landing a minute after its newest event.
fn land_orders(landing: &Path, events: usize, span_s: i64, end_s: i64) -> u64 {
    let dir = landing.join("orders");
    let mut bytes = 0u64;
    let (mut n, mut f) = (0usize, 0usize);
    let mut last_id = String::new();
    while n < events {
        let path = dir.join(format!("partition={}/f{f:06}.ndjson", f % 4));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut w = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let end = (n + EVENTS_PER_FILE).min(events);
        let mut newest = 0i64;
        for i in n..end {
            // 0.5% re-deliveries of the previous event.
            if i % 200 != 199 || last_id.is_empty() {
                last_id = uuid::Uuid::new_v4().to_string();
            }
            let ts_ms = (end_s - span_s) * 1000 + (i as i64 * span_s * 1000) / events as i64;
            newest = newest.max(ts_ms);
            writeln!(
                w,
                r#"{{"event_id":"{last_id}","event_ts":{ts_ms},"order_id":"ord-{:09}","sku":"SKU-{:04}","quantity":{},"amount_cents":{}}}"#,
                i / 3,
                i % 997,
                1 + i % 3,
                199 * (1 + i % 3)
            )
            .unwrap();
        }
        w.flush().unwrap();
        drop(w);
        let ft = filetime::FileTime::from_unix_time(newest / 1000 + 60, 0);
        filetime::set_file_mtime(&path, ft).unwrap();
        bytes += std::fs::metadata(&path).unwrap().len();
        n = end;
        f += 1;
    }
    bytes
}

/// Ingest every landed order with `engine` (the cluster at `url`) as the coordinator, in
/// a process of its own (this benchmark run again as `ingest-child DIR`): its wall time,
/// its peak RSS and the rows it wrote.
fn ingest(root: &Path, landing: &Path, engine: Engine, url: Option<&str>) -> (f64, f64, i64) {
    let dir = root.join(format!("ingest-{}", engine.name().replace(' ', "-")));
    std::fs::create_dir_all(&dir).unwrap();
    write_config(&dir, &config_text(landing, &dir.join("warehouse"), url));
    let me = std::env::current_exe().unwrap();
    let mut c = Command::new(me);
    c.arg("ingest-child").arg(&dir);
    let (secs, peak, out) = measured(c);
    let written = out.trim().parse().unwrap_or(-1);
    (secs, peak, written)
}

/// `ingest-child DIR`: ingest `orders` with `DIR/kestrel.toml`, print the rows written.
fn ingest_child(dir: &Path) {
    let text = std::fs::read_to_string(dir.join("kestrel.toml")).unwrap();
    let cfg = Config::parse(&text, "kestrel.toml", dir).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let written = rt.block_on(async {
        let ing = Ingestor::new(cfg.clone(), IngestOptions::default()).unwrap();
        let port = kestrel::engine::connect::read_port(&cfg.engine, ing.warehouse())
            .await
            .unwrap();
        let ing = ing.with_cluster(port.map(Arc::new));
        ing.ingest_source("orders").await.unwrap().rows_written()
    });
    println!("{written}");
}

/// Run `c` to its end: wall time, peak RSS (its VmHWM, sampled every 20 ms until it
/// exits) and its output. A failure stops the benchmark.
fn measured(mut c: Command) -> (f64, f64, String) {
    let t = Instant::now();
    let mut child = c
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s)
            .map(|_| s)
            .unwrap_or_default()
    });
    let mut peak = 0.0f64;
    let status = loop {
        let p = peak_mib(&pid);
        if p.is_finite() {
            peak = peak.max(p);
        }
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let secs = t.elapsed().as_secs_f64();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    assert!(status.success(), "{c:?} failed: {err}");
    (secs, peak, reader.join().unwrap_or_default())
}

/// Run `kestrel ARGS…` with config `cfg`; its wall time and peak RSS (MiB).
fn kestrel(cfg: &Path, args: &[&str]) -> (f64, f64) {
    let mut c = Command::new(BIN);
    c.arg("--config").arg(cfg).args(args);
    let (secs, peak, _) = measured(c);
    (secs, peak)
}

fn copy_dir(from: &Path, to: &Path) {
    let ok = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap()
        .success();
    assert!(ok, "cp -a {} {}", from.display(), to.display());
}

fn day(s: i64) -> String {
    chrono::DateTime::from_timestamp(s, 0)
        .unwrap()
        .format("%Y-%m-%d")
        .to_string()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.first().is_some_and(|a| a == "ingest-child") {
        return ingest_child(Path::new(&args[1]));
    }
    let events: usize = args
        .first()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5_000_000);
    let days: i64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(7);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    println!(
        "kestrel cluster benchmark: {events} events, {days}-day backfill, {rounds} micro-batches ({} cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // 1. Ingestion.
    let landing = root.join("landing-ingest");
    let t = Instant::now();
    let bytes = land_orders(&landing, events, 3600, T0_S);
    println!(
        "landed {events} events, {:.0} MiB, in {:.1}s",
        bytes as f64 / 1048576.0,
        t.elapsed().as_secs_f64()
    );
    println!("\n1. ingestion of {events} order events");
    println!(
        "{:<12} {:>9} {:>12} {:>9} {:>14} {:>14}",
        "engine", "seconds", "events/s", "÷ local", "coord. MiB", "executor MiB"
    );
    let mut base = None;
    for engine in Engine::ALL {
        let cluster = match engine {
            Engine::Local => None,
            Engine::Cluster(n) => Some(Cluster::start(n)),
        };
        let url = cluster.as_ref().map(|c| c.url.as_str());
        let (secs, peak, written) = ingest(root, &landing, engine, url);
        let base = *base.get_or_insert(secs);
        let exec = cluster.as_ref().map_or(0.0, Cluster::executor_peak);
        println!(
            "{:<12} {:>9.1} {:>12.0} {:>9.2} {:>14.0} {:>14.0}   ({written} rows written)",
            engine.name(),
            secs,
            events as f64 / secs,
            secs / base,
            peak,
            exec
        );
    }

    // 2. Backfill: `days` days of orders, ingested and run once locally, then the
    // same warehouse backfilled by each engine.
    let per_day = 50_000;
    let landing = root.join("landing-days");
    // Whole days, ending at midnight before T0.
    let midnight = T0_S - T0_S.rem_euclid(86_400);
    land_orders(&landing, per_day * days as usize, days * 86_400, midnight);
    let seed = root.join("backfill-seed");
    std::fs::create_dir_all(&seed).unwrap();
    let cfg = write_config(&seed, &config_text(&landing, &seed.join("warehouse"), None));
    kestrel(&cfg, &["run", "--source", "orders", "--job", "revenue_5m"]);
    let (from, to) = (day(midnight - days * 86_400), day(midnight - 1));
    println!("\n2. backfill of revenue_5m, {from} … {to} ({days} days, {per_day} orders a day)");
    println!(
        "{:<12} {:>9} {:>9} {:>14} {:>14}",
        "engine", "seconds", "÷ local", "coord. MiB", "executor MiB"
    );
    let mut base = None;
    for engine in Engine::ALL {
        let cluster = match engine {
            Engine::Local => None,
            Engine::Cluster(n) => Some(Cluster::start(n)),
        };
        let dir = root.join(format!("backfill-{}", engine.name().replace(' ', "-")));
        std::fs::create_dir_all(&dir).unwrap();
        copy_dir(&seed.join("warehouse"), &dir.join("warehouse"));
        let url = cluster.as_ref().map(|c| c.url.as_str());
        let cfg = write_config(&dir, &config_text(&landing, &dir.join("warehouse"), url));
        let (secs, peak) = kestrel(
            &cfg,
            &[
                "backfill",
                "--job",
                "revenue_5m",
                "--from",
                &from,
                "--to",
                &to,
            ],
        );
        let base = *base.get_or_insert(secs);
        let exec = cluster.as_ref().map_or(0.0, Cluster::executor_peak);
        println!(
            "{:<12} {:>9.1} {:>9.2} {:>14.0} {:>14.0}",
            engine.name(),
            secs,
            secs / base,
            peak,
            exec
        );
    }

    // 3. Per-batch overhead: five-minute demo drops, `run` after each.
    println!(
        "\n3. a small micro-batch: a five-minute demo drop of every source, then `kestrel run`"
    );
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>12}",
        "engine", "median s", "min s", "max s", "+ vs local"
    );
    let mut base = None;
    for engine in Engine::ALL {
        let cluster = match engine {
            Engine::Local => None,
            Engine::Cluster(n) => Some(Cluster::start(n)),
        };
        let dir = root.join(format!("batches-{}", engine.name().replace(' ', "-")));
        let landing = dir.join("landing");
        std::fs::create_dir_all(&landing).unwrap();
        let url = cluster.as_ref().map(|c| c.url.as_str());
        let cfg = write_config(&dir, &config_text(&landing, &dir.join("warehouse"), url));
        let mut times = Vec::new();
        for r in 0..=rounds {
            let end = chrono::DateTime::from_timestamp(T0_S + 300 * r as i64, 0).unwrap();
            let opts = kestrel::demo::DemoOptions {
                hours: 5.0 / 60.0,
                end: Some(end),
                seed: r as u64,
                ..Default::default()
            };
            kestrel::demo::generate(&landing, &opts).unwrap();
            let (secs, _) = kestrel(&cfg, &["run"]);
            // The first run creates every table: not a steady-state batch.
            if r > 0 {
                times.push(secs);
            }
        }
        let (lo, hi) = (
            times.iter().copied().fold(f64::MAX, f64::min),
            times.iter().copied().fold(0.0, f64::max),
        );
        let m = median(&mut times);
        let base = *base.get_or_insert(m);
        println!(
            "{:<12} {:>10.2} {:>10.2} {:>10.2} {:>+12.2}",
            engine.name(),
            m,
            lo,
            hi,
            m - base
        );
    }
}
