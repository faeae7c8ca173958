//! The operator contract: what a job's operator declares about itself and the two
//! things it computes — one micro-batch from its state, and one day's restatement for a
//! backfill. The runner (`runner::batch`, `runner::backfill`) owns the protocol around
//! them (plans, durable results, late side output, MERGEs, the run log, leases) and is
//! the same for every operator. An operator reads only through its [`Context`] (the
//! [`port::ReadPort`] — Delta tables in the warehouse, or tables in memory in tests —,
//! the source schemas and the clock) and writes nothing: it returns the rows to commit.
//!
//! One module per operator, each holding its `[params]` parser, its batch compute, its
//! state handling, its restatement and its metrics, with its pure logic over Arrow
//! batches beside it:
//! - [`windowed`]: the declarative windowed aggregates (tumbling, sliding, session); its
//!   pure window assignment and aggregation is `job::aggregate`, which also holds the
//!   column helpers the other operators and the runner share;
//! - [`payments`]: order/payment matching (`payments_fast`, `payment_reconciliation`),
//!   pure logic in `payments::matching`;
//! - [`stockout`]: stock-out alerts and availability, pure logic in `stockout::detect`,
//!   which `kestrel stream` runs always-on over the same code;
//! - [`select`]: a filtered projection of one source;
//! - [`mirror`]: a change-data-capture source kept as a table (and its history), pure
//!   logic in `mirror::apply`.
//!
//! [`REGISTRY`] maps the name a job file gives (`operator = "…"`) to its parser; a file
//! without one is a declarative windowed aggregate. Adding an operator: a module here
//! implementing [`Operator`] with its `[params]` parser, and one line in [`REGISTRY`].

pub mod budget;
pub mod fresh;
pub mod metrics;
pub mod mirror;
pub mod payments;
pub mod pending;
pub mod port;
pub mod prefetch;
pub mod read;
pub mod select;
pub mod stockout;
pub mod windowed;

#[cfg(test)]
pub(crate) mod testing;

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::common::ScalarValue;
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;

use crate::error::{Error, Result};
use crate::job::plan::{JobPlan, JobResult, JobState};
use crate::job::spec::{Fields, JobSpec};
use crate::names;
use crate::schema::SourceSchema;
use crate::time::clock::Clock;
use crate::time::Micros;
pub use metrics::Metrics;
use port::ReadPort;

/// One table an operator writes, and the txn app id its commits carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub table: String,
    pub app: String,
}

/// A job's operator, holding its parsed `[params]`.
#[async_trait]
pub trait Operator: std::fmt::Debug + Send + Sync {
    /// Gold tables written after the job's own `[sink] table`, in commit order (the last
    /// commit of a batch completes it).
    fn more_outputs(&self, _spec: &JobSpec) -> Vec<Output> {
        Vec::new()
    }

    /// Why a backfill has nothing to restate for this operator (None: it restates days).
    fn no_days(&self) -> Option<&'static str> {
        None
    }

    /// The columns of `source`'s new rows (of bronze schema `bronze`) this operator's
    /// batches read, when it knows them before its first batch (None: learnt from that
    /// batch's read). A run then holds the batches it hands over to its jobs with those
    /// columns only from the first ([`fresh::FreshRows::want`]).
    fn new_row_columns(
        &self,
        _spec: &JobSpec,
        _source: &str,
        _bronze: &arrow::datatypes::Schema,
    ) -> Option<Vec<String>> {
        None
    }

    /// Whether `kestrel stream` can run the job always-on.
    fn can_stream(&self) -> bool {
        false
    }

    /// The output (one of [`Operator::more_outputs`]) holding the operator's state,
    /// which the always-on mode commits less often than its batches run (see
    /// [`pending`]); the operator then reads state from [`Context::pending_rows`] first.
    fn deferred_output(&self, _spec: &JobSpec) -> Option<pending::DeferredOutput> {
        None
    }

    /// The gold merge keys: `given` (`[sink] merge_keys`, never empty) checked, or the
    /// operator's default; Err names what `merge_keys` must be.
    fn merge_keys(&self, given: Option<Vec<String>>) -> std::result::Result<Vec<String>, String>;

    /// Compute batch `plan` from the state `before` it: new rows, watermark, touched
    /// output rows, too-late rows, the state after it and the batch's metrics.
    async fn process(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        plan: &JobPlan,
        before: JobState,
    ) -> Result<Computed>;

    /// The job's gold rows of `day`, recomputed from everything it consumed.
    async fn restate(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        day: i32,
        input: &DayInput,
    ) -> Result<Restated>;

    /// The operator as `Any`, for tests that look at what was parsed.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Parses one operator's `[params]` (and checks its sources) from a job file.
