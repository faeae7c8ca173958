//! MERGE of a batch's keyed rows into a gold table: copy-on-write, planned and committed
//! by kestrel, with delta-rs's MERGE kept for the tables this one does not handle.
//!
//! A gold batch is a set of rows keyed by the job's natural key, each marked `upsert`
//! (insert or replace the row with that key) or `delete` (a tombstone: remove it), and
//! the partitions those rows and the rows they replace live in. So a MERGE here is:
//!
//! 1. the source rows by key (an upsert of a key wins over a tombstone of it; of two
//!    upserts, the later);
//! 2. the active files of the named partitions (an `IN` list per partition column), found
//!    by one pass over the snapshot's file list comparing partition values;
//! 3. each of those files read whole, its rows given their partition values; a file
//!    holding none of the keys is left alone, one holding some is rewritten without
//!    them;
//! 4. the kept rows of rewritten files and the upserts written as new files (one writer
//!    per partition, see [`crate::sink::delta::write_files`]), and one commit removing
//!    the rewritten files and adding the new ones, carrying the batch's transaction and
//!    the counts delta-rs's MERGE records (`operationMetrics`, which
//!    [`crate::sink::delta::written_by`] reads back).
//!
//! Why not delta-rs's MERGE: it does the same work, and then some that grows with the
//! table's age rather than with the batch — after writing, it walks every *active* file
//! of the table to find the rewritten ones and counts them all again for its skipped-files
//! metric, ≈ 36 µs a file; gold keeps 24 hour-partition files per closed day, so a batch
//! against 30 days of history paid ≈ 26 ms more per MERGE than against one day (README
//! "Windowed jobs"). Here a file outside the batch's partitions costs one comparison of
//! its partition values.
//!
//! Concurrency: the commit is a `MERGE` without a read predicate, which Delta's
//! conflict checker treats as having read the whole table: any other writer's commit
//! since the snapshot that adds or removes data (a compaction of this table included)
//! makes it fail with a conflict, and the caller plans it again from the newer table
//! (see `JobRunner::merge_gold`); blind appends pass. Gold tables have one writer (the
//! job's lease holder), so the only races are with compactions, which are rare.
//!
//! Tables whose files this reader cannot take as they are — deletion vectors, column
//! mapping, type widening ([`crate::sink::delta::unsupported_layout`]), or columns the
//! batch does not write (a table from a newer release: a MERGE keeps their values for
//! updated rows) — are merged by delta-rs ([`merge_by_delta_rs`]).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{new_null_array, Array, ArrayRef, AsArray, BooleanArray, RecordBatch};
use arrow::compute::{cast, concat_batches, filter_record_batch};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::row::{RowConverter, Rows, SortField};
use datafusion::common::ScalarValue;
use datafusion::prelude::{SessionConfig, SessionContext};
use deltalake::kernel::{Action, Remove};
use deltalake::logstore::object_store::path::Path as ObjPath;
use deltalake::parquet::arrow::async_reader::ParquetRecordBatchStreamBuilder;
use deltalake::protocol::DeltaOperation;
use deltalake::DeltaTable;
use futures::{StreamExt, TryStreamExt};

use crate::error::{Error, Result};
use crate::sink::cluster;
use crate::sink::delta::{self, txn_props};
use crate::sink::probe::Reader;

/// How to MERGE rows into a keyed table with target-side pruning.
#[derive(Debug, Clone)]
pub struct MergeSpec<'a> {
    /// Key columns (matched with `=`, or `IS NOT DISTINCT FROM` when nullable).
    pub keys: &'a [(String, bool)],
    /// Partition columns of the target and the values the source rows (and the rows
    /// they replace) hold: only those partitions' files are read (a column without
    /// values is not restricted).
    pub partitions: Vec<(&'a str, Vec<ScalarValue>)>,
    /// Columns to write (all target columns).
    pub columns: Vec<String>,
    /// Source column holding `upsert` or `delete` (tombstones).
    pub op_column: &'a str,
    /// A column of `partitions` that is not a partition column of the table but by
    /// which its files are clustered (gold's hour within a date partition): files whose
    /// statistics put them outside the column's values are not read, and the rows
    /// written go to one file per value ([`delta::write_clustered`]).
    pub cluster: Option<&'a str>,
}

/// What a MERGE did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MergeCounts {
    pub updated: i64,
    pub inserted: i64,
    pub deleted: i64,
    pub files_scanned: i64,
}

/// What can go wrong merging that is neither Delta's nor the store's.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error("merge into {table}: reading {file}: {source}")]
    Read {
        table: String,
        file: String,
        #[source]
        source: deltalake::parquet::errors::ParquetError,
    },
    #[error("merge into {table}: the rows to merge lack column `{column}`")]
    SourceLacks { table: String, column: String },
    #[error("merge into {table}: partition value `{value}` of column `{column}`: {source}")]
    PartitionValue {
        table: String,
        column: String,
        value: String,
        #[source]
        source: datafusion::error::DataFusionError,
    },
}

