//! The read port whose sessions execute on a Ballista cluster.
//!
//! Ballista cannot ship delta-rs's table provider (its scan has no codec), so a Delta
//! table is registered as what its current snapshot says it is: the active Parquet
//! files, one listing per partition, each with its partition values as typed literals
//! (delta-rs does not write partition columns into the files), all of them one
//! `UNION ALL` view. A filter on a partition column folds to `true`/`false` per branch,
//! so a read of two event dates plans the files of those two dates only; filters on
//! other columns prune row groups on the executors as they do locally.
//!
//! Files with deletion vectors, and tables with column mapping or type widening, cannot
//! be read as plain Parquet: such a table is read in this process (one log line) and
//! its rows join the remote plan as an in-memory table ([`super::codec`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::datatypes::{Field, Schema, SchemaRef};
use async_trait::async_trait;
use ballista_core::extension::{SessionConfigExt, SessionStateExt};
use datafusion::catalog::TableProvider;
use datafusion::common::ScalarValue;
use datafusion::datasource::empty::EmptyTable;
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{col, lit, DataFrame, Expr, ParquetReadOptions, SessionContext};
use deltalake::DeltaTable;

use crate::error::{Error, Result};
use crate::operator::port::ReadPort;
use crate::sink::delta::{self, Warehouse};

/// The warehouse's tables, read on the cluster behind `scheduler` (`http://host:port`).
#[derive(Debug, Clone)]
pub struct ClusterPort {
    wh: Warehouse,
    scheduler: String,
    job_timeout: Option<std::time::Duration>,
    lost: super::deadline::Lost,
}

impl ClusterPort {
    /// Reads of `wh`'s tables planned and run by the scheduler at `scheduler`
    /// (`http://host:port`, see [`super::connect`]), each job bounded by `job_timeout`
    /// ([`super::deadline`]).
    pub fn new(wh: Warehouse, scheduler: String, job_timeout: Option<std::time::Duration>) -> Self {
        ClusterPort {
            wh,
            scheduler,
            job_timeout,
            lost: Default::default(),
        }
    }

    /// Start a run: forget that a job of an earlier run timed out
    /// ([`super::deadline::Lost`]).
    pub fn new_run(&self) {
        self.lost.clear();
    }

    /// The scheduler's address.
    pub fn scheduler(&self) -> &str {
        &self.scheduler
    }
}

/// One active file of a snapshot: its URL and its partition values, in the order of
/// the table's partition columns.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveFile {
    pub url: String,
    pub partition: Vec<ScalarValue>,
}

/// What a cluster needs to read a Delta table: its schema, partition columns and
/// active files; or why it cannot (read it locally instead).
#[derive(Debug)]
pub enum Listing {
    Files {
        schema: SchemaRef,
        partition_columns: Vec<String>,
        files: Vec<ActiveFile>,
    },
    Unsupported(String),
}

