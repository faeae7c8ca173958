//! Delta tables in the warehouse: open or create, read the application-transaction
//! version, append with a transaction, query with DataFusion.

use arrow::array::{BooleanArray, RecordBatch};
use arrow::datatypes::SchemaRef;
use datafusion::execution::cache::cache_manager::{CacheManagerConfig, FileMetadataCache};
use datafusion::execution::cache::default_cache::DefaultCache;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use deltalake::kernel::engine::arrow_conversion::TryIntoKernel;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::kernel::{StructType, Transaction};
use deltalake::parquet::basic::{Compression, Encoding};
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::parquet::schema::types::ColumnPath;
use deltalake::protocol::SaveMode;
use deltalake::{DeltaTable, DeltaTableBuilder};
use std::collections::HashMap;
use std::sync::Arc;
use url::Url;

use crate::error::{Error, Result};
use crate::sink::known::KnownFile;
use crate::storage::Location;

/// The URL scheme delta-rs sees for the tables of a local warehouse: `file:///a/b/` is
/// opened as `kestrel-file:///a/b/`, with the same local store handed to delta-rs
/// ([`crate::sink::Warehouse`] builds every table with it), so the files, the log and
/// every other reader see nothing of it. Why: delta-rs 1.1.3 normalises the path of a
/// `file` table's files with two `std::fs::canonicalize` calls each (the table root's
/// and the file's, a `readlink` per path component), and a MERGE does that for every
/// *active* file of the table after writing (`should_remove_rewritten_file`), so each
/// MERGE paid ≈ 30 µs per file of history — 720 hour files after 30 days of gold. Other
/// schemes skip it (as delta-rs's own `delta-unc` scheme for Windows shares does), and
/// kestrel has nothing for it to resolve: every path delta-rs compares is built from the
/// one root URL a table is opened at (`storage::to_url` makes it absolute, without `.`
/// or `..`). Measured with `--bench jobs -- history`: a MERGE against 30 days of gold
/// (720 files) 97–104 ms before, 76–82 ms after; against one day 48–54 ms either way.
pub const LOCAL_TABLE_SCHEME: &str = "kestrel-file";

/// Register kestrel's log stores with delta-rs (once per process): delta-rs's default
/// log store for [`LOCAL_TABLE_SCHEME`] tables (as for `file`) and for `s3`/`s3a` ones.
///
/// kestrel builds without deltalake's `s3` feature (deltalake-aws and the AWS SDK were
/// ~35 crates and a C build of aws-lc, a fifth of the cold build, for two things kestrel
/// does itself): every S3 table is opened on the warehouse's own `object_store`
/// `AmazonS3` ([`Warehouse`]'s builder hands it to delta-rs), and its log store is the
/// one deltalake-aws 1.0 registers too — `default_logstore`, which commits a version
/// with a put-if-absent (S3 conditional writes; DynamoDB locking is gone from delta-rs).
pub fn register_log_stores() {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        for scheme in [LOCAL_TABLE_SCHEME, "s3", "s3a"] {
            if let Ok(url) = Url::parse(&format!("{scheme}://")) {
                deltalake::logstore::logstore_factories().insert(url, Arc::new(DefaultLogStores));
            }
        }
    });
}

/// `url` (a `file` URL) under [`LOCAL_TABLE_SCHEME`], whose log stores delta-rs builds
/// like a `file` table's ([`register_log_stores`]).
pub fn local_table_url(url: &Url) -> Result<Url> {
    register_log_stores();
    let s = format!("{LOCAL_TABLE_SCHEME}://{}", url.path());
    Url::parse(&s).map_err(|e| Error::Location {
        url: url.to_string(),
        reason: e.to_string(),
    })
}

/// Log stores of [`LOCAL_TABLE_SCHEME`] and S3 tables: delta-rs's default one.
struct DefaultLogStores;

