//! A Delta table's snapshot as a DataFusion table whose scans choose their files from
//! the snapshot kestrel already holds.
//!
//! delta-rs's table provider hands every scan's file list to the kernel, which replays
//! the snapshot's add actions again (statistics parsed from JSON per file): ≈ 83 µs per
//! *active* file per scan, paid by every read of a table with a file a day of history
//! (`cargo bench --bench jobs -- readcost`). [`SnapshotTable`] instead prunes the
//! snapshot's files with DataFusion's `PruningPredicate` over the statistics delta-rs
//! has already parsed into the snapshot (`stats_parsed`, `partitionValues_parsed`:
//! vectorised, one comparison per file), and plans a Parquet scan of the files left, with
//! their partition values as constants — as a listing table does, and as
//! [`crate::engine::port`] does for the cluster. Row groups, pages and bloom filters are
//! pruned by the Parquet scan as before; every filter stays above the scan too
//! (`Inexact`), so the statistics only ever skip files, never decide a row.
//!
//! What plain Parquet cannot read — deletion vectors, column mapping, type widening —
//! is left to delta-rs's provider ([`unreadable_as_parquet`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray, Int64Array};
use arrow::datatypes::{DataType, FieldRef, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{Column, DFSchema, ScalarValue};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::CachedParquetFileReaderFactory;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::datasource::table_schema::TableSchema;
use datafusion::datasource::TableType;
use datafusion::error::Result as DfResult;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_optimizer::pruning::{PruningPredicateBuilder, PruningStatistics};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};
use deltalake::table::state::DeltaTableState;
use deltalake::DeltaTable;
use object_store::path::Path;

use super::delta;

static DELTA_RS: AtomicBool = AtomicBool::new(false);

/// Read through delta-rs's table provider instead (`true`), for benchmarks that
/// measure both side by side; kestrel reads with [`SnapshotTable`] by default.
pub fn use_delta_rs(on: bool) {
    DELTA_RS.store(on, Ordering::Relaxed);
}

/// Whether reads go through [`SnapshotTable`] (see [`use_delta_rs`]).
pub fn enabled() -> bool {
    !DELTA_RS.load(Ordering::Relaxed)
}

/// Why delta-rs's provider must read `snap` (None: a [`SnapshotTable`] can).
pub fn unreadable_as_parquet(snap: &DeltaTableState) -> Option<String> {
    if let Some(why) = delta::unsupported_layout(snap) {
        return Some(why);
    }
    let p = snap.protocol();
    let dv = p
        .reader_features()
        .into_iter()
        .flatten()
        .map(|f| f.to_string())
        .chain(
            p.writer_features()
                .into_iter()
                .flatten()
                .map(|f| f.to_string()),
        )
        .any(|name| name.contains("deletionVectors"));
    if dv {
        return Some("deletion vectors".into());
    }
    None
}

/// A Delta table at one snapshot, read as its active Parquet files.
#[derive(Debug)]
pub struct SnapshotTable {
    state: DeltaTableState,
    /// The table's columns in Delta's order (what `SELECT *` gives).
    schema: SchemaRef,
    /// Columns stored in the files, in the table's order, then the partition columns:
    /// the order of a Parquet scan's columns.
    scan_schema: TableSchema,
    /// Position in the scan's columns of each of the table's columns.
    to_scan: Vec<usize>,
    partition_columns: Vec<String>,
    store: ObjectStoreUrl,
    /// The table's root in `store`.
    root: Path,
}