/// The active files of `table`'s current snapshot, with typed partition values, as
/// URLs under `root` (the table's URL as other processes reach it: `file://` or
/// `s3://`).
pub fn listing(table: &DeltaTable, root: &url::Url) -> Result<Listing> {
    let url = table.table_url().to_string();
    let snap = table.snapshot().map_err(|e| Error::delta(&url, e))?;
    if let Some(why) = delta::unsupported_layout(snap) {
        return Ok(Listing::Unsupported(why));
    }
    let schema = snap.snapshot().arrow_schema();
    let partition_columns = snap.metadata().partition_columns().to_vec();
    let types = partition_columns
        .iter()
        .map(|c| {
            schema
                .field_with_name(c)
                .map(|f| f.data_type().clone())
                .map_err(|e| Error::query(format!("partition column {c} of {url}"), e.into()))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut files = Vec::new();
    for f in snap.log_data().iter() {
        if f.deletion_vector_descriptor().is_some() {
            return Ok(Listing::Unsupported("deletion vectors".into()));
        }
        let partition = delta::file_partition_values(&f, &partition_columns, &types)
            .map_err(|e| Error::query(format!("partition values of {url}"), e))?;
        files.push(ActiveFile {
            url: file_url(root, &f.object_store_path())?,
            partition,
        });
    }
    Ok(Listing::Files {
        schema,
        partition_columns,
        files,
    })
}

/// The URL of the file at `path` under the table at `root` that names the same object
/// again when DataFusion turns it back into a path: each part of `path` is taken as
/// object_store holds it (a partition value's `:` is `%3A` there) and percent-encoded as
/// a URL path segment (that `%` becomes `%25`). Pasting the path's text into the URL
/// would name another object, which a listing reads as an empty partition, silently.
fn file_url(root: &url::Url, path: &object_store::path::Path) -> Result<String> {
    let mut url = root.clone();
    {
        let mut segments = url.path_segments_mut().map_err(|_| Error::Location {
            url: root.to_string(),
            reason: "not a hierarchical URL".into(),
        })?;
        segments.pop_if_empty();
        for part in path.parts() {
            segments.push(part.as_ref());
        }
    }
    Ok(url.to_string())
}

/// The table of `listing` as one plan in `ctx`: a listing of each partition's files
/// with its values as literals, `UNION ALL`; an empty table when there are no files.
pub async fn table_plan(
    ctx: &SessionContext,
    schema: &SchemaRef,
    partition_columns: &[String],
    files: Vec<ActiveFile>,
    what: &str,
) -> Result<Arc<dyn TableProvider>> {
    let file_fields: Vec<Field> = schema
        .fields()
        .iter()
        .filter(|f| !partition_columns.contains(f.name()))
        .map(|f| f.as_ref().clone())
        .collect();
    let file_schema = Schema::new(file_fields);
    let mut groups: BTreeMap<String, (Vec<ScalarValue>, Vec<String>)> = BTreeMap::new();
    for f in files {
        let key = format!("{:?}", f.partition);
        groups
            .entry(key)
            .or_insert_with(|| (f.partition.clone(), Vec::new()))
            .1
            .push(f.url);
    }
    let mut plan: Option<DataFrame> = None;
    for (_, (values, urls)) in groups {
        let opts = ParquetReadOptions::default().schema(&file_schema);
        let df = ctx
            .read_parquet(urls, opts)
            .await
            .map_err(|e| Error::query(what, e))?;
        let exprs: Vec<Expr> = schema
            .fields()
            .iter()
            .map(
                |f| match partition_columns.iter().position(|c| c == f.name()) {
                    Some(i) => lit(values[i].clone()).alias(f.name()),
                    None => col(format!("\"{}\"", f.name())),
                },
            )
            .collect();
        let df = df.select(exprs).map_err(|e| Error::query(what, e))?;
        plan = Some(match plan {
            None => df,
            Some(p) => p.union(df).map_err(|e| Error::query(what, e))?,
        });
    }
    Ok(match plan {
        Some(p) => p.into_view(),
        None => Arc::new(EmptyTable::new(schema.clone())),
    })
}

#[async_trait]
impl ReadPort for ClusterPort {
    async fn register(&self, ctx: &SessionContext, path: &str, alias: &str) -> Result<bool> {
        let Some(table) = self.wh.open(path).await? else {
            return Ok(false);
        };
        let root = self.wh.loc.child_url(path)?;
        let what = format!("plan {path} for the cluster");
        let provider = match listing(&table, &root)? {
            Listing::Files {
                schema,
                partition_columns,
                files,
            } => table_plan(ctx, &schema, &partition_columns, files, &what).await?,
            Listing::Unsupported(why) => {
                tracing::warn!(
                    table = path,
                    feature = %why,
                    "the cluster cannot read this table as Parquet; reading it in this process"
                );
                let local = delta::session_with(&table, "t").await?;
                let df = local.table("t").await.map_err(|e| Error::query(&what, e))?;
                let schema = Arc::new(df.schema().as_arrow().clone());
                let rows = df.collect().await.map_err(|e| Error::query(&what, e))?;
                Arc::new(MemTable::try_new(schema, vec![rows]).map_err(|e| Error::query(&what, e))?)
            }
        };
        ctx.register_table(alias, provider)
            .map_err(|e| Error::query(&what, e))?;
        Ok(true)
    }

    /// A session configured as every kestrel read ([`delta::session_config`]) whose
    /// plans the scheduler runs, with kestrel's codec.
    fn session(&self) -> SessionContext {
        cluster_session(&self.scheduler, self.job_timeout, &self.lost)
    }
}

/// A session whose plans the scheduler at `scheduler` (`http://host:port`) runs,
/// configured as every kestrel read, with kestrel's codecs; each of its jobs fails once
/// it has run for `job_timeout` ([`super::deadline`]).
pub fn cluster_session(
    scheduler: &str,
    job_timeout: Option<std::time::Duration>,
    lost: &super::deadline::Lost,
) -> SessionContext {
    let config = delta::session_config()
        .upgrade_for_ballista()
        .with_ballista_logical_extension_codec(super::codec::logical())
        .with_ballista_physical_extension_codec(super::codec::physical());
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .build();
    match state.clone().upgrade_for_ballista(scheduler.to_string()) {
        Ok(s) => match job_timeout {
            Some(t) => {
                let planner = super::deadline::DeadlinePlanner::new(
                    s.query_planner().clone(),
                    t,
                    lost.clone(),
                );
                let s = SessionStateBuilder::new_from_existing(s)
                    .with_query_planner(Arc::new(planner))
                    .build();
                SessionContext::new_with_state(s)
            }
            None => SessionContext::new_with_state(s),
        },
        Err(e) => {
            // Only a malformed configuration fails here, and connect() checked it.
            tracing::error!(error = %e, "cannot configure a cluster session; reading locally");
            SessionContext::new_with_state(state)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Location;
    use arrow::array::{Date32Array, Int64Array, RecordBatch, TimestampMicrosecondArray};
    use arrow::datatypes::{DataType, TimeUnit};

    async fn rows(ctx: &SessionContext, sql: &str) -> Vec<String> {
        let b = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let text = arrow::util::pretty::pretty_format_batches(&b).unwrap();
        text.to_string().lines().map(str::to_string).collect()
    }

    /// A Delta table registered as its snapshot's files (what the cluster reads) holds
    /// the rows the Delta provider reads: typed date and timestamp partition values and
    /// a null partition; a partition filter reads the same; a table without files is an
    /// empty table of its schema.
    #[tokio::test]
    async fn a_snapshot_as_parquet_listings_reads_like_the_delta_table() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::open(dir.path().to_str().unwrap(), &Default::default(), true).unwrap();
        let wh = Warehouse::new(loc);
        let ts = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, false),
            Field::new("event_date", DataType::Date32, false),
            Field::new("hour", ts, true),
        ]));
        let parts = ["event_date", "hour"];
        let mut t = wh.open_or_create("t", &schema, &parts).await.unwrap();
        let hour = 20_000i64 * 86_400_000_000 + 3_600_000_000;
        for v in 0..3i64 {
            let b = RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from(vec![v, v + 10, v + 20])),
                    Arc::new(Date32Array::from(vec![20_000, 20_000 + v as i32, 20_001])),
                    Arc::new(
                        TimestampMicrosecondArray::from(vec![Some(hour), None, Some(hour)])
                            .with_timezone("UTC"),
                    ),
                ],
            )
            .unwrap();
            t = delta::append(t, vec![b], &parts, "w", v + 1).await.unwrap();
        }
        let delta_ctx = delta::session_with(&t, "t").await.unwrap();
        let root = wh.loc.child_url("t").unwrap();
        let Listing::Files {
            schema: s,
            partition_columns,
            files,
        } = listing(&t, &root).unwrap()
        else {
            panic!("a plain Delta table is listed");
        };
        assert_eq!(partition_columns, ["event_date", "hour"]);
        assert!(
            files.iter().all(|f| f.url.starts_with("file://")),
            "{files:?}"
        );
        let ctx = SessionContext::new();
        let plan = table_plan(&ctx, &s, &partition_columns, files, "t")
            .await
            .unwrap();
        ctx.register_table("t", plan).unwrap();
        for sql in [
            "SELECT n, event_date, hour FROM t ORDER BY n",
            "SELECT n, hour FROM t WHERE event_date = DATE '2024-10-04' ORDER BY n",
            "SELECT count(*) FROM t WHERE hour IS NULL",
        ] {
            let got = rows(&ctx, sql).await;
            assert!(got.len() > 4, "{sql}: {got:?}");
            assert_eq!(got, rows(&delta_ctx, sql).await, "{sql}");
        }

        let empty = wh.open_or_create("e", &schema, &parts).await.unwrap();
        let Listing::Files { schema, files, .. } = listing(&empty, &root).unwrap() else {
            panic!("listed");
        };
        assert!(files.is_empty());
        let plan = table_plan(&ctx, &schema, &partition_columns, files, "e")
            .await
            .unwrap();
        ctx.register_table("e", plan).unwrap();
        assert_eq!(rows(&ctx, "SELECT count(*) AS n FROM e").await[3], "| 0 |");
    }
}
