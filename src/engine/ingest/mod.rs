//! Ingestion as a distributed stage: a batch's files decoded, validated, deduplicated
//! and written as bronze Parquet by a cluster's executors; the coordinator commits the
//! files they wrote, with the batch's txn, in one Delta transaction (the way Spark
//! writes Delta).
//!
//! One Ballista job per batch, two stages:
//! 1. [`decode::DecodeExec`], one task per group of files: read and decode each planned
//!    file exactly as the coordinator would ([`crate::runner::ingest::decode_planned`]).
//!    Valid rows leave tagged with their plan order (file, then row); each file also
//!    leaves one row describing its outcome (records, rejects with their reasons, or
//!    why the whole file was rejected), and the task stores the event dates its files
//!    touch under the stage's prefix in the warehouse.
//! 2. Rows are hash-partitioned by `event_id`, so every copy of an id meets in one task:
//!    [`write::WriteExec`] keeps the first delivery in plan order, removes what bronze
//!    already holds in the event dates the *batch* touches (the union of stage 1's
//!    dates, all of which exist once stage 2 runs) at the bronze version the
//!    coordinator planned against — the same dedup as a local run
//!    ([`crate::runner::ingest::dedup`]) — and writes the survivors into the bronze
//!    table's directory with bronze's writer settings. It returns the Delta `add`
//!    actions, its counts and the file outcomes.
//!
//! The coordinator then writes quarantine, ledger and run log as for a local batch.
//! A failed or killed task's files are named by no commit: no reader sees them, and
//! vacuum removes them. A replay of a batch bronze already holds runs the stages
//! without writing (for the counts the run log records).

mod decode;
mod scan;
mod write;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::error::DataFusionError;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ledger::{FileAction, Plan, PlannedFile};
use crate::schema::SourceSchema;
use crate::source::decode::{Decoded, Rejected};
use crate::storage::Location;

pub use decode::DecodeExec;
pub use scan::IngestScan;
pub use write::WriteExec;

/// Column of stage 1's rows: the row's place in plan order (file index × 2³² + row).
pub(crate) const ORDER: &str = "_kestrel_order";
/// Column of stage 1's rows: a file's outcome as JSON ([`FileMeta`]); null on data rows.
pub(crate) const FILE_META: &str = "_kestrel_file";

/// Everything an executor needs to ingest one batch (no credentials: a process opens
/// stores with its own `[storage]`, see [`super::stores`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IngestTask {
    pub source: String,
    /// The source's schema document.
    pub schema_text: String,
    /// URLs of the landing zone and the warehouse.
    pub landing: String,
    pub warehouse: String,
    pub batch_id: i64,
    pub ingested_at_us: i64,
    /// The bronze version the batch deduplicates against.
    pub bronze_version: u64,
    /// False for a replay of a batch bronze already holds: count, write nothing.
    pub write: bool,
    /// The plan's files, in plan order (changed files are not read).
    pub files: Vec<PlannedFile>,
    /// Tasks of the decode stage and of the write stage.
    pub decode_tasks: usize,
    pub write_tasks: usize,
    /// Names this attempt's stage prefix ([`crate::names::key::ingest_stage`]).
    pub stage: String,
}

impl IngestTask {
    /// The source schema, parsed again from its document.
    pub fn source_schema(&self) -> Result<Arc<SourceSchema>> {
        let origin = format!("(plan of {} batch {}) schema", self.source, self.batch_id);
        crate::schema::parse(&self.schema_text, Path::new(&origin)).map(Arc::new)
    }

    /// The stage prefix's object where decode task `task` lists its event dates.
    pub(crate) fn dates_key(&self, task: usize) -> String {
        format!(
            "{}dates-{task:05}.json",
            crate::names::key::ingest_stage(&self.source, self.batch_id, &self.stage)
        )
    }
}

/// One file's outcome, as stage 1 reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FileMeta {
    /// Index in the plan's files.
    pub index: usize,
    pub records: usize,
    pub rejects: Vec<Rejected>,
    /// Why the whole file was rejected.
    pub file_rejected: Option<String>,
}

/// A write task's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Counts {
    /// Valid rows it received, and the rows left after dedup.
    pub valid: u64,
    pub written: u64,
}

/// The rows stage 1 hands stage 2: bronze's columns (every one nullable, for the file
/// rows), the plan order and the file outcome.
pub(crate) fn stage_schema(bronze: &Schema) -> SchemaRef {
    let mut fields: Vec<Field> = bronze
        .fields()
        .iter()
        .map(|f| f.as_ref().clone().with_nullable(true))
        .collect();
    fields.push(Field::new(ORDER, DataType::Int64, false));
    fields.push(Field::new(FILE_META, DataType::Utf8, true));
    Arc::new(Schema::new(fields))
}

/// What the job returns: `kind` (`file`, `add`, `counts`) and its JSON.
pub(crate) fn output_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("kind", DataType::Utf8, false),
        Field::new("json", DataType::Utf8, false),
    ]))
}