/// Which MERGE gold tables get: kestrel's ([`merge`]) unless `KESTREL_MERGE=delta-rs`
/// is set (an escape hatch: every MERGE by delta-rs's operation, as before kestrel had
/// its own) or a benchmark chose with [`use_delta_rs`].
static DELTA_RS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Make every later [`merge`] of this process delta-rs's (`true`) or kestrel's: the
/// benchmarks measure both side by side.
pub fn use_delta_rs(on: bool) {
    DELTA_RS.store(if on { 2 } else { 1 }, std::sync::atomic::Ordering::Relaxed);
}

fn delta_rs_chosen() -> bool {
    match DELTA_RS.load(std::sync::atomic::Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KESTREL_MERGE").is_ok_and(|v| v == "delta-rs");
            use_delta_rs(on);
            on
        }
        v => v == 2,
    }
}

/// Files read at once while looking for the batch's keys.
const READ_AHEAD: usize = 4;

/// MERGE `batches` into `table` in one commit carrying `(app_id, version)`: rows with
/// op `upsert` update or insert, rows with op `delete` delete their match (see the
/// module docs). Returns the table and the number of target rows rewritten, inserted
/// and deleted. Nothing to change commits nothing (as delta-rs's MERGE).
pub async fn merge(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    spec: &MergeSpec<'_>,
    app_id: &str,
    version: i64,
) -> Result<(DeltaTable, MergeCounts)> {
    let url = table.table_url().to_string();
    let Some(first) = batches.first() else {
        return Ok((table, MergeCounts::default()));
    };
    let source = concat_batches(&first.schema(), &batches)?;
    drop(batches);
    if source.num_rows() == 0 {
        return Ok((table, MergeCounts::default()));
    }
    if delta_rs_chosen() {
        return merge_by_delta_rs(table, vec![source], spec, app_id, version).await;
    }
    let started = std::time::Instant::now();
    let name = super::timings::table_name(&url);
    let stage = |what: &str, since: std::time::Instant| {
        super::timings::record(format!("merge {name}: {what}"), since.elapsed());
        std::time::Instant::now()
    };
    let target = match Target::of(&table, spec)? {
        Ok(t) => t,
        Err(why) => {
            tracing::debug!(table = %delta::shown(url.clone()), why, "merged by delta-rs");
            return merge_by_delta_rs(table, vec![source], spec, app_id, version).await;
        }
    };
    let keys = target
        .converter()?
        .convert_columns(&target.keys(&source, &url)?)?;
    let src = Source::new(&source, &keys, spec.op_column, &url)?;
    let t = stage("plan", started);

    // The files of the batch's partitions, each read whole: the rows of those holding
    // none of the batch's keys stay where they are.
    let store = table.log_store().object_store(None);
    let reads: Vec<_> = target
        .files
        .iter()
        .map(|f| scan_file(store.clone(), f, &target, &src.lookup, &url))
        .collect();
    let scans: Vec<FileScan> = futures::stream::iter(reads)
        .buffer_unordered(READ_AHEAD)
        .try_collect()
        .await?;

    let t = stage("read", t);
    let mut counts = MergeCounts {
        files_scanned: scans.len() as i64,
        ..Default::default()
    };
    let mut matched = vec![false; source.num_rows()];
    let mut removes: Vec<Remove> = Vec::new();
    let mut rows: Vec<RecordBatch> = Vec::new();
    for scan in scans {
        if scan.matched.is_empty() {
            continue;
        }
        for i in scan.matched {
            if src.is_delete(i) {
                counts.deleted += 1;
            } else {
                counts.updated += 1;
            }
            matched[i] = true;
        }
        removes.push(scan.remove);
        rows.extend(scan.kept);
    }
    let upserts = src.upserts();
    counts.inserted = upserts.iter().filter(|i| !matched[**i]).count() as i64;
    if !upserts.is_empty() {
        rows.push(src.rows_of(&upserts, &target.schema)?);
    }
    rows.retain(|b| b.num_rows() > 0);
    if removes.is_empty() && rows.is_empty() {
        return Ok((table, counts));
    }

    let writers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let props = delta::writer_properties(&[]);
    let adds = match spec.cluster {
        Some(column) => delta::write_clustered(&table, rows, column, props, writers).await?,
        None => delta::write_files(&table, rows, props, writers).await?,
    };
    let t = stage("write", t);
    let metrics = serde_json::json!({
        "num_source_rows": source.num_rows(),
        "num_target_rows_inserted": counts.inserted,
        "num_target_rows_updated": counts.updated,
        "num_target_rows_deleted": counts.deleted,
        "num_target_files_scanned": counts.files_scanned,
        "num_target_files_added": adds.len(),
        "num_target_files_removed": removes.len(),
        "execution_time_ms": started.elapsed().as_millis() as u64,
    });
    let operation = DeltaOperation::Merge {
        predicate: None,
        merge_predicate: Some(target.key_names.join(", ")),
        matched_predicates: Vec::new(),
        not_matched_predicates: Vec::new(),
        not_matched_by_source_predicates: Vec::new(),
    };
    let actions: Vec<Action> = removes
        .into_iter()
        .map(Action::Remove)
        .chain(adds.into_iter().map(Action::Add))
        .collect();
    let props = delta::txn_props_with(app_id, version, [("operationMetrics".to_string(), metrics)]);
    let table = delta::commit_actions(table, actions, props, operation).await?;
    stage("commit", t);
    super::timings::record(format!("merge {name}"), started.elapsed());
    Ok((table, counts))
}

