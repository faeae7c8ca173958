//! Ingestion benchmark (not a test): `cargo bench --bench ingest -- [EVENTS]`.
//!
//! Generates EVENTS order events (default 2,000,000) as NDJSON files with arrival times,
//! then measures side by side in one run:
//! - raw decode: arrow-json decoding the same files into RecordBatches (the ceiling), on
//!   one thread and on as many threads as kestrel's decode uses (one per core);
//! - kestrel's strict decode alone (no dedup or storage) against arrow-json's, one
//!   thread each, alternating rounds;
//! - kestrel ingestion: discovery, plan, strict decode + validation, dedup, bronze
//!   Delta commit, quarantine, ledger and run log.
//!
//! It prints events/s, MB/s, peak memory and the cores busy on average (CPU time ÷
//! wall time) of each phase, and their ratio; for kestrel, also where the full run's
//! storage time went (`sink::timings`: encoding — in total and summed over each Parquet
//! writer — commits, the dedup probe). Then it encodes 1.4M of the bronze rows again,
//! on one writer with bronze's settings and without each of its optional Parquet
//! features (bloom filters, statistics, Snappy, all three), and on one writer against
//! one per core; and it measures discovery cost against landing-zone size: listing one
//! new file after the cursor vs a full listing, with 1k and 20k files already landed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kestrel::config::Config;
use kestrel::runner::ingest::{IngestOptions, Ingestor};
use kestrel::source::discover;
use kestrel::storage::Location;

const EVENTS_PER_FILE: usize = 10_000;
const T0_US: i64 = 1_763_640_000_000_000;

#[path = "common/peak.rs"]
mod peak;
use peak::{peak_mib, reset_peak};

fn generate(landing: &Path, events: usize) -> (Vec<PathBuf>, u64) {
    let dir = landing.join("orders");
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    let mut bytes = 0u64;
    let mut n = 0usize;
    let mut f = 0usize;
    while n < events {
        let path = dir.join(format!("partition={}/f{f:06}.ndjson", f % 4));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut w = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let end = (n + EVENTS_PER_FILE).min(events);
        for i in n..end {
            // 0.5% re-deliveries of the previous event id
            let id = if i % 200 == 199 { i - 1 } else { i };
            let ts_ms = (T0_US / 1000) - 3_600_000 + (i as i64 * 7) % 3_600_000;
            // Random UUIDs, as producers send them (and as `--bench jobs` lands them): ids
            // of a shared prefix made every comparison of two ids scan it.
            writeln!(
                w,
                r#"{{"event_id":"{}","event_ts":"{}","order_id":"ord-{}","sku":"SKU-{:04}","quantity":{},"amount_cents":{}}}"#,
                uuid::Uuid::from_u128(mix(id as u64, 1)).hyphenated(),
                chrono::DateTime::from_timestamp_millis(ts_ms).unwrap().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                uuid::Uuid::from_u128(mix(id as u64 / 3, 2)).simple(),
                id % 997,
                1 + id % 3,
                199 * (1 + id % 3)
            )
            .unwrap();
        }
        w.flush().unwrap();
        drop(w);
        let ft = filetime::FileTime::from_unix_time(T0_US / 1_000_000 + f as i64, 0);
        filetime::set_file_mtime(&path, ft).unwrap();
        bytes += std::fs::metadata(&path).unwrap().len();
        files.push(path);
        n = end;
        f += 1;
    }
    (files, bytes)
}

