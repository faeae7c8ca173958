//! Deferred state commits of the always-on mode: durable per batch, committed to the
//! table one partition per poll.
//!
//! `kestrel stream --job stockout` over a million skus spent its polls rewriting
//! `gold/sku_availability`: a poll's ~2,000 events touch skus in every bucket, and the
//! MERGE rewrote every bucket's file — all million rows, every second. Alerts do not
//! depend on that table, so the stream now commits it less often:
//!
//! - Each batch writes the availability rows it computed (the touched skus' states) to
//!   `_kestrel/plans/job/<job>/<batch>.deferred.parquet`, put-if-absent, before its alerts
//!   commit, and adds them to the in-memory [`Pending`] rows the operator reads state
//!   from ahead of the table.
//! - After each poll one partition (bucket) is committed: the one pending longest, with
//!   the txn `<app>-part-<bucket>` = the last complete batch. So each poll rewrites one
//!   bucket (1/16 of the table), every bucket trails the alerts by at most 16 polls, and
//!   a stream that stops (or idles for 16 polls) leaves the table complete. Stopping
//!   commits whatever is pending at once, with the table's own app id.
//! - The table holds, for bucket `p`, the state after batch max(txn `<app>`, txn
//!   `<app>-part-<p>`). A marker, `_kestrel/plans/job/<job>/deferred.json`, says a stream
//!   defers since batch `since`; while it is there the deferred files from `since` on are
//!   kept by plan expiry, and whoever runs the job next — `kestrel run`, or the stream
//!   restarted after a kill — first [`catch_up`]s: the rows of the batches each bucket
//!   lacks, latest per sku, in one MERGE with the table's app id at the last complete
//!   batch; then the marker goes. Without a marker there is nothing to catch up (one GET).
//!
//! A kill at any point therefore loses nothing: every complete batch's states are in the
//! table or in its deferred file, and an incomplete batch is re-run from the state before
//! it (its deferred file, if written, holds the same states: the computation is the same).

use std::sync::Arc;

use arrow::array::{Array, RecordBatch};
use serde::{Deserialize, Serialize};
use tracing::info;

use crate::error::{Error, Result};
use crate::job::spec::JobSpec;
use crate::names;
use crate::operator::pending::{latest_per_key, DeferredOutput, Pending};
use crate::operator::{GoldRows, Write};
use crate::runlog;
use crate::sink::delta::{self, Warehouse};

use super::batch::JobRunner;

/// The marker of a stream that defers a job's state output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// The first batch whose state rows may be missing from the table.
    pub since: i64,
    pub started_at: String,
}

async fn read_marker(wh: &Warehouse, job: &str) -> Result<Option<Marker>> {
    crate::job::plan::read_json(wh, &names::key::job_deferred_marker(job)).await
}

/// The first batch whose deferred rows must be kept (None: nothing is deferred).
pub async fn keep_from(wh: &Warehouse, job: &str) -> Result<Option<i64>> {
    Ok(read_marker(wh, job).await?.map(|m| m.since))
}

/// Make batch `n`'s deferred rows durable (or leave the ones already there: a batch
/// re-run computes the same states).
pub async fn write_rows(wh: &Warehouse, job: &str, n: i64, rows: &RecordBatch) -> Result<()> {
    let mut buf = Vec::new();
    {
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, rows.schema(), None)?;
        w.write(rows)?;
        w.close()?;
    }
    wh.loc
        .put_if_absent(&names::key::job_deferred(job, n), buf)
        .await?;
    Ok(())
}

/// Batch `n`'s deferred rows; None when it wrote none (it ran before the stream).
pub async fn read_rows(wh: &Warehouse, job: &str, n: i64) -> Result<Option<RecordBatch>> {
    let Some(bytes) = wh.loc.get_opt(&names::key::job_deferred(job, n)).await? else {
        return Ok(None);
    };
    let reader =
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes)?.build()?;
    let schema = arrow::record_batch::RecordBatchReader::schema(&reader);
    let batches = reader.collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Some(arrow::compute::concat_batches(&schema, &batches)?))
}

/// Per partition, the batch the table holds its state after.
pub async fn positions(wh: &Warehouse, out: &DeferredOutput) -> Result<Vec<(i32, i64)>> {
    let Some(table) = wh.open(&out.table).await? else {
        return Ok(out.parts.clone().map(|p| (p, 0)).collect());
    };
    let all = delta::txn_version(&table, &out.app).await?.unwrap_or(0);
    let mut v = Vec::new();
    for p in out.parts.clone() {
        let own = delta::txn_version(&table, &out.part_app(p))
            .await?
            .unwrap_or(0);
        v.push((p, all.max(own)));
    }
    Ok(v)
}