impl deltalake::logstore::LogStoreFactory for DefaultLogStores {
    fn with_options(
        &self,
        prefixed_store: deltalake::logstore::ObjectStoreRef,
        root_store: deltalake::logstore::ObjectStoreRef,
        location: &Url,
        options: &deltalake::logstore::StorageConfig,
    ) -> deltalake::DeltaResult<Arc<dyn deltalake::logstore::LogStore>> {
        Ok(deltalake::logstore::default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}

/// `s` with table URLs under [`LOCAL_TABLE_SCHEME`] shown as the `file` URLs they are
/// (for messages).
pub fn shown(s: String) -> String {
    let local = format!("{LOCAL_TABLE_SCHEME}://");
    if s.contains(&local) {
        s.replace(&local, "file://")
    } else {
        s
    }
}

/// `delta.checkpointInterval` of the tables kestrel creates.
pub const CHECKPOINT_INTERVAL: &str = "10";

/// The warehouse: a location holding Delta tables at relative paths. Tables are kept
/// open across batches ([`super::tables`]).
#[derive(Clone, Debug)]
pub struct Warehouse {
    pub loc: Location,
    /// `delta.deletedFileRetentionDuration` of the tables it creates.
    tombstones: std::time::Duration,
}

/// Default `delta.deletedFileRetentionDuration` of the tables kestrel creates. Delta's
/// default (a week) keeps every file a compaction or MERGE replaced in every checkpoint
/// for a week: a table rewritten each batch (the run log, `sku_availability`) carried
/// ~2,000 such tombstones by midday at Kestrel's scale, and a week's worth is read on
/// every open and written by every checkpoint. Vacuum does not depend on them (it lists
/// the table's directory and keeps files for `[maintain] retention`).
pub const TOMBSTONE_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

impl Warehouse {
    /// Wrap a location.
    pub fn new(loc: Location) -> Self {
        Warehouse {
            loc,
            tombstones: TOMBSTONE_RETENTION,
        }
    }

    /// Tables created from now on keep tombstones in their checkpoints this long.
    pub fn with_tombstone_retention(mut self, d: std::time::Duration) -> Self {
        self.tombstones = d;
        self
    }

    /// Whether a kept local table was deleted (and maybe created again) since: a table
    /// created anew would otherwise look unchanged.
    fn replaced(&self, rel: &str, table: &DeltaTable) -> bool {
        match (&self.loc.local_dir, table.version()) {
            (Some(dir), Some(v)) => !dir
                .join(rel)
                .join("_delta_log")
                .join(format!("{v:020}.json"))
                .exists(),
            _ => false,
        }
    }

    /// Forget a kept table (after it was deleted or replaced underneath).
    pub fn forget(&self, rel: &str) {
        if let Ok(url) = self.table_url(rel) {
            super::tables::forget(&url);
        }
    }

    /// URL delta-rs opens a table at, e.g. `bronze/orders`: the location's URL, except
    /// that a local warehouse's tables are named by [`LOCAL_TABLE_SCHEME`]
    /// instead of `file` (same path, same local store; see there why).
    pub fn table_url(&self, rel: &str) -> Result<Url> {
        let url = self.loc.child_url(rel)?;
        match self.loc.local_dir {
            // A path that needs percent-encoding stays `file`: the kernel decodes the
            // paths of other schemes' log files as they are (`%20` would stay `%20`).
            Some(_) if !url.path().contains('%') => local_table_url(&url),
            _ => Ok(url),
        }
    }

    /// Open a table; None when nothing has been committed there yet.
    pub async fn open(&self, rel: &str) -> Result<Option<DeltaTable>> {
        let t = std::time::Instant::now();
        let r = self.open_inner(rel).await;
        super::timings::record(format!("open {rel}"), t.elapsed());
        r
    }

    async fn open_inner(&self, rel: &str) -> Result<Option<DeltaTable>> {
        let url = self.table_url(rel)?;
        if let Some(dir) = &self.loc.local_dir {
            if !dir.join(rel).join("_delta_log").is_dir() {
                self.forget(rel);
                return Ok(None);
            }
        }
        let mut kept = super::tables::kept(&url);
        if kept.as_ref().is_some_and(|t| self.replaced(rel, t)) {
            self.forget(rel);
            kept = None;
        }
        if let Some(mut table) = kept {
            match super::tables::refresh(&mut table).await {
                Ok(()) => return Ok(Some(table)),
                // Deleted or rewritten underneath (a test, an operator): load afresh.
                Err(e) => {
                    tracing::debug!(table = rel, error = %e, "kept table unusable; reloading");
                    self.forget(rel);
                }
            }
        }
        let mut table = self
            .builder(&url)?
            .build()
            .map_err(|e| Error::delta(url.as_str(), e))?;
        match table.load().await {
            Ok(()) => {
                super::tables::keep_loaded(&table);
                Ok(Some(table))
            }
            Err(deltalake::DeltaTableError::NotATable(_)) => Ok(None),
            Err(e) => Err(Error::delta(url.as_str(), e)),
        }
    }

    fn options(&self) -> HashMap<String, String> {
        self.loc.options.clone()
    }

    /// A table builder for `url` with this warehouse's storage options (and, only when a
    /// fault point inside delta-rs commits is asked for, the fault-injecting store).
    fn builder(&self, url: &Url) -> Result<DeltaTableBuilder> {
        let mut b = DeltaTableBuilder::from_url(url.clone())
            .map_err(|e| Error::delta(url.as_str(), e))?
            .with_storage_options(self.options());
        type Store = std::sync::Arc<dyn deltalake::logstore::object_store::ObjectStore>;
        // Local tables list their logs by name (see `sink::loglist`); their store retries
        // transient failures like every store kestrel opens (`storage::layered`). Other
        // tables (S3, memory) use the warehouse's own store, bucket-rooted, with the same
        // retries (and, when a test asks for them, fault points): delta-rs has no S3
        // store of its own in this build ([`register_log_stores`]).
        let root: Store = match &self.loc.local_dir {
            Some(_) => {
                let local: Store = std::sync::Arc::new(
                    deltalake::logstore::object_store::local::LocalFileSystem::new(),
                );
                crate::storage::layered(std::sync::Arc::new(super::loglist::LogListing::new(local)))
            }
            None => {
                register_log_stores();
                self.loc.store.clone()
            }
        };
        b = b.with_storage_backend(root, url.clone());
        Ok(b)
    }

    /// Open a table, creating it empty with `schema` and `partitions` if it does not exist.
    pub async fn open_or_create(
        &self,
        rel: &str,
        schema: &SchemaRef,
        partitions: &[&str],
    ) -> Result<DeltaTable> {
        if let Some(t) = self.open(rel).await? {
            return Ok(t);
        }
        let url = self.table_url(rel)?;
        if let Some(dir) = &self.loc.local_dir {
            std::fs::create_dir_all(dir.join(rel))
                .map_err(|e| Error::io(dir.join(rel).display().to_string(), e))?;
        }
        let st: StructType = schema
            .as_ref()
            .try_into_kernel()
            .map_err(|e| Error::delta(url.to_string(), e.into()))?;
        let table = self
            .builder(&url)?
            .build()
            .map_err(|e| Error::delta(url.as_str(), e))?;
        let mut create = table.create();
        if schema.fields().len() > DELTA_INDEXED_COLUMNS {
            // Delta keeps statistics of the first 32 columns by default; gold's hour
            // column (by which its files are clustered) comes late in a wide job's rows.
            create = create.with_configuration_property(
                deltalake::TableProperty::DataSkippingNumIndexedCols,
                Some(schema.fields().len().to_string()),
            );
        }
        let created = create
            .with_columns(st.fields().cloned())
            .with_partition_columns(partitions.iter().map(|s| s.to_string()))
            // Every batch commits; a checkpoint every 10 commits keeps opening a table
            // (log replay) cheap between maintenance runs.
            .with_configuration_property(
                deltalake::TableProperty::CheckpointInterval,
                Some(CHECKPOINT_INTERVAL),
            )
            .with_configuration_property(
                deltalake::TableProperty::DeletedFileRetentionDuration,
                Some(format!("interval {} seconds", self.tombstones.as_secs())),
            )
            .with_save_mode(SaveMode::Ignore)
            // A create that finds version 0 taken must fail (and open the winner's
            // table below), not be retried: delta-rs would commit it again as a second
            // metadata action at a later version, and every concurrent writer that read
            // the first one would then fail with "Metadata changed since last commit".
            .with_commit_properties(commit_props().with_max_retries(0))
            .await;
        match created {
            Ok(t) => {
                super::tables::keep(&t);
                Ok(t)
            }
            // Lost a creation race: the other writer's table is just as good.
            Err(e) => match self.open(rel).await? {
                Some(t) => Ok(t),
                None => Err(Error::delta(url.as_str(), e)),
            },
        }
    }
}

/// Columns Delta keeps file statistics of unless a table says otherwise.
const DELTA_INDEXED_COLUMNS: usize = 32;

/// The last application-transaction version recorded for `app_id`.
pub async fn txn_version(table: &DeltaTable, app_id: &str) -> Result<Option<i64>> {
    let t = std::time::Instant::now();
    let r = txn_version_inner(table, app_id).await;
    super::timings::record(
        format!(
            "txn {}",
            super::timings::table_name(table.table_url().as_str())
        ),
        t.elapsed(),
    );
    r
}

async fn txn_version_inner(table: &DeltaTable, app_id: &str) -> Result<Option<i64>> {
    super::txn::version(table, app_id).await
}

/// A timestamp literal (micros, UTC) for filters over kestrel's tables.
pub fn ts_lit(v: crate::time::Micros) -> datafusion::prelude::Expr {
    datafusion::prelude::lit(datafusion::common::ScalarValue::TimestampMicrosecond(
        Some(v),
        Some(std::sync::Arc::from("UTC")),
    ))
}

/// Whether `table` holds the commit of `(app_id, version)`: its last recorded version of
/// `app_id` is at least `version` (a writer's versions only grow, so equal or higher
/// means this batch, or a later one, is in).
pub async fn holds(table: &DeltaTable, app_id: &str, version: i64) -> Result<bool> {
    Ok(txn_version(table, app_id).await?.unwrap_or(0) >= version)
}

/// The one shape of an exactly-once commit: run `commit` on `table` unless the table
/// already holds `(app_id, version)` (a replay after a crash, or another process that
/// committed this batch first). `commit` must carry that transaction itself (it is handed
/// the table, not the txn, so appends, MERGEs and evolving appends all fit). Returns what
/// `commit` returned, or None when the batch was already there.
pub async fn commit_once<T, F, Fut>(
    table: DeltaTable,
    app_id: &str,
    version: i64,
    commit: F,
) -> Result<Option<T>>
where
    F: FnOnce(DeltaTable) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    if holds(&table, app_id, version).await? {
        return Ok(None);
    }
    commit(table).await.map(Some)
}

/// Commit properties carrying an application transaction. The commit's `commitInfo`
/// names it too (`kestrel.txn`), so [`written_by`] can find the commit again.
pub fn txn_props(app_id: &str, version: i64) -> CommitProperties {
    txn_props_with(app_id, version, [])
}

/// [`txn_props`] with more `commitInfo` entries (a MERGE's `operationMetrics`).
pub fn txn_props_with(
    app_id: &str,
    version: i64,
    info: impl IntoIterator<Item = (String, serde_json::Value)>,
) -> CommitProperties {
    commit_props()
        .with_application_transaction(Transaction::new(app_id, version))
        .with_metadata(
            std::iter::once((
                TXN_INFO_KEY.to_string(),
                serde_json::json!({ "app": app_id, "version": version }),
            ))
            .chain(info),
        )
}

/// The `commitInfo` field naming the application transaction a kestrel commit carries.
pub const TXN_INFO_KEY: &str = "kestrel.txn";

/// How many of a table's newest commits [`written_by`] reads looking for a transaction.
const WRITTEN_SEARCH_COMMITS: usize = 64;

/// The rows the commit carrying `(app_id, version)` wrote — a MERGE's updated, inserted
/// and deleted rows, a write's added rows — from the metrics delta-rs keeps in its
/// `commitInfo`. None when it is not among the table's newest commits (or names no
/// metrics). A batch resumed after a kill between its gold commit and its run-log row
/// reports with it what the killed process wrote, as an uninterrupted batch does.
pub async fn written_by(table: &DeltaTable, app_id: &str, version: i64) -> Result<Option<i64>> {
    use futures::TryStreamExt;
    let url = table.table_url().to_string();
    let mut infos = table.history(Some(WRITTEN_SEARCH_COMMITS));
    while let Some(info) = infos.try_next().await.map_err(|e| Error::delta(&url, e))? {
        let ours = info.info.get(TXN_INFO_KEY).is_some_and(|t| {
            t.get("app").and_then(|a| a.as_str()) == Some(app_id)
                && t.get("version").and_then(|v| v.as_i64()) == Some(version)
        });
        if !ours {
            continue;
        }
        let Some(m) = info.info.get("operationMetrics") else {
            return Ok(None);
        };
        let n = |k: &str| m.get(k).and_then(|v| v.as_i64());
        return Ok(match n("num_target_rows_inserted") {
            Some(inserted) => Some(
                inserted
                    + n("num_target_rows_updated").unwrap_or(0)
                    + n("num_target_rows_deleted").unwrap_or(0),
            ),
            None => n("num_added_rows"),
        });
    }
    Ok(None)
}

/// Commit properties of every kestrel commit: no expired-log cleanup after the commit.
/// delta-rs would otherwise list the whole `_delta_log` after every commit (its cost
/// grows with every commit the log still holds: ~10 µs each, 0.1 s at 10,000); the
/// maintenance slot cleans the logs instead ([`crate::sink::compact::cleanup_log`]).
pub fn commit_props() -> CommitProperties {
    CommitProperties::default().with_cleanup_expired_logs(Some(false))
}

/// Parquet writer settings: snappy, and no dictionary for the named columns (unique
/// values such as event ids only pay for a dictionary that is then abandoned).
pub fn writer_properties(no_dictionary: &[&str]) -> WriterProperties {
    let mut b = WriterProperties::builder().set_compression(Compression::SNAPPY);
    for c in no_dictionary {
        b = b.set_column_dictionary_enabled(ColumnPath::from(*c), false);
    }
    b.build()
}

/// False-positive rate of the `event_id` bloom filters in bronze files. A dedup probe of
/// K incoming ids against the row groups of the touched dates reads a row group that
/// cannot hold any of them with probability ≈ K × fpp; at Kestrel's scale (K ≈ 50k,
/// ~100 row groups a day) 1e-7 keeps that under one wasted read per batch, for ≈ 7
/// bytes of filter per event.
pub const EVENT_ID_BLOOM_FPP: f64 = 1e-7;

/// Rows per Parquet row group in bronze files: the unit a dedup probe reads when a bloom
/// filter says "maybe".
pub const BRONZE_ROW_GROUP_ROWS: usize = 128 * 1024;

/// Names of `table`'s columns.
pub fn table_columns(table: &DeltaTable) -> Result<std::collections::HashSet<String>> {
    let snap = table
        .snapshot()
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    Ok(snap
        .schema()
        .fields()
        .map(|f| f.name().to_string())
        .collect())
}

/// Bronze columns that carry a bloom filter besides `event_id`: keys jobs look rows up
/// by. The payments jobs read the lines and payments of the orders a batch touched, up
/// to a week around them (`horizon`), by `order_id` ([`crate::operator::payments::matching::ORDER_ID`]);
/// with a filter per row group that read skips every row group holding none of them
/// instead of scanning the week.
pub const LOOKUP_KEYS: [&str; 1] = ["order_id"];

/// Rows per Parquet row group in bronze tables with a [`LOOKUP_KEYS`] column (orders,
/// payments). A keyed read reads every row group whose filter holds one of its keys
/// whole, and a batch's keys are mostly recent orders plus a few late ones spread over
/// the horizon: with [`BRONZE_ROW_GROUP_ROWS`] each late key would cost a read of up to
/// 128k rows, a quarter of a day of orders at Kestrel's scale. These tables are small
/// (≈ 0.5 M rows a day each at that scale), so the extra row groups cost a few
/// kilobytes of metadata and filter checks of a few thousand keys.
pub const LOOKUP_ROW_GROUP_ROWS: usize = 16 * 1024;

/// False-positive rate of the [`LOOKUP_KEYS`] bloom filters. A read of K keys over R row
/// groups scans ≈ K × R × fpp row groups needlessly: at Kestrel's scale ≈ 5k touched
/// orders and a week of row groups, about one.
pub const LOOKUP_KEY_BLOOM_FPP: f64 = 1e-5;

/// Bronze columns written without a dictionary, besides the [`LOOKUP_KEYS`]: values
/// nearly every row has its own (ids, line numbers, microsecond event times). A Parquet
/// writer keeps a dictionary until it outgrows 1 MB, which a row group of these never
/// does, so each value was hashed into a dictionary page as large as the values and
/// then referenced by an index — encoded and compressed twice. Measured on 5M orders
/// (`cargo bench --bench jobs -- throughput`, two alternating pairs): bronze encoding
/// and commit 4.04 and 3.93 s a run with dictionaries on `event_ts` and `order_id`,
/// 3.46 and 3.39 s without; the 2M-order bronze table 473 → 462 MB. Line numbers and
/// event times are among the [`BRONZE_DELTA_ENCODED`] columns, which have no dictionary
/// either.
pub const BRONZE_NO_DICTIONARY: [&str; 1] = ["event_id"];

/// Bronze's integer and time columns written as deltas (`DELTA_BINARY_PACKED`), without a
/// dictionary: the bookkeeping a file or a batch shares (arrival, ingestion batch and
/// time), line numbers counting up and event times close to their neighbours' are a
/// few bits per value that way, where a dictionary hashed every value into one and
/// plain values were Snappy-compressed.
pub const BRONZE_DELTA_ENCODED: [&str; 5] = [
    "event_ts",
    "_source_line",
    "_landed_at",
    "_batch_id",
    "_ingested_at",
];

/// Parquet settings of bronze files (ingestion appends and their compaction alike): ids,
/// line numbers, event times and [`LOOKUP_KEYS`] without dictionaries
/// ([`BRONZE_NO_DICTIONARY`], [`BRONZE_DELTA_ENCODED`]), a bloom filter on `event_id` so dedup reads only the row
/// groups that may hold an incoming id, and one on each of the [`LOOKUP_KEYS`] among
/// `columns` (the table's columns). Filters are sized for a full row group and folded by
/// the writer to what a row group holds, so a five-minute append of a few hundred events
/// carries a few kilobytes of them.
pub fn bronze_writer_properties<'a>(
    columns: impl IntoIterator<Item = &'a str>,
) -> WriterProperties {
    bronze_props(columns, |_| Compression::SNAPPY)
}

/// [`bronze_writer_properties`] for writing the rows `parts` keep: `event_id` and the
/// [`LOOKUP_KEYS`] compressed only when a sample of the rows' values shows it pays
/// ([`sampled_compression`]).
pub fn bronze_writer_properties_for<'a>(
    columns: impl IntoIterator<Item = &'a str>,
    parts: &[Kept],
) -> WriterProperties {
    bronze_props(columns, |c| sampled_compression(parts, c))
}

/// How much of its plain encoding Snappy must save on a sample of a column's values for
/// bronze to compress the column ([`sampled_compression`]).
pub const ID_SNAPPY_MIN_SAVING: f64 = 0.2;