/// 128 pseudo-random bits determined by `(n, salt)` (splitmix64 twice): the same event
/// gets the same id in every run and at its re-delivery.
fn mix(n: u64, salt: u64) -> u128 {
    let step = |x: u64| {
        let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let hi = step(n ^ salt.rotate_left(32));
    (u128::from(hi) << 64) | u128::from(step(hi))
}

/// arrow-json decode of `files` on `threads` threads (each takes the next file).
fn raw_decode(files: &[PathBuf], threads: usize) -> usize {
    let schemas = kestrel::schema::load_all(Path::new("/none")).unwrap();
    let schema = schemas["orders"].event_schema();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let rows = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(f) = files.get(i) else { break };
                let data = std::fs::read(f).unwrap();
                let reader = arrow::json::ReaderBuilder::new(schema.clone())
                    .with_batch_size(8192)
                    .build(std::io::Cursor::new(data))
                    .unwrap();
                for b in reader {
                    rows.fetch_add(b.unwrap().num_rows(), std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    rows.into_inner()
}

/// kestrel's strict decode of `files` on this thread, each read whole and decoded into
/// bronze-shaped rows as ingestion does (validation included); returns the rows.
fn strict_decode(files: &[PathBuf]) -> usize {
    use kestrel::source::decode::{decode_file, Decoded};
    use kestrel::source::discover::Format;
    use kestrel::source::validate::FileContext;
    let schemas = kestrel::schema::load_all(Path::new("/none")).unwrap();
    let schema = &schemas["orders"];
    let mut rows = 0;
    for (i, f) in files.iter().enumerate() {
        let ctx = FileContext {
            source_file: f.display().to_string(),
            partition: "0".into(),
            landed_at_us: T0_US + i as i64 * 1_000_000,
            batch_id: 1,
            ingested_at_us: T0_US + 3_600_000_000,
        };
        let bytes = bytes::Bytes::from(std::fs::read(f).unwrap());
        match decode_file(bytes, Format::Ndjson, schema, &ctx).unwrap() {
            Decoded::Rows { batch, rejects, .. } => {
                assert!(rejects.is_empty(), "{rejects:?}");
                rows += batch.map_or(0, |b| b.num_rows());
            }
            Decoded::FileRejected { reason } => panic!("{reason}"),
        }
    }
    rows
}

/// CPU time of this process, in microseconds.
fn cpu_us() -> i64 {
    kestrel::time::clock::cpu_us()
}

/// Cores busy on average since `cpu0` ([`cpu_us`]) over `secs` of wall time.
fn cores_used(cpu0: i64, secs: f64) -> f64 {
    (cpu_us() - cpu0) as f64 / 1e6 / secs
}

fn main() {
    // As the kestrel binary runs. RUST_LOG=kestrel=info shows per-batch phase timings.
    kestrel::alloc::tune();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let events: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(2_000_000);
    let tmp = tempfile::tempdir().unwrap();
    let landing = tmp.path().join("landing");
    let (files, bytes) = generate(&landing, events);
    let mb = bytes as f64 / 1e6;
    println!(
        "generated {events} events in {} files, {mb:.1} MB of NDJSON",
        files.len()
    );

    // raw decode ceiling: on one thread, and on as many as kestrel's decode uses (one
    // per core): the fair comparison.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut raw = Vec::new();
    for t_n in [1, threads] {
        reset_peak();
        let (t, cpu) = (Instant::now(), cpu_us());
        let rows = raw_decode(&files, t_n);
        let raw_s = t.elapsed().as_secs_f64();
        let cores = cores_used(cpu, raw_s);
        let raw_peak = peak_mib("self");
        assert_eq!(rows, events);
        println!(
            "raw arrow-json decode, {t_n} thread(s): {:>8.2} s {:>12.0} events/s {:>8.1} MB/s  peak RSS {raw_peak:.0} MiB  {cores:.2} cores busy",
            raw_s,
            events as f64 / raw_s,
            mb / raw_s
        );
        raw.push(raw_s);
    }
    let (raw_1, raw_s) = (raw[0], raw[1]);

    // The strict decode alone (kestrel's per-file decode and validation into bronze-shaped
    // rows, no dedup or storage) against arrow-json's, both on one thread, alternating
    // rounds: the decode's share of the ingestion ceiling, less sensitive to this
    // machine's noise than the whole path.
    let (mut strict, mut arrow_1) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        assert_eq!(strict_decode(&files), events);
        strict.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        assert_eq!(raw_decode(&files, 1), events);
        arrow_1.push(t.elapsed().as_secs_f64());
    }
    strict.sort_by(f64::total_cmp);
    arrow_1.sort_by(f64::total_cmp);
    println!(
        "strict decode alone, 1 thread: {:.2} s against arrow-json's {:.2} s (medians of 3 alternating): kestrel ÷ arrow-json time {:.2}",
        strict[1],
        arrow_1[1],
        strict[1] / arrow_1[1]
    );

    // kestrel ingestion, memory bounded by a 64 MB batch: once on the whole landing
    // zone, once on a copy of its first half (peak memory should not follow the size).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let ingest = |landing: &Path, wh: &Path| {
        let mut cfg = Config::defaults(tmp.path());
        cfg.landing = landing.display().to_string();
        cfg.warehouse = wh.display().to_string();
        cfg.ingest.max_bytes_per_batch = 64 * 1024 * 1024;
        cfg.ingest.sources = Some(vec!["orders".into()]);
        reset_peak();
        let (t, cpu) = (Instant::now(), cpu_us());
        let report = rt
            .block_on(async {
                let ing = Ingestor::new(cfg, IngestOptions::default())?;
                ing.ingest_source("orders").await
            })
            .unwrap();
        let s = t.elapsed().as_secs_f64();
        (s, peak_mib("self"), report, cores_used(cpu, s))
    };
    let half = tmp.path().join("half");
    for f in &files[..files.len() / 2] {
        let dest = half.join(f.strip_prefix(&landing).unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(f, &dest).unwrap();
        let mtime = filetime::FileTime::from_last_modification_time(&std::fs::metadata(f).unwrap());
        filetime::set_file_mtime(&dest, mtime).unwrap();
    }
    let (h_s, h_peak, h_report, _) = ingest(&half, &tmp.path().join("wh-half"));
    let _ = kestrel::sink::timings::take();
    let (k_s, k_peak, report, k_cores) = ingest(&landing, &tmp.path().join("warehouse"));
    // Where the full run's storage time went (operation: count, total).
    let spent: Vec<String> = kestrel::sink::timings::take()
        .into_iter()
        .map(|(what, (n, took))| format!("{what} {n}× {:.0} ms", took.as_secs_f64() * 1e3))
        .collect();
    println!(
        "kestrel ingest        : {:>8.2} s {:>12.0} events/s {:>8.1} MB/s  peak RSS {k_peak:.0} MiB  {k_cores:.2} cores busy  ({} batches of ≤64 MB, {} written, {} duplicates)",
        k_s,
        events as f64 / k_s,
        mb / k_s,
        report.batches.len(),
        report.rows_written(),
        report.duplicates()
    );
    println!("  storage operations of it: {}", spent.join(", "));
    println!(
        "kestrel ingest, half : {:>8.2} s {:>12.0} events/s                peak RSS {h_peak:.0} MiB  ({} batches)",
        h_s,
        h_report.rows_in() as f64 / h_s,
        h_report.batches.len()
    );
    println!(
        "ratio kestrel/raw throughput, same threads ({threads}): {:.2}  (target ≥ 1.0); against raw on 1 thread: {:.2}",
        raw_s / k_s,
        raw_1 / k_s
    );
    println!(
        "peak memory, full vs half landing zone: {:.2}  (≈1 means bounded by batch size)",
        k_peak / h_peak
    );

    // bronze encoding, side by side on the same rows: one writer (as delta-rs's write
    // encodes a batch of one event date) against one per core (`delta::write_files`).
    // Files are written and not committed, three alternating rounds.
    let (one, many) = rt.block_on(async {
        use kestrel::sink::delta::{self, Warehouse};
        let loc = Location::open(
            tmp.path().join("warehouse").to_str().unwrap(),
            &Default::default(),
            false,
        )
        .unwrap();
        let wh = Warehouse::new(loc);
        let bronze = wh.open("bronze/orders").await.unwrap().unwrap();
        let fields = bronze.snapshot().unwrap().snapshot().arrow_schema();
        let cols: Vec<String> = fields
            .fields()
            .iter()
            .map(|f| format!("\"{}\"", f.name()))
            .collect();
        let ctx = delta::session_with(&bronze, "t").await.unwrap();
        let q = format!("SELECT {} FROM t LIMIT 1400000", cols.join(", "));
        // As the table holds them (a read gives strings as views).
        let target = std::sync::Arc::new(arrow::datatypes::Schema::new(fields.fields().clone()));
        let rows: Vec<arrow::array::RecordBatch> = delta::sql(&ctx, &q)
            .await
            .unwrap()
            .iter()
            .map(|b| {
                let cols = b
                    .columns()
                    .iter()
                    .zip(target.fields())
                    .map(|(c, f)| arrow::compute::cast(c, f.data_type()).unwrap())
                    .collect();
                arrow::array::RecordBatch::try_new(target.clone(), cols).unwrap()
            })
            .collect();
        let n: usize = rows.iter().map(|b| b.num_rows()).sum();
        let names: Vec<String> = fields.fields().iter().map(|f| f.name().clone()).collect();
        // As ingestion writes them: `event_id` and `order_id` compressed only when a
        // sample shows it pays (random UUIDs: not).
        let parts: Vec<delta::Kept> = rows.iter().map(|b| (b.clone(), None)).collect();
        let props = delta::bronze_writer_properties_for(names.iter().map(String::as_str), &parts);
        encoding_options(&bronze, &rows, &names, &props).await;
        let (mut one, mut many) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            for (writers, out) in [(1, &mut one), (threads, &mut many)] {
                let t = Instant::now();
                let adds = delta::write_files(&bronze, rows.clone(), props.clone(), writers)
                    .await
                    .unwrap();
                out.push(t.elapsed().as_secs_f64());
                assert!(!adds.is_empty());
            }
        }
        one.sort_by(f64::total_cmp);
        many.sort_by(f64::total_cmp);
        println!(
            "bronze encoding of {n} rows: 1 writer {:.2} s, {threads} writers {:.2} s (medians of 3)",
            one[1], many[1]
        );
        (one[1], many[1])
    });
    println!(
        "ratio bronze encoding, 1 writer / {threads} writers: {:.2}",
        one / many
    );

    // discovery cost vs landing size
    for existing in [1_000usize, 20_000] {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("clicks");
        for i in 0..existing {
            let p = src.join(format!(
                "partition={}/2026-11-{:02}/h{:02}/f{i:06}.ndjson",
                i % 4,
                1 + (i / 2000) % 28,
                (i / 100) % 24
            ));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"{}\n").unwrap();
        }
        let loc = Location::open(d.path().to_str().unwrap(), &Default::default(), false).unwrap();
        let all = rt
            .block_on(discover::list_source(&loc, "clicks", None))
            .unwrap();
        let mut cursors = std::collections::BTreeMap::new();
        for f in &all {
            let c = cursors
                .entry(f.partition.clone())
                .or_insert_with(String::new);
            if f.path > *c {
                *c = f.path.clone();
            }
        }
        let p = src.join("partition=0/2026-11-28/h23/zz-new.ndjson");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"{}\n").unwrap();
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            let new = rt
                .block_on(discover::list_source(&loc, "clicks", Some(&cursors)))
                .unwrap();
            assert_eq!(new.len(), 1);
        }
        let inc = t.elapsed().as_secs_f64() / reps as f64;
        let t = Instant::now();
        for _ in 0..reps {
            let _ = rt
                .block_on(discover::list_source(&loc, "clicks", None))
                .unwrap();
        }
        let full = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "discovery with {existing:>6} files landed: incremental {:>8.3} ms, full listing {:>8.3} ms (ratio {:.1}x)",
            inc * 1e3,
            full * 1e3,
            full / inc
        );
    }
}

