//! `age`: the per-run cost of a pipeline as it ages (`cargo bench --bench jobs -- age
//! [small|scale] [RUNS]`).
//!
//! Consecutive five-minute drops of all four sources land in a local landing zone, each
//! followed by what a cron-driven `kestrel run` does (a fresh `App`: every source and
//! every job, `parallel_jobs` at once), with the maintenance the daemon runs: its daily
//! slot at 03:30 (simulated time) and whatever `run` itself does between batches.
//! Simulated days pass by event time, arrival time (file modification times) and
//! processing time (each run's clock is set to its drop's end: run-log dates,
//! `_ingested_at`, plan times), not by the wall clock. Event ids are random UUIDs;
//! lateness is heavy-tailed (the demo's distribution: p50 0.4 s, p99 4 s, max 16 min)
//! plus a tail of events minutes to hours late and a few beyond the 3-day lookback;
//! 0.3 % of events are delivered twice and one line in 5,000 is malformed.
//!
//! - `small`: ~500 events per drop (clickstream, orders, payments and inventory at the
//!   demo's ratios, one file per source partition and drop); default a week, 2,016 runs.
//! - `scale`: Kestrel's scale, 14 M clickstream events a day (≈ 48.6k per drop, one file
//!   per source partition and arrival minute, ≈ 55k events per drop in all); default one
//!   day, 288 runs.
//!
//! Prints progress every simulated hour, then the cost curve: medians of runs 1–12, of
//! the last 12 of day 1 and of the last 12 of day 7, their ratios, the slowest run, the
//! peak RSS, and a run with nothing new at the end. At each day's end the aged pipeline
//! is measured beside the young one: the day's last 16 drops replayed on a copy of the
//! warehouse as it was before them, and runs 24–39 on a copy of the young warehouse, in
//! alternating repetitions, each run started as a new process, so the ratio is of ages,
//! not of the machine's minute-to-minute drift. Every run is also written to
//! `age-<mode>.csv` in the working directory. `KESTREL_AGE_PROFILE=1` adds where each
//! hour's time went (the top 25 printed, every storage operation and each source's and
//! job's batches in `age-<mode>-profile.csv`); `KESTREL_AGE_KEEP=1` keeps the aged warehouse and landing zone;
//! `KESTREL_AGE_PARALLEL=N` works on N sources and jobs at once (default: `parallel_jobs`,
//! one per core, as `kestrel run` does; 1: every source, then every job, in turn);
//! `KESTREL_AGE_DAEMON=1` runs every drop in one process with its tables kept from run to
//! run, as `kestrel schedule` does (default: each run as a new cron-started process).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kestrel::app::App;
use kestrel::config::Config;
use kestrel::job::spec::JobSpec;
use kestrel::ops::maintain::{self, MaintainOptions};
use kestrel::runner::ingest::IngestOptions;
use kestrel::schema::SourceSchema;
use kestrel::time::clock::Clock;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const US: i64 = 1_000_000;
const MINUTE: i64 = 60 * US;
const DROP: i64 = 5 * MINUTE;
const DAY_US: i64 = 86_400 * US;
/// Simulated day 1: 2026-06-01T00:00:00Z.
const START_US: i64 = 1_780_272_000 * US;
const SOURCES: [(&str, u32); 4] = [
    ("clickstream", 4),
    ("inventory", 2),
    ("orders", 2),
    ("payments", 2),
];

/// Event time generated before the first measured run (landed as its backlog).
const WARMUP: i64 = 3 * 3600 * US;
/// The loop index of the run before which the young pipeline is snapshotted for the side
/// by side: its window starts at run 24 (02:00), at the same place in the hour as the
/// aged window's (run 273 of a day: both hold two runs ≡ 0 mod 12). Hourly work — the
/// landing zone's full listing every 12th batch, the hourly `payment_reconciliation` —
/// falls on runs ≡ 0 mod 12 (at scale they averaged 3.35 s against 3.01–3.25 s for the
/// other eleven places); with run 13 as the control (until `000ce1c`) the aged side paid
/// it and the young side did not.
const CONTROL_AT: usize = 23;

/// Copy a directory tree (`cp -a`), or link it (`cp -al`: hard links, for snapshots and
/// landing zones — kestrel and the generator never write a file in place, they write a
/// new one and rename it), replacing `to`.
fn copy_dir(from: &Path, to: &Path, links: bool) {
    let _ = std::fs::remove_dir_all(to);
    let ok = std::process::Command::new("cp")
        .arg(if links { "-al" } else { "-a" })
        .arg(from)
        .arg(to)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cp {} {}", from.display(), to.display());
    // Written back before anything is timed: a day at scale is gigabytes of dirty pages,
    // and flushing them inside the next timed run slowed it by seconds, more for the
    // larger (aged) copy (at dd740d2 the day's last drop took 8.8 s on the aged copy,
    // 7.8 s in place right after the copy, and the runs before it ≈ 5.3 s).
    let _ = std::process::Command::new("sync").status();
}

