//! The ledger: durable batch plans (`_kestrel/plans/…`) and the table of processed files
//! (`_kestrel/ledger`, a Delta table partitioned by source).
//!
//! A plan is written with put-if-absent before any data is read, so a batch re-run after
//! a crash processes exactly the same files, and two writers cannot plan different
//! contents for the same batch id.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock};

use arrow::array::{
    Array, Date32Builder, Int64Builder, RecordBatch, StringBuilder, TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::parquet::schema::types::ColumnPath;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::names;
use crate::schema::ts_type;
use crate::sink::delta::{self, Warehouse};
use crate::source::discover::LandedFile;

/// Partition columns of the ledger: the source, then the UTC date the file landed, so a
/// batch appends to (and the between-batches compaction rewrites) one small partition.
/// Ledgers created before `landed_date` existed stay partitioned by source alone.
pub const PARTITIONS: [&str; 2] = ["source", "landed_date"];

/// What a batch does with a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum FileAction {
    /// Read, validate and append to bronze.
    Ingest,
    /// Already processed but its size or e-tag changed: reported, not re-read.
    Changed {
        previous_size: u64,
        previous_e_tag: Option<String>,
    },
}

/// One file in a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedFile {
    #[serde(flatten)]
    pub file: LandedFile,
    #[serde(flatten)]
    pub action: FileAction,
}

/// A durable ingestion batch plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub source: String,
    pub batch_id: i64,
    pub created_at: String,
    /// Whether discovery listed the whole source.
    pub full_scan: bool,
    /// Files in processing order: (landed time, path).
    pub files: Vec<PlannedFile>,
    /// Per source partition, the greatest key processed once this batch is done.
    pub cursors_after: BTreeMap<String, String>,
}

/// Delete `source`'s ingestion plans of batches before `keep_from` written more than
/// `older_than` ago (the maintenance retention): a completed batch's plan is only read
/// again to plan the next batch (its listing cursors), so the last one is kept.
pub async fn expire_plans(
    wh: &Warehouse,
    source: &str,
    keep_from: i64,
    older_than: std::time::Duration,
) -> Result<usize> {
    let prefix = names::key::ingest_plans(source);
    wh.loc
        .expire(&prefix, older_than, |key| {
            names::key::plan_batch(key).is_some_and(|b| b < keep_from)
        })
        .await
}

/// Read a plan; None when it does not exist.
pub async fn read_plan(wh: &Warehouse, source: &str, batch_id: i64) -> Result<Option<Plan>> {
    let key = names::key::ingest_plan(source, batch_id);
    let Some(plan) = crate::job::plan::read_json::<Plan>(wh, &key).await? else {
        return Ok(None);
    };
    if plan.batch_id != batch_id || plan.source != source {
        return Err(Error::Plan {
            path: wh.loc.display(&key),
            reason: format!("holds batch {} of {}", plan.batch_id, plan.source),
        });
    }
    Ok(Some(plan))
}

/// Write a plan if no plan with that id exists. Returns the plan that is durable
/// (ours, or the one another writer created first).
pub async fn write_plan(wh: &Warehouse, plan: &Plan) -> Result<Plan> {
    let key = names::key::ingest_plan(&plan.source, plan.batch_id);
    let body = serde_json::to_vec_pretty(plan)?;
    if wh.loc.put_if_absent(&key, body).await? {
        return Ok(plan.clone());
    }
    read_plan(wh, &plan.source, plan.batch_id)
        .await?
        .ok_or_else(|| Error::Plan {
            path: wh.loc.display(&key),
            reason: "reported as existing but cannot be read".into(),
        })
}

/// Schema of the ledger table.
pub static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("source", DataType::Utf8, true),
        Field::new("path", DataType::Utf8, true),
        Field::new("partition", DataType::Utf8, true),
        Field::new("size", DataType::Int64, true),
        Field::new("e_tag", DataType::Utf8, true),
        Field::new("landed_at", ts_type(), true),
        Field::new("batch_id", DataType::Int64, true),
        Field::new("status", DataType::Utf8, true),
        Field::new("records", DataType::Int64, true),
        Field::new("reason", DataType::Utf8, true),
        Field::new("recorded_at", ts_type(), true),
        Field::new("landed_date", DataType::Date32, true),
    ]))
});