/// The target side of a MERGE: the table's schema and partition columns, the key
/// columns' positions and types, and the active files of the batch's partitions.
pub(crate) struct Target {
    pub(crate) schema: SchemaRef,
    partition_columns: Vec<String>,
    key_names: Vec<String>,
    key_types: Vec<DataType>,
    pub(crate) files: Vec<TargetFile>,
}

/// An active file of the batch's partitions, with its typed partition values (in the
/// order of the table's partition columns) and the remove action that retires it.
pub(crate) struct TargetFile {
    pub(crate) path: ObjPath,
    pub(crate) size: u64,
    partition: Vec<ScalarValue>,
    pub(crate) remove: Remove,
}

impl Target {
    /// The target of `spec` in `table`, or `Err(why)` when delta-rs must merge it.
    pub(crate) fn of(
        table: &DeltaTable,
        spec: &MergeSpec<'_>,
    ) -> Result<std::result::Result<Self, String>> {
        let url = table.table_url().to_string();
        let snap = table.snapshot().map_err(|e| Error::delta(&url, e))?;
        if let Some(why) = delta::unsupported_layout(snap) {
            return Ok(Err(why));
        }
        let schema = snap.snapshot().arrow_schema();
        if let Some(f) = schema
            .fields()
            .iter()
            .find(|f| !spec.columns.contains(f.name()))
        {
            return Ok(Err(format!(
                "column {} is not written by the batch",
                f.name()
            )));
        }
        let partition_columns = snap.metadata().partition_columns().to_vec();
        let types_of = |names: &[String]| -> Result<Vec<DataType>> {
            names
                .iter()
                .map(|c| {
                    schema
                        .field_with_name(c)
                        .map(|f| f.data_type().clone())
                        .map_err(Error::from)
                })
                .collect()
        };
        let types = types_of(&partition_columns)?;
        // Each restricted partition column's values, as the column's type.
        let mut allowed: Vec<Option<Vec<ScalarValue>>> = vec![None; partition_columns.len()];
        for (column, values) in &spec.partitions {
            let Some(i) = partition_columns.iter().position(|c| c == column) else {
                continue; // not a partition column of this table: no file is excluded
            };
            if values.is_empty() {
                continue;
            }
            let values = values
                .iter()
                .map(|v| {
                    v.cast_to(&types[i])
                        .map_err(|e| Error::query(format!("partition {column} of {url}"), e))
                })
                .collect::<Result<Vec<_>>>()?;
            allowed[i] = Some(values);
        }
        // Restricted columns that are data columns (the clustering column): a file is
        // read only if its min–max range holds one of the values (or it has no
        // statistics for the column).
        let mut ranged: Vec<(String, Vec<i64>)> = Vec::new();
        for (column, values) in &spec.partitions {
            if values.is_empty() || partition_columns.iter().any(|c| c == column) {
                continue;
            }
            let ints: Option<Vec<i64>> = values.iter().map(cluster::integer_of).collect();
            if let (Some(ints), Ok(_)) = (ints, schema.field_with_name(column)) {
                ranged.push((column.to_string(), ints));
            }
        }
        let mut parsed: HashMap<(usize, Option<String>), ScalarValue> = HashMap::new();
        let mut files = Vec::new();
        'files: for f in snap.log_data().iter() {
            if f.deletion_vector_descriptor().is_some() {
                return Ok(Err("deletion vectors".into()));
            }
            let values = f.partition_values_map();
            let mut partition = Vec::with_capacity(partition_columns.len());
            for (i, c) in partition_columns.iter().enumerate() {
                let raw = values.get(c).cloned().flatten();
                let v = match parsed.get(&(i, raw.clone())) {
                    Some(v) => v.clone(),
                    None => {
                        let v = delta::partition_value(raw.as_deref(), &types[i]).map_err(
                            |source| MergeError::PartitionValue {
                                table: delta::shown(url.clone()),
                                column: c.clone(),
                                value: raw.clone().unwrap_or_else(|| "null".into()),
                                source,
                            },
                        )?;
                        parsed.insert((i, raw), v.clone());
                        v
                    }
                };
                if let Some(allowed) = &allowed[i] {
                    if !allowed.contains(&v) {
                        continue 'files;
                    }
                }
                partition.push(v);
            }
            if !ranged.is_empty() && !cluster::stats_admit(f.stats().as_deref(), &ranged) {
                continue;
            }
            files.push(TargetFile {
                path: f.object_store_path(),
                size: f.size() as u64,
                partition,
                remove: f.remove_action(true),
            });
        }
        let key_names: Vec<String> = spec.keys.iter().map(|(k, _)| k.clone()).collect();
        let key_types = types_of(&key_names)?;
        Ok(Ok(Target {
            schema,
            partition_columns,
            key_names,
            key_types,
            files,
        }))
    }

    fn converter(&self) -> Result<RowConverter> {
        Ok(RowConverter::new(
            self.key_types.iter().cloned().map(SortField::new).collect(),
        )?)
    }

    /// `batch`'s key columns, as the table's types.
    fn keys(&self, batch: &RecordBatch, table: &str) -> Result<Vec<ArrayRef>> {
        self.key_names
            .iter()
            .zip(&self.key_types)
            .map(|(k, ty)| {
                let c = batch
                    .column_by_name(k)
                    .ok_or_else(|| MergeError::SourceLacks {
                        table: delta::shown(table.to_string()),
                        column: k.clone(),
                    })?;
                Ok(if c.data_type() == ty {
                    c.clone()
                } else {
                    cast(c, ty)?
                })
            })
            .collect()
    }
}

