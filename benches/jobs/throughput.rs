//! `throughput [EVENTS]`: landing → bronze → `gold/revenue_5m` end to end, next to DuckDB
//! and DataFusion computing the same aggregate from the same NDJSON files.
//!
//! EVENTS order events (default 5,000,000) arrive evenly over one hour in 200 files
//! (one every 18 s, four partitions, file modification time = arrival). Event ids are
//! random UUIDs; event time is arrival minus the demo's heavy-tailed lateness (p50
//! 0.4 s, max 16 min, all inside the job's 3-day lookback, so every row is applied);
//! 0.5 % of the events are delivered again, in the same or one of the next six files.
//! Timestamps are RFC 3339 strings with milliseconds, as producers send them.
//!
//! Measured side by side in one run, in this order:
//! 1. kestrel on a copy of the first half of the landing zone, then on all of it (each
//!    with a fresh warehouse, in a process of its own as a `kestrel run` is, with its
//!    own peak RSS: full ÷ half ≈ 1 means memory is bounded by the batch, not by the
//!    landing zone);
//! 2. DuckDB (`$KESTREL_PYTHON`, the venv `.ci/run` installs with duckdb 1.5.5):
//!    `read_json` with explicit columns, re-deliveries dropped (`DISTINCT`: they are
//!    byte-identical lines, so this equals kestrel's dedup by `event_id`), the per (sku,
//!    5-minute window) count and sums, written to Parquet; its own timer around the
//!    query, on as many threads as this machine has cores;
//! 3. DataFusion alone: the same query over the same files (no validation, Delta or
//!    MERGE).
//!
//! Each step starts with every dirty page written back ([`settle`]). The three results
//! are compared row by row (kestrel's from `gold/revenue_5m`); a
//! difference fails the bench.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kestrel::job::spec::JobSpec;
use kestrel::schema::SourceSchema;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{peak_rss_bytes, Site, DAY0};

const FILES: usize = 200;
const SKUS: usize = 1_000;
/// A file lands every this many seconds (200 files: one hour).
const EVERY_S: i64 = 18;

/// (sku, window start µs, orders, units, revenue cents), sorted.
type Rows = Vec<(String, i64, i64, i64, i64)>;

fn rfc3339_ms(us: i64) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

/// Land `events` orders under `dir/landing/orders`; (files, bytes, distinct events).
fn generate(dir: &Path, events: usize) -> (Vec<PathBuf>, u64, usize) {
    let mut rng = StdRng::seed_from_u64(15);
    let per = events / FILES;
    let mut redeliver: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let (mut files, mut bytes, mut distinct) = (Vec::new(), 0u64, 0usize);
    for f in 0..FILES {
        let landed_s = DAY0 + 90 + f as i64 * EVERY_S;
        let path = dir.join(format!("landing/orders/partition={}/f{f:05}.ndjson", f % 4));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut w = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        for line in redeliver.remove(&f).unwrap_or_default() {
            writeln!(w, "{line}").unwrap();
        }
        for i in 0..per {
            // Arrival spread over the file's 18 s; event time = arrival - lateness.
            let arrival_us =
                (landed_s - EVERY_S) * 1_000_000 + (i as i64 * EVERY_S * 1_000_000) / per as i64;
            let ts = arrival_us - kestrel::demo::sample_lateness_us(&mut rng);
            let id = uuid::Uuid::from_u128(rng.gen()).hyphenated().to_string();
            let sku = rng.gen_range(0..SKUS);
            let q = rng.gen_range(1..=3i64);
            let order = uuid::Uuid::from_u128(rng.gen()).simple().to_string();
            let line = format!(
                r#"{{"event_id":"{id}","event_ts":"{}","order_id":"ord-{order}","sku":"SKU-{sku:04}","quantity":{q},"amount_cents":{}}}"#,
                rfc3339_ms(ts),
                q * (199 + 10 * (sku as i64 % 50))
            );
            writeln!(w, "{line}").unwrap();
            distinct += 1;
            if rng.gen_bool(0.005) {
                let later = (f + rng.gen_range(0..=6)).min(FILES - 1);
                if later == f {
                    writeln!(w, "{line}").unwrap();
                } else {
                    redeliver.entry(later).or_default().push(line);
                }
            }
        }
        w.flush().unwrap();
        drop(w);
        filetime::set_file_mtime(&path, filetime::FileTime::from_unix_time(landed_s, 0)).unwrap();
        bytes += std::fs::metadata(&path).unwrap().len();
        files.push(path);
    }
    (files, bytes, distinct)
}

/// Write every dirty page back (`sync`) before a measured step, so that no step shares
/// the machine with the kernel writing back what ran before it: the 1.4 GB of landing
/// files this bench has just generated and copied, then each step's bronze files.
fn settle() {
    if let Err(e) = std::process::Command::new("sync").status() {
        eprintln!("sync: {e}");
    }
}