impl SnapshotTable {
    /// `table`'s current snapshot as a table; Err when it cannot be read as plain
    /// Parquet ([`unreadable_as_parquet`]) or has no snapshot.
    pub fn try_new(table: &DeltaTable) -> crate::error::Result<std::result::Result<Self, String>> {
        let url = table.table_url().clone();
        let state = table
            .snapshot()
            .map_err(|e| crate::error::Error::delta(url.as_str(), e))?
            .clone();
        if let Some(why) = unreadable_as_parquet(&state) {
            return Ok(Err(why));
        }
        let schema = state.snapshot().arrow_schema();
        let partition_columns = state.metadata().partition_columns().to_vec();
        let is_partition = |f: &FieldRef| partition_columns.contains(f.name());
        let file_fields: Vec<FieldRef> = schema
            .fields()
            .iter()
            .filter(|f| !is_partition(f))
            .cloned()
            .collect();
        let mut partition_fields: Vec<FieldRef> = Vec::new();
        for c in &partition_columns {
            match schema.field_with_name(c) {
                Ok(f) => partition_fields.push(Arc::new(f.clone())),
                Err(_) => return Ok(Err(format!("partition column {c} not in the schema"))),
            }
        }
        let to_scan = schema
            .fields()
            .iter()
            .map(
                |f| match partition_columns.iter().position(|c| c == f.name()) {
                    Some(i) => file_fields.len() + i,
                    None => file_fields
                        .iter()
                        .position(|g| g.name() == f.name())
                        .unwrap_or_default(),
                },
            )
            .collect();
        let scan_schema = TableSchema::builder(Arc::new(Schema::new(file_fields)))
            .with_table_partition_cols(partition_fields)
            .build();
        let store = ObjectStoreUrl::parse(format!(
            "{}://{}",
            url.scheme(),
            &url[url::Position::BeforeHost..url::Position::AfterPort]
        ))
        .map_err(|e| crate::error::Error::query(format!("object store of {url}"), e))?;
        let root = Path::from_url_path(url.path()).map_err(|e| crate::error::Error::Location {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        Ok(Ok(SnapshotTable {
            state,
            schema,
            scan_schema,
            to_scan,
            partition_columns,
            store,
            root,
        }))
    }

    /// Which of the snapshot's files (in `log_data` order) may hold a row `predicate`
    /// (bound to the scan's columns) keeps, by their statistics and partition values.
    fn keep(
        &self,
        state: &dyn Session,
        predicate: Option<&Arc<dyn PhysicalExpr>>,
    ) -> DfResult<Vec<bool>> {
        let files = self.state.log_data().num_files();
        let max_in_list = state.config().options().execution.parquet.max_in_list_size;
        // No filter, or one the statistics cannot judge: every file is read.
        let Some(pruning) = predicate.and_then(|p| {
            PruningPredicateBuilder::new()
                .with_file_schema(self.scan_schema.table_schema().clone())
                .with_max_in_list_size(max_in_list)
                .build(p.clone())
        }) else {
            return Ok(vec![true; files]);
        };
        let stats = Stats {
            partition_columns: &self.partition_columns,
            log: self.state.log_data(),
        };
        pruning.prune(&stats)
    }
}

/// The snapshot's statistics as DataFusion's pruning reads them, with the maximum of a
/// timestamp column taken up to the next millisecond: Delta statistics hold timestamps
/// at millisecond precision, truncated, so a file's true maximum may lie up to 999 µs
/// above the recorded one (delta-rs's own reads round it up the same way).
struct Stats<'a> {
    partition_columns: &'a [String],
    log: deltalake::kernel::LogDataHandler<'a>,
}

impl PruningStatistics for Stats<'_> {
    fn min_values(&self, column: &Column) -> Option<ArrayRef> {
        self.log.min_values(column)
    }

    fn max_values(&self, column: &Column) -> Option<ArrayRef> {
        let max = self.log.max_values(column)?;
        if self.partition_columns.contains(&column.name) {
            return Some(max);
        }
        match max.data_type() {
            DataType::Timestamp(unit, _) => {
                let step = match unit {
                    TimeUnit::Second | TimeUnit::Millisecond => return Some(max),
                    TimeUnit::Microsecond => 999,
                    TimeUnit::Nanosecond => 999_999,
                };
                let ty = max.data_type().clone();
                let raw = arrow::compute::cast(&max, &DataType::Int64).ok()?;
                let raw = raw.as_any().downcast_ref::<Int64Array>()?;
                let up: Int64Array = raw.unary(|v| v.saturating_add(step));
                arrow::compute::cast(&up, &ty).ok()
            }
            _ => Some(max),
        }
    }

    fn num_containers(&self) -> usize {
        self.log.num_containers()
    }

    fn null_counts(&self, column: &Column) -> Option<ArrayRef> {
        self.log.null_counts(column)
    }

    fn row_counts(&self) -> Option<ArrayRef> {
        self.log.row_counts()
    }

    fn contained(
        &self,
        column: &Column,
        values: &std::collections::HashSet<ScalarValue>,
    ) -> Option<BooleanArray> {
        self.log.contained(column, values)
    }
}

