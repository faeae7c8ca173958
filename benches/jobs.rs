//! Windowed-job benchmark (not a test): `cargo bench --bench jobs -- [EVENTS]`.
//!
//! 1. History: one 5-minute micro-batch of 100k order events through ingestion and
//!    `revenue_5m`, against a warehouse holding 1 day and one holding 30 days of history
//!    (20k events/day, 1,000 skus, one ingestion + job batch per day, as a daily-compacted
//!    warehouse looks). Nine rounds, alternating; prints the job-batch times, the files
//!    the MERGE scanned, and the 30d/1d ratio of the medians.
//! 2. Throughput: EVENTS order events (default 5,000,000) landed as NDJSON, then
//!    landing → bronze → `gold/revenue_5m` end to end, in events/s; side by side with
//!    the same aggregate computed by DataFusion alone straight from the NDJSON files (no
//!    validation, dedup, Delta or MERGE): the ceiling on this machine.
//! 3. Payments: one hour of orders and payments through `payment_reconciliation` and
//!    `payments_fast` against 1, 10 and 30 days of history.
//!
//! Pick one with `history`, `throughput` (or an event count) or `payments`; none: all.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kestrel::config::Config;
use kestrel::job::spec::JobSpec;
use kestrel::runner::batch::JobRunner;
use kestrel::runner::ingest::{IngestOptions, Ingestor};
use kestrel::schema::SourceSchema;
use kestrel::sink::delta::Warehouse;
use kestrel::storage::Location;

/// 2025-11-20T00:00:00Z.
const DAY0: i64 = 1_763_596_800;
const DAY: i64 = 86_400;
/// Micro-batches measured per warehouse (alternating, median reported).
const ROUNDS: i64 = 9;

fn write_orders(path: &Path, n: usize, first_id: usize, start_s: i64, span_s: i64, landed: i64) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for i in 0..n {
        let id = first_id + i;
        let ts_ms = start_s * 1000 + (i as i64 * 7919) % (span_s * 1000);
        writeln!(
            w,
            r#"{{"event_id":"e{id:012}","event_ts":{ts_ms},"order_id":"o{:010}","sku":"SKU-{:04}","quantity":{},"amount_cents":{}}}"#,
            id / 2,
            id % 1000,
            1 + id % 3,
            199 * (1 + id % 3)
        )
        .unwrap();
    }
    w.flush().unwrap();
    drop(w);
    filetime::set_file_mtime(path, filetime::FileTime::from_unix_time(landed, 0)).unwrap();
}

struct Site {
    dir: PathBuf,
    schemas: BTreeMap<String, Arc<SourceSchema>>,
    sources: Vec<String>,
    specs: Vec<JobSpec>,
}

impl Site {
    fn new(
        dir: PathBuf,
        schemas: &BTreeMap<String, Arc<SourceSchema>>,
        specs: &[&JobSpec],
    ) -> Self {
        let mut sources: Vec<String> = specs.iter().flat_map(|s| s.sources.clone()).collect();
        sources.sort();
        sources.dedup();
        Site {
            dir,
            schemas: schemas.clone(),
            sources,
            specs: specs.iter().map(|s| (*s).clone()).collect(),
        }
    }

    fn config(&self) -> Config {
        let mut cfg = Config::defaults(&self.dir);
        cfg.landing = self.dir.join("landing").display().to_string();
        cfg.warehouse = self.dir.join("warehouse").display().to_string();
        cfg.ingest.sources = Some(self.sources.clone());
        cfg
    }