/// The source side: the rows to merge and, per key, the row that decides it.
struct Source<'a> {
    rows: &'a RecordBatch,
    /// Per source row: whether it is a tombstone.
    delete: Vec<bool>,
    /// Encoded key → the source row that decides it (the last upsert of the key, or its
    /// last tombstone when the key has no upsert).
    lookup: HashMap<&'a [u8], usize>,
}

impl<'a> Source<'a> {
    /// `keys` are `rows`' key columns encoded by [`Target::converter`].
    fn new(rows: &'a RecordBatch, keys: &'a Rows, op_column: &str, url: &str) -> Result<Self> {
        let ops = rows
            .column_by_name(op_column)
            .ok_or_else(|| MergeError::SourceLacks {
                table: delta::shown(url.to_string()),
                column: op_column.to_string(),
            })?;
        let ops = cast(ops, &DataType::Utf8)?;
        let ops = ops.as_string::<i32>();
        let n = rows.num_rows();
        let mut delete = vec![false; n];
        let mut lookup: HashMap<&'a [u8], usize> = HashMap::with_capacity(n);
        for i in 0..n {
            let is_delete = match ops.is_valid(i).then(|| ops.value(i)) {
                Some("upsert") => false,
                Some("delete") => true,
                _ => continue, // no clause of the MERGE applies to it
            };
            delete[i] = is_delete;
            let key = keys.row(i).data();
            match lookup.get(key) {
                // a tombstone after an upsert of the key: the upsert wins
                Some(&j) if is_delete && !delete[j] => {}
                _ => {
                    lookup.insert(key, i);
                }
            }
        }
        Ok(Source {
            rows,
            delete,
            lookup,
        })
    }

    fn is_delete(&self, i: usize) -> bool {
        self.delete[i]
    }

    /// Rows that insert or replace a row: the deciding upserts, in source order.
    fn upserts(&self) -> Vec<usize> {
        let mut rows: Vec<usize> = self
            .lookup
            .values()
            .copied()
            .filter(|i| !self.delete[*i])
            .collect();
        rows.sort_unstable();
        rows
    }

    /// Source rows `which`, as rows of the table.
    fn rows_of(&self, which: &[usize], schema: &SchemaRef) -> Result<RecordBatch> {
        let mut mask = vec![false; self.rows.num_rows()];
        for i in which {
            mask[*i] = true;
        }
        let picked = filter_record_batch(self.rows, &BooleanArray::from(mask))?;
        crate::columns::conform(&picked, schema)
    }
}

/// One target file read: the source rows whose keys it holds, its other rows, and the
/// remove action that retires it if it is rewritten.
struct FileScan {
    matched: Vec<usize>,
    kept: Vec<RecordBatch>,
    remove: Remove,
}

/// Read `file` whole, as rows of the table, and split its rows into those whose key
/// `lookup` names (the batch replaces or deletes them) and the others.
async fn scan_file(
    store: Arc<dyn deltalake::logstore::object_store::ObjectStore>,
    file: &TargetFile,
    target: &Target,
    lookup: &HashMap<&[u8], usize>,
    url: &str,
) -> Result<FileScan> {
    let mut stream = file_rows(store, file, target, url).await?;
    let converter = target.converter()?;
    let mut scan = FileScan {
        matched: Vec::new(),
        kept: Vec::new(),
        remove: file.remove.clone(),
    };
    while let Some(b) = stream.next().await {
        let b = b?;
        let keys = converter.convert_columns(&target.keys(&b, url)?)?;
        let mut keep = Vec::with_capacity(b.num_rows());
        for r in 0..b.num_rows() {
            match lookup.get(keys.row(r).data()) {
                Some(&i) => {
                    scan.matched.push(i);
                    keep.push(false);
                }
                None => keep.push(true),
            }
        }
        scan.kept
            .push(filter_record_batch(&b, &BooleanArray::from(keep))?);
    }
    if scan.matched.is_empty() {
        scan.kept.clear();
    }
    Ok(scan)
}

/// `file`'s rows, as rows of the table (see [`table_rows`]).
pub(crate) async fn file_rows<'a>(
    store: Arc<dyn deltalake::logstore::object_store::ObjectStore>,
    file: &'a TargetFile,
    target: &'a Target,
    url: &'a str,
) -> Result<futures::stream::BoxStream<'a, Result<RecordBatch>>> {
    let read_err = move |source| {
        Error::from(MergeError::Read {
            table: delta::shown(url.to_string()),
            file: file.path.to_string(),
            source,
        })
    };
    let reader = Reader {
        store,
        path: file.path.clone(),
        size: file.size,
    };
    let stream = ParquetRecordBatchStreamBuilder::new(reader)
        .await
        .map_err(read_err)?
        .build()
        .map_err(read_err)?;
    Ok(stream
        .map(move |b| table_rows(&b.map_err(read_err)?, target, &file.partition))
        .boxed())
}