#[async_trait]
impl TableProvider for SnapshotTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> DfResult<Vec<TableProviderFilterPushDown>> {
        // Every filter skips files and row groups below and is applied again above.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        // One predicate, bound to the scan's columns: it skips files here and row groups,
        // pages and rows in the Parquet scan.
        let predicate = match conjunction(filters.iter().cloned()) {
            Some(p) => {
                let columns = DFSchema::try_from(self.scan_schema.table_schema().as_ref().clone())?;
                Some(state.create_physical_expr(p, &columns)?)
            }
            None => None,
        };
        let keep = self.keep(state, predicate.as_ref())?;
        let types: Vec<DataType> = self
            .scan_schema
            .table_partition_cols()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        let mut files = Vec::new();
        for (f, keep) in self.state.log_data().iter().zip(keep) {
            if !keep {
                continue;
            }
            let partition = delta::file_partition_values(&f, &self.partition_columns, &types)?;
            let mut file = PartitionedFile::new("", u64::try_from(f.size()).unwrap_or(0));
            file.object_meta.location =
                Path::from_iter(self.root.parts().chain(f.object_store_path().parts()));
            file.partition_values = partition;
            files.push(file);
        }
        let columns: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        if files.is_empty() {
            let projected = self.schema.project(&columns)?;
            return Ok(Arc::new(EmptyExec::new(Arc::new(projected))));
        }
        let projection: Vec<usize> = columns.iter().map(|&i| self.to_scan[i]).collect();
        let options = datafusion::config::TableParquetOptions {
            global: state.config().options().execution.parquet.clone(),
            ..Default::default()
        };
        let store = state.runtime_env().object_store(&self.store)?;
        let cache = state.runtime_env().cache_manager.get_file_metadata_cache();
        let mut source = ParquetSource::new(self.scan_schema.clone())
            .with_table_parquet_options(options)
            .with_parquet_file_reader_factory(Arc::new(CachedParquetFileReaderFactory::new(
                store, cache,
            )));
        if let Some(predicate) = predicate {
            // Rows a filter drops are dropped while decoding (as delta-rs's scan does).
            source = source.with_predicate(predicate).with_pushdown_filters(true);
        }
        let config = FileScanConfigBuilder::new(self.store.clone(), Arc::new(source))
            .with_file_groups(groups(files, state.config().target_partitions()))
            .with_limit(limit)
            .with_projection_indices(Some(projection))?
            .build();
        Ok(DataSourceExec::from_data_source(config))
    }
}

