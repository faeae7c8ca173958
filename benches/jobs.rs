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
    spec: JobSpec,
}

impl Site {
    fn config(&self) -> Config {
        let mut cfg = Config::defaults(&self.dir);
        cfg.landing = self.dir.join("landing").display().to_string();
        cfg.warehouse = self.dir.join("warehouse").display().to_string();
        cfg.ingest.sources = Some(vec!["orders".into()]);
        cfg
    }

    /// Ingest what landed, then run revenue_5m: (ingest s, job s).
    async fn step(&self) -> (f64, f64) {
        let t = Instant::now();
        let ing = Ingestor::with_schemas(
            self.config(),
            self.schemas.clone(),
            IngestOptions::default(),
        )
        .unwrap();
        ing.ingest_source("orders").await.unwrap();
        let ingest_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let wh = Warehouse::new(
            Location::open(&self.config().warehouse, &BTreeMap::new(), true).unwrap(),
        );
        let runner = JobRunner::new(
            wh,
            self.schemas.clone(),
            std::time::Duration::from_secs(600),
        );
        runner.run_job(&self.spec).await.unwrap();
        (ingest_s, t.elapsed().as_secs_f64())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn history(base: &Path, schemas: &BTreeMap<String, Arc<SourceSchema>>, spec: &JobSpec) {
    let mut sites = Vec::new();
    for days in [1i64, 30] {
        let site = Site {
            dir: base.join(format!("h{days}")),
            schemas: schemas.clone(),
            spec: spec.clone(),
        };
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
    let site = Site {
        dir: base.join("tp"),
        schemas: schemas.clone(),
        spec: spec.clone(),
    };
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
    let (ingest_total, job_total) = site.step().await;
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
        if !args.iter().any(|a| a == "throughput") {
            history(tmp.path(), &schemas, &spec).await;
        }
        if !args.iter().any(|a| a == "history") {
            throughput(tmp.path(), events, &schemas, &spec).await;
        }
    });
}