/// `rows` (with `_op`) of `out` as a MERGE into its table committed with `app`.
fn gold_rows(out: &DeferredOutput, app: String, rows: RecordBatch) -> GoldRows {
    let fields: Vec<_> = rows
        .schema()
        .fields()
        .iter()
        .filter(|f| f.name() != crate::job::aggregate::OP)
        .cloned()
        .collect();
    GoldRows {
        table: out.table.clone(),
        app,
        keys: vec![(out.key.to_string(), false)],
        schema: Arc::new(arrow::datatypes::Schema::new(fields)),
        rows: vec![rows],
        partitions: vec![out.partition],
        cluster: None,
        extra_partitions: Vec::new(),
        write: Write::Merge,
    }
}

/// Bring `spec`'s deferred output up to its last complete batch if a stream left it
/// behind (see the module docs); returns the rows committed.
pub async fn catch_up(runner: &JobRunner, spec: &JobSpec) -> Result<usize> {
    let Some(out) = spec.operator.deferred_output(spec) else {
        return Ok(0);
    };
    let wh = runner.warehouse();
    let Some(marker) = read_marker(wh, &spec.name).await? else {
        return Ok(0);
    };
    let done = runlog::last_batch(wh, "job", &spec.name).await?;
    let pos = positions(wh, &out).await?;
    let from = pos
        .iter()
        .map(|(_, n)| *n)
        .min()
        .unwrap_or(done)
        .max(marker.since - 1);
    let mut picked = Vec::new();
    for n in from + 1..=done {
        let Some(rows) = read_rows(wh, &spec.name, n).await? else {
            return Err(Error::Plan {
                path: wh.loc.display(&names::key::job_deferred(&spec.name, n)),
                reason: format!(
                    "missing: batch {n} of the stream's deferred `{}` rows (the stream defers since batch {})",
                    out.table, marker.since
                ),
            });
        };
        // Only the partitions the table lacks batch `n` of.
        let part = crate::columns::int32(&rows, out.partition)?;
        let mask: arrow::array::BooleanArray = (0..rows.num_rows())
            .map(|i| {
                let p = part.is_valid(i).then(|| part.value(i));
                Some(pos.iter().any(|(q, at)| Some(*q) == p && *at < n))
            })
            .collect();
        let rows = arrow::compute::filter_record_batch(&rows, &mask)?;
        if rows.num_rows() > 0 {
            picked.push(rows);
        }
    }
    let mut committed = 0;
    if !picked.is_empty() {
        let rows = latest_per_key(&picked, out.key)?;
        committed = rows.num_rows();
        runner
            .merge_gold(spec, gold_rows(&out, out.app.clone(), rows), done)
            .await?;
        info!(job = %spec.name, table = %out.table, batch = done, rows = committed, from, "deferred state caught up");
    }
    wh.loc
        .delete_if_exists(&names::key::job_deferred_marker(&spec.name))
        .await?;
    Ok(committed)
}

/// A stream's deferral of `spec`'s state output, from its first batch on.
pub struct Deferral {
    pub pending: Arc<Pending>,
}

impl Deferral {
    /// Start deferring (after [`catch_up`]): the marker says so from the next batch on.
    pub async fn start(runner: &JobRunner, spec: &JobSpec) -> Result<Option<Deferral>> {
        let Some(out) = spec.operator.deferred_output(spec) else {
            return Ok(None);
        };
        let wh = runner.warehouse();
        let done = runlog::last_batch(wh, "job", &spec.name).await?;
        let marker = Marker {
            since: done + 1,
            started_at: chrono::Utc::now().to_rfc3339(),
        };
        wh.loc
            .put(
                &names::key::job_deferred_marker(&spec.name),
                serde_json::to_vec_pretty(&marker)?,
            )
            .await?;
        Ok(Some(Deferral {
            pending: Arc::new(Pending::new(out, done)),
        }))
    }

    /// Commit the partition pending longest; returns (partition, rows) when one was.
    pub async fn commit_oldest(
        &self,
        runner: &JobRunner,
        spec: &JobSpec,
    ) -> Result<Option<(i32, usize)>> {
        let Some((p, rows, upto)) = self.pending.oldest()? else {
            return Ok(None);
        };
        let out = self.pending.output();
        let n = rows.num_rows();
        runner
            .merge_gold(spec, gold_rows(out, out.part_app(p), rows), upto)
            .await?;
        self.pending.committed(p);
        Ok(Some((p, n)))
    }

    /// Commit everything pending (the stream stops) and drop the marker; returns the rows.
    pub async fn finish(&self, runner: &JobRunner, spec: &JobSpec) -> Result<usize> {
        let (rows, upto) = self.pending.all()?;
        let out = self.pending.output();
        let mut n = 0;
        if let Some(rows) = rows {
            n = rows.num_rows();
            runner
                .merge_gold(spec, gold_rows(out, out.app.clone(), rows), upto)
                .await?;
        }
        self.pending.committed_all();
        runner
            .warehouse()
            .loc
            .delete_if_exists(&names::key::job_deferred_marker(&spec.name))
            .await?;
        Ok(n)
    }
}