/// Bytes of plain-encoded values sampled (one Snappy block, the window its matches
/// come from).
const ID_SAMPLE_BYTES: usize = 64 << 10;

/// How bronze compresses the string `column` in a write of the rows `parts` keep
/// ([`write_kept`]): Snappy when it saves at least [`ID_SNAPPY_MIN_SAVING`] on the first
/// 64 KiB of its values as Parquet lays them out (plain, each behind its length), else
/// not at all. Taken for the columns written without a dictionary whose values are ids:
/// `event_id` and the [`LOOKUP_KEYS`]. Random UUIDs — what producers send — save ≈ 15 % (the hex alphabet
/// is redundant, but Snappy has no entropy coding), at ≈ 150 ms of CPU per million ids
/// each time they are written and read: on 5M orders (`cargo bench --bench jobs --
/// throughput`, two alternating pairs) bronze's encoding and commit took 520–590 ms per
/// 1.4M-row batch with Snappy on `event_id` and 410–460 ms without, and landing → gold
/// 8.61, 8.30 s → 8.04, 7.75 s, for a bronze table 3.8 % larger (462 → 480 MB); then on
/// `order_id` too (`ord-` + 32 random hex digits, `throughput-run`, two pairs): 487–518
/// → 343–382 ms a batch, bronze 458 → 493 MB. Ids with shared prefixes (ULIDs, counters,
/// `order-…`) compress by far more and keep Snappy.
pub fn sampled_compression(parts: &[Kept], column: &str) -> Compression {
    use arrow::array::{Array, AsArray};
    let mut plain = Vec::with_capacity(ID_SAMPLE_BYTES + 1024);
    'rows: for (b, keep) in parts {
        let Some(values) = b.column_by_name(column) else {
            continue;
        };
        let Some(values) = values.as_string_opt::<i32>() else {
            continue;
        };
        let kept = |i: usize| keep.as_ref().is_none_or(|k| k.value(i));
        for i in (0..values.len()).filter(|i| kept(*i) && values.is_valid(*i)) {
            let v = values.value(i);
            plain.extend_from_slice(&(v.len() as u32).to_le_bytes());
            plain.extend_from_slice(v.as_bytes());
            if plain.len() >= ID_SAMPLE_BYTES {
                break 'rows;
            }
        }
    }
    if plain.is_empty() {
        return Compression::SNAPPY;
    }
    match snap::raw::Encoder::new().compress_vec(&plain) {
        Ok(c) if (c.len() as f64) > (1.0 - ID_SNAPPY_MIN_SAVING) * plain.len() as f64 => {
            Compression::UNCOMPRESSED
        }
        _ => Compression::SNAPPY,
    }
}

/// Bronze's writer properties; `compression` picks that of `event_id` and of each of the
/// [`LOOKUP_KEYS`] among `columns` (the rest have Snappy).
fn bronze_props<'a>(
    columns: impl IntoIterator<Item = &'a str>,
    compression: impl Fn(&str) -> Compression,
) -> WriterProperties {
    let keys: Vec<&str> = columns
        .into_iter()
        .filter(|c| LOOKUP_KEYS.contains(c))
        .collect();
    let rows = match keys.is_empty() {
        true => BRONZE_ROW_GROUP_ROWS,
        false => LOOKUP_ROW_GROUP_ROWS,
    };
    let ndv = rows as u64;
    let id = ColumnPath::from("event_id");
    let mut b = WriterProperties::builder().set_compression(Compression::SNAPPY);
    for c in BRONZE_NO_DICTIONARY.iter().chain(&LOOKUP_KEYS) {
        b = b.set_column_dictionary_enabled(ColumnPath::from(*c), false);
    }
    for c in BRONZE_DELTA_ENCODED {
        b = b
            .set_column_dictionary_enabled(ColumnPath::from(c), false)
            .set_column_encoding(ColumnPath::from(c), Encoding::DELTA_BINARY_PACKED);
    }
    let mut b = b
        .set_column_compression(id.clone(), compression("event_id"))
        .set_column_bloom_filter_enabled(id.clone(), true)
        .set_column_bloom_filter_fpp(id.clone(), EVENT_ID_BLOOM_FPP)
        .set_column_bloom_filter_max_ndv(id, ndv)
        .set_max_row_group_row_count(Some(rows));
    for c in keys {
        let key = ColumnPath::from(c);
        b = b
            .set_column_compression(key.clone(), compression(c))
            .set_column_bloom_filter_enabled(key.clone(), true)
            .set_column_bloom_filter_fpp(key.clone(), LOOKUP_KEY_BLOOM_FPP)
            .set_column_bloom_filter_max_ndv(key, ndv);
    }
    b.build()
}

/// Append batches in one commit carrying `(app_id, version)`. Returns the table after commit.
pub async fn append(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    partitions: &[&str],
    app_id: &str,
    version: i64,
) -> Result<DeltaTable> {
    append_with(table, batches, partitions, app_id, version, None).await
}

/// [`append`] with explicit Parquet writer properties.
pub async fn append_with(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    partitions: &[&str],
    app_id: &str,
    version: i64,
    props: Option<WriterProperties>,
) -> Result<DeltaTable> {
    let partitions: Vec<String> = partitions.iter().map(|s| s.to_string()).collect();
    write_append(table, batches, &partitions, app_id, version, props, false).await
}

/// Append in one commit carrying `(app_id, version)`, adding any columns the table lacks
/// (schema merge), for tables whose schema grows between releases.
pub async fn append_evolving(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    partitions: &[String],
    app_id: &str,
    version: i64,
    props: Option<WriterProperties>,
) -> Result<DeltaTable> {
    write_append(table, batches, partitions, app_id, version, props, true).await
}

/// The one append path: a commit carrying `(app_id, version)`, timed, and the table
/// kept open afterwards; `evolve` merges new columns into the table's schema.
async fn write_append(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    partitions: &[String],
    app_id: &str,
    version: i64,
    props: Option<WriterProperties>,
    evolve: bool,
) -> Result<DeltaTable> {
    if fits(&table, &batches, partitions)? {
        // The rows are the table's: encode them and commit the files, without the
        // write operation's plan (a run-log row took ≈ 17 ms that way, ≈ 12 ms this way
        // with its encoding, in the small-drop benchmark).
        let writers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let props = props.unwrap_or_else(|| writer_properties(&[]));
        let adds = write_files(&table, batches, props, writers).await?;
        return commit_adds(table, adds, app_id, version).await;
    }
    let url = table.table_url().to_string();
    let mut w = table
        .write(batches)
        .with_save_mode(SaveMode::Append)
        .with_commit_properties(txn_props(app_id, version));
    if evolve {
        w = w.with_schema_mode(deltalake::operations::write::SchemaMode::Merge);
    }
    if let Some(p) = props {
        w = w.with_writer_properties(p);
    }
    if !partitions.is_empty() {
        w = w.with_partition_columns(partitions.iter().cloned());
    }
    let t = std::time::Instant::now();
    let r = w.await.map_err(|e| Error::delta(&url, e));
    super::timings::record(
        format!("append {}", super::timings::table_name(&url)),
        t.elapsed(),
    );
    if let Ok(t) = &r {
        super::tables::keep(t);
    }
    r
}

/// Whether `batches` are rows of `table` as it is (every column of its schema, of its
/// type, nothing else; its partition columns if `partitions` names any), so an append
/// needs no cast and no schema change: then [`write_files`] and [`commit_adds`] do it.
fn fits(table: &DeltaTable, batches: &[RecordBatch], partitions: &[String]) -> Result<bool> {
    let snap = table
        .snapshot()
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    if !partitions.is_empty() && partitions[..] != snap.metadata().partition_columns()[..] {
        return Ok(false);
    }
    let schema = snap.snapshot().arrow_schema();
    Ok(batches.iter().all(|b| {
        b.num_columns() == schema.fields().len()
            && schema.fields().iter().all(|f| {
                b.column_by_name(f.name()).is_some_and(|c| {
                    c.data_type() == f.data_type() && (f.is_nullable() || c.null_count() == 0)
                })
            })
    }))
}

/// Rows of a Parquet writer of [`write_files`]: a batch of at most this many is encoded
/// by one writer (one file per partition), so small batches add no files; a larger one
/// by one writer per this many rows begun, up to the writers asked for (each then gets
/// more than half that many). One bronze row group of [`BRONZE_ROW_GROUP_ROWS`]: at
/// 250,000 a 64 MB ingestion batch (≈ 450k orders) was encoded on one core while the
/// other waited, 120–150 ms of its ≈ 250–290 ms; split in two it took 60–80 ms (`cargo
/// bench --bench ingest`, release, two alternating pairs: ingestion of 2M orders 1.30,
/// 1.29 s → 1.00, 1.11 s). Writers were first one per whole 128k rows: a backlog's last
/// batch of 250k orders was then encoded on one core, 118 ms at one core busy where the
/// batches before took 84–96 ms for 350k (opt-level 1).
pub const ROWS_PER_WRITER: usize = BRONZE_ROW_GROUP_ROWS;

/// Encode `batches` (of `table`'s schema) into new Parquet files of `table`, one file per
/// partition value and writer, without committing them; returns their add actions, to
/// commit with [`commit_adds`]. The rows are cut into up to `writers` runs of about the
/// same size (none under [`ROWS_PER_WRITER`]), each encoded on its own task: encoding
/// is most of the cost of a bronze write, and delta-rs's write encodes each partition on
/// one core — a batch of one event date left the other core idle.
pub async fn write_files(
    table: &DeltaTable,
    batches: Vec<RecordBatch>,
    props: WriterProperties,
    writers: usize,
) -> Result<Vec<deltalake::kernel::Add>> {
    let parts = batches.into_iter().map(|b| (b, None)).collect();
    let how = KeptWrite {
        writers,
        ..KeptWrite::default()
    };
    let written = write_kept(table, parts, props, how).await?;
    Ok(written.adds)
}

/// A batch to write and, when only some of its rows are to be written, which ones: a
/// filter mask as long as the batch, without nulls.
pub type Kept = (RecordBatch, Option<BooleanArray>);

/// How [`write_kept`] writes.
#[derive(Debug, Clone, Default)]
pub struct KeptWrite {
    /// Cut the kept rows by the Date32 column at this index (bronze's `event_date`).
    pub cut: Option<usize>,
    /// Parquet writers at most, each on a task of its own (one per core).
    pub writers: usize,
    /// Return the written rows too, in order (a batch small enough to hand to this
    /// process's jobs, [`crate::operator::fresh`]).
    pub hold: bool,
    /// Hold only these columns (indices) of the written rows: what the jobs read. The
    /// others are freed as each writer goes, as when nothing is held.
    pub hold_columns: Option<Arc<[usize]>>,
    /// Return, for each file written, the filter hash of every row's value of the
    /// string column at this index, in row order ([`crate::sink::known`]).
    pub remember: Option<usize>,
}

/// What [`write_kept`] wrote: the new files' add actions, the rows written when the
/// caller asked to hold them, and the files' hashes when it asked to remember them (by
/// file name; a file whose rows a writer could not tell apart is left out).
pub struct Written {
    pub adds: Vec<deltalake::kernel::Add>,
    pub rows: Vec<RecordBatch>,
    pub known: Vec<(String, KnownFile)>,
}