/// Runs in each side of the side by side: one cycle of the open day's compaction
/// (`OpenCompaction::default().min_files` small files make a partition compacted), so
/// both sides pay it alike. With one run per side (until `035086e`) the
/// aged side's drop at scale was one of the two in sixteen whose ingestion compacts the
/// open day (1.00 s of ingest against 0.43–0.61 s for the runs around it) and the young
/// side's compacted nothing: the ratio (1.40) measured where a compaction fell.
const WINDOW: usize = 16;

/// Alternating repetitions of the two windows at each day's end.
const REPEATS: usize = 3;

/// A snapshot a window starts from: the warehouse and the landing zone before the
/// window's first drop landed.
struct Snapshot {
    dir: PathBuf,
    /// Index of the window's first run (0-based).
    first: usize,
}

impl Snapshot {
    /// Take one of `warehouse` and `landing` into `dir`, for the window starting at run
    /// index `first`.
    fn take(warehouse: &Path, landing: &Path, dir: &Path, first: usize) -> Snapshot {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        // Hard links, both: taking it costs the pipeline's next runs nothing. (A real copy
        // of a day at scale is gigabytes; taken before run 273 it slowed runs 273–288 —
        // median 2.71 s in the run, where the same drops replayed on copies of it took
        // 2.40 s a run.) Kestrel writes no file in place (object_store writes a new file
        // and renames it), so the snapshot stays as it was taken.
        copy_dir(landing, &dir.join("landing"), true);
        copy_dir(warehouse, &dir.join("warehouse"), true);
        Snapshot {
            dir: dir.to_path_buf(),
            first,
        }
    }
}

/// The window's runs on a fresh copy of `snap`, each as a cron-driven `kestrel run`
/// (a new process: nothing kept) with the pipeline's configuration `cfg` (its
/// parallelism, its scaled tombstone retention) pointed at the copy, its drop's files
/// linked into the copy's landing zone first (with their modification times). Mean
/// seconds per run.
async fn run_window(
    snap: &Snapshot,
    drops: &[Vec<PathBuf>],
    cfg: &Config,
    copy: &Path,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    jobs: &BTreeMap<String, JobSpec>,
) -> f64 {
    let _ = std::fs::remove_dir_all(copy);
    std::fs::create_dir_all(copy).unwrap();
    copy_dir(&snap.dir.join("landing"), &copy.join("landing"), true);
    copy_dir(&snap.dir.join("warehouse"), &copy.join("warehouse"), false);
    let landing = Path::new(&cfg.landing);
    let mut cfg = cfg.clone();
    cfg.landing = copy.join("landing").display().to_string();
    cfg.warehouse = copy.join("warehouse").display().to_string();
    let mut total = 0.0;
    for (k, files) in drops[snap.first..snap.first + WINDOW].iter().enumerate() {
        for f in files {
            let rel = f.strip_prefix(landing).unwrap();
            let to = copy.join("landing").join(rel);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::hard_link(f, &to).unwrap();
        }
        kestrel::sink::tables::clear();
        kestrel::sink::timings::take();
        let t = Instant::now();
        run_once(&cfg, schemas, jobs, drop_end(snap.first + k)).await;
        total += t.elapsed().as_secs_f64();
    }
    let _ = std::fs::remove_dir_all(copy);
    total / WINDOW as f64
}

/// The day's-end side by side: [`REPEATS`] alternating runs of the young window (runs
/// 24–39, 02:00–03:15) and of the aged one (the day's last [`WINDOW`] runs), each on a
/// fresh copy, back to back, so the machine's drift over minutes falls on both alike.
/// Both windows hold the same hourly work (two runs ≡ 0 mod 12) and no daily
/// maintenance slot (03:30). Returns (aged, young) medians of the windows' mean run and
/// the median of the repetitions' ratios.
async fn side_by_side(
    young: &Snapshot,
    aged: &Snapshot,
    drops: &[Vec<PathBuf>],
    cfg: &Config,
    base: &Path,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    jobs: &BTreeMap<String, JobSpec>,
) -> (f64, f64, f64) {
    let copy = base.join("control");
    let (mut a, mut y, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..REPEATS {
        let ys = run_window(young, drops, cfg, &copy, schemas, jobs).await;
        let as_ = run_window(aged, drops, cfg, &copy, schemas, jobs).await;
        y.push(ys);
        a.push(as_);
        r.push(as_ / ys);
    }
    (median(&a), median(&y), median(&r))
}

/// Which drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    Small,
    Scale,
}

impl Size {
    /// Multiplier on the demo's rates (2 visitors/s of ~8 events, 0.3 orders/s).
    fn rate(self) -> f64 {
        match self {
            // ≈ 500 events per 300-s drop.
            Size::Small => 0.093,
            // 14 M clickstream events a day ≈ 162/s ≈ 10.1 × the demo's 16/s.
            Size::Scale => 10.1,
        }
    }
    fn skus(self) -> usize {
        match self {
            Size::Small => 200,
            Size::Scale => 5_000,
        }
    }
    fn default_runs(self) -> usize {
        match self {
            Size::Small => 7 * 288,
            Size::Scale => 288,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Size::Small => "small",
            Size::Scale => "scale",
        }
    }
}