pub(crate) type Parse =
    fn(&Fields<'_>, &[String], &BTreeMap<String, Arc<SourceSchema>>) -> Result<Arc<dyn Operator>>;

/// The registry: the operators a job file names with `operator = "…"`, and their
/// parsers. A file without `operator` is a declarative windowed aggregate
/// ([`windowed::parse`]).
pub(crate) const REGISTRY: &[(&str, Parse)] = &[
    ("payments_fast", payments::parse_fast),
    ("payment_reconciliation", payments::parse_reconciliation),
    ("stockout", stockout::parse),
    ("select", select::parse),
    ("mirror", mirror::parse),
];

/// The names [`REGISTRY`] knows, in its order.
pub fn names() -> Vec<&'static str> {
    REGISTRY.iter().map(|(n, _)| *n).collect()
}

/// Parse the `[params]` (and check the sources) of the operator a job file names.
pub(crate) fn parse(
    name: &str,
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    match REGISTRY.iter().find(|(n, _)| *n == name) {
        Some((_, parse)) => parse(top, sources, schemas),
        None => Err(top.err(
            "operator",
            format!("one of {}, got {name:?}", names().join(", ")),
        )),
    }
}

/// The merge keys of an operator whose gold rows have a natural key (`whose`, for the
/// message): `[sink] merge_keys` must name exactly `natural`, and must be given.
pub(crate) fn natural_keys(
    given: Option<Vec<String>>,
    natural: &[&str],
    whose: &str,
) -> std::result::Result<Vec<String>, String> {
    match given {
        Some(k) if k != natural => Err(format!("{natural:?} ({whose}), got {k:?}")),
        Some(k) => Ok(k),
        None => Err("the operator's natural key columns".into()),
    }
}

/// What an operator computes with: the tables it reads, the source schemas, the clock.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    pub port: &'a dyn ReadPort,
    pub schemas: &'a BTreeMap<String, Arc<SourceSchema>>,
    pub clock: &'a Clock,
    /// Rows of the deferred output not committed yet (always-on mode only).
    pub pending: Option<&'a pending::Pending>,
    /// The process's recompute budget (none: unbounded), see [`budget`].
    pub budget: Option<&'a budget::RowBudget>,
    /// New rows this process's ingestion just committed (none: read bronze), see
    /// [`fresh`].
    pub fresh: Option<&'a fresh::FreshRows>,
    /// The job's read-ahead of its next batch's new rows (none: no read-ahead), see
    /// [`prefetch`].
    pub prefetch: Option<&'a prefetch::Prefetch>,
}

impl<'a> Context<'a> {
    pub fn new(
        port: &'a dyn ReadPort,
        schemas: &'a BTreeMap<String, Arc<SourceSchema>>,
        clock: &'a Clock,
    ) -> Self {
        Context {
            port,
            schemas,
            clock,
            pending: None,
            budget: None,
            fresh: None,
            prefetch: None,
        }
    }

    /// The same, taking new rows `fresh` holds from it instead of bronze.
    pub fn with_fresh(mut self, fresh: Option<&'a fresh::FreshRows>) -> Self {
        self.fresh = fresh;
        self
    }

    /// The same, reading the next batch's new rows ahead with `prefetch`.
    pub fn with_prefetch(mut self, prefetch: Option<&'a prefetch::Prefetch>) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Start reading the next batch's new rows ahead, once this batch's own reads are
    /// done (see [`prefetch`]).
    pub fn read_ahead(&self) {
        if let Some(p) = self.prefetch {
            p.launch();
        }
    }

    /// Where a batch's new rows may be before a bronze read: held by this process's
    /// ingestion (see [`fresh`]), or read ahead (see [`prefetch`]).
    pub fn given_rows(&self) -> read::Given<'a> {
        read::Given {
            fresh: self.fresh,
            prefetch: self.prefetch,
        }
    }

    /// The same, recomputing within `budget`.
    pub fn with_budget(mut self, budget: &'a budget::RowBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Hold `rows` of the recompute budget (see [`budget`]) until the result is dropped.
    pub async fn hold(&self, rows: usize) -> Option<budget::Held<'a>> {
        match self.budget {
            Some(b) => Some(b.hold(rows).await),
            None => None,
        }
    }

    /// The same, with `pending` rows of the deferred output ahead of its table.
    pub fn with_pending(mut self, pending: Option<&'a pending::Pending>) -> Self {
        self.pending = pending;
        self
    }

    /// The latest rows of `keys` in `table` not committed to it yet (None: none, or
    /// `table` is not deferred): they supersede the table's rows of those keys.
    pub fn pending_rows(
        &self,
        table: &str,
        keys: &std::collections::HashSet<&str>,
    ) -> Result<Option<RecordBatch>> {
        match self.pending {
            Some(p) if p.output().table == table => p.rows_for(keys),
            _ => Ok(None),
        }
    }