/// [`write_files`] of the rows `parts` keep, each writer copying the kept rows of a
/// batch ([`kept_rows`], cut by the Date32 column at `how.cut` when given) just before
/// it encodes them: the copy a filter makes is spread over the writers' cores and each
/// copy is freed once encoded, where filtering every batch first took one core 160–320
/// ms per 1.4M-row ingestion batch while the other waited (`throughput-run`, see the
/// README).
pub async fn write_kept(
    table: &DeltaTable,
    parts: Vec<Kept>,
    props: WriterProperties,
    how: KeptWrite,
) -> Result<Written> {
    let url = table.table_url().to_string();
    let t = std::time::Instant::now();
    let rows: usize = parts.iter().map(|(b, _)| b.num_rows()).sum();
    let writers = how.writers.clamp(1, rows.div_ceil(ROWS_PER_WRITER).max(1));
    let tasks: Vec<_> = split_rows(parts, rows.div_ceil(writers).max(1))
        .into_iter()
        .map(|run| {
            let (table, props, url) = (table.clone(), props.clone(), url.clone());
            let how = how.clone();
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let mut w = deltalake::writer::RecordBatchWriter::for_table(&table)
                    .map_err(|e| Error::delta(&url, e))?
                    .with_writer_properties(props);
                let partitions = partition_columns(&table)?;
                let mut held = Vec::new();
                let mut hashes = how.remember.map(|_| PartitionHashes::default());
                for (b, keep) in run {
                    for b in kept_rows(b, keep.as_ref(), how.cut)? {
                        if how.hold {
                            held.push(match &how.hold_columns {
                                Some(ix) => b.project(ix)?,
                                None => b.clone(),
                            });
                        }
                        let values = one_partition(&b, &partitions)?;
                        if let (Some(h), Some(col)) = (hashes.as_mut(), how.remember) {
                            if !h.add(values.as_ref(), &b, col) {
                                hashes = None;
                            }
                        }
                        match values {
                            Some(values) => w
                                .write_partition(b, &values, deltalake::writer::WriteMode::Default)
                                .await
                                .map(drop),
                            None => deltalake::writer::DeltaWriter::write(&mut w, b).await,
                        }
                        .map_err(|e| Error::delta(&url, e))?;
                    }
                }
                let flushing = std::time::Instant::now();
                let adds = deltalake::writer::DeltaWriter::flush(&mut w)
                    .await
                    .map_err(|e| Error::delta(&url, e))?;
                let name = super::timings::table_name(&url);
                super::timings::record(format!("encode {name}: flush"), flushing.elapsed());
                super::timings::record(format!("encode {name}: a writer"), started.elapsed());
                let known = hashes.map_or_else(Vec::new, |h| h.files(&adds));
                Ok::<_, Error>((adds, held, known))
            })
        })
        .collect();
    let mut written = Written {
        adds: Vec::new(),
        rows: Vec::new(),
        known: Vec::new(),
    };
    for task in tasks {
        let (adds, rows, known) = task.await.map_err(|source| Error::Task {
            what: format!("a Parquet writer of {}", shown(url.clone())),
            source,
        })??;
        written.adds.extend(adds);
        written.rows.extend(rows);
        written.known.extend(known);
    }
    super::timings::record(
        format!("encode {}", super::timings::table_name(&url)),
        t.elapsed(),
    );
    Ok(written)
}

/// One writer's rows by partition, as it wrote them: the partition values (serialized
/// as the add actions carry them, by column name) and each row's filter hash of the
/// remembered column.
#[derive(Default)]
struct PartitionHashes {
    parts: Vec<(PartitionKey, Vec<u64>)>,
}

/// A partition's values by column name, serialized, sorted by name.
type PartitionKey = Vec<(String, String)>;

impl PartitionHashes {
    /// Add the hashes of `b`'s column `col`, written to the partition `values`. False when
    /// the rows cannot be told apart by file: a batch of several partitions (delta-rs
    /// splits it), or a column that is not a string.
    fn add(
        &mut self,
        values: Option<&indexmap::IndexMap<String, delta_kernel::expressions::Scalar>>,
        b: &RecordBatch,
        col: usize,
    ) -> bool {
        use arrow::array::AsArray;
        use deltalake::kernel::scalars::ScalarExt;
        let (Some(values), Some(ids)) = (values, b.column(col).as_string_opt::<i32>()) else {
            return false;
        };
        let mut key: PartitionKey = values
            .iter()
            .map(|(k, v)| (k.clone(), v.serialize()))
            .collect();
        key.sort();
        let at = match self.parts.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                self.parts.push((key, Vec::new()));
                self.parts.len() - 1
            }
        };
        let hashes = &mut self.parts[at].1;
        hashes.extend(
            ids.iter()
                .map(|v| v.map_or(0, |s| super::bloom::hash(s.as_bytes()))),
        );
        true
    }

    /// The files `adds` (this writer's) hold, each with its rows' hashes: a partition's
    /// rows went to the one file of its values (a writer that left several files for
    /// one partition is not told apart: left out).
    fn files(self, adds: &[deltalake::kernel::Add]) -> Vec<(String, KnownFile)> {
        let mut out = Vec::new();
        for (key, hashes) in self.parts {
            let mut of_part = adds.iter().filter(|a| {
                a.partition_values.len() == key.len()
                    && key.iter().all(|(k, v)| {
                        a.partition_values
                            .get(k)
                            .is_some_and(|x| x.as_deref() == Some(v.as_str()))
                    })
            });
            if let (Some(add), None) = (of_part.next(), of_part.next()) {
                let name = super::known::file_name(&add.path).to_string();
                let size = add.size.max(0) as u64;
                out.push((name, KnownFile { size, hashes }));
            }
        }
        out
    }
}

/// The rows of `batch` that `keep` keeps (all without it), as batches of one value of
/// the Date32 column at `cut` each when given (bronze's `event_date`): rows in order
/// within a batch, none empty, and a batch of one date whose rows are all kept passed
/// on, not copied. A batch of one date is what [`write_kept`]'s writers encode without
/// copying the rows once more ([`one_partition`]): delta-rs's split by partition value
/// copies every row of a batch, one date or several, so cutting here while the kept
/// rows are copied anyway leaves a row copied once between decode and Parquet, not
/// twice.
pub fn kept_rows(
    batch: RecordBatch,
    keep: Option<&BooleanArray>,
    cut: Option<usize>,
) -> Result<Vec<RecordBatch>> {
    use arrow::array::{Array, AsArray, Date32Array};
    use arrow::compute::filter_record_batch;
    use arrow::datatypes::Date32Type;
    let dates = cut.and_then(|c| batch.column(c).as_primitive_opt::<Date32Type>());
    if let Some(dates) = dates {
        let (lo, hi) = (arrow::compute::min(dates), arrow::compute::max(dates));
        // Several dates (and no nulls, which a comparison would drop): one batch a date.
        if dates.null_count() == 0 && lo != hi {
            let mut each = std::collections::BTreeSet::new();
            each.extend(dates.values().iter().copied());
            let mut out = Vec::with_capacity(each.len());
            for d in each {
                let on = arrow::compute::kernels::cmp::eq(dates, &Date32Array::new_scalar(d))?;
                let on = match keep {
                    Some(k) => arrow::compute::and(k, &on)?,
                    None => on,
                };
                let f = filter_record_batch(&batch, &on)?;
                if f.num_rows() > 0 {
                    out.push(f);
                }
            }
            return Ok(out);
        }
    }
    let kept = match keep {
        Some(k) if k.true_count() < batch.num_rows() => filter_record_batch(&batch, k)?,
        _ => batch,
    };
    Ok(match kept.num_rows() {
        0 => Vec::new(),
        _ => vec![kept],
    })
}

/// Each of `batches` with the mask of the rows to write of it (as many masks as
/// batches, in order).
pub fn with_masks(batches: Vec<RecordBatch>, masks: Vec<BooleanArray>) -> Vec<Kept> {
    batches
        .into_iter()
        .zip(masks.into_iter().map(Some))
        .collect()
}

/// Rows `parts` keep.
pub fn kept_count(parts: &[Kept]) -> usize {
    parts
        .iter()
        .map(|(b, k)| k.as_ref().map_or(b.num_rows(), |k| k.true_count()))
        .sum()
}

/// The memory the rows `parts` keep would take once copied: each batch's share of its
/// kept rows (a batch's arrays may hold more than its rows, as builders leave them).
pub fn kept_bytes(parts: &[Kept]) -> usize {
    kept_share(parts, RecordBatch::get_array_memory_size)
}

/// [`kept_bytes`] of the `columns` (indices) only.
pub fn kept_bytes_of(parts: &[Kept], columns: &[usize]) -> usize {
    kept_share(parts, |b| {
        columns
            .iter()
            .filter(|&&i| i < b.num_columns())
            .map(|&i| b.column(i).get_array_memory_size())
            .sum()
    })
}

/// The kept rows' share of `bytes` of each batch of `parts`, summed.
fn kept_share(parts: &[Kept], bytes: impl Fn(&RecordBatch) -> usize) -> usize {
    parts
        .iter()
        .map(|(b, k)| {
            let all = bytes(b);
            match k {
                Some(k) if !k.is_empty() => all / k.len() * k.true_count(),
                _ => all,
            }
        })
        .sum()
}

/// The partition values of `batch` when all its rows share them (and none is null), for a
/// write that skips delta-rs's split of the batch by partition: that split copies every
/// row (`take`) even when the batch holds one partition, as a bronze batch cut by event
/// date does ([`crate::runner::ingest`]), and a gold batch whose windows fall on one
/// date. `None` for an
/// unpartitioned table (delta-rs writes those without a split) and for a batch of
/// several partitions.
pub fn one_partition(
    batch: &RecordBatch,
    partitions: &[String],
) -> Result<Option<indexmap::IndexMap<String, delta_kernel::expressions::Scalar>>> {
    use deltalake::kernel::scalars::ScalarExt;
    if partitions.is_empty() || batch.num_rows() == 0 {
        return Ok(None);
    }
    let mut values = indexmap::IndexMap::with_capacity(partitions.len());
    for name in partitions {
        let Some(col) = batch.column_by_name(name) else {
            return Ok(None);
        };
        if col.null_count() > 0 {
            return Ok(None);
        }
        let first = arrow::array::Scalar::new(col.slice(0, 1));
        if arrow::compute::kernels::cmp::eq(col, &first)?.true_count() != col.len() {
            return Ok(None);
        }
        match delta_kernel::expressions::Scalar::from_array(col.as_ref(), 0) {
            Some(v) => values.insert(name.clone(), v),
            None => return Ok(None),
        };
    }
    Ok(Some(values))
}

/// [`write_files`], but a file holds rows of one value of `column` only (one file per
/// partition and value): how gold keeps each hour of a date partition in its own files
/// ("clustered"), so a MERGE or a read of an hour picks its files by their statistics.
/// Up to `writers` values are encoded at once. Without the column, as [`write_files`].
pub async fn write_clustered(
    table: &DeltaTable,
    batches: Vec<RecordBatch>,
    column: &str,
    props: WriterProperties,
    writers: usize,
) -> Result<Vec<deltalake::kernel::Add>> {
    use futures::{StreamExt, TryStreamExt};
    let Some(first) = batches.first() else {
        return Ok(Vec::new());
    };
    if first.column_by_name(column).is_none() {
        return write_files(table, batches, props, writers).await;
    }
    let all = arrow::compute::concat_batches(&first.schema(), &batches)?;
    drop(batches);
    let Some(values) = all.column_by_name(column) else {
        return write_files(table, vec![all], props, writers).await;
    };
    let order = arrow::compute::sort_to_indices(values, None, None)?;
    let sorted = arrow::compute::take_record_batch(&all, &order)?;
    drop(all);
    let Some(values) = sorted.column_by_name(column) else {
        return write_files(table, vec![sorted], props, writers).await;
    };
    let groups: Vec<RecordBatch> = arrow::compute::partition(std::slice::from_ref(values))?
        .ranges()
        .into_iter()
        .map(|r| sorted.slice(r.start, r.end - r.start))
        .collect();
    let written: Vec<Vec<deltalake::kernel::Add>> = futures::stream::iter(groups)
        .map(|g| {
            let props = props.clone();
            async move { write_files(table, vec![g], props, 1).await }
        })
        .buffer_unordered(writers.max(1))
        .try_collect()
        .await?;
    Ok(written.into_iter().flatten().collect())
}