/// Copy the first half of `files` (with their modification times) under `to`.
fn copy_half(files: &[PathBuf], from: &Path, to: &Path) {
    for f in &files[..files.len() / 2] {
        let dest = to.join(f.strip_prefix(from).unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(f, &dest).unwrap();
        let mtime = filetime::FileTime::from_last_modification_time(&std::fs::metadata(f).unwrap());
        filetime::set_file_mtime(&dest, mtime).unwrap();
    }
}

/// One kestrel step over `site` — what `kestrel run` does: ingestion, the job following
/// it batch by batch — in a process of its own (this bench's binary, `throughput-run
/// DIR`; `throughput-run DIR serial` runs one thing at a time, as `parallel_jobs = 1`):
/// (seconds, seconds to the end of ingestion, seconds from the job's first batch to its
/// last, peak RSS bytes). Run in this process after another site's step, a step
/// started from ~50 MiB more resident (what the step before left in the allocator's
/// heaps, given back or not) and peaked ~100 MiB higher on the same first batch, so the
/// site run second — the full landing zone — was charged for the one before it.
fn kestrel_once(site: &Site) -> (f64, f64, f64, usize) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--bench", "throughput-run"])
        .arg(&site.dir)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "kestrel step failed: {out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(RUN_RESULT))
        .unwrap_or_else(|| panic!("no result from the kestrel step: {stdout}"));
    let v: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (v[0], v[1], v[2], v[3] as usize)
}

/// How the child process of [`kestrel_once`] reports its step.
const RUN_RESULT: &str = "kestrel step: ";