/// What bronze's optional Parquet features cost: the same rows encoded by one writer
/// with bronze's settings, then without bloom filters, without statistics, without
/// Snappy, and without all three (dictionaries as bronze has them, so no column's
/// bytes grow by more than its compression), three alternating rounds. It bounds what
/// tuning the writer's settings can give the ingestion (README, "What Parquet's options
/// cost").
async fn encoding_options(
    bronze: &deltalake::DeltaTable,
    rows: &[arrow::array::RecordBatch],
    names: &[String],
    props: &deltalake::parquet::file::properties::WriterProperties,
) {
    use deltalake::parquet::basic::Compression;
    use deltalake::parquet::file::properties::EnabledStatistics;
    use deltalake::parquet::file::properties::{WriterProperties, WriterPropertiesBuilder};
    use deltalake::parquet::schema::types::ColumnPath;
    use kestrel::sink::delta;
    // `props` with `f` applied to every column.
    let each =
        |p: &WriterProperties,
         f: fn(WriterPropertiesBuilder, ColumnPath) -> WriterPropertiesBuilder| {
            let mut b = p.clone().into_builder();
            for c in names {
                b = f(b, ColumnPath::from(c.as_str()));
            }
            b.build()
        };
    let no_bloom: fn(WriterPropertiesBuilder, ColumnPath) -> WriterPropertiesBuilder =
        |b, c| b.set_column_bloom_filter_enabled(c, false);
    let no_stats: fn(WriterPropertiesBuilder, ColumnPath) -> WriterPropertiesBuilder =
        |b, c| b.set_column_statistics_enabled(c, EnabledStatistics::None);
    let no_snappy: fn(WriterPropertiesBuilder, ColumnPath) -> WriterPropertiesBuilder =
        |b, c| b.set_column_compression(c, Compression::UNCOMPRESSED);
    let lean = each(&each(&each(props, no_bloom), no_stats), no_snappy);
    let variants = [
        ("bronze's settings", props.clone()),
        ("no bloom filters", each(props, no_bloom)),
        ("no statistics", each(props, no_stats)),
        ("no Snappy", each(props, no_snappy)),
        ("none of the three", lean),
    ];
    let mut took: Vec<Vec<(f64, f64, i64)>> = vec![Vec::new(); variants.len()];
    for _ in 0..3 {
        for (i, (_, p)) in variants.iter().enumerate() {
            let (c0, t) = (cpu_us(), Instant::now());
            let adds = delta::write_files(bronze, rows.to_vec(), p.clone(), 1)
                .await
                .unwrap();
            let cpu = (cpu_us() - c0) as f64 / 1e6;
            let bytes = adds.iter().map(|a| a.size).sum();
            took[i].push((t.elapsed().as_secs_f64(), cpu, bytes));
        }
    }
    // Each variant's round of median CPU; the first is bronze's settings.
    let medians: Vec<(f64, f64, i64)> = took
        .into_iter()
        .map(|mut r| {
            r.sort_by(|a, b| a.1.total_cmp(&b.1));
            r[1]
        })
        .collect();
    let base = medians[0].1;
    let n: usize = rows.iter().map(|b| b.num_rows()).sum();
    for ((what, _), (wall, cpu, bytes)) in variants.iter().zip(medians) {
        println!(
            "bronze encoding of {n} rows, 1 writer, {what:<17}: {wall:.2} s, CPU {cpu:.2} s ({:.2} of bronze's), {:.0} MB (the round of median CPU of 3)",
            cpu / base,
            bytes as f64 / 1e6
        );
    }
}