/// `parts` cut into consecutive runs of `per_run` rows (the last may be shorter),
/// slicing batches (and their masks) where a run ends; no rows are copied.
fn split_rows(parts: Vec<Kept>, per_run: usize) -> Vec<Vec<Kept>> {
    let mut runs = vec![Vec::new()];
    let mut in_run = 0;
    for (b, keep) in parts {
        let mut offset = 0;
        while offset < b.num_rows() {
            if in_run == per_run {
                runs.push(Vec::new());
                in_run = 0;
            }
            let take = (per_run - in_run).min(b.num_rows() - offset);
            if let Some(run) = runs.last_mut() {
                run.push((
                    b.slice(offset, take),
                    keep.as_ref().map(|k| k.slice(offset, take)),
                ));
            }
            offset += take;
            in_run += take;
        }
    }
    runs.retain(|r| !r.is_empty());
    runs
}

/// Commit files another process wrote into `table` (a cluster's executors, see
/// [`crate::engine::ingest`]) as one append carrying `(app_id, version)`: the way Spark
/// commits the files its tasks wrote. A file no commit names is never read, and vacuum
/// removes it. Returns the table after the commit.
pub async fn commit_adds(
    table: DeltaTable,
    adds: Vec<deltalake::kernel::Add>,
    app_id: &str,
    version: i64,
) -> Result<DeltaTable> {
    let url = table.table_url().to_string();
    let snap = table.snapshot().map_err(|e| Error::delta(&url, e))?;
    let partitions = snap.metadata().partition_columns().to_vec();
    let operation = deltalake::protocol::DeltaOperation::Write {
        mode: SaveMode::Append,
        partition_by: (!partitions.is_empty()).then_some(partitions),
        predicate: None,
    };
    // What the commit wrote, as delta-rs's write records it ([`written_by`] reads it).
    let rows: i64 = adds
        .iter()
        .filter_map(|a| a.stats.as_deref())
        .filter_map(|s| serde_json::from_str::<serde_json::Value>(s).ok())
        .filter_map(|v| v.get("numRecords").and_then(|n| n.as_i64()))
        .sum();
    let metrics = serde_json::json!({ "num_added_rows": rows, "num_added_files": adds.len() });
    let t = std::time::Instant::now();
    let props = txn_props_with(app_id, version, [("operationMetrics".to_string(), metrics)]);
    let actions = adds
        .into_iter()
        .map(deltalake::kernel::Action::Add)
        .collect();
    let table = commit_actions(table, actions, props, operation).await?;
    super::timings::record(
        format!("append {}", super::timings::table_name(&url)),
        t.elapsed(),
    );
    Ok(table)
}

/// Commit `actions` (files kestrel wrote and the ones they replace) to `table` as one
/// `operation`, with `props` (a txn, `operationMetrics`); returns the table at the new
/// version, kept open ([`super::tables`]). Delta's conflict checks decide a race with
/// another writer: the error is then a commit conflict ([`Error::is_commit_conflict`]).
pub async fn commit_actions(
    table: DeltaTable,
    actions: Vec<deltalake::kernel::Action>,
    props: CommitProperties,
    operation: deltalake::protocol::DeltaOperation,
) -> Result<DeltaTable> {
    use deltalake::kernel::transaction::CommitBuilder;
    let url = table.table_url().to_string();
    let snap = table.snapshot().map_err(|e| Error::delta(&url, e))?;
    let finalized = CommitBuilder::from(props)
        .with_actions(actions)
        .build(Some(snap), table.log_store(), operation)
        .await
        .map_err(|e| Error::delta(&url, e))?;
    let mut table = table;
    table.state = Some(finalized.snapshot());
    super::tables::keep(&table);
    Ok(table)
}

/// Replace every row of `table` by `batches` (of `schema`; none is an empty table) in
/// one commit carrying `(app_id, version)`.
pub async fn overwrite(
    table: DeltaTable,
    batches: Vec<RecordBatch>,
    schema: &SchemaRef,
    app_id: &str,
    version: i64,
) -> Result<DeltaTable> {
    let url = table.table_url().to_string();
    let batches = if batches.is_empty() {
        vec![RecordBatch::new_empty(schema.clone())]
    } else {
        batches
    };
    let t = std::time::Instant::now();
    let r = table
        .write(batches)
        .with_save_mode(SaveMode::Overwrite)
        .with_commit_properties(txn_props(app_id, version))
        .await
        .map_err(|e| Error::delta(&url, e));
    super::timings::record(
        format!("overwrite {}", super::timings::table_name(&url)),
        t.elapsed(),
    );
    if let Ok(t) = &r {
        super::tables::keep(t);
    }
    r
}

/// The partition columns of `table` (tables created by an earlier release may lack one
/// a newer release would create).
pub fn partition_columns(table: &DeltaTable) -> Result<Vec<String>> {
    let snap = table
        .snapshot()
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    Ok(snap.metadata().partition_columns().to_vec())
}

/// Why a reader of `table`'s Parquet files that bypasses delta-rs (a cluster's listing,
/// kestrel's MERGE) cannot take them as they are — column mapping, type widening — or
/// None when it can. Deletion vectors are a property of each file: check them per file.
pub fn unsupported_layout(snap: &deltalake::table::state::DeltaTableState) -> Option<String> {
    if snap
        .metadata()
        .configuration()
        .get("delta.columnMapping.mode")
        .is_some_and(|m| m != "none")
    {
        return Some("column mapping".into());
    }
    snap.protocol()
        .reader_features()
        .into_iter()
        .flatten()
        .map(|f| f.to_string())
        .find(|name| name.contains("typeWidening") || name.contains("columnMapping"))
}

/// A partition value as the Delta log holds it (None: null), as a value of `ty`.
pub fn partition_value(
    raw: Option<&str>,
    ty: &arrow::datatypes::DataType,
) -> datafusion::error::Result<datafusion::common::ScalarValue> {
    match raw {
        Some(s) => datafusion::common::ScalarValue::try_from_string(s.to_string(), ty),
        None => datafusion::common::ScalarValue::try_from(ty),
    }
}

/// The partition values of the active file `f`, typed as `types` (one per column of
/// `columns`, the table's partition columns in order).
pub fn file_partition_values(
    f: &deltalake::kernel::LogicalFileView,
    columns: &[String],
    types: &[arrow::datatypes::DataType],
) -> datafusion::error::Result<Vec<datafusion::common::ScalarValue>> {
    if columns.is_empty() {
        return Ok(Vec::new());
    }
    let values = f.partition_values_map();
    columns
        .iter()
        .zip(types)
        .map(|(c, ty)| partition_value(values.get(c).and_then(|v| v.as_deref()), ty))
        .collect()
}

/// A DataFusion session for reading kestrel's tables. Its runtime shares the process's
/// cache of Parquet footers ([`FILE_METADATA_CACHE_BYTES`]).
pub fn session() -> SessionContext {
    if !FILE_METADATA_SHARED.load(std::sync::atomic::Ordering::Relaxed) {
        return SessionContext::new_with_config(session_config());
    }
    let caches = CacheManagerConfig::default()
        .with_file_metadata_cache(Some(FILE_METADATA.clone()))
        .with_metadata_cache_limit(FILE_METADATA_CACHE_BYTES);
    match RuntimeEnvBuilder::new()
        .with_cache_manager(caches)
        .build_arc()
    {
        Ok(runtime) => SessionContext::new_with_config_rt(session_config(), runtime),
        Err(e) => {
            tracing::warn!(error = %e, "cannot share the Parquet footer cache; this read loads its own");
            SessionContext::new_with_config(session_config())
        }
    }
}

/// Bytes of Parquet footers (with their page indexes) every read of this process
/// shares, least recently used evicted first. A session's runtime kept its own cache,
/// dropped with it, so every batch read the footer of every file it touched again: the
/// payments' reads of a week of orders and payments, a file per closed day, paid for
/// each day's footer on every batch. Shared, a day file costs such a read ≈ 0.42 ms
/// instead of ≈ 0.57 ms (`cargo bench --bench jobs -- readcost`); the rest is its bloom
/// filter reads and DataFusion's opening of the file. Data files are never rewritten in
/// place (a Delta file's name is unique), so an entry — keyed by the file's path,
/// checked against its size — never goes stale.
pub const FILE_METADATA_CACHE_BYTES: usize = 16 << 20;

static FILE_METADATA: std::sync::LazyLock<Arc<FileMetadataCache>> =
    std::sync::LazyLock::new(|| {
        Arc::new(DefaultCache::new(FILE_METADATA_CACHE_BYTES).with_name("kestrel footers"))
    });

static FILE_METADATA_SHARED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

/// Forget every cached footer (what a new process starts with). The daemon calls it
/// between runs (see `runner::schedule`), benchmarks of cron-driven runs between theirs.
pub fn clear_file_metadata() {
    FILE_METADATA.clear();
}

/// The object-store paths of the footers cached now.
#[cfg(test)]
fn cached_footers() -> Vec<String> {
    FILE_METADATA
        .list_entries()
        .into_keys()
        .map(|p| p.to_string())
        .collect()
}