/// `files` spread over up to `n` groups of about equal bytes (largest first, each to the
/// lightest group).
fn groups(mut files: Vec<PartitionedFile>, n: usize) -> Vec<FileGroup> {
    let n = n.clamp(1, files.len().max(1));
    files.sort_by_key(|f| std::cmp::Reverse(f.object_meta.size));
    let mut groups: Vec<(u64, Vec<PartitionedFile>)> = vec![(0, Vec::new()); n];
    for f in files {
        if let Some(g) = groups.iter_mut().min_by_key(|g| g.0) {
            g.0 += f.object_meta.size;
            g.1.push(f);
        }
    }
    groups
        .into_iter()
        .filter(|g| !g.1.is_empty())
        .map(|g| FileGroup::new(g.1))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::delta;
    use arrow::array::{Date32Array, RecordBatch, StringArray, TimestampMicrosecondArray};
    use arrow::datatypes::Field;
    use datafusion::datasource::physical_plan::FileScanConfig;
    use datafusion::prelude::SessionContext;

    fn schema(extra: bool) -> SchemaRef {
        let mut fields = vec![
            Field::new("id", DataType::Utf8, true),
            Field::new("day", DataType::Date32, true),
            Field::new(
                "ts",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
            Field::new("sku", DataType::Utf8, true),
        ];
        if extra {
            fields.push(Field::new("note", DataType::Utf8, true));
        }
        Arc::new(Schema::new(fields))
    }

    /// Rows of one day: ids `tag-0..n`, timestamps `base_us + i * 1_001` µs (not whole
    /// milliseconds: the statistics' truncation matters), skus `S{i % 3}` (one null).
    fn rows(tag: &str, day: i32, base_us: i64, n: usize, extra: bool) -> RecordBatch {
        let mut cols: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| format!("{tag}-{i}")),
            )),
            Arc::new(Date32Array::from(vec![day; n])),
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(
                    (0..n).map(|i| base_us + i as i64 * 1_001),
                )
                .with_timezone("UTC"),
            ),
            Arc::new(StringArray::from_iter(
                (0..n).map(|i| (i != 1).then(|| format!("S{}", i % 3))),
            )),
        ];
        if extra {
            cols.push(Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| format!("n{i}")),
            )));
        }
        RecordBatch::try_new(schema(extra), cols).unwrap()
    }

    /// Files a scan of `table` with `filter` plans.
    async fn files_planned(delta: &DeltaTable, filter: Option<Expr>) -> usize {
        let table = SnapshotTable::try_new(delta).unwrap().unwrap();
        let ctx = SessionContext::new();
        delta.update_datafusion_session(&ctx.state()).unwrap();
        let filters: Vec<Expr> = filter.into_iter().collect();
        let plan = table
            .scan(&ctx.state(), None, &filters, None)
            .await
            .unwrap();
        match plan.downcast_ref::<DataSourceExec>() {
            Some(exec) => exec
                .data_source()
                .downcast_ref::<FileScanConfig>()
                .map(|c| c.file_groups.iter().map(|g| g.len()).sum())
                .unwrap_or(0),
            None => 0,
        }
    }

    /// The same query through delta-rs's provider and through [`SnapshotTable`], as
    /// sorted text rows.
    async fn both(table: &DeltaTable, query: &str) -> (Vec<String>, Vec<String>) {
        let mut out = Vec::new();
        for delta_rs in [true, false] {
            let ctx = delta::session();
            table.update_datafusion_session(&ctx.state()).unwrap();
            let provider: Arc<dyn TableProvider> = if delta_rs {
                table.table_provider().await.unwrap()
            } else {
                Arc::new(SnapshotTable::try_new(table).unwrap().unwrap())
            };
            ctx.register_table("t", provider).unwrap();
            let batches = ctx.sql(query).await.unwrap().collect().await.unwrap();
            let text = arrow::util::pretty::pretty_format_batches(&batches)
                .unwrap()
                .to_string();
            let mut lines: Vec<String> = text
                .lines()
                .filter(|l| l.starts_with('|'))
                .map(str::to_string)
                .collect();
            // The header first, then the rows in order.
            let header = if lines.is_empty() {
                String::new()
            } else {
                lines.remove(0)
            };
            lines.sort();
            lines.insert(0, header);
            out.push(lines);
        }
        let snapshot = out.pop().unwrap_or_default();
        let delta_rs = out.pop().unwrap_or_default();
        (delta_rs, snapshot)
    }

    /// Reads through the snapshot give what delta-rs's provider gives — every column in
    /// its order, files from before a
    /// column was added (nulls), filters on the partition, on timestamps a microsecond
    /// past a file's last whole millisecond, on strings, lists and nulls — and skip the
    /// files the statistics rule out.
    #[tokio::test]
    async fn reads_equal_delta_rs_and_skip_files_by_statistics() {
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let mut table = wh
            .open_or_create("t", &schema(false), &["day"])
            .await
            .unwrap();
        let day_us = 86_400_000_000i64;
        // Three days of three files, then a column added, then two more files.
        let mut v = 0;
        for day in 0..3 {
            for part in 0..3 {
                v += 1;
                let base = day as i64 * day_us + part as i64 * 3_600_000_000;
                table = delta::append(
                    table,
                    vec![rows(
                        &format!("d{day}p{part}"),
                        20_000 + day,
                        base,
                        50,
                        false,
                    )],
                    &["day"],
                    "w",
                    v,
                )
                .await
                .unwrap();
            }
        }
        for day in [2, 3] {
            v += 1;
            let base = day as i64 * day_us + 5 * 3_600_000_000;
            table = delta::append_evolving(
                table,
                vec![rows(&format!("e{day}"), 20_000 + day, base, 50, true)],
                &["day".to_string()],
                "w",
                v,
                None,
            )
            .await
            .unwrap();
        }
        let snap = SnapshotTable::try_new(&table).unwrap().unwrap();
        // The columns of delta-rs's provider, in its order.
        let theirs = table.table_provider().await.unwrap().schema();
        let names =
            |s: SchemaRef| -> Vec<String> { s.fields().iter().map(|f| f.name().clone()).collect() };
        assert_eq!(names(snap.schema()), names(theirs));
        // The last row of day 0's first file is at 49 * 1001 µs = 49.049 ms: its
        // statistics say 49 ms.
        let last_of_first = 49 * 1_001;
        let queries = [
            "SELECT * FROM t".to_string(),
            "SELECT sku, id FROM t WHERE day = DATE '2024-10-04'".to_string(),
            format!("SELECT id, ts FROM t WHERE ts >= to_timestamp_micros({last_of_first})"),
            format!("SELECT id FROM t WHERE ts > to_timestamp_micros({})", last_of_first - 1),
            "SELECT id, note FROM t WHERE note IS NOT NULL".to_string(),
            "SELECT id FROM t WHERE sku IS NULL".to_string(),
            "SELECT id FROM t WHERE id IN ('d1p2-7', 'e3-0', 'nope')".to_string(),
            "SELECT day, count(*) AS n FROM t WHERE sku = 'S2' OR day > DATE '2024-10-05' GROUP BY day".to_string(),
            "SELECT count(*) AS n FROM t WHERE day = DATE '2030-01-01'".to_string(),
            "SELECT id FROM t WHERE ts < to_timestamp_micros(0)".to_string(),
        ];
        for q in &queries {
            let (theirs, ours) = both(&table, q).await;
            assert!(
                theirs.len() > 1 || q.contains("< to_timestamp"),
                "{q}: {theirs:?}"
            );
            assert_eq!(ours, theirs, "{q}");
        }
        assert_eq!(files_planned(&table, None).await, 11);
        let day = |d: i32| {
            datafusion::prelude::col("day").eq(datafusion::prelude::lit(ScalarValue::Date32(Some(
                20_000 + d,
            ))))
        };
        assert_eq!(files_planned(&table, Some(day(0))).await, 3);
        assert_eq!(files_planned(&table, Some(day(3))).await, 1);
        assert_eq!(files_planned(&table, Some(day(9))).await, 0);
        // Day 0's first file holds 0..=49.049 ms: a filter at 49.049 ms keeps it (its
        // statistics' maximum, 49 ms, is taken up to 49.999 ms) and the two later
        // files of that day, and nothing else of day 0.
        let at = |us: i64| {
            datafusion::prelude::col("ts").gt_eq(datafusion::prelude::lit(
                ScalarValue::TimestampMicrosecond(Some(us), Some("UTC".into())),
            ))
        };
        assert_eq!(
            files_planned(&table, Some(at(last_of_first).and(day(0)))).await,
            3
        );
        assert_eq!(files_planned(&table, Some(at(50_000).and(day(0)))).await, 2);
        let id = datafusion::prelude::col("id").eq(datafusion::prelude::lit("d1p2-7"));
        assert_eq!(files_planned(&table, Some(id)).await, 1);
    }

    /// A partition value that object stores escape (`:`, `%`, a space) names its files
    /// again: the rows are read, not an empty partition.
    #[tokio::test]
    async fn partition_values_with_escaped_characters_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let s = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("n", DataType::Int64, true),
        ]));
        let mut table = wh.open_or_create("t", &s, &["k"]).await.unwrap();
        let keys = ["a:b", "50% off", "x/y", "plain"];
        for (i, k) in keys.iter().enumerate() {
            let b = RecordBatch::try_new(
                s.clone(),
                vec![
                    Arc::new(StringArray::from(vec![*k])),
                    Arc::new(Int64Array::from(vec![i as i64])),
                ],
            )
            .unwrap();
            table = delta::append(table, vec![b], &["k"], "w", i as i64 + 1)
                .await
                .unwrap();
        }
        let (theirs, ours) = both(&table, "SELECT k, n FROM t").await;
        assert_eq!(ours, theirs);
        assert_eq!(ours.len(), 1 + keys.len(), "{ours:?}");
        let (theirs, ours) = both(&table, "SELECT n FROM t WHERE k = 'a:b'").await;
        assert_eq!(ours, theirs);
        assert_eq!(ours.len(), 2, "{ours:?}");
    }

    /// A table whose protocol allows deletion vectors is left to delta-rs's provider
    /// (plain Parquet would return rows a vector deletes), and reads the same.
    #[tokio::test]
    async fn tables_with_deletion_vectors_are_read_by_delta_rs() {
        use deltalake::kernel::engine::arrow_conversion::TryIntoKernel;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        std::fs::create_dir_all(&path).unwrap();
        let s = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, true)]));
        let st: deltalake::kernel::StructType = s.as_ref().try_into_kernel().unwrap();
        deltalake::DeltaTableBuilder::from_url(url::Url::from_directory_path(&path).unwrap())
            .unwrap()
            .build()
            .unwrap()
            .create()
            .with_columns(st.fields().cloned())
            .with_configuration_property(
                deltalake::TableProperty::EnableDeletionVectors,
                Some("true"),
            )
            .await
            .unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let table = wh.open("t").await.unwrap().unwrap();
        let why = SnapshotTable::try_new(&table).unwrap().err();
        assert_eq!(why.as_deref(), Some("deletion vectors"));
        let b = RecordBatch::try_new(s.clone(), vec![Arc::new(Int64Array::from(vec![1, 2, 3]))])
            .unwrap();
        let table = delta::append(table, vec![b], &[], "w", 1).await.unwrap();
        let ctx = delta::session_with(&table, "t").await.unwrap();
        let out = delta::sql(&ctx, "SELECT sum(n) AS s FROM t").await.unwrap();
        let sum = out[0]
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .value(0);
        assert_eq!(sum, 6);
    }
}