    /// Processing time now, in microseconds.
    pub fn now_us(&self) -> Micros {
        self.clock.now_us()
    }

    pub fn source_schema(&self, source: &str) -> Result<&'a Arc<SourceSchema>> {
        self.schemas
            .get(source)
            .ok_or_else(|| Error::NoSchema(source.to_string()))
    }

    /// Table `path` alone in a new session as `alias`; None when it does not exist yet.
    pub async fn open(&self, path: &str, alias: &str) -> Result<Option<SessionContext>> {
        port::open(self.port, path, alias).await
    }

    /// A session with every source's bronze table as [`read::session_table`] (an empty
    /// table for a source that has no bronze yet).
    pub async fn sources_session(&self, spec: &JobSpec) -> Result<SessionContext> {
        let ctx = self.port.session();
        for s in &spec.sources {
            let alias = read::session_table(s);
            if !self
                .port
                .register(&ctx, &names::table::bronze(s), &alias)
                .await?
            {
                let schema = self.source_schema(s)?.bronze.clone();
                let empty = MemTable::try_new(schema, vec![vec![]])
                    .map_err(|e| Error::query("empty bronze table", e))?;
                ctx.register_table(alias, Arc::new(empty))
                    .map_err(|e| Error::query("empty bronze table", e))?;
            }
        }
        Ok(ctx)
    }

    /// A gold output to the job's own table (`[sink] table`, keys `merge_keys`).
    pub(crate) fn gold_output(
        &self,
        spec: &JobSpec,
        schema: SchemaRef,
        rows: Vec<RecordBatch>,
        partitions: &[&'static str],
        extra_partitions: Vec<Vec<ScalarValue>>,
    ) -> GoldRows {
        let keys = spec
            .merge_keys
            .iter()
            .map(|k| {
                // `=` for keys that cannot be null: MERGE then joins on every key; with
                // `IS NOT DISTINCT FROM` DataFusion hashes only the non-null-safe ones and
                // compares the rest pairwise (seconds per batch for a sliding window).
                let nullable = self
                    .source_schema(&spec.sources[0])
                    .is_ok_and(|s| s.may_be_null(k));
                (k.clone(), nullable)
            })
            .collect();
        GoldRows {
            table: spec.table.clone(),
            app: names::app::job(&spec.name),
            keys,
            schema,
            rows,
            partitions: partitions.to_vec(),
            cluster: partitions
                .iter()
                .copied()
                .find(|p| crate::sink::cluster::COLUMNS.contains(p)),
            extra_partitions,
            write: Write::Merge,
        }
    }
}

/// A computed batch: its durable result and the rows to commit.
pub struct Computed {
    pub(crate) result: JobResult,
    pub(crate) late: Option<RecordBatch>,
    /// Gold MERGEs, committed in this order; the last one completes the batch's gold.
    pub(crate) gold: Vec<GoldRows>,
}

impl Computed {
    /// The batch `plan` computed: its durable result (state after it, counts) and the
    /// rows to commit.
    pub(crate) fn new(
        plan: &JobPlan,
        state: JobState,
        metrics: &impl Metrics,
        late: Option<RecordBatch>,
        gold: Vec<GoldRows>,
    ) -> Result<Self> {
        Ok(Computed {
            result: JobResult {
                job: plan.job.clone(),
                batch_id: plan.batch_id,
                state,
                counts: metrics.counts(),
                metrics: metrics::named(metrics)?,
            },
            late,
            gold,
        })
    }
}

/// Merge-source rows for one gold table.
#[derive(Clone)]
pub struct GoldRows {
    pub(crate) table: String,
    /// Application id of the table's commits (txn version = job batch).
    pub(crate) app: String,
    /// Key columns and whether each is nullable.
    pub(crate) keys: Vec<(String, bool)>,
    /// The gold table's schema (the rows add `_op`).
    pub(crate) schema: SchemaRef,
    pub(crate) rows: Vec<RecordBatch>,
    /// Columns whose values locate the rows (a date and its hour, or an integer bucket):
    /// the table's partition columns and its clustering column (`cluster`); a table
    /// created by an earlier release may have fewer, or its hour as a partition column.
    pub(crate) partitions: Vec<&'static str>,
    /// The column of `partitions` a new table clusters its files by instead of
    /// partitioning by it ([`crate::sink::cluster`]); None once the table is found to partition by it.
    pub(crate) cluster: Option<&'static str>,
    /// Per partition column, values the MERGE must read besides those the rows go to
    /// (where rows that moved or are deleted may sit now); may be shorter than
    /// `partitions`.
    pub(crate) extra_partitions: Vec<Vec<ScalarValue>>,
    /// How the rows reach the table.
    pub(crate) write: Write,
}