/// Whether sessions share the footer cache (default) or each keeps its own, for
/// benchmarks that measure both side by side.
pub fn share_file_metadata(on: bool) {
    FILE_METADATA_SHARED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The session delta-rs's rewrites (optimize, MERGE) run in: kestrel's, so the files
/// they write carry plain `Utf8` in their Arrow schema. With delta-rs's default session
/// they carried `Utf8View` (its scan's types), and a reader then compares
/// `CAST(order_id AS Utf8)` with a keyed read's list, which no bloom filter can answer:
/// every payments read scanned all of the compacted day's orders and payments (15.8 MB
/// a read by 23:00 at Kestrel's scale, instead of the few row groups holding its keys).
pub fn rewrite_session() -> Arc<dyn datafusion::catalog::Session> {
    Arc::new(session().state())
}

/// The configuration of every kestrel read's session, local or on a cluster.
pub fn session_config() -> SessionConfig {
    // Plain Utf8 from Parquet: view types would be cast back (a copy) by every reader.
    let mut config = SessionConfig::new().with_target_partitions(2);
    let options = config.options_mut();
    options.execution.parquet.schema_force_view_types = false;
    // A keyed read (a semi join against a batch's touched keys) hands the keys to the
    // scan as a list up to this many, so row groups are skipped by bloom filter; beyond
    // it DataFusion pushes a hash-table probe, which no Parquet index can use. Its
    // defaults (150 values, 128 KiB) are meant for dimension joins; a batch touches a
    // few thousand orders.
    options
        .optimizer
        .hash_join_inlist_pushdown_max_distinct_values = KEYED_READ_LIST;
    options.optimizer.hash_join_inlist_pushdown_max_size = KEYED_READ_LIST * 64;
    config
}

/// Keys a keyed read hands to its scan as a list (see [`session`]).
pub const KEYED_READ_LIST: usize = 20_000;

/// A DataFusion session with `table` registered under `name`.
pub async fn session_with(table: &DeltaTable, name: &str) -> Result<SessionContext> {
    let ctx = session();
    register(&ctx, table, name).await?;
    Ok(ctx)
}

/// Register `table` under `name` in `ctx`.
pub async fn register(ctx: &SessionContext, table: &DeltaTable, name: &str) -> Result<()> {
    let url = table.table_url().to_string();
    let t = std::time::Instant::now();
    table
        .update_datafusion_session(&ctx.state())
        .map_err(|e| Error::delta(&url, e))?;
    // Kestrel's scan of the snapshot in hand (`super::scan`); delta-rs's provider for
    // what plain Parquet cannot read.
    let snapshot = match super::scan::enabled() {
        true => super::scan::SnapshotTable::try_new(table)?,
        false => Err("delta-rs's provider chosen".to_string()),
    };
    let provider: Arc<dyn datafusion::catalog::TableProvider> = match snapshot {
        Ok(t) => Arc::new(t),
        Err(why) => {
            tracing::debug!(table = %shown(url.clone()), why, "read through delta-rs's table provider");
            table
                .table_provider()
                .await
                .map_err(|e| Error::query(format!("open {url}"), e))?
        }
    };
    ctx.register_table(name, provider)
        .map_err(|e| Error::query(format!("register {url}"), e))?;
    super::timings::record(
        format!("register {}", super::timings::table_name(&url)),
        t.elapsed(),
    );
    Ok(())
}

/// Run SQL and collect the result.
pub async fn sql(ctx: &SessionContext, query: &str) -> Result<Vec<RecordBatch>> {
    let t = std::time::Instant::now();
    let r = sql_inner(ctx, query).await;
    super::timings::record(
        format!("sql {}", &query[..query.len().min(40)]),
        t.elapsed(),
    );
    r
}

async fn sql_inner(ctx: &SessionContext, query: &str) -> Result<Vec<RecordBatch>> {
    let df = ctx.sql(query).await.map_err(|e| Error::query(query, e))?;
    df.collect().await.map_err(|e| Error::query(query, e))
}

/// Number of rows over batches.
pub fn rows(batches: &[RecordBatch]) -> usize {
    batches.iter().map(|b| b.num_rows()).sum()
}

/// A warehouse on the local directory `dir` (tests: a temporary one).
#[cfg(test)]
pub(crate) fn local_warehouse(dir: &std::path::Path) -> Warehouse {
    let loc =
        crate::storage::Location::open(dir.to_string_lossy().as_ref(), &Default::default(), true);
    Warehouse::new(loc.expect("a local warehouse location"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::merge::{merge, MergeSpec};
    use arrow::array::{Array, Int64Array};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::collections::BTreeMap;
    use std::sync::Arc;

    /// Bronze files keep no dictionary for the columns of nearly unique values (ids, event
    /// times, lookup keys) and keep one for the rest (a sku, a source file).
    #[test]
    fn bronze_files_keep_dictionaries_only_for_repeated_values() {
        use arrow::array::{StringArray, TimestampMicrosecondArray};
        use deltalake::parquet::arrow::ArrowWriter;
        let names = ["event_id", "event_ts", "order_id", "sku", "_source_file"];
        let schema = Arc::new(Schema::new(
            names
                .iter()
                .map(|n| match *n {
                    "event_ts" => Field::new(
                        *n,
                        DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, None),
                        true,
                    ),
                    _ => Field::new(*n, DataType::Utf8, true),
                })
                .collect::<Vec<_>>(),
        ));
        let n = 2_000;
        let text = |f: &dyn Fn(usize) -> String| {
            Arc::new(StringArray::from((0..n).map(f).collect::<Vec<_>>())) as arrow::array::ArrayRef
        };
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                text(&|i| format!("{i:032x}")),
                Arc::new(TimestampMicrosecondArray::from(
                    (0..n as i64)
                        .map(|i| 1_700_000_000_000_000 + i * 7_919)
                        .collect::<Vec<_>>(),
                )),
                text(&|i| format!("ord-{}", i / 2)),
                text(&|i| format!("SKU-{:04}", i % 50)),
                text(&|_| "landing/orders/f1.ndjson".to_string()),
            ],
        )
        .unwrap();
        let mut buf = Vec::new();
        let props = bronze_writer_properties(names);
        let mut w = ArrowWriter::try_new(&mut buf, schema, Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let meta = deltalake::parquet::file::metadata::ParquetMetaDataReader::new()
            .parse_and_finish(&bytes::Bytes::from(buf))
            .unwrap();
        let rg = meta.row_group(0);
        let with_dictionary: Vec<&str> = (0..rg.num_columns())
            .filter(|i| rg.column(*i).dictionary_page_offset().is_some())
            .map(|i| names[i])
            .collect();
        assert_eq!(with_dictionary, ["sku", "_source_file"]);
    }

    /// Random UUIDs are written uncompressed, ids with shared prefixes with Snappy; the
    /// other columns keep Snappy either way.
    #[test]
    fn event_ids_are_compressed_only_when_it_pays() {
        use arrow::array::StringArray;
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("sku", DataType::Utf8, true),
        ]));
        let batch = |ids: Vec<String>| {
            let skus: Vec<String> = (0..ids.len())
                .map(|i| format!("SKU-{:04}", i % 50))
                .collect();
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from(ids)),
                    Arc::new(StringArray::from(skus)),
                ],
            )
            .unwrap()
        };
        let uuids = batch(
            (0..20_000)
                .map(|_| uuid::Uuid::new_v4().to_string())
                .collect(),
        );
        let counters = batch((0..20_000).map(|i| format!("evt-{i:012}")).collect());
        let ulid_like = batch(
            (0..20_000u64)
                .map(|i| {
                    format!(
                        "01JE{:06}{:016X}",
                        i / 100,
                        i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    )
                })
                .collect(),
        );
        let all = |b: &RecordBatch| [(b.clone(), None)];
        assert_eq!(
            sampled_compression(&all(&uuids), "event_id"),
            Compression::UNCOMPRESSED
        );
        assert_eq!(
            sampled_compression(&all(&counters), "event_id"),
            Compression::SNAPPY
        );
        assert_eq!(
            sampled_compression(&all(&ulid_like), "event_id"),
            Compression::SNAPPY
        );
        // Only kept rows are sampled: a batch whose mask drops every row is not judged.
        let none = |b: &RecordBatch| Some(BooleanArray::from(vec![false; b.num_rows()]));
        assert_eq!(
            sampled_compression(
                &[(uuids.clone(), none(&uuids)), (counters.clone(), None)],
                "event_id"
            ),
            Compression::SNAPPY
        );
        assert_eq!(
            sampled_compression(
                &[(counters.clone(), none(&counters)), (uuids.clone(), None)],
                "event_id"
            ),
            Compression::UNCOMPRESSED
        );
        assert_eq!(
            sampled_compression(&[], "event_id"),
            Compression::SNAPPY,
            "nothing to judge by"
        );
        // The choice reaches the file: event_id's chunk uncompressed, sku's compressed.
        let props = bronze_writer_properties_for(["event_id", "sku"], &all(&uuids));
        assert_eq!(
            written_compressions(&uuids, props),
            [Compression::UNCOMPRESSED, Compression::SNAPPY]
        );
    }

    /// The compression of each column chunk of `batch` written with `props`.
    fn written_compressions(batch: &RecordBatch, props: WriterProperties) -> Vec<Compression> {
        let mut buf = Vec::new();
        let mut w =
            deltalake::parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), Some(props))
                .unwrap();
        w.write(batch).unwrap();
        w.close().unwrap();
        let meta = deltalake::parquet::file::metadata::ParquetMetaDataReader::new()
            .parse_and_finish(&bytes::Bytes::from(buf))
            .unwrap();
        let rg = meta.row_group(0);
        (0..rg.num_columns())
            .map(|c| rg.column(c).compression())
            .collect()
    }

    /// Bronze's integer and time bookkeeping columns are written as deltas without a
    /// dictionary, read back to the same values; `sku` keeps its dictionary.
    #[test]
    fn bronze_bookkeeping_columns_are_delta_encoded_and_read_back_the_same() {
        use arrow::array::{Int64Array, StringArray, TimestampMicrosecondArray};
        use deltalake::parquet::basic::Encoding;
        let ts =
            || DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, Some("UTC".into()));
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, false),
            Field::new("event_ts", ts(), false),
            Field::new("sku", DataType::Utf8, false),
            Field::new("_landed_at", ts(), false),
            Field::new("_source_line", DataType::Int64, false),
            Field::new("_batch_id", DataType::Int64, false),
            Field::new("_ingested_at", ts(), true),
        ]));
        let n = 5000i64;
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter_values(
                    (0..n).map(|i| format!("e{i}")),
                )),
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        (0..n).map(|i| 1_763_596_890_000_000 + i * 997 - (i % 7) * 50_000),
                    )
                    .with_timezone("UTC"),
                ),
                Arc::new(StringArray::from_iter_values(
                    (0..n).map(|i| format!("SKU-{}", i % 9)),
                )),
                Arc::new(
                    TimestampMicrosecondArray::from(vec![1_763_596_900_000_000; n as usize])
                        .with_timezone("UTC"),
                ),
                Arc::new(Int64Array::from_iter_values(1..=n)),
                Arc::new(Int64Array::from(vec![7; n as usize])),
                Arc::new(
                    TimestampMicrosecondArray::from(
                        (0..n)
                            .map(|i| (i % 100 != 0).then_some(i))
                            .collect::<Vec<_>>(),
                    )
                    .with_timezone("UTC"),
                ),
            ],
        )
        .unwrap();
        let props = bronze_writer_properties(["event_id", "event_ts", "sku"]);
        let mut buf = Vec::new();
        let mut w =
            deltalake::parquet::arrow::ArrowWriter::try_new(&mut buf, schema, Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let bytes = bytes::Bytes::from(buf);
        let meta = deltalake::parquet::file::metadata::ParquetMetaDataReader::new()
            .parse_and_finish(&bytes)
            .unwrap();
        let rg = meta.row_group(0);
        for c in 0..rg.num_columns() {
            let col = rg.column(c);
            let name = col.column_path().string();
            let delta = col.encodings().any(|e| e == Encoding::DELTA_BINARY_PACKED);
            let dict = col.encodings().any(|e| e == Encoding::RLE_DICTIONARY);
            let want = BRONZE_DELTA_ENCODED.contains(&name.as_str());
            assert_eq!((delta, dict && want), (want, false), "{name}");
            if name == "sku" {
                assert!(dict, "sku keeps its dictionary");
            }
        }
        let back: Vec<RecordBatch> =
            deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(bytes, 8192)
                .unwrap()
                .collect::<std::result::Result<_, _>>()
                .unwrap();
        let back = arrow::compute::concat_batches(&back[0].schema(), &back).unwrap();
        assert_eq!(back, batch);
    }

    /// The lookup keys' compression is chosen the same way as event_id's, column by
    /// column: random order ids uncompressed beside counter-like event ids with Snappy,
    /// and a column that is neither keeps Snappy whatever it holds.
    #[test]
    fn lookup_keys_are_compressed_only_when_it_pays() {
        use arrow::array::StringArray;
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("order_id", DataType::Utf8, true),
            Field::new("note", DataType::Utf8, true),
        ]));
        let random = |_| format!("ord-{}", uuid::Uuid::new_v4().simple());
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter_values(
                    (0..20_000).map(|i| format!("evt-{i:012}")),
                )),
                Arc::new(StringArray::from_iter_values((0..20_000).map(random))),
                Arc::new(StringArray::from_iter_values((0..20_000).map(random))),
            ],
        )
        .unwrap();
        let rows = &[(batch.clone(), None)];
        assert_eq!(sampled_compression(rows, "event_id"), Compression::SNAPPY);
        assert_eq!(
            sampled_compression(rows, "order_id"),
            Compression::UNCOMPRESSED
        );
        assert_eq!(sampled_compression(rows, "absent"), Compression::SNAPPY);
        let props = bronze_writer_properties_for(["event_id", "order_id", "note"], rows);
        assert_eq!(
            written_compressions(&batch, props),
            [
                Compression::SNAPPY,
                Compression::UNCOMPRESSED,
                Compression::SNAPPY
            ]
        );
    }

    /// Removes in the newest checkpoint of a table after 12 appends, a compaction of
    /// them and 7 more appends.
    async fn tombstones_kept(retention: std::time::Duration) -> usize {
        let dir = tempfile::tempdir().unwrap();
        let wh = local_warehouse(dir.path()).with_tombstone_retention(retention);
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let mut table = wh.open_or_create("t", &schema, &[]).await.unwrap();
        let batch = |v: i64| {
            RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![v]))]).unwrap()
        };
        for v in 1..=12 {
            table = append(table, vec![batch(v)], &[], "app", v).await.unwrap();
        }
        let (t, m) = table.optimize().await.unwrap();
        assert_eq!(m.num_files_removed, 12);
        table = t;
        std::thread::sleep(std::time::Duration::from_millis(5));
        for v in 13..=19 {
            table = append(table, vec![batch(v)], &[], "app", v).await.unwrap();
        }
        assert_eq!(table.version(), Some(20));
        let log = dir.path().join("t/_delta_log");
        let mut ckpts: Vec<String> = std::fs::read_dir(&log)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".checkpoint") && n.ends_with(".parquet"))
            .collect();
        ckpts.sort();
        let newest = ckpts.last().expect("a checkpoint");
        // delta-rs checkpoints every tenth version (9, 19): the newest follows the
        // compaction (version 13).
        assert!(newest.starts_with("00000000000000000019."), "{ckpts:?}");
        let file = std::fs::File::open(log.join(newest)).unwrap();
        let reader =
            deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                .unwrap()
                .build()
                .unwrap();
        let mut removes = 0;
        for b in reader {
            let b = b.unwrap();
            if let Some(r) = b.column_by_name("remove") {
                removes += r.len() - r.null_count();
            }
        }
        removes
    }

    /// A read's footers stay cached for the next read of the process until
    /// [`clear_file_metadata`] forgets them (as the daemon does between runs).
    #[tokio::test]
    async fn cleared_footers_are_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let wh = local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let table = wh.open_or_create("t", &schema, &[]).await.unwrap();
        let batch =
            RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![1, 2]))])
                .unwrap();
        let table = append(table, vec![batch], &[], "app", 1).await.unwrap();
        let file = table
            .snapshot()
            .unwrap()
            .log_data()
            .iter()
            .map(|f| f.object_store_path().to_string())
            .next()
            .expect("one data file");
        let cached = || cached_footers().iter().any(|p| p.ends_with(&file));
        // Another test's daemon may clear the cache between the read and the check:
        // read again then.
        let mut seen = false;
        for _ in 0..5 {
            let ctx = session_with(&table, "t").await.unwrap();
            let rows: usize = ctx
                .sql("SELECT a FROM t")
                .await
                .unwrap()
                .collect()
                .await
                .unwrap()
                .iter()
                .map(|b| b.num_rows())
                .sum();
            assert_eq!(rows, 2);
            if cached() {
                seen = true;
                break;
            }
        }
        assert!(seen, "{file} not among {:?}", cached_footers());
        clear_file_metadata();
        assert!(!cached(), "{file} still cached");
    }

    /// A local warehouse's tables are opened under `kestrel-file` (see
    /// [`LOCAL_TABLE_SCHEME`]): written, merged, checkpointed, read back and opened again
    /// like any table, with the same files at the same paths a `file` URL names, and
    /// messages naming them by their `file` URL.
    #[tokio::test]
    async fn local_tables_open_under_their_own_scheme() {
        let base = tempfile::tempdir().unwrap();
        local_table_round_trip(base.path(), LOCAL_TABLE_SCHEME).await;
        // A path that needs percent-encoding keeps the `file` scheme.
        local_table_round_trip(&base.path().join("with space"), "file").await;
    }

    async fn local_table_round_trip(dir: &std::path::Path, scheme: &str) {
        let loc = Location::open(dir.to_str().unwrap(), &Default::default(), true).unwrap();
        let wh = Warehouse::new(loc.clone());
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, true),
            Field::new("op", DataType::Utf8, true),
        ]));
        let batch = |k: Vec<i64>, v: i64| {
            let n = k.len();
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from(k)),
                    Arc::new(Int64Array::from(vec![v; n])),
                    Arc::new(arrow::array::StringArray::from(vec!["upsert"; n])),
                ],
            )
            .unwrap()
        };
        let mut table = wh.open_or_create("gold/t", &schema, &[]).await.unwrap();
        assert_eq!(table.table_url().scheme(), scheme);
        for v in 1..=11 {
            let keys = [("k".to_string(), false)];
            let spec = MergeSpec {
                keys: &keys,
                partitions: Vec::new(),
                columns: vec!["k".into(), "v".into(), "op".into()],
                op_column: "op",
                cluster: None,
            };
            table = merge(table, vec![batch(vec![v % 3], v)], &spec, "app", v)
                .await
                .unwrap()
                .0;
        }
        assert!(dir
            .join("gold/t/_delta_log/00000000000000000009.checkpoint.parquet")
            .exists());
        crate::sink::tables::forget(&table.table_url().clone());
        let table = wh.open("gold/t").await.unwrap().expect("the table");
        assert_eq!(table.version(), Some(11));
        assert_eq!(txn_version(&table, "app").await.unwrap(), Some(11));
        // What each transaction's commit wrote is found again (a resumed batch's count):
        // batch 1 inserted key 1, batch 11 updated key 2; an unknown one names nothing.
        assert_eq!(written_by(&table, "app", 1).await.unwrap(), Some(1));
        assert_eq!(written_by(&table, "app", 11).await.unwrap(), Some(1));
        assert_eq!(written_by(&table, "app", 12).await.unwrap(), None);
        assert_eq!(written_by(&table, "other", 11).await.unwrap(), None);
        let log = wh.open_or_create("gold/log", &schema, &[]).await.unwrap();
        let log = append(log, vec![batch(vec![1, 2, 3], 0)], &[], "w", 7)
            .await
            .unwrap();
        assert_eq!(written_by(&log, "w", 7).await.unwrap(), Some(3));
        let ctx = session_with(&table, "t").await.unwrap();
        let got = sql(&ctx, "SELECT k, v FROM t ORDER BY k").await.unwrap();
        let v: Vec<i64> = got
            .iter()
            .flat_map(|b| {
                let a = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
                a.values().to_vec()
            })
            .collect();
        assert_eq!(v, vec![9, 10, 11]);
        // The same table through a `file` URL, as any other reader opens it.
        let plain = deltalake::open_table(loc.child_url("gold/t").unwrap())
            .await
            .unwrap();
        assert_eq!(plain.version(), Some(11));
        let err = Error::delta(
            table.table_url().as_str(),
            deltalake::DeltaTableError::Generic("x".into()),
        );
        let shown = err.to_string();
        assert!(
            shown.contains("file:///") && !shown.contains(LOCAL_TABLE_SCHEME),
            "{shown}"
        );
    }

    /// The rows kept are the rows the masks keep, in order within each batch and event
    /// date, a batch of several dates cut into one batch a date (in date order), with
    /// empty batches dropped and a whole batch of one date passed on uncopied.
    #[test]
    fn kept_rows_are_the_masks_rows_in_order_one_date_a_batch() {
        use arrow::array::{AsArray, Date32Array, StringArray};
        use arrow::datatypes::Date32Type;
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
            Field::new("d", DataType::Date32, false),
        ]));
        let mut batches = Vec::new();
        let mut masks = Vec::new();
        let mut next = 0i64;
        // 9 batches of 20k rows: every 7th row dropped, batch 4 dropped whole, batch 6
        // kept whole; batches 2 and 5 hold two dates (every third row a day earlier),
        // batch 8 two dates and every row kept.
        let date = |b: i64, v: i64| {
            if [2, 5, 8].contains(&b) && v % 3 == 0 {
                20_000
            } else {
                20_001
            }
        };
        let keeps = |b: i64, v: i64| b != 4 && (b == 6 || b == 8 || v % 7 != 0);
        for b in 0..9 {
            let n: Vec<i64> = (next..next + 20_000).collect();
            next += 20_000;
            let s: Vec<String> = n.iter().map(|v| format!("id-{v}")).collect();
            let d: Vec<i32> = n.iter().map(|v| date(b, *v)).collect();
            batches.push(
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from(n.clone())),
                        Arc::new(StringArray::from(s)),
                        Arc::new(Date32Array::from(d)),
                    ],
                )
                .unwrap(),
            );
            masks.push(BooleanArray::from(
                n.iter().map(|v| keeps(b, *v)).collect::<Vec<_>>(),
            ));
        }
        let whole = batches[6].column(1).clone();
        let mut expected = Vec::new();
        for b in 0..9 {
            for d in [20_000, 20_001] {
                expected.extend(
                    (b * 20_000..(b + 1) * 20_000).filter(|v| keeps(b, *v) && date(b, *v) == d),
                );
            }
        }
        let kept: Vec<RecordBatch> = batches
            .into_iter()
            .zip(masks)
            .flat_map(|(b, m)| kept_rows(b, Some(&m), Some(2)).unwrap())
            .collect();
        assert_eq!(
            kept.len(),
            11,
            "the emptied batch is dropped, the three of two dates cut in two"
        );
        for b in &kept {
            let d = b.column(2).as_primitive::<Date32Type>();
            assert_eq!(
                arrow::compute::min(d),
                arrow::compute::max(d),
                "one date a batch"
            );
        }
        assert!(
            kept.iter().any(|b| Arc::ptr_eq(b.column(1), &whole)),
            "a whole batch of one date is not copied"
        );
        let got: Vec<i64> = kept
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec()
            })
            .collect();
        assert_eq!(got, expected);
        let strings: Vec<String> = kept
            .iter()
            .flat_map(|b| {
                let s = b.column(1).as_string::<i32>();
                (0..s.len())
                    .map(|i| s.value(i).to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(
            strings,
            expected
                .iter()
                .map(|v| format!("id-{v}"))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn rows_are_cut_into_runs_of_equal_size_across_batches() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let batch = |a: i64, b: i64| {
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from_iter_values(a..b))],
            )
            .unwrap()
        };
        // The middle batch keeps its odd keys: its mask is cut where the batch is.
        let odd = BooleanArray::from((5..12).map(|k| k % 2 == 1).collect::<Vec<_>>());
        let parts = vec![
            (batch(0, 5), None),
            (batch(5, 12), Some(odd)),
            (batch(12, 13), None),
        ];
        let runs = split_rows(parts, 4);
        let sizes: Vec<Vec<usize>> = runs
            .iter()
            .map(|r| r.iter().map(|(b, _)| b.num_rows()).collect())
            .collect();
        assert_eq!(sizes, vec![vec![4], vec![1, 3], vec![4], vec![1]]);
        let keys: Vec<i64> = runs
            .iter()
            .flatten()
            .flat_map(|(b, k)| {
                let a = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                let kept: Vec<i64> = match k {
                    Some(k) => {
                        assert_eq!(k.len(), b.num_rows(), "a mask as long as its slice");
                        a.values()
                            .iter()
                            .zip(k.iter())
                            .filter(|(_, k)| *k == Some(true))
                            .map(|(v, _)| *v)
                            .collect()
                    }
                    None => a.values().to_vec(),
                };
                kept
            })
            .collect();
        assert_eq!(keys, vec![0, 1, 2, 3, 4, 5, 7, 9, 11, 12]);
        assert!(split_rows(Vec::new(), 4).is_empty());
    }

    /// Keys `ks` with the day `day` gives each (a nullable `d` string column).
    fn keyed_days(
        schema: &SchemaRef,
        ks: std::ops::Range<i64>,
        day: impl Fn(i64) -> Option<&'static str>,
    ) -> RecordBatch {
        let ds: Vec<Option<&str>> = ks.clone().map(day).collect();
        RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(ks.collect::<Vec<_>>())),
                Arc::new(arrow::array::StringArray::from(ds)),
            ],
        )
        .unwrap()
    }

    /// Two writers encode a batch of two partitions into four files, committed as one
    /// append carrying the txn: every row once, from a row group's rows and one more;
    /// a row group's rows or fewer get one writer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn files_of_parallel_writers_commit_as_one_append_of_every_row() {
        let dir = tempfile::tempdir().unwrap();
        let wh = local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("d", DataType::Utf8, false),
        ]));
        let n = ROWS_PER_WRITER as i64 + 10;
        let day = |k: i64| {
            if k % 3 == 0 {
                "2026-01-01"
            } else {
                "2026-01-02"
            }
        };
        let batches: Vec<RecordBatch> = (0..4)
            .map(|q| keyed_days(&schema, q * n / 4..(q + 1) * n / 4, |k| Some(day(k))))
            .collect();
        let table = wh.open_or_create("t", &schema, &["d"]).await.unwrap();
        let props = WriterProperties::builder().build();
        let adds = write_files(&table, batches, props.clone(), 8)
            .await
            .unwrap();
        assert_eq!(adds.len(), 4, "two writers, two partitions");
        let table = commit_adds(table, adds, "w", 1).await.unwrap();
        assert_eq!(txn_version(&table, "w").await.unwrap(), Some(1));
        let ctx = session_with(&table, "t").await.unwrap();
        let got = sql(&ctx, "SELECT count(*), count(DISTINCT k), sum(k), sum(CASE WHEN d = '2026-01-01' THEN 1 ELSE 0 END) FROM t").await.unwrap();
        let col = |i: usize| {
            arrow::compute::cast(got[0].column(i), &DataType::Int64)
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .value(0)
        };
        assert_eq!((col(0), col(1), col(2)), (n, n, n * (n - 1) / 2));
        assert_eq!(col(3), (0..n).filter(|k| k % 3 == 0).count() as i64);
        // One row group's rows or fewer: one writer.
        let one = ROWS_PER_WRITER as i64;
        let small = vec![keyed_days(&schema, 0..one, |_| Some("2026-01-01"))];
        assert_eq!(write_files(&table, small, props, 8).await.unwrap().len(), 1);
    }

    /// The rows masks keep, written by parallel writers that copy them by date: the
    /// table holds exactly those rows, each file one date, and the rows handed back are
    /// the same rows, one date a batch (none without `hold`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kept_rows_of_parallel_writers_are_the_rows_the_masks_keep() {
        use arrow::array::{AsArray, Date32Array};
        use arrow::datatypes::{Date32Type, Int64Type};
        let dir = tempfile::tempdir().unwrap();
        let wh = local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("d", DataType::Date32, false),
        ]));
        // Two writers' rows (one more would make three).
        let n = 2 * ROWS_PER_WRITER as i64;
        // Batch 1 of two dates, batch 2 dropped whole, batch 3 kept whole.
        let day = |q: i64, k: i64| if q == 1 && k % 3 == 0 { 20_000 } else { 20_001 };
        let keeps = |q: i64, k: i64| q != 2 && (q == 3 || k % 5 != 0);
        let parts: Vec<Kept> = (0..4)
            .map(|q| {
                let ks: Vec<i64> = (q * n / 4..(q + 1) * n / 4).collect();
                let ds: Vec<i32> = ks.iter().map(|k| day(q, *k)).collect();
                let keep = BooleanArray::from(ks.iter().map(|k| keeps(q, *k)).collect::<Vec<_>>());
                let b = RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from(ks)),
                        Arc::new(Date32Array::from(ds)),
                    ],
                )
                .unwrap();
                (b, Some(keep))
            })
            .collect();
        let mut expect: Vec<(i64, i32)> = (0..4)
            .flat_map(|q| (q * n / 4..(q + 1) * n / 4).map(move |k| (q, k)))
            .filter(|(q, k)| keeps(*q, *k))
            .map(|(q, k)| (k, day(q, k)))
            .collect();
        expect.sort();
        assert_eq!(kept_count(&parts), expect.len());
        let table = wh.open_or_create("t", &schema, &["d"]).await.unwrap();
        let props = WriterProperties::builder().build();
        let how = KeptWrite {
            cut: Some(1),
            writers: 8,
            hold: true,
            hold_columns: None,
            remember: None,
        };
        let written = write_kept(&table, parts.clone(), props.clone(), how.clone())
            .await
            .unwrap();
        assert!(written.known.is_empty(), "nothing remembered unasked");
        assert_eq!(
            written.adds.len(),
            3,
            "the first writer's rows of two dates, the second's of one"
        );
        let mut held: Vec<(i64, i32)> = Vec::new();
        for b in &written.rows {
            let d = b.column(1).as_primitive::<Date32Type>();
            assert_eq!(
                arrow::compute::min(d),
                arrow::compute::max(d),
                "one date a batch"
            );
            let k = b.column(0).as_primitive::<Int64Type>();
            held.extend(k.values().iter().zip(d.values()).map(|(k, d)| (*k, *d)));
        }
        held.sort();
        assert_eq!(held, expect);
        let table = commit_adds(table, written.adds, "w", 1).await.unwrap();
        let ctx = session_with(&table, "t").await.unwrap();
        let got = sql(&ctx, "SELECT k, CAST(d AS INT) AS d FROM t ORDER BY k")
            .await
            .unwrap();
        let mut rows: Vec<(i64, i32)> = Vec::new();
        for b in &got {
            let k = b.column(0).as_primitive::<Int64Type>();
            let d = b.column(1).as_primitive::<arrow::datatypes::Int32Type>();
            rows.extend(k.values().iter().zip(d.values()).map(|(k, d)| (*k, *d)));
        }
        assert_eq!(rows, expect);
        let how = KeptWrite { hold: false, ..how };
        let unheld = write_kept(&table, parts, props, how).await.unwrap();
        assert!(unheld.rows.is_empty() && !unheld.adds.is_empty());
    }

    /// Batches of one partition each are written without delta-rs's split, a batch of
    /// several with it, and every row lands in the partition of its own value.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_of_one_partition_are_written_to_it_and_mixed_ones_split() {
        let dir = tempfile::tempdir().unwrap();
        let wh = local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("d", DataType::Utf8, true),
        ]));
        let batch = |ks: std::ops::Range<i64>, day: &dyn Fn(i64) -> Option<&'static str>| {
            keyed_days(&schema, ks, day)
        };
        let jan1 = |_| Some("2026-01-01");
        let jan2 = |_| Some("2026-01-02");
        let mixed = |k: i64| {
            Some(if k % 2 == 0 {
                "2026-01-01"
            } else {
                "2026-01-02"
            })
        };
        let nulls = |k: i64| (k % 2 == 0).then_some("2026-01-01");
        let parts = vec!["d".to_string()];
        let one = one_partition(&batch(0..10, &jan1), &parts)
            .unwrap()
            .unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(
            deltalake::kernel::scalars::ScalarExt::serialize(&one["d"]),
            "2026-01-01"
        );
        assert!(one_partition(&batch(0..10, &mixed), &parts)
            .unwrap()
            .is_none());
        assert!(one_partition(&batch(0..10, &nulls), &parts)
            .unwrap()
            .is_none());
        assert!(one_partition(&batch(0..10, &jan1), &[]).unwrap().is_none());

        let table = wh.open_or_create("t", &schema, &["d"]).await.unwrap();
        let batches = vec![
            batch(0..100, &jan1),
            batch(100..250, &jan2),
            batch(250..400, &mixed),
            batch(400..420, &jan1),
            batch(420..440, &nulls),
        ];
        // Per day (null as "null"): rows and sum of keys, as the batches hold them.
        let mut expect: BTreeMap<String, (i64, i64)> = BTreeMap::new();
        for b in &batches {
            let ks = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            let ds = b
                .column(1)
                .as_any()
                .downcast_ref::<arrow::array::StringArray>()
                .unwrap();
            for i in 0..b.num_rows() {
                let d = if ds.is_valid(i) { ds.value(i) } else { "null" };
                let e = expect.entry(d.to_string()).or_default();
                *e = (e.0 + 1, e.1 + ks.value(i));
            }
        }
        assert_eq!(expect.len(), 3, "two days and null");
        let adds = write_files(&table, batches, WriterProperties::builder().build(), 2)
            .await
            .unwrap();
        let table = commit_adds(table, adds, "w", 1).await.unwrap();
        let ctx = session_with(&table, "t").await.unwrap();
        let got = sql(
            &ctx,
            "SELECT coalesce(d, 'null') AS d, count(*), sum(k) FROM t GROUP BY 1",
        )
        .await
        .unwrap();
        let mut rows: BTreeMap<String, (i64, i64)> = BTreeMap::new();
        for b in &got {
            let d = arrow::compute::cast(b.column(0), &DataType::Utf8).unwrap();
            let d = d
                .as_any()
                .downcast_ref::<arrow::array::StringArray>()
                .unwrap();
            let int = |c: usize| arrow::compute::cast(b.column(c), &DataType::Int64).unwrap();
            let (n, sum) = (int(1), int(2));
            let (n, sum) = (
                n.as_any().downcast_ref::<Int64Array>().unwrap(),
                sum.as_any().downcast_ref::<Int64Array>().unwrap(),
            );
            for i in 0..b.num_rows() {
                rows.insert(d.value(i).to_string(), (n.value(i), sum.value(i)));
            }
        }
        assert_eq!(rows, expect);
    }

    /// Writers (`run`, the daemon, a backfill) racing to create one table: the losers
    /// open the winner's table. delta-rs would otherwise retry a lost create as a second
    /// metadata commit (version 1), and every writer that read version 0 then failed
    /// with "Metadata changed since last commit" (seen on S3 in the concurrent-writers
    /// test, on the ledger).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writers_racing_to_create_a_table_leave_one_create_and_all_append() {
        let dir = tempfile::tempdir().unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let writers: Vec<_> = (0..8i64)
            .map(|i| {
                let (path, schema) = (dir.path().to_path_buf(), schema.clone());
                tokio::spawn(async move {
                    let loc =
                        Location::open(path.to_str().unwrap(), &Default::default(), true).unwrap();
                    let wh = Warehouse::new(loc);
                    let t = wh.open_or_create("race/t", &schema, &[]).await.unwrap();
                    let rows = vec![Arc::new(Int64Array::from(vec![i])) as _];
                    let b = RecordBatch::try_new(schema.clone(), rows).unwrap();
                    append(t, vec![b], &[], &format!("writer-{i}"), 1)
                        .await
                        .unwrap();
                })
            })
            .collect();
        for w in writers {
            w.await.unwrap();
        }
        let log = dir.path().join("race/t/_delta_log");
        let mut creates = Vec::new();
        for e in std::fs::read_dir(&log).unwrap() {
            let p = e.unwrap().path();
            let json = p.extension().is_some_and(|x| x == "json");
            if json
                && std::fs::read_to_string(&p)
                    .unwrap()
                    .contains("\"metaData\"")
            {
                creates.push(p.file_name().unwrap().to_string_lossy().into_owned());
            }
        }
        assert_eq!(creates, vec!["00000000000000000000.json".to_string()]);
    }

    #[tokio::test]
    async fn checkpoints_keep_tombstones_for_the_configured_retention_only() {
        assert_eq!(
            tombstones_kept(std::time::Duration::from_secs(3600)).await,
            12
        );
        assert_eq!(tombstones_kept(std::time::Duration::ZERO).await, 0);
    }
}