/// The child of [`kestrel_once`]: one step over the site at `dir`, its result printed.
pub async fn run_step(
    dir: &Path,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    spec: &JobSpec,
    serial: bool,
) {
    let site = Site::new(dir.to_path_buf(), schemas, &[spec]);
    let t = Instant::now();
    let (ingest_s, job_s) = site.run_step(serial).await;
    println!(
        "{RUN_RESULT}{} {ingest_s} {} {}",
        t.elapsed().as_secs_f64(),
        job_s[0],
        peak_rss_bytes()
    );
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// DuckDB's run of the aggregate: (query seconds, its process's peak RSS bytes, rows),
/// or why it did not run.
fn duckdb(landing: &Path, out: &Path) -> Result<(f64, usize, Rows), String> {
    let python = std::env::var("KESTREL_PYTHON").map_err(|_| {
        "KESTREL_PYTHON is not set (the venv .ci/run installs has duckdb 1.5.5)".to_string()
    })?;
    let script = r#"
import resource, sys, time
import duckdb
landing, out, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
con = duckdb.connect()
con.execute(f"SET threads = {threads}")
con.execute("SET enable_progress_bar = false")
t = time.perf_counter()
con.execute(f"""
COPY (
  SELECT sku,
         (epoch_us(event_ts) // 300000000) * 300000000 AS window_start_us,
         count(*)::BIGINT AS orders,
         sum(quantity)::BIGINT AS units,
         sum(amount_cents)::BIGINT AS revenue_cents
  FROM (
    SELECT DISTINCT event_id, event_ts, sku, quantity, amount_cents
    FROM read_json('{landing}/orders/*/*.ndjson', format = 'newline_delimited',
      columns = {{'event_id': 'VARCHAR', 'event_ts': 'TIMESTAMPTZ', 'order_id': 'VARCHAR',
                  'sku': 'VARCHAR', 'quantity': 'BIGINT', 'amount_cents': 'BIGINT'}})
  )
  GROUP BY ALL
) TO '{out}' (FORMAT parquet)
""")
elapsed = time.perf_counter() - t
print(elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"#;
    let o = std::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(landing)
        .arg(out)
        .arg(cores().to_string())
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "duckdb failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let mut it = text.lines().last().unwrap_or_default().split_whitespace();
    let secs: f64 = it.next().and_then(|s| s.parse().ok()).ok_or("no timing")?;
    let rss: usize = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let file = std::fs::File::open(out).map_err(|e| e.to_string())?;
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.build())
        .map_err(|e| e.to_string())?;
    let mut batches = Vec::new();
    for b in reader {
        batches.push(b.map_err(|e| e.to_string())?);
    }
    Ok((secs, rss, rows_of(&batches)))
}

/// Rows of batches shaped (sku, window start µs, orders, units, revenue), sorted.
fn rows_of(batches: &[arrow::array::RecordBatch]) -> Rows {
    let mut out = Vec::new();
    for b in batches {
        let sku = kestrel::columns::string_at(b, 0).unwrap();
        let ints: Vec<_> = (1..5)
            .map(|i| kestrel::columns::int64_at(b, i).unwrap())
            .collect();
        for r in 0..b.num_rows() {
            out.push((
                sku.value(r).to_string(),
                ints[0].value(r),
                ints[1].value(r),
                ints[2].value(r),
                ints[3].value(r),
            ));
        }
    }
    out.sort();
    out
}

/// DataFusion alone over the NDJSON files: (seconds, rows).
async fn datafusion_alone(landing: &Path) -> (f64, Rows) {
    let schemas = kestrel::schema::load_all(Path::new("/none")).unwrap();
    let schema = schemas["orders"].event_schema();
    let t = Instant::now();
    let ctx = datafusion::prelude::SessionContext::new();
    let opts = datafusion::prelude::JsonReadOptions {
        file_extension: ".ndjson",
        schema: Some(schema.as_ref()),
        ..Default::default()
    };
    let dir = format!("{}/orders/", landing.display());
    ctx.register_json("o", &dir, opts).await.unwrap();
    let b = ctx
        .sql(
            "SELECT sku, (CAST(event_ts AS BIGINT) / 300000000) * 300000000, \
             count(*), sum(quantity), sum(amount_cents) \
             FROM (SELECT DISTINCT event_id, event_ts, sku, quantity, amount_cents FROM o) GROUP BY 1, 2",
        )
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    (t.elapsed().as_secs_f64(), rows_of(&b))
}

/// `gold/revenue_5m` of `site`, shaped as [`Rows`].
async fn gold_rows(site: &Site) -> Rows {
    let b = site
        .query(
            "gold/revenue_5m",
            "SELECT sku, CAST(window_start AS BIGINT), orders, units, revenue_cents FROM t",
        )
        .await;
    rows_of(&b)
}

/// The first difference between two results, if any.
fn difference(a: &Rows, b: &Rows) -> Option<String> {
    if let Some((x, y)) = a.iter().zip(b).find(|(x, y)| x != y) {
        return Some(format!("{x:?} vs {y:?}"));
    }
    (a.len() != b.len()).then(|| format!("{} rows vs {}", a.len(), b.len()))
}

pub async fn throughput(
    base: &Path,
    events: usize,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
    spec: &JobSpec,
) {
    let full = Site::new(base.join("tp"), schemas, &[spec]);
    let half = Site::new(base.join("tp-half"), schemas, &[spec]);
    let (files, bytes, distinct) = generate(&full.dir, events);
    copy_half(&files, &full.dir, &half.dir);
    let landing = full.dir.join("landing");
    let n = distinct;
    println!(
        "throughput: {n} order events (+0.5 % re-delivered) in {FILES} files, {:.0} MB of NDJSON, random UUID ids, {} cores",
        bytes as f64 / 1e6,
        cores()
    );

    settle();
    let (h_s, _, _, h_rss) = kestrel_once(&half);
    settle();
    let (k_s, ingest_s, job_s, k_rss) = kestrel_once(&full);
    println!(
        "kestrel landing → bronze → gold/revenue_5m: {k_s:.2} s, {:.0} events/s (ingestion ends at {ingest_s:.2} s; the job's batches, following it, take {job_s:.2} s), peak RSS {:.0} MiB",
        n as f64 / k_s,
        k_rss as f64 / 1048576.0
    );
    println!(
        "kestrel on half the landing zone: {h_s:.2} s, peak RSS {:.0} MiB; full ÷ half peak RSS {:.2} (≈ 1: bounded by the batch)",
        h_rss as f64 / 1048576.0,
        k_rss as f64 / h_rss.max(1) as f64
    );
    let gold = gold_rows(&full).await;

    settle();
    let (df_s, df_rows) = datafusion_alone(&landing).await;
    println!(
        "DataFusion alone (NDJSON → dedup → aggregate, no Delta): {df_s:.2} s, {:.0} events/s",
        n as f64 / df_s
    );
    if let Some(d) = difference(&gold, &df_rows) {
        panic!("kestrel's gold/revenue_5m differs from DataFusion's aggregate: {d}");
    }

    settle();
    match duckdb(&landing, &base.join("duckdb-revenue.parquet")) {
        Ok((dd_s, dd_rss, dd_rows)) => {
            println!(
                "DuckDB (read_json → dedup → aggregate → Parquet): {dd_s:.2} s, {:.0} events/s, peak RSS {:.0} MiB",
                n as f64 / dd_s,
                dd_rss as f64 / 1048576.0
            );
            if let Some(d) = difference(&gold, &dd_rows) {
                panic!("kestrel's gold/revenue_5m differs from DuckDB's aggregate: {d}");
            }
            println!(
                "identical aggregates: kestrel = DuckDB = DataFusion ({} windows)",
                gold.len()
            );
            println!(
                "ratio kestrel ÷ DuckDB throughput: {:.2} (target ≥ 0.5); kestrel ÷ DataFusion-alone: {:.2}",
                dd_s / k_s,
                df_s / k_s
            );
        }
        Err(why) => {
            println!("DuckDB not run: {why}");
            println!(
                "identical aggregates: kestrel = DataFusion ({} windows)",
                gold.len()
            );
            println!(
                "ratio kestrel ÷ DataFusion-alone throughput: {:.2}",
                df_s / k_s
            );
        }
    }
}