/// An event waiting for its arrival: (arrival µs, sequence, source index, partition, line).
type Pending = Reverse<(i64, u64, usize, u32, String)>;

/// The event generator: state that carries over between drops (stock levels, events
/// generated earlier that arrive later).
struct Gen {
    rng: StdRng,
    size: Size,
    prices: Vec<i64>,
    on_hand: Vec<i64>,
    pending: BinaryHeap<Pending>,
    seq: u64,
    started: bool,
    lines: u64,
}

fn rfc3339(us: i64) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl Gen {
    fn new(size: Size, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let prices = (0..size.skus())
            .map(|_| rng.gen_range(199..20_000))
            .collect();
        Gen {
            rng,
            size,
            prices,
            on_hand: vec![0; size.skus()],
            pending: BinaryHeap::new(),
            seq: 0,
            started: false,
            lines: 0,
        }
    }

    fn exp(&mut self, mean_s: f64) -> i64 {
        let u: f64 = self.rng.gen_range(f64::EPSILON..1.0);
        (-u.ln() * mean_s * 1e6) as i64
    }

    fn sku(&mut self) -> usize {
        let u: f64 = self.rng.gen();
        ((u * u * u) * self.size.skus() as f64) as usize % self.size.skus()
    }

    /// Arrival delay: the demo's heavy tail, plus 0.1 % minutes to hours late and
    /// 0.002 % beyond the 3-day lookback.
    fn lateness(&mut self) -> i64 {
        let base = kestrel::demo::sample_lateness_us(&mut self.rng);
        let r: f64 = self.rng.gen();
        if r < 0.000_02 {
            base + self.rng.gen_range(80 * 3600 * US..100 * 3600 * US)
        } else if r < 0.001 {
            base + self.rng.gen_range(5 * MINUTE..120 * MINUTE)
        } else {
            base
        }
    }

    /// Queue one event of `source` (index into [`SOURCES`]) at `ts` with its fields.
    fn push(&mut self, source: usize, ts: i64, fields: String) {
        let id = uuid::Uuid::from_u128(self.rng.gen())
            .hyphenated()
            .to_string();
        let ts_field = if self.rng.gen_bool(0.1) {
            format!("{}", ts / 1000)
        } else {
            format!("\"{}\"", rfc3339(ts))
        };
        let line = format!(r#"{{"event_id":"{id}","event_ts":{ts_field},{fields}}}"#);
        let partition = self.rng.gen_range(0..SOURCES[source].1);
        let arrival = ts + self.lateness();
        if self.rng.gen_bool(0.003) {
            let again = arrival + self.rng.gen_range(0..120 * US);
            self.seq += 1;
            self.pending
                .push(Reverse((again, self.seq, source, partition, line.clone())));
        }
        self.seq += 1;
        self.pending
            .push(Reverse((arrival, self.seq, source, partition, line)));
    }

    fn clickstream(&mut self, t0: i64, t1: i64) {
        let rate = 2.0 * self.size.rate();
        let pages = ["/", "/search", "/cart", "/checkout", "/account"];
        let mut t = t0;
        loop {
            t += self.exp(1.0 / rate);
            if t >= t1 {
                break;
            }
            let anon = uuid::Uuid::from_u128(self.rng.gen()).simple().to_string();
            let mut et = t;
            for _ in 0..self.rng.gen_range(1..16) {
                let r: f64 = self.rng.gen();
                let sku = self.sku();
                let fields = if r < 0.6 {
                    format!(
                        r#""anonymous_id":"{anon}","event_type":"page_view","sku":"SKU-{sku:05}","page":"/p/SKU-{sku:05}""#
                    )
                } else if r < 0.7 {
                    let p = pages[self.rng.gen_range(0..pages.len())];
                    format!(r#""anonymous_id":"{anon}","event_type":"page_view","page":"{p}""#)
                } else if r < 0.8 {
                    format!(r#""anonymous_id":"{anon}","event_type":"search","page":"/search""#)
                } else if r < 0.95 {
                    format!(
                        r#""anonymous_id":"{anon}","event_type":"add_to_cart","sku":"SKU-{sku:05}","page":"/p/SKU-{sku:05}""#
                    )
                } else {
                    format!(r#""anonymous_id":"{anon}","event_type":"checkout","page":"/checkout""#)
                };
                self.push(0, et, fields);
                et += if self.rng.gen_bool(0.03) {
                    self.exp(2400.0)
                } else {
                    self.exp(40.0)
                };
            }
        }
    }

    fn inventory(&mut self, ts: i64, sku: usize, kind: &str, quantity: i64) {
        let wh = sku % 3 + 1;
        self.push(
            1,
            ts,
            format!(r#""sku":"SKU-{sku:05}","warehouse_id":"WH-{wh}","kind":"{kind}","quantity":{quantity}"#),
        );
    }

    fn pay(&mut self, order: &str, ts: i64, amount: i64, status: &str) {
        let pid = uuid::Uuid::from_u128(self.rng.gen()).simple().to_string();
        self.push(
            3,
            ts,
            format!(r#""payment_id":"pay-{pid}","order_id":"{order}","amount_cents":{amount},"status":"{status}""#),
        );
    }

    fn commerce(&mut self, t0: i64, t1: i64) {
        if !self.started {
            self.started = true;
            for s in 0..self.size.skus() {
                let level = if s % 17 == 0 {
                    3
                } else {
                    self.rng.gen_range(20..200)
                };
                self.on_hand[s] = level;
                self.inventory(t0, s, "count", level);
            }
        }
        let rate = 0.3 * self.size.rate();
        let mut t = t0;
        loop {
            t += self.exp(1.0 / rate);
            if t >= t1 {
                break;
            }
            let order = format!("ord-{}", uuid::Uuid::from_u128(self.rng.gen()).simple());
            let mut total = 0;
            for l in 0..self.rng.gen_range(1..4) {
                let s = self.sku();
                let qty = self.rng.gen_range(1..4i64);
                let amount = qty * self.prices[s];
                total += amount;
                let ts = t + l * self.rng.gen_range(0..3 * US);
                self.push(
                    2,
                    ts,
                    format!(r#""order_id":"{order}","sku":"SKU-{s:05}","quantity":{qty},"amount_cents":{amount}"#),
                );
                let sale = ts + self.rng.gen_range(0..5 * US);
                self.on_hand[s] -= qty;
                self.inventory(sale, s, "sale", -qty);
                if self.on_hand[s] <= 0 && self.rng.gen_bool(0.5) {
                    let at = sale + self.exp(600.0);
                    let q = self.rng.gen_range(20..100);
                    self.on_hand[s] += q;
                    self.inventory(at, s, "receipt", q);
                }
            }
            let r: f64 = self.rng.gen();
            let auth = t + self.rng.gen_range(US..20 * US);
            if r >= 0.02 {
                self.pay(&order, auth, total, "authorized");
                if r < 0.05 {
                    self.pay(&order, auth + 5 * US, total, "failed");
                    let retry = auth + self.exp(900.0);
                    self.pay(&order, retry, total, "captured");
                } else if r < 0.06 {
                    let cap = auth + self.exp(60.0);
                    self.pay(&order, cap, total - 100, "captured");
                } else {
                    let cap = auth + self.exp(60.0);
                    self.pay(&order, cap, total, "captured");
                    if r > 0.98 {
                        let refund = cap + self.exp(1200.0);
                        self.pay(&order, refund, total, "refunded");
                    }
                }
            }
            if self.rng.gen_bool(0.005) {
                let ghost = format!("ord-{}", uuid::Uuid::from_u128(self.rng.gen()).simple());
                self.pay(&ghost, t, 999, "captured");
            }
            if self.rng.gen_bool(0.02) {
                let s = self.sku();
                let adj = -self.rng.gen_range(1..3);
                self.on_hand[s] += adj;
                let at = t + self.exp(30.0);
                self.inventory(at, s, "adjustment", adj);
            }
        }
    }

    /// Generate the events of `[t0, t1)` and land every event that arrived by `t1`:
    /// per source partition one file for the drop (`small`) or per arrival minute
    /// (`scale`), modification time = the end of its span. Returns the files and the
    /// number of lines.
    fn land(&mut self, landing: &Path, t0: i64, t1: i64) -> (Vec<PathBuf>, usize) {
        self.clickstream(t0, t1);
        self.commerce(t0, t1);
        let span = match self.size {
            Size::Small => DROP,
            Size::Scale => MINUTE,
        };
        let mut files: BTreeMap<(usize, u32, i64), String> = BTreeMap::new();
        while self.pending.peek().is_some_and(|Reverse(p)| p.0 < t1) {
            let Some(Reverse((arrival, _, source, partition, line))) = self.pending.pop() else {
                break;
            };
            let slot = arrival.max(t0).div_euclid(span);
            let text = files.entry((source, partition, slot)).or_default();
            self.lines += 1;
            if self.lines.is_multiple_of(5_000) {
                text.push_str(r#"{"event_id": "broken", "event_ts": "2026-"#);
                text.push('\n');
            }
            text.push_str(&line);
            text.push('\n');
        }
        let mut lines = 0;
        let mut landed_files = Vec::with_capacity(files.len());
        for ((source, partition, slot), text) in files {
            lines += text.lines().count();
            let (name, _) = SOURCES[source];
            let dir = landing.join(name).join(format!("partition={partition}"));
            std::fs::create_dir_all(&dir).unwrap();
            let stamp = chrono::DateTime::from_timestamp_micros(slot * span)
                .unwrap_or_default()
                .format("%Y%m%dT%H%M%SZ");
            let file = dir.join(format!("{stamp}-{name}.ndjson"));
            let tmp = dir.join(format!("_{stamp}-{name}.tmp"));
            std::fs::write(&tmp, text).unwrap();
            let landed = ((slot + 1) * span).min(t1);
            let ft = filetime::FileTime::from_unix_time(landed / US, 0);
            filetime::set_file_mtime(&tmp, ft).unwrap();
            std::fs::rename(&tmp, &file).unwrap();
            landed_files.push(file);
        }
        (landed_files, lines)
    }
}

/// One measured run.
struct Run {
    index: usize,
    at_us: i64,
    files: usize,
    lines: usize,
    ingest_s: f64,
    jobs_s: Vec<f64>,
    total_s: f64,
    rss_mb: f64,
    /// Heap in use once the run is over (malloc's count, after its memory is freed):
    /// what the process keeps from one run to the next.
    kept_mb: f64,
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The simulated time run index `i` (0-based) happens at: the end of its drop.
fn drop_end(i: usize) -> i64 {
    START_US + (i as i64 + 1) * DROP
}

/// What a cron-driven `kestrel run` does ([`App::run`]: every source and job,
/// `parallel_jobs` at once, a job once its sources are ingested). Returns the seconds
/// until the last source's ingestion finished and the seconds after it (the jobs still
/// running then).
async fn run_once(
    cfg: &Config,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    jobs: &BTreeMap<String, JobSpec>,
    at_us: i64,
) -> (f64, Vec<f64>) {
    let t = Instant::now();
    // Processing time is the simulated time the run happens at (the drop's end): what
    // it stamps — the run log's `run_date` partition, `_ingested_at`, plan times — rolls
    // over with the simulated days, as a real pipeline's does. On the wall clock a
    // simulated week fell on one `run_date`, and the open run-log partition (compacted
    // between batches) grew all week: 33 → 60 ms a run of compaction by day 7.
    let clock = Clock::shifted(at_us);
    let started_us = clock.now_us();
    let app = App::with_parts(
        cfg.clone(),
        schemas.clone(),
        jobs.clone(),
        IngestOptions::default(),
    )
    .unwrap()
    .with_clock(clock);
    let out = app.run(&[], &[]).await.unwrap();
    assert!(out.failures().is_none(), "{:?}", out.failures());
    let total = t.elapsed().as_secs_f64();
    // Each source's and job's batches (from the run log's own start and finish stamps:
    // the batch, not the compaction after it) beside the storage operations.
    let took = |what: String, started_us: i64, finished_us: i64| {
        let us = (finished_us - started_us).max(0) as u64;
        kestrel::sink::timings::record(what, std::time::Duration::from_micros(us));
    };
    for r in &out.sources {
        for b in &r.batches {
            took(
                format!("batch ingest {}", r.source),
                b.started_at_us,
                b.finished_at_us,
            );
        }
    }
    for r in &out.jobs {
        for b in &r.batches {
            took(
                format!("batch job {}", r.job),
                b.started_at_us,
                b.finished_at_us,
            );
        }
    }
    let ingest_s = super::ingested_after(&out, started_us, total);
    (ingest_s, vec![total - ingest_s])
}

/// Active files of a table (0 when absent).
async fn active_files(cfg: &Config, rel: &str) -> usize {
    let wh = kestrel::sink::delta::Warehouse::new(
        kestrel::storage::Location::open(&cfg.warehouse, &BTreeMap::new(), true).unwrap(),
    );
    match wh.open(rel).await.unwrap() {
        Some(t) => t.snapshot().map(|s| s.log_data().num_files()).unwrap_or(0),
        None => 0,
    }
}

/// The `age` benchmark; `runs` overrides the mode's default.
pub async fn age(
    base: &Path,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    jobs: &BTreeMap<String, JobSpec>,
    size: Size,
    runs: Option<usize>,
) {
    let runs = runs.unwrap_or(size.default_runs());
    let dir = base.join(format!("age-{}", size.name()));
    let mut cfg = Config::defaults(&dir);
    cfg.landing = dir.join("landing").display().to_string();
    cfg.warehouse = dir.join("warehouse").display().to_string();
    // `KESTREL_AGE_PARALLEL=1` works on one source or job at a time (the default: as many
    // at once as `kestrel run`, one per core).
    if let Some(n) = std::env::var("KESTREL_AGE_PARALLEL")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        cfg.parallel_jobs = n.max(1);
    }
    let daemon = std::env::var("KESTREL_AGE_DAEMON").is_ok_and(|v| v == "1");
    if daemon {
        println!("  daemon mode: one process, tables kept from run to run (the side by side still replays cron runs)");
    }
    // Checkpoints drop tombstones by the wall clock, and the simulated clock here runs
    // ~55× (scale: a five-minute run every ~5.5 s) to ~200× (small: ~1.5 s) faster: the
    // default hour, scaled to it (about twelve runs).
    cfg.maintain.tombstone_retention = std::time::Duration::from_secs(match size {
        Size::Small => 18,
        Size::Scale => 65,
    });
    std::fs::create_dir_all(&cfg.landing).unwrap();
    let landing = PathBuf::from(&cfg.landing);
    let specs: Vec<JobSpec> = jobs.values().cloned().collect();
    let sources: Vec<String> = SOURCES.iter().map(|(s, _)| s.to_string()).collect();
    let mut gen = Gen::new(size, 7);
    let csv_path = format!("age-{}.csv", size.name());
    let mut csv = std::io::BufWriter::new(std::fs::File::create(&csv_path).unwrap());
    writeln!(
        csv,
        "run,sim_time,files,lines,total_s,ingest_s,jobs_s,peak_rss_mb"
    )
    .unwrap();
    let mut prof = std::env::var("KESTREL_AGE_PROFILE").is_ok().then(|| {
        let path = format!("age-{}-profile.csv", size.name());
        let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
        writeln!(f, "run,ms_per_run,calls_per_run,operation").unwrap();
        f
    });
    println!(
        "age {}: {runs} runs of five-minute drops from {} (all seven jobs, random UUIDs)",
        size.name(),
        rfc3339(START_US)
    );
    // The event stream existed before the pipeline: three hours of events (the lateness
    // tail reaches two) land before the first measured run, which ingests them as a
    // backlog, so run 1 already sees late data for windows it has computed.
    let warm = Instant::now();
    let mut backlog = (0, 0);
    let mut t = START_US - WARMUP;
    while t < START_US {
        let (f, l) = gen.land(&landing, t, t + DROP);
        backlog = (backlog.0 + f.len(), backlog.1 + l);
        t += DROP;
    }
    kestrel::sink::tables::clear();
    run_once(&cfg, schemas, jobs, START_US).await;
    // The first hour's profile is of runs 1–12, not of the backlog before them.
    kestrel::sink::timings::take();
    println!(
        "  backlog of {} h before the first run ({} files, {} lines): ingested and computed in {:.1} s",
        WARMUP / 3_600_000_000,
        backlog.0,
        backlog.1,
        warm.elapsed().as_secs_f64()
    );
    let mut young: Option<Snapshot> = None;
    let mut controls: Vec<(usize, f64, f64, f64, f64)> = Vec::new();
    let mut aged: Option<Snapshot> = None;
    // Every drop's files, for the side by side's windows.
    let mut drops: Vec<Vec<PathBuf>> = Vec::with_capacity(runs);
    let mut done: Vec<Run> = Vec::with_capacity(runs);
    let mut maint_s: Vec<f64> = Vec::new();
    let mut last_slot_day = None;
    for i in 0..runs {
        let t0 = START_US + i as i64 * DROP;
        let t1 = t0 + DROP;
        // The daemon's daily maintenance slot (03:30) falls inside this drop.
        let day = t1.div_euclid(DAY_US);
        let slot = day * DAY_US + (3 * 60 + 30) * MINUTE;
        if t0 <= slot && slot < t1 && last_slot_day != Some(day) {
            last_slot_day = Some(day);
            let wh = kestrel::sink::delta::Warehouse::new(
                kestrel::storage::Location::open(&cfg.warehouse, &BTreeMap::new(), true).unwrap(),
            );
            let mut opts = MaintainOptions::from_config(&cfg);
            opts.today = day as i32;
            let t = Instant::now();
            let r = maintain::run(&wh, &sources, &specs, &opts, |_| {})
                .await
                .unwrap();
            let s = t.elapsed().as_secs_f64();
            maint_s.push(s);
            let before: usize = r.tables.iter().map(|t| t.files_before).sum();
            let after: usize = r.tables.iter().map(|t| t.files_after).sum();
            println!(
                "  {} daily maintenance: {before} active files → {after} in {s:.1} s",
                rfc3339(slot)
            );
        }
        let warehouse = Path::new(&cfg.warehouse);
        if i == CONTROL_AT && runs >= CONTROL_AT + WINDOW {
            // The young pipeline before run 24, measured again beside the aged one.
            let at = base.join(format!("age-{}-young", size.name()));
            young = Some(Snapshot::take(warehouse, &landing, &at, i));
        }
        if (i + WINDOW).is_multiple_of(288) && i >= CONTROL_AT + WINDOW {
            // The aged pipeline before the day's last WINDOW runs.
            let at = base.join(format!("age-{}-day-end", size.name()));
            aged = Some(Snapshot::take(warehouse, &landing, &at, i));
        }
        let (landed, lines) = gen.land(&landing, t0, t1);
        let files = landed.len();
        drops.push(landed);
        // Each cron-driven `kestrel run` is a new process: nothing kept from the last,
        // and its own peak memory (freed memory returned, the peak counter reset).
        // `KESTREL_AGE_DAEMON=1`: one process runs them all, as the daemon does —
        // tables kept from run to run, the footer cache cleared between them.
        if daemon {
            kestrel::sink::delta::clear_file_metadata();
        } else {
            kestrel::sink::tables::clear();
        }
        reset_peak_rss();
        let t = Instant::now();
        let (ingest_s, jobs_s) = run_once(&cfg, schemas, jobs, t1).await;
        let total_s = t.elapsed().as_secs_f64();
        let run = Run {
            index: i + 1,
            at_us: t1,
            files,
            lines,
            ingest_s,
            jobs_s,
            total_s,
            rss_mb: peak_rss_bytes() as f64 / 1e6,
            kept_mb: heap_in_use_bytes() as f64 / 1e6,
        };
        writeln!(
            csv,
            "{},{},{},{},{:.3},{:.3},{},{:.0}",
            run.index,
            rfc3339(run.at_us),
            run.files,
            run.lines,
            run.total_s,
            run.ingest_s,
            run.jobs_s
                .iter()
                .map(|s| format!("{s:.3}"))
                .collect::<Vec<_>>()
                .join(","),
            run.rss_mb
        )
        .unwrap();
        done.push(run);
        if let (true, Some(young), Some(aged)) = ((i + 1) % 288 == 0, &young, &aged) {
            let last12 = median(
                &done[done.len() - 12..]
                    .iter()
                    .map(|r| r.total_s)
                    .collect::<Vec<_>>(),
            );
            let (aged, young_now, ratio) =
                side_by_side(young, aged, &drops, &cfg, base, schemas, jobs).await;
            println!(
                "  day {} ends: last 12 runs {last12:.2} s; side by side ({REPEATS} × {WINDOW} runs): the day's last {WINDOW} on the aged pipeline {aged:.2} s a run, runs 24–39 on the young one {young_now:.2} s; aged ÷ young {ratio:.2}",
                (i + 1) / 288,
            );
            controls.push(((i + 1) / 288, last12, aged, young_now, ratio));
        }
        if (i + 1) % 12 == 0 {
            csv.flush().unwrap();
            let last: Vec<f64> = done[done.len() - 12..].iter().map(|r| r.total_s).collect();
            let r = &done[done.len() - 1];
            println!(
                "  run {:>4} ({}): median of the last 12 {:.2} s (sources ingested by {:.2} s, jobs after that {:.2} s), {} lines/drop, peak RSS {:.0} MB, heap kept {:.0} MB, {} events pending",
                r.index,
                rfc3339(r.at_us),
                median(&last),
                r.ingest_s,
                r.jobs_s.iter().sum::<f64>(),
                r.lines,
                r.rss_mb,
                r.kept_mb,
                gen.pending.len()
            );
            if let Some(prof) = prof.as_mut() {
                let p = kestrel::sink::timings::take();
                // Every operation, not only the top 25: `age-<mode>-profile.csv`.
                for (k, (n, d)) in &p {
                    writeln!(
                        prof,
                        "{},{:.3},{:.2},\"{}\"",
                        r.index,
                        d.as_secs_f64() * 1e3 / 12.0,
                        *n as f64 / 12.0,
                        k.replace('"', "'").replace('\n', " ")
                    )
                    .unwrap();
                }
                prof.flush().unwrap();
                let mut v: Vec<_> = p.into_iter().collect();
                v.sort_by_key(|e| std::cmp::Reverse(e.1 .1));
                for (k, (n, d)) in v.iter().take(25) {
                    println!(
                        "      {:>8.1} ms/run {:>6.1} calls/run  {k}",
                        d.as_secs_f64() * 1e3 / 12.0,
                        *n as f64 / 12.0
                    );
                }
            }
        }
    }
    csv.flush().unwrap();

    // A run with nothing new, after all that.
    let mut idle = Vec::new();
    for _ in 0..3 {
        kestrel::sink::tables::clear();
        let t = Instant::now();
        run_once(&cfg, schemas, jobs, drop_end(runs)).await;
        idle.push(t.elapsed().as_secs_f64());
    }

    let totals: Vec<f64> = done.iter().map(|r| r.total_s).collect();
    let first = median(&totals[..totals.len().min(12)]);
    let day_end = |d: usize| -> Option<f64> {
        let end = d * 288;
        (totals.len() >= end).then(|| median(&totals[end - 12..end]))
    };
    println!(
        "\nage {}: per-run cost (ingest + seven jobs), medians of 12 runs",
        size.name()
    );
    println!("  runs 1–12 of day 1:        {first:.2} s");
    let report = |label: &str, v: Option<f64>| {
        if let Some(v) = v {
            println!(
                "  {label:<26} {v:.2} s   ratio to runs 1–12: {:.2} (target ≤ 1.2)",
                v / first
            );
        }
    };
    report("last 12 runs of day 1:", day_end(1));
    report("last 12 runs of day 7:", day_end(7));
    if totals.len() > 12 && day_end(1).is_none() {
        report(
            &format!("last 12 of {} runs:", totals.len()),
            Some(median(&totals[totals.len() - 12..])),
        );
    }
    let (slowest, at) = done
        .iter()
        .map(|r| (r.total_s, r.index))
        .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a });
    println!("  slowest run: {slowest:.2} s (run {at})");
    println!(
        "  run with nothing new after {} runs: median of 3 {:.2} s (target ≤ 0.5)",
        totals.len(),
        median(&idle)
    );
    if !maint_s.is_empty() {
        println!(
            "  daily maintenance slots: {} , median {:.1} s",
            maint_s.len(),
            median(&maint_s)
        );
    }
    for (day, last12, aged, young_now, ratio) in &controls {
        println!(
            "  side by side at the end of day {day}: the day's last {WINDOW} runs on the aged pipeline {aged:.2} s a run ÷ runs 24–39 on the young one {young_now:.2} s, median of {REPEATS} alternating repetitions' ratios {ratio:.2} (target ≤ 1.2); last 12 runs {last12:.2} s",
        );
    }
    let worst = done.iter().map(|r| r.rss_mb).fold(0.0, f64::max);
    // Megabytes (10^6 bytes), as the per-run figures and the CSV; the target is 1 GiB.
    println!(
        "  peak RSS of a run (each measured from its start): {worst:.0} MB = {:.0} MiB (target ≤ 1 GiB = 1,074 MB)",
        worst * 1e6 / (1u64 << 20) as f64
    );
    let mut tables: Vec<String> = Vec::new();
    for (s, _) in SOURCES {
        tables.push(format!("bronze/{s}"));
    }
    for spec in &specs {
        tables.push(spec.table.clone());
    }
    tables.push("gold/sku_availability".into());
    tables.push("_kestrel/runs".into());
    tables.push("_kestrel/ledger".into());
    let mut counts = Vec::new();
    for t in &tables {
        counts.push(format!("{t} {}", active_files(&cfg, t).await));
    }
    println!("  active files: {}", counts.join(", "));
    println!("  every run: {csv_path}");
}

fn status_kb(key: &str) -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
        })
        .unwrap_or(0)
}

/// Return freed memory to the system and restart the peak-RSS counter, so the next
/// run's peak is its own (as if it were a new process).
fn reset_peak_rss() {
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Bytes malloc has handed out and not had back (every arena, mapped chunks included).
fn heap_in_use_bytes() -> usize {
    // SAFETY: mallinfo2 only reads malloc's counters.
    let m = unsafe { libc::mallinfo2() };
    m.uordblks + m.hblkhd
}

fn peak_rss_bytes() -> usize {
    status_kb("VmHWM:") * 1024
}

/// `age logcost`: what one more commit and one open cost against a table with many
/// commits already in its log (the run log's situation), and with many files.
pub async fn log_cost(base: &Path) {
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use kestrel::sink::delta;
    let dir = base.join("logcost");
    std::fs::create_dir_all(&dir).unwrap();
    let wh = delta::Warehouse::new(
        kestrel::storage::Location::open(dir.to_str().unwrap(), &BTreeMap::new(), true).unwrap(),
    );
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
    let mut t = wh.open_or_create("t", &schema, &[]).await.unwrap();
    let batch =
        RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![1]))]).unwrap();
    let mut n = 0;
    for target in [100, 1000, 3000, 10000] {
        while n < target {
            n += 1;
            t = delta::append(t, vec![batch.clone()], &[], "app", n)
                .await
                .unwrap();
            if n % 50 == 0 {
                // keep active files few, as compaction does
                let (nt, _) = t.optimize().await.unwrap();
                t = nt;
            }
        }
        let mut times = Vec::new();
        for _ in 0..10 {
            let s = Instant::now();
            n += 1;
            t = delta::append(t, vec![batch.clone()], &[], "app", n)
                .await
                .unwrap();
            times.push(s.elapsed().as_secs_f64() * 1e3);
        }
        let mut opens = Vec::new();
        for _ in 0..10 {
            // A new process's open: nothing kept (the kept copy is restored below).
            kestrel::sink::tables::clear();
            let s = Instant::now();
            let w2 = delta::Warehouse::new(
                kestrel::storage::Location::open(dir.to_str().unwrap(), &BTreeMap::new(), true)
                    .unwrap(),
            );
            w2.open("t").await.unwrap();
            opens.push(s.elapsed().as_secs_f64() * 1e3);
        }
        kestrel::sink::tables::keep(&t);
        let mut incr = Vec::new();
        for _ in 0..10 {
            let s = Instant::now();
            wh.open("t").await.unwrap();
            incr.push(s.elapsed().as_secs_f64() * 1e3);
        }
        // An open-partition compaction of 16 small files, kestrel's (`sink::compact`)
        // and delta-rs's optimize (whose post-commit hook lists the whole log), in
        // alternating pairs against the same log.
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        let opts = kestrel::sink::compact::OpenCompaction::default();
        for _ in 0..3 {
            for by_delta_rs in [false, true] {
                for _ in 0..16 {
                    n += 1;
                    t = delta::append(t, vec![batch.clone()], &[], "app", n)
                        .await
                        .unwrap();
                }
                let s = Instant::now();
                if by_delta_rs {
                    let (nt, _) = t.optimize().await.unwrap();
                    t = nt;
                    theirs.push(s.elapsed().as_secs_f64() * 1e3);
                } else {
                    kestrel::sink::compact::open_partitions(&wh, "t", &opts, &[], None, false)
                        .await
                        .unwrap()
                        .expect("compacted");
                    ours.push(s.elapsed().as_secs_f64() * 1e3);
                    t = wh.open("t").await.unwrap().unwrap();
                }
            }
        }
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        println!(
            "{target:>6} commits: append {:.1} ms (mean {mean:.1}), cold open {:.1} ms, kept open {:.1} ms; \
             compaction of 16 files {:.1} ms, by delta-rs's optimize {:.1} ms ({:.2}x)",
            median(&times),
            median(&opens),
            median(&incr),
            median(&ours),
            median(&theirs),
            median(&theirs) / median(&ours)
        );
    }
}