impl GoldRows {
    /// The partition columns of a new table: `partitions` without the clustering column.
    pub(crate) fn table_partitions(&self) -> Vec<&'static str> {
        self.partitions
            .iter()
            .copied()
            .filter(|p| Some(*p) != self.cluster)
            .collect()
    }
}

/// How a batch's rows reach their table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// MERGE by the keys: upserts and tombstones (`_op`).
    Merge,
    /// Every row is an upsert of a key the table does not hold (the operator read the
    /// existing rows): append instead of MERGE, which reads no target file.
    Append,
    /// The rows are the whole table now (a state snapshot such as the open sessions):
    /// overwrite it — committed every batch, also with no rows.
    Replace,
}

/// What a day's recompute reads: the job's state after its last batch, and sessions
/// over every source's bronze (`bronze_<source>`) and the job's late ledger (`late`).
pub struct DayInput {
    pub(crate) watermark: Option<Micros>,
    pub(crate) positions: BTreeMap<String, i64>,
    pub(crate) as_of_batch: i64,
    pub(crate) ctx: SessionContext,
    pub(crate) late: Option<SessionContext>,
}

impl DayInput {
    pub(crate) fn position(&self, source: &str) -> i64 {
        self.positions.get(source).copied().unwrap_or(0)
    }
}

/// A day's recomputed gold rows (merge schema, all upserts, all in the day's partition).
pub struct Restated {
    pub(crate) rows: RecordBatch,
    pub(crate) gold_schema: SchemaRef,
    /// Columns that identify a row (the merge keys).
    pub(crate) ident: Vec<String>,
    /// The date partition column (a day's rows are those of `partition = day`)…
    pub(crate) partition: &'static str,
    /// …and every partition column a new table gets.
    pub(crate) partitions: &'static [&'static str],
    pub(crate) with_too_late: Vec<String>,
}

impl JobSpec {
    /// The gold tables this job writes, in the order a batch commits them.
    pub fn outputs(&self) -> Vec<Output> {
        let mut out = vec![Output {
            table: self.table.clone(),
            app: names::app::job(&self.name),
        }];
        out.extend(self.operator.more_outputs(self));
        out
    }

    /// The output whose commit of batch `n` completes the batch's gold writes.
    pub fn completing_output(&self) -> Output {
        let mut out = self.outputs();
        // `outputs` always holds the job's own table.
        out.pop().unwrap_or_else(|| Output {
            table: self.table.clone(),
            app: names::app::job(&self.name),
        })
    }

    /// Every table the job's batches write: its outputs and its late ledger.
    pub fn tables(&self) -> Vec<String> {
        let mut t: Vec<String> = self.outputs().into_iter().map(|o| o.table).collect();
        t.push(names::table::late(&self.name));
        t
    }

    /// Whether `kestrel stream` can run this job always-on (the same operator code over
    /// a poll's rows).
    pub fn can_stream(&self) -> bool {
        self.operator.can_stream()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The shipped jobs: stock-out writes alerts then availability (the second commit
    /// completes its batch) and is the one that streams; the others write one table.
    #[tokio::test]
    async fn shipped_jobs_declare_their_outputs() {
        let schemas = crate::schema::load_all(Path::new("/none")).unwrap();
        let jobs = crate::job::spec::load_all(Path::new("/none"), &schemas)
            .await
            .unwrap();
        let so = &jobs["stockout"];
        let tables: Vec<String> = so.outputs().into_iter().map(|o| o.table).collect();
        assert_eq!(tables, ["gold/stockout_alerts", "gold/sku_availability"]);
        assert_eq!(
            so.completing_output().app,
            "kestrel-job-stockout-availability"
        );
        assert!(so.can_stream());
        assert_eq!(so.tables().last().unwrap(), "late/stockout");
        let r = &jobs["revenue_5m"];
        assert_eq!(r.outputs().len(), 1);
        assert_eq!(r.completing_output().table, "gold/revenue_5m");
        assert_eq!(r.completing_output().app, "kestrel-job-revenue_5m");
        assert!(!r.can_stream() && !jobs["payments_fast"].can_stream());
    }

    /// A natural key is checked and named as before the operators shared the check.
    #[test]
    fn natural_keys_are_required_and_checked() {
        let k = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            super::natural_keys(k(&["sku", "minute"]), &["sku", "minute"], "the alerts' key"),
            Ok(vec!["sku".to_string(), "minute".to_string()])
        );
        assert_eq!(
            super::natural_keys(k(&["sku"]), &["sku", "minute"], "the alerts' key"),
            Err(r#"["sku", "minute"] (the alerts' key), got ["sku"]"#.to_string())
        );
        assert_eq!(
            super::natural_keys(None, &["order_id"], "the payments operators' key"),
            Err("the operator's natural key columns".to_string())
        );
    }
}