/// Outcome of one file, recorded in the ledger.
#[derive(Debug, Clone)]
pub struct FileOutcome {
    pub status: &'static str,
    pub records: i64,
    pub reason: Option<String>,
}

/// Build the ledger rows of a batch.
pub fn ledger_batch(
    plan: &Plan,
    outcomes: &[FileOutcome],
    recorded_at_us: i64,
) -> Result<RecordBatch> {
    let mut source = StringBuilder::new();
    let mut path = StringBuilder::new();
    let mut part = StringBuilder::new();
    let mut size = Int64Builder::new();
    let mut etag = StringBuilder::new();
    let mut landed = TimestampMicrosecondBuilder::new();
    let mut batch = Int64Builder::new();
    let mut status = StringBuilder::new();
    let mut records = Int64Builder::new();
    let mut reason = StringBuilder::new();
    let mut recorded = TimestampMicrosecondBuilder::new();
    let mut landed_date = Date32Builder::new();
    for (f, o) in plan.files.iter().zip(outcomes) {
        landed_date.append_value(f.file.landed_at_us.div_euclid(86_400_000_000) as i32);
        source.append_value(&plan.source);
        path.append_value(&f.file.path);
        part.append_value(&f.file.partition);
        size.append_value(f.file.size as i64);
        etag.append_option(f.file.e_tag.as_deref());
        landed.append_value(f.file.landed_at_us);
        batch.append_value(plan.batch_id);
        status.append_value(o.status);
        records.append_value(o.records);
        reason.append_option(o.reason.as_deref());
        recorded.append_value(recorded_at_us);
    }
    Ok(RecordBatch::try_new(
        SCHEMA.clone(),
        vec![
            Arc::new(source.finish()),
            Arc::new(path.finish()),
            Arc::new(part.finish()),
            Arc::new(size.finish()),
            Arc::new(etag.finish()),
            Arc::new(landed.finish().with_timezone("UTC")),
            Arc::new(batch.finish()),
            Arc::new(status.finish()),
            Arc::new(records.finish()),
            Arc::new(reason.finish()),
            Arc::new(recorded.finish().with_timezone("UTC")),
            Arc::new(landed_date.finish()),
        ],
    )?)
}

/// What the ledger knows about a file: its latest recorded size and e-tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    pub size: u64,
    pub e_tag: Option<String>,
    pub batch_id: i64,
}

/// Append the ledger rows of batch `batch_id` of `source` unless the ledger holds them
/// (txn `kestrel-ledger-<source>`).
pub async fn record(wh: &Warehouse, source: &str, batch_id: i64, rows: RecordBatch) -> Result<()> {
    let table = wh
        .open_or_create(names::table::LEDGER, &SCHEMA, &PARTITIONS)
        .await?;
    let app = names::app::ledger(source);
    let parts = delta::partition_columns(&table)?;
    let props = Some(writer_properties());
    delta::commit_once(table, &app, batch_id, |t| {
        delta::append_evolving(t, vec![rows], &parts, &app, batch_id, props)
    })
    .await?;
    Ok(())
}

/// Parquet properties of the ledger's files: a bloom filter on `path`, so a full
/// listing's "was this file seen before?" reads the filters of a source's ledger, not
/// every path it ever ingested (see [`known_files`]).
pub fn writer_properties() -> WriterProperties {
    let path = ColumnPath::from("path");
    WriterProperties::builder()
        .set_column_bloom_filter_enabled(path.clone(), true)
        .set_column_bloom_filter_fpp(path.clone(), 0.001)
        // About a day of one source's files at Kestrel's scale: a compacted day fills
        // one filter (≈ 32 KiB).
        .set_column_bloom_filter_max_ndv(path, 16_384)
        .build()
}