    /// Ingest what landed, then run each job: (ingest s, job s per job).
    async fn step(&self) -> (f64, Vec<f64>) {
        let t = Instant::now();
        let ing = Ingestor::with_schemas(
            self.config(),
            self.schemas.clone(),
            IngestOptions::default(),
        )
        .unwrap();
        for s in &self.sources {
            ing.ingest_source(s).await.unwrap();
        }
        let ingest_s = t.elapsed().as_secs_f64();
        let wh = Warehouse::new(
            Location::open(&self.config().warehouse, &BTreeMap::new(), true).unwrap(),
        );
        let runner = JobRunner::new(
            wh,
            self.schemas.clone(),
            std::time::Duration::from_secs(600),
        );
        let mut job_s = Vec::new();
        for spec in &self.specs {
            let t = Instant::now();
            runner.run_job(spec).await.unwrap();
            job_s.push(t.elapsed().as_secs_f64());
        }
        (ingest_s, job_s)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn history(base: &Path, schemas: &BTreeMap<String, Arc<SourceSchema>>, spec: &JobSpec) {
    let mut sites = Vec::new();
    for days in [1i64, 30] {
        let site = Site::new(base.join(format!("h{days}")), schemas, &[spec]);
        let t = Instant::now();
        for d in 0..days {
            let start = DAY0 - (days - d) * DAY;
            let p = site.dir.join(format!("landing/orders/h{d:04}.ndjson"));
            write_orders(
                &p,
                20_000,
                (d as usize) * 20_000,
                start,
                DAY,
                start + DAY + 60,
            );
            site.step().await;
        }
        println!(
            "history {days:>2} d: built in {:.1} s ({} job batches)",
            t.elapsed().as_secs_f64(),
            days
        );
        sites.push((days, site));
    }
    let mut times: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    for round in 0..ROUNDS {
        for (days, site) in &sites {
            let start = DAY0 + round * 300;
            let p = site.dir.join(format!("landing/orders/n{round:04}.ndjson"));
            write_orders(
                &p,
                100_000,
                50_000_000 + round as usize * 100_000,
                start,
                300,
                start + 310,
            );
            let (ingest_s, job_s) = site.step().await;
            let job_s = job_s[0];
            println!(
                "round {round}: {days:>2} d of history: ingest {ingest_s:.2} s, revenue_5m batch {job_s:.2} s"
            );
            times.entry(*days).or_default().push(job_s);
        }
    }
    let m1 = median(times[&1].clone());
    let m30 = median(times[&30].clone());
    println!(
        "revenue_5m micro-batch (100k events), median of {ROUNDS}: 1 d {m1:.2} s, 30 d {m30:.2} s, ratio 30d/1d {:.2}  (target ≤ 1.2)",
        m30 / m1
    );
}

async fn throughput(
    base: &Path,
    events: usize,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    spec: &JobSpec,
) {
    let site = Site::new(base.join("tp"), schemas, &[spec]);
    // One hour of event time, 200 files landing over that hour.
    let files = 200usize;
    let per = events / files;
    let mut bytes = 0u64;
    for f in 0..files {
        let start = DAY0 + (f as i64 * 3600) / files as i64;
        let p = site
            .dir
            .join(format!("landing/orders/partition={}/f{f:05}.ndjson", f % 4));
        write_orders(&p, per, f * per, start, 60, start + 90);
        bytes += std::fs::metadata(&p).unwrap().len();
    }
    let n = per * files;
    println!(
        "throughput: {n} events in {files} files, {:.0} MB of NDJSON",
        bytes as f64 / 1e6
    );

    // Ceiling: DataFusion alone, NDJSON → the same aggregate.
    let t = Instant::now();
    let ctx = datafusion::prelude::SessionContext::new();
    let dir = site.dir.join("landing/orders/");
    let opts = datafusion::prelude::JsonReadOptions {
        file_extension: ".ndjson",
        ..Default::default()
    };
    ctx.register_json("o", dir.to_str().unwrap(), opts)
        .await
        .unwrap();
    let b = ctx
        .sql("SELECT sku, (event_ts / 300000) * 300000 AS w, count(*), sum(quantity), sum(amount_cents) FROM o GROUP BY 1, 2")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let rows: usize = b.iter().map(|b| b.num_rows()).sum();
    let ceiling_s = t.elapsed().as_secs_f64();
    println!(
        "DataFusion alone (NDJSON → aggregate, per file, no Delta): {ceiling_s:.2} s, {:.0} events/s ({rows} windows)",
        n as f64 / ceiling_s
    );

    let t = Instant::now();
    // One step ingests every pending batch (≤ 256 MB each), then runs one job batch per
    // ingestion batch.
    let (ingest_total, job_s) = site.step().await;
    let job_total = job_s[0];
    let total = t.elapsed().as_secs_f64();
    println!(
        "kestrel landing → bronze → gold/revenue_5m: {total:.2} s, {:.0} events/s (ingest {ingest_total:.2} s, job {job_total:.2} s)",
        n as f64 / total
    );
    println!(
        "ratio kestrel / DataFusion-alone throughput: {:.2}",
        ceiling_s / total
    );
}

/// Orders `first_id..first_id + n` spread over `[start_s, start_s + span_s)`: two lines
/// each, an authorisation and a capture within a minute (1 % never paid, 1 % a refund two
/// hours later, 0.5 % an extra payment for an order that does not exist).
fn write_commerce(dir: &Path, tag: &str, n: usize, first_id: usize, start_s: i64, span_s: i64) {
    let landed = start_s + span_s + 60;
    let open = |source: &str| {
        let p = dir.join(format!("landing/{source}/{tag}.ndjson"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        (
            p.clone(),
            std::io::BufWriter::new(std::fs::File::create(p).unwrap()),
        )
    };
    let (po, mut o) = open("orders");
    let (pp, mut p) = open("payments");
    let ts = |s: f64| (s * 1000.0) as i64;
    for i in 0..n {
        let id = first_id + i;
        let t = start_s as f64 + (i as f64 * span_s as f64) / n as f64;
        let amount = 199 * (1 + id as i64 % 7);
        for l in 0..2 {
            writeln!(
                o,
                r#"{{"event_id":"o{id}-{l}","event_ts":{},"order_id":"ord{id}","sku":"SKU-{:04}","quantity":1,"amount_cents":{amount}}}"#,
                ts(t + l as f64),
                (id + l) % 1000
            )
            .unwrap();
        }
        let mut pay = |k: &str, dt: f64, order: &str, cents: i64, status: &str| {
            writeln!(
                p,
                r#"{{"event_id":"p{id}-{k}","event_ts":{},"payment_id":"pay{id}","order_id":"{order}","amount_cents":{cents},"status":"{status}"}}"#,
                ts(t + dt)
            )
            .unwrap();
        };
        if id.is_multiple_of(100) {
            continue;
        }
        pay("a", 5.0, &format!("ord{id}"), 2 * amount, "authorized");
        pay("c", 30.0, &format!("ord{id}"), 2 * amount, "captured");
        if id % 100 == 1 {
            pay("r", 7200.0, &format!("ord{id}"), 2 * amount, "refunded");
        }
        if id % 200 == 3 {
            pay("x", 10.0, &format!("ghost{id}"), 999, "captured");
        }
    }
    for (path, mut w) in [(po, o), (pp, p)] {
        w.flush().unwrap();
        drop(w);
        filetime::set_file_mtime(&path, filetime::FileTime::from_unix_time(landed, 0)).unwrap();
    }
}

/// Cost against history of the payments jobs: one hour of orders and payments through
/// ingestion, `payment_reconciliation` and `payments_fast`, against 1, 10 and 30 days of
/// history (ORDERS_PER_DAY orders a day). Reads reach `horizon` (7 d) around the touched
/// orders, so 1 d → 10 d may grow; 10 d → 30 d must not.
async fn payments_history(
    base: &Path,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    jobs: &[&JobSpec],
) {
    const ORDERS_PER_DAY: usize = 24_000;
    let mut sites = Vec::new();
    for days in [1i64, 10, 30] {
        let site = Site::new(base.join(format!("p{days}")), schemas, jobs);
        let t = Instant::now();
        for d in 0..days {
            let start = DAY0 - (days - d) * DAY;
            write_commerce(
                &site.dir,
                &format!("h{d:04}"),
                ORDERS_PER_DAY,
                d as usize * ORDERS_PER_DAY,
                start,
                DAY,
            );
            site.step().await;
        }
        println!(
            "payments history {days:>2} d: built in {:.1} s ({} orders)",
            t.elapsed().as_secs_f64(),
            days as usize * ORDERS_PER_DAY
        );
        sites.push((days, site));
    }
    let mut times: BTreeMap<(i64, usize), Vec<f64>> = BTreeMap::new();
    let hour = ORDERS_PER_DAY / 24;
    for round in 0..ROUNDS {
        for (days, site) in &sites {
            let start = DAY0 + round * 3600;
            write_commerce(
                &site.dir,
                &format!("n{round:04}"),
                hour,
                100_000_000 + round as usize * hour,
                start,
                3600,
            );
            let (ingest_s, job_s) = site.step().await;
            println!(
                "round {round}: {days:>2} d of history: ingest {ingest_s:.2} s, payment_reconciliation {:.2} s, payments_fast {:.2} s",
                job_s[0], job_s[1]
            );
            for (j, s) in job_s.iter().enumerate() {
                times.entry((*days, j)).or_default().push(*s);
            }
        }
    }
    for (j, job) in jobs.iter().enumerate() {
        let m = |d: i64| median(times[&(d, j)].clone());
        println!(
            "{} hourly batch ({hour} orders), median of {ROUNDS}: 1 d {:.2} s, 10 d {:.2} s, 30 d {:.2} s; ratio 30d/10d {:.2} (bounded: ≈ 1), 10d/1d {:.2}",
            job.name,
            m(1),
            m(10),
            m(30),
            m(30) / m(10),
            m(10) / m(1)
        );
    }
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let events: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    rt.block_on(async {
        let schemas = kestrel::schema::load_all(Path::new("/none")).unwrap();
        let jobs = kestrel::job::spec::load_all(Path::new("/none"), &schemas)
            .await
            .unwrap();
        let spec = jobs["revenue_5m"].clone();
        let only = |mode: &str| args.is_empty() || args.iter().any(|a| a == mode);
        if only("history") {
            history(tmp.path(), &schemas, &spec).await;
        }
        if only("throughput") || args.first().is_some_and(|a| a.parse::<usize>().is_ok()) {
            throughput(tmp.path(), events, &schemas, &spec).await;
        }
        if only("payments") {
            let pay = [&jobs["payment_reconciliation"], &jobs["payments_fast"]];
            payments_history(tmp.path(), &schemas, &pay).await;
        }
    });
}