/// Open the landing zone or the warehouse (`what`) at `url` in the process a task runs
/// in, with that process's `storage`; an error names the store and says where.
pub(crate) fn open_store(
    url: &str,
    storage: &BTreeMap<String, String>,
    what: &str,
) -> Result<Location> {
    Location::open(url, storage, false).map_err(|e| {
        Error::from(super::EngineError::Stage {
            what: format!(
                "a cluster process (host {}) cannot open the {what} {url}",
                hostname()
            ),
            reason: format!(
                "{e}; executors need the coordinator's storage: the same local paths, or its [storage] through --config"
            ),
        })
    })
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// A kestrel error as DataFusion carries it across a plan.
pub(crate) fn df_err(e: Error) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

/// What the cluster did with one batch.
#[derive(Debug)]
pub struct Ingested {
    /// Per planned file: its outcome (rows stay on the cluster: `batch` is None), or
    /// None for a file that is not read.
    pub decoded: Vec<Option<Decoded>>,
    /// Valid rows, and rows written after dedup.
    pub valid: i64,
    pub written: i64,
    /// The files written into bronze, to commit.
    pub adds: Vec<deltalake::kernel::Add>,
}

/// Tasks of each stage for `files` planned files on a cluster that runs `parallelism`
/// tasks at once: a decode task per file up to that, and as many write tasks.
fn tasks(files: usize, parallelism: usize) -> (usize, usize) {
    let p = parallelism.max(1);
    (files.clamp(1, p), p)
}

/// Ingest `plan` where `ctx` runs its plans (a cluster session, see
/// [`super::port::ClusterPort`]): decode, dedup against bronze at `bronze_version`, and
/// (when `write`) write bronze files. Nothing is committed.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    ctx: &datafusion::prelude::SessionContext,
    plan: &Plan,
    schema: &SourceSchema,
    landing: &Location,
    warehouse: &Location,
    ingested_at_us: i64,
    bronze_version: u64,
    write: bool,
    storage: &BTreeMap<String, String>,
) -> Result<Ingested> {
    let read = plan
        .files
        .iter()
        .filter(|f| f.action == FileAction::Ingest)
        .count();
    let parallelism = ctx.state().config().target_partitions();
    let (decode_tasks, write_tasks) = tasks(read, parallelism);
    let task = IngestTask {
        source: plan.source.clone(),
        schema_text: schema.text.to_string(),
        landing: landing.url.to_string(),
        warehouse: warehouse.url.to_string(),
        batch_id: plan.batch_id,
        ingested_at_us,
        bronze_version,
        write,
        files: plan.files.clone(),
        decode_tasks,
        write_tasks,
        stage: uuid::Uuid::new_v4().to_string(),
    };
    let what = format!(
        "ingest {} batch {} on the cluster",
        plan.source, plan.batch_id
    );
    let scan = IngestScan::new(Arc::new(task.clone()), storage.clone());
    let rows = async { ctx.read_table(Arc::new(scan))?.collect().await }
        .await
        .map_err(|e| Error::query(&what, e));
    // The stage's date lists are no use once the job is over, whatever its outcome.
    for t in 0..task.decode_tasks {
        if let Err(e) = warehouse.delete_if_exists(&task.dates_key(t)).await {
            tracing::warn!(error = %e, "could not remove an ingestion stage file");
        }
    }
    collect(&task, &rows?)
}

/// The job's rows as the batch's outcome.
fn collect(task: &IngestTask, rows: &[arrow::array::RecordBatch]) -> Result<Ingested> {
    let bad = |what: &str, reason: String| {
        Error::from(super::EngineError::Stage {
            what: format!(
                "{what} from the cluster ({} batch {})",
                task.source, task.batch_id
            ),
            reason,
        })
    };
    let mut decoded: Vec<Option<Decoded>> = task.files.iter().map(|_| None).collect();
    let mut out = Ingested {
        decoded: Vec::new(),
        valid: 0,
        written: 0,
        adds: Vec::new(),
    };
    let mut seen = BTreeSet::new();
    for b in rows {
        let kind = crate::columns::string_at(b, 0)?;
        let json = crate::columns::string_at(b, 1)?;
        for i in 0..b.num_rows() {
            let text = json.value(i);
            match kind.value(i) {
                "file" => {
                    let m: FileMeta = serde_json::from_str(text)
                        .map_err(|e| bad("a file outcome", e.to_string()))?;
                    let slot = decoded
                        .get_mut(m.index)
                        .ok_or_else(|| bad("a file outcome", format!("no file {}", m.index)))?;
                    seen.insert(m.index);
                    *slot = Some(match m.file_rejected {
                        Some(reason) => Decoded::FileRejected { reason },
                        None => Decoded::Rows {
                            batch: None,
                            rejects: m.rejects,
                            records: m.records,
                        },
                    });
                }
                "add" => out.adds.push(
                    serde_json::from_str(text).map_err(|e| bad("an add action", e.to_string()))?,
                ),
                "counts" => {
                    let c: Counts =
                        serde_json::from_str(text).map_err(|e| bad("counts", e.to_string()))?;
                    out.valid += c.valid as i64;
                    out.written += c.written as i64;
                }
                other => return Err(bad("a row", format!("unknown kind {other:?}"))),
            }
        }
    }
    let expected: BTreeSet<usize> = task
        .files
        .iter()
        .enumerate()
        .filter(|(_, f)| f.action == FileAction::Ingest)
        .map(|(i, _)| i)
        .collect();
    if seen != expected {
        let missing: Vec<&str> = expected
            .difference(&seen)
            .map(|i| task.files[*i].file.path.as_str())
            .collect();
        return Err(bad("outcomes", format!("none for {}", missing.join(", "))));
    }
    out.decoded = decoded;
    Ok(out)
}

#[cfg(test)]
mod tests;