/// What the ledger knows of `listed` (a full listing of `source`): each listed path's
/// latest recorded size, e-tag and batch (paths never recorded are absent).
///
/// Bounded by the listing, not by the ledger's age: an unchanged file's row sits in the
/// `landed_date` partition of its modification time, so those partitions are read
/// first; the paths not found there — new files, and changed ones whose modification
/// time moved — are then looked up in the rest of the source's ledger by the bloom
/// filters on `path` ([`probe`]), and only the paths found are read. (A path whose
/// modification time moved to another day and then back is read from the partition of
/// its current time alone.) A ledger created before `landed_date` existed is read whole.
pub async fn known_files(
    wh: &Warehouse,
    source: &str,
    listed: &[LandedFile],
) -> Result<HashMap<String, Known>> {
    let mut out: HashMap<String, Known> = HashMap::new();
    let Some(table) = wh.open(names::table::LEDGER).await? else {
        return Ok(out);
    };
    let ctx = delta::session_with(&table, "ledger").await?;
    let own = format!("source = '{}'", source.replace('\'', "''"));
    if !delta::partition_columns(&table)?
        .iter()
        .any(|c| c == "landed_date")
    {
        read_known(&ctx, &own, &mut out).await?;
        return Ok(out);
    }
    let days: std::collections::BTreeSet<String> = listed
        .iter()
        .map(|f| crate::time::date(f.landed_at_us.div_euclid(86_400_000_000) as i32))
        .collect();
    if days.is_empty() {
        return Ok(out);
    }
    let in_days = days
        .iter()
        .map(|d| format!("DATE '{d}'"))
        .collect::<Vec<_>>()
        .join(", ");
    read_known(
        &ctx,
        &format!("{own} AND landed_date IN ({in_days})"),
        &mut out,
    )
    .await?;
    let unmatched: HashSet<&str, foldhash::fast::RandomState> = listed
        .iter()
        .map(|f| f.path.as_str())
        .filter(|p| !out.contains_key(*p))
        .collect();
    if unmatched.is_empty() {
        return Ok(out);
    }
    let sources = [source.to_string()];
    let probe = crate::sink::probe::Probe {
        column: "path",
        partition: ("source", &sources),
        exclude: None,
    };
    let found = crate::sink::probe::existing(&table, &probe, &unmatched).await?;
    if found.ids.is_empty() {
        return Ok(out);
    }
    let paths = found
        .ids
        .iter()
        .map(|p| format!("'{}'", p.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(", ");
    read_known(&ctx, &format!("{own} AND path IN ({paths})"), &mut out).await?;
    Ok(out)
}

/// Add the ledger rows matching `filter` to `out`, keeping each path's latest batch.
async fn read_known(
    ctx: &datafusion::prelude::SessionContext,
    filter: &str,
    out: &mut HashMap<String, Known>,
) -> Result<()> {
    let q = format!(
        "SELECT CAST(path AS VARCHAR) AS path, size, CAST(e_tag AS VARCHAR) AS e_tag, batch_id FROM ledger WHERE {filter}"
    );
    for b in delta::sql(ctx, &q).await? {
        let paths = crate::columns::string_at(&b, 0)?;
        let sizes = crate::columns::int64_at(&b, 1)?;
        let etags = crate::columns::string_at(&b, 2)?;
        let batches = crate::columns::int64_at(&b, 3)?;
        for i in 0..b.num_rows() {
            let k = Known {
                size: sizes.value(i) as u64,
                e_tag: (!etags.is_null(i)).then(|| etags.value(i).to_string()),
                batch_id: batches.value(i),
            };
            match out.get(paths.value(i)) {
                Some(prev) if prev.batch_id >= k.batch_id => {}
                _ => {
                    out.insert(paths.value(i).to_string(), k);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::discover::Format;

    const DAY: i64 = 86_400_000_000;

    fn file(path: &str, size: u64, landed_at_us: i64) -> LandedFile {
        LandedFile {
            path: path.into(),
            partition: "0".into(),
            size,
            e_tag: Some(format!("{size}-{landed_at_us}")),
            landed_at_us,
            format: Format::Ndjson,
        }
    }

    fn plan(batch_id: i64, files: &[LandedFile]) -> Plan {
        Plan {
            source: "orders".into(),
            batch_id,
            created_at: String::new(),
            full_scan: false,
            files: files
                .iter()
                .map(|f| PlannedFile {
                    file: f.clone(),
                    action: FileAction::Ingest,
                })
                .collect(),
            cursors_after: BTreeMap::new(),
        }
    }

    #[tokio::test]
    async fn known_files_finds_unchanged_moved_and_new_paths_of_a_listing() {
        let dir = tempfile::tempdir().unwrap();
        let wh = Warehouse::new(
            crate::storage::Location::open(dir.path().to_str().unwrap(), &Default::default(), true)
                .unwrap(),
        );
        let t0 = 20_000 * DAY + 3_600_000_000;
        // Three days of files, one batch a day; another source's file of the same name.
        for d in 0..3 {
            let files: Vec<LandedFile> = (0..50)
                .map(|i| file(&format!("orders/d{d}/f{i}.ndjson"), 100 + i, t0 + d * DAY))
                .collect();
            let outcomes: Vec<FileOutcome> = files
                .iter()
                .map(|_| FileOutcome {
                    status: "ingested",
                    records: 1,
                    reason: None,
                })
                .collect();
            let rows = ledger_batch(&plan(d + 1, &files), &outcomes, 0).unwrap();
            record(&wh, "orders", d + 1, rows).await.unwrap();
        }
        let mut other = plan(1, &[file("orders/d0/f7.ndjson", 999, t0)]);
        other.source = "payments".into();
        let outcome = [FileOutcome {
            status: "ingested",
            records: 1,
            reason: None,
        }];
        record(
            &wh,
            "payments",
            1,
            ledger_batch(&other, &outcome, 0).unwrap(),
        )
        .await
        .unwrap();

        let listed = vec![
            // unchanged (found in its landed day's partition)
            file("orders/d2/f3.ndjson", 103, t0 + 2 * DAY),
            // rewritten two days later: bigger, another modification day
            file("orders/d0/f7.ndjson", 500, t0 + 2 * DAY),
            // never ingested
            file("orders/new.ndjson", 10, t0 + 2 * DAY),
        ];
        let known = known_files(&wh, "orders", &listed).await.unwrap();
        assert_eq!(known["orders/d2/f3.ndjson"].size, 103);
        assert_eq!(known["orders/d2/f3.ndjson"].batch_id, 3);
        // the orders row, not the payments one of the same path
        assert_eq!(known["orders/d0/f7.ndjson"].size, 107);
        assert_eq!(known["orders/d0/f7.ndjson"].batch_id, 1);
        assert!(!known.contains_key("orders/new.ndjson"));
        assert_eq!(
            known.len(),
            50 + 1,
            "the listed days' rows and the moved file"
        );

        // The ledger's files carry the path filter the probe relies on.
        let table = wh.open(names::table::LEDGER).await.unwrap().unwrap();
        // d2's path range covers the second path: only its filter rules that file out.
        let paths = ["orders/d1/f9.ndjson", "orders/d2/nope.ndjson"];
        let incoming = paths.iter().copied().collect();
        let sources = ["orders".to_string()];
        let probe = crate::sink::probe::Probe {
            column: "path",
            partition: ("source", &sources),
            exclude: None,
        };
        let found = crate::sink::probe::existing(&table, &probe, &incoming)
            .await
            .unwrap();
        assert_eq!(
            found.ids.iter().collect::<Vec<_>>(),
            ["orders/d1/f9.ndjson"]
        );
        assert_eq!(found.files, 3);
        assert_eq!(found.row_groups, 3);
        assert_eq!(found.row_groups_read, 1, "{found:?}");
    }
}