/// A batch read from a target file as rows of the table: partition columns from the
/// file's partition values, columns the file predates as nulls.
fn table_rows(b: &RecordBatch, target: &Target, partition: &[ScalarValue]) -> Result<RecordBatch> {
    let n = b.num_rows();
    let columns = target
        .schema
        .fields()
        .iter()
        .map(|f| {
            if let Some(i) = target.partition_columns.iter().position(|c| c == f.name()) {
                let a = partition[i]
                    .to_array_of_size(n)
                    .map_err(|e| Error::query(format!("partition column {}", f.name()), e))?;
                return Ok(if a.data_type() == f.data_type() {
                    a
                } else {
                    cast(&a, f.data_type())?
                });
            }
            Ok(match b.column_by_name(f.name()) {
                Some(c) if c.data_type() == f.data_type() => c.clone(),
                Some(c) => cast(c, f.data_type())?,
                None => new_null_array(f.data_type(), n),
            })
        })
        .collect::<Result<Vec<ArrayRef>>>()?;
    Ok(RecordBatch::try_new(target.schema.clone(), columns)?)
}

/// MERGE by delta-rs's own operation (tables [`merge`] does not handle; and the
/// reference the equivalence test compares with).
pub async fn merge_by_delta_rs(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    spec: &MergeSpec<'_>,
    app_id: &str,
    version: i64,
) -> Result<(DeltaTable, MergeCounts)> {
    let url = table.table_url().to_string();
    let t_merge = std::time::Instant::now();
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let source = ctx
        .read_batches(batches)
        .map_err(|e| Error::query("merge source", e))?;
    use datafusion::prelude::{col, lit, Expr};
    let mut pred: Vec<Expr> = spec
        .keys
        .iter()
        .map(|(k, nullable)| {
            let (t, s) = (col(format!("t.{k}")), col(format!("s.{k}")));
            if *nullable {
                datafusion::logical_expr::binary_expr(
                    t,
                    datafusion::logical_expr::Operator::IsNotDistinctFrom,
                    s,
                )
            } else {
                t.eq(s)
            }
        })
        .collect();
    for (pcol, values) in &spec.partitions {
        if !values.is_empty() {
            let list = values.iter().map(|v| lit(v.clone())).collect();
            pred.push(col(format!("t.{pcol}")).in_list(list, false));
        }
    }
    let predicate = pred.into_iter().reduce(Expr::and).unwrap_or(lit(true));
    let op = spec.op_column;
    let is_op = |v: &str| col(format!("s.{op}")).eq(lit(v.to_string()));
    let key_names: Vec<&str> = spec.keys.iter().map(|(k, _)| k.as_str()).collect();
    let (table, metrics) = table
        .merge(source, predicate)
        .with_session_state(super::delta::rewrite_session())
        .with_source_alias("s")
        .with_target_alias("t")
        .with_commit_properties(txn_props(app_id, version))
        .when_matched_delete(|d| d.predicate(is_op("delete")))
        .and_then(|m| {
            m.when_matched_update(|mut u| {
                u = u.predicate(is_op("upsert"));
                for c in &spec.columns {
                    if !key_names.contains(&c.as_str()) {
                        u = u.update(c.as_str(), col(format!("s.{c}")));
                    }
                }
                u
            })
        })
        .and_then(|m| {
            m.when_not_matched_insert(|mut i| {
                i = i.predicate(is_op("upsert"));
                for c in &spec.columns {
                    i = i.set(c.as_str(), col(format!("s.{c}")));
                }
                i
            })
        })
        .map_err(|e| Error::delta(&url, e))?
        .await
        .map_err(|e| Error::delta(&url, e))?;
    super::timings::record(
        format!("merge {}", super::timings::table_name(&url)),
        t_merge.elapsed(),
    );
    super::tables::keep(&table);
    Ok((
        table,
        MergeCounts {
            updated: metrics.num_target_rows_updated as i64,
            inserted: metrics.num_target_rows_inserted as i64,
            deleted: metrics.num_target_rows_deleted as i64,
            files_scanned: metrics.num_target_files_scanned as i64,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::delta::Warehouse;
    use crate::storage::Location;
    use arrow::array::{Date32Array, Int32Array, Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};
    use rand::{Rng, SeedableRng};

    const OP: &str = "_op";
    /// The hour column: gold's name, so the compaction knows the table is clustered.
    const H: &str = "window_hour";

    fn gold_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, false),
            Field::new("n", DataType::Int64, true),
            Field::new("d", DataType::Date32, false),
            Field::new(H, DataType::Int32, false),
            Field::new("v", DataType::Int64, true),
        ]))
    }

    /// Rows `(k, n, v, op)`; a key's partition (`d`, `h`) follows from it, as a gold
    /// row's date and hour follow from its window.
    fn source(rows: &[(String, Option<i64>, i64, &str)]) -> RecordBatch {
        let part = |k: &str, n: Option<i64>| {
            let x = k.bytes().map(u64::from).sum::<u64>() + n.unwrap_or(7) as u64;
            (20_000 + (x % 2) as i32, (x % 3) as i32)
        };
        let mut fields: Vec<Field> = gold_schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(Field::new(OP, DataType::Utf8, true));
        RecordBatch::try_new(
            Arc::new(Schema::new(fields)),
            vec![
                Arc::new(StringArray::from_iter_values(
                    rows.iter().map(|r| r.0.as_str()),
                )),
                Arc::new(Int64Array::from_iter(rows.iter().map(|r| r.1))),
                Arc::new(Date32Array::from_iter_values(
                    rows.iter().map(|r| part(&r.0, r.1).0),
                )),
                Arc::new(Int32Array::from_iter_values(
                    rows.iter().map(|r| part(&r.0, r.1).1),
                )),
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.3))),
            ],
        )
        .unwrap()
    }

    fn spec_of<'a>(keys: &'a [(String, bool)], b: &RecordBatch) -> MergeSpec<'a> {
        let values = |c: &str| {
            let a = b.column_by_name(c).unwrap();
            let mut v: Vec<ScalarValue> = (0..a.len())
                .map(|i| ScalarValue::try_from_array(a, i).unwrap())
                .collect();
            v.sort_by(|x, y| x.partial_cmp(y).unwrap());
            v.dedup();
            v
        };
        MergeSpec {
            keys,
            partitions: vec![("d", values("d")), (H, values(H))],
            columns: ["k", "n", "d", H, "v"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            op_column: OP,
            cluster: None,
        }
    }

    async fn contents(table: &DeltaTable) -> String {
        let ctx = crate::sink::delta::session_with(table, "t").await.unwrap();
        let b = crate::sink::delta::sql(
            &ctx,
            "SELECT k, n, d, window_hour, v FROM t ORDER BY k, n, v",
        )
        .await
        .unwrap();
        arrow::util::pretty::pretty_format_batches(&b)
            .unwrap()
            .to_string()
    }

    fn warehouse(dir: &std::path::Path) -> Warehouse {
        Warehouse::new(Location::open(dir.to_str().unwrap(), &Default::default(), true).unwrap())
    }

    /// Random batches of upserts and tombstones (a nullable key column among the keys,
    /// keys in two dates × three hours, partitions compacted now and then so they hold
    /// several files) MERGEd here and by delta-rs give the same rows and the same counts
    /// after every batch.
    #[tokio::test]
    async fn merges_like_delta_rs() {
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        let schema = gold_schema();
        let mut ours = wh
            .open_or_create("gold/ours", &schema, &["d", H])
            .await
            .unwrap();
        let mut theirs = wh
            .open_or_create("gold/theirs", &schema, &["d", H])
            .await
            .unwrap();
        // The layout gold tables get: partitioned by date, each file one hour's.
        let mut clustered = wh
            .open_or_create("gold/clustered", &schema, &["d"])
            .await
            .unwrap();
        let keys = [("k".to_string(), false), ("n".to_string(), true)];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut compactions = 0;
        for batch in 1..=24i64 {
            let mut rows: Vec<(String, Option<i64>, i64, &str)> = Vec::new();
            for _ in 0..rng.gen_range(1..25) {
                let k = format!("k{}", rng.gen_range(0..12));
                let n = match rng.gen_range(0..3) {
                    0 => None,
                    x => Some(x),
                };
                if rows.iter().any(|r| r.0 == k && r.1 == n) {
                    continue;
                }
                let op = if rng.gen_bool(0.2) {
                    "delete"
                } else {
                    "upsert"
                };
                rows.push((k, n, batch * 100 + rows.len() as i64, op));
            }
            let b = source(&rows);
            let spec = spec_of(&keys, &b);
            let (t, ours_n) = merge(ours, vec![b.clone()], &spec, "app", batch)
                .await
                .unwrap();
            ours = t;
            let by_hour = MergeSpec {
                cluster: Some(H),
                ..spec.clone()
            };
            let (t, clustered_n) = merge(clustered, vec![b.clone()], &by_hour, "app", batch)
                .await
                .unwrap();
            clustered = t;
            let (t, theirs_n) = merge_by_delta_rs(theirs, vec![b], &spec, "app", batch)
                .await
                .unwrap();
            theirs = t;
            assert_eq!(
                (ours_n.updated, ours_n.inserted, ours_n.deleted),
                (
                    clustered_n.updated,
                    clustered_n.inserted,
                    clustered_n.deleted
                ),
                "counts of batch {batch}, clustered"
            );
            assert_eq!(
                contents(&clustered).await,
                contents(&theirs).await,
                "batch {batch}, clustered"
            );
            assert_eq!(
                (ours_n.updated, ours_n.inserted, ours_n.deleted),
                (theirs_n.updated, theirs_n.inserted, theirs_n.deleted),
                "counts of batch {batch}"
            );
            assert_eq!(
                contents(&ours).await,
                contents(&theirs).await,
                "batch {batch}"
            );
            if batch % 8 == 0 {
                ours = ours.optimize().await.unwrap().0;
                // The open day's compaction: an hour's small files into one.
                let opts = crate::sink::compact::OpenCompaction {
                    min_files: 2,
                    target_size: 32 << 20,
                };
                let done = crate::sink::compact::open_partitions(
                    &wh,
                    "gold/clustered",
                    &opts,
                    &[],
                    None,
                    false,
                )
                .await
                .unwrap();
                if let Some(d) = done {
                    assert!(d.files_removed > d.files_added, "batch {batch}: {d:?}");
                    compactions += 1;
                }
                clustered = wh.open("gold/clustered").await.unwrap().unwrap();
                assert_eq!(contents(&clustered).await, contents(&theirs).await);
            }
        }
        assert!(compactions > 0, "an hour's files were compacted");
        // Every file of the clustered table holds one hour, and a batch touching one
        // hour reads only that hour's files of its date.
        let snap = clustered.snapshot().unwrap();
        let mut per_hour: HashMap<(String, i64), i64> = HashMap::new();
        for f in snap.log_data().iter() {
            let h = cluster::single_value(f.stats().as_deref(), H);
            let d = f
                .partition_values_map()
                .get("d")
                .cloned()
                .flatten()
                .unwrap();
            *per_hour
                .entry((d, h.expect("one hour per file")))
                .or_default() += 1;
        }
        let b = source(&[("k1".into(), Some(1), 9, "upsert")]);
        let spec = MergeSpec {
            cluster: Some(H),
            ..spec_of(&keys, &b)
        };
        let (hour, date) = (
            b.column_by_name(H)
                .unwrap()
                .as_primitive::<arrow::datatypes::Int32Type>()
                .value(0),
            b.column_by_name("d")
                .unwrap()
                .as_primitive::<arrow::datatypes::Date32Type>()
                .value(0),
        );
        let date = arrow::temporal_conversions::date32_to_datetime(date)
            .unwrap()
            .format("%Y-%m-%d")
            .to_string();
        let (_, n) = merge(clustered, vec![b], &spec, "app", 25).await.unwrap();
        assert_eq!(
            n.files_scanned,
            per_hour[&(date, i64::from(hour))],
            "{per_hour:?}"
        );
        // What each commit wrote is found again (a resumed batch reports it).
        let last = crate::sink::delta::written_by(&ours, "app", 24)
            .await
            .unwrap();
        assert!(last.is_some_and(|n| n > 0), "{last:?}");
        assert_eq!(
            crate::sink::delta::txn_version(&ours, "app").await.unwrap(),
            Some(24)
        );
        // Only files holding a batch's keys are rewritten: a batch touching one key
        // leaves the other partitions' files (and that partition's other files) alone.
        let before: std::collections::HashSet<String> = ours.get_file_uris().unwrap().collect();
        let b = source(&[("k1".into(), Some(1), 9, "upsert")]);
        let (ours, n) = merge(ours, vec![b.clone()], &spec_of(&keys, &b), "app", 25)
            .await
            .unwrap();
        let after: std::collections::HashSet<String> = ours.get_file_uris().unwrap().collect();
        assert_eq!(n.updated + n.inserted, 1);
        assert!(
            before.difference(&after).count() <= 1,
            "one file rewritten at most"
        );
        assert_eq!(after.difference(&before).count(), 1, "one file written");
    }

    /// A MERGE planned on a snapshot that a compaction of the table has since replaced
    /// fails with a commit conflict (the caller plans it again), and then succeeds.
    #[tokio::test]
    async fn a_merge_racing_a_compaction_conflicts() {
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        let mut table = wh
            .open_or_create("gold/t", &gold_schema(), &["d", H])
            .await
            .unwrap();
        let keys = [("k".to_string(), false), ("n".to_string(), true)];
        // Three keys of one partition (`n` 1, 7, 13: see `source`), one file each.
        for v in 1..=3 {
            let b = source(&[("k1".into(), Some(1 + 6 * (v - 1)), v, "upsert")]);
            table = merge(table, vec![b.clone()], &spec_of(&keys, &b), "app", v)
                .await
                .unwrap()
                .0;
        }
        let stale = table.clone();
        let (compacted, m) = table.optimize().await.unwrap();
        assert!(m.num_files_removed > 0);
        let b = source(&[("k1".into(), Some(1), 10, "upsert")]);
        let err = merge(stale, vec![b.clone()], &spec_of(&keys, &b), "app", 4)
            .await
            .unwrap_err();
        assert!(err.is_commit_conflict(), "{err}");
        let (table, n) = merge(compacted, vec![b.clone()], &spec_of(&keys, &b), "app", 4)
            .await
            .unwrap();
        assert_eq!((n.updated, n.inserted), (1, 0));
        assert_eq!(contents(&table).await.matches("| k1 ").count(), 3);
    }

    /// In a clustered table an hour's compaction and a MERGE race either way: a MERGE
    /// planned before the compaction committed conflicts (and succeeds planned again);
    /// a compaction planned before a MERGE that rewrote one of its files conflicts (and
    /// is given up). Nothing is lost or doubled.
    #[tokio::test]
    async fn an_hour_compaction_and_a_merge_race_either_way() {
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        let mut table = wh
            .open_or_create("gold/t", &gold_schema(), &["d"])
            .await
            .unwrap();
        let keys = [("k".to_string(), false), ("n".to_string(), true)];
        // `n` 1, 7, 13 of k1 fall in one date and hour (see `source`): three files.
        for v in 1..=3 {
            let b = source(&[("k1".into(), Some(1 + 6 * (v - 1)), v, "upsert")]);
            let spec = MergeSpec {
                cluster: Some(H),
                ..spec_of(&keys, &b)
            };
            table = merge(table, vec![b.clone()], &spec, "app", v)
                .await
                .unwrap()
                .0;
        }
        let paths = active_paths(&table);
        assert_eq!(paths.len(), 3);
        let hour = i64::from(
            source(&[("k1".into(), Some(1), 0, "upsert")])
                .column_by_name(H)
                .unwrap()
                .as_primitive::<arrow::datatypes::Int32Type>()
                .value(0),
        );
        let props = crate::sink::delta::writer_properties(&[]);
        let compact = |t: DeltaTable| {
            let (paths, props) = (paths.clone(), props.clone());
            async move { cluster::compact_hour(t, H, hour, &paths, props, 32 << 20).await }
        };
        let b = source(&[("k1".into(), Some(1), 10, "upsert")]);
        let spec = MergeSpec {
            cluster: Some(H),
            ..spec_of(&keys, &b)
        };

        // The compaction first: the stale MERGE conflicts, then succeeds.
        let stale = table.clone();
        let (compacted, m) = compact(table.clone()).await.unwrap();
        assert_eq!((m.files_removed, m.files_added), (3, 1));
        let err = merge(stale, vec![b.clone()], &spec, "app", 4)
            .await
            .unwrap_err();
        assert!(err.is_commit_conflict(), "{err}");
        let (merged, n) = merge(compacted, vec![b.clone()], &spec, "app", 4)
            .await
            .unwrap();
        assert_eq!((n.updated, n.inserted), (1, 0));
        assert_eq!(contents(&merged).await.matches("| k1 ").count(), 3);

        // The MERGE first: a compaction planned before it conflicts.
        let dir2 = tempfile::tempdir().unwrap();
        let wh2 = warehouse(dir2.path());
        let mut t2 = wh2
            .open_or_create("gold/t", &gold_schema(), &["d"])
            .await
            .unwrap();
        for v in 1..=3 {
            let b = source(&[("k1".into(), Some(1 + 6 * (v - 1)), v, "upsert")]);
            t2 = merge(t2, vec![b], &spec, "app", v).await.unwrap().0;
        }
        let paths = active_paths(&t2);
        let stale = t2.clone();
        merge(t2, vec![b.clone()], &spec, "app", 4).await.unwrap();
        let err = cluster::compact_hour(stale, H, hour, &paths, props.clone(), 32 << 20)
            .await
            .unwrap_err();
        assert!(err.is_commit_conflict(), "{err}");
        let t2 = wh2.open("gold/t").await.unwrap().unwrap();
        assert_eq!(contents(&t2).await, contents(&merged).await);
    }

    /// The paths of `table`'s active files.
    fn active_paths(table: &DeltaTable) -> std::collections::HashSet<String> {
        let snap = table.snapshot().unwrap();
        snap.log_data()
            .iter()
            .map(|f| f.object_store_path().to_string())
            .collect()
    }

    /// A table with a column the batch does not write is merged by delta-rs, which keeps
    /// that column's values in updated rows.
    #[tokio::test]
    async fn a_table_with_columns_the_batch_does_not_write_keeps_them() {
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        let mut fields: Vec<Field> = gold_schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(Field::new("extra", DataType::Int64, true));
        let wide = Arc::new(Schema::new(fields));
        let table = wh.open_or_create("gold/t", &wide, &["d", H]).await.unwrap();
        let row = source(&[("k1".into(), None, 1, "upsert")]);
        let mut cols = row.columns()[..5].to_vec();
        cols.push(Arc::new(Int64Array::from(vec![42])));
        let table = crate::sink::delta::append(
            table,
            vec![RecordBatch::try_new(wide, cols).unwrap()],
            &["d", H],
            "seed",
            1,
        )
        .await
        .unwrap();
        let keys = [("k".to_string(), false), ("n".to_string(), true)];
        let b = source(&[("k1".into(), None, 5, "upsert")]);
        let (table, n) = merge(table, vec![b.clone()], &spec_of(&keys, &b), "app", 1)
            .await
            .unwrap();
        assert_eq!(n.updated, 1);
        let ctx = crate::sink::delta::session_with(&table, "t").await.unwrap();
        let got = crate::sink::delta::sql(&ctx, "SELECT v, extra FROM t")
            .await
            .unwrap();
        let text = arrow::util::pretty::pretty_format_batches(&got)
            .unwrap()
            .to_string();
        assert!(text.contains("| 5 | 42    |"), "{text}");
    }
}
