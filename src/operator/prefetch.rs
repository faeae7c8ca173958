//! The next job batch's new rows, read from bronze while the batch before computes.
//!
//! A job batch starts by reading its new rows — the bronze rows of the ingestion batch
//! it consumes ([`super::read::take_new_rows`]) — and then computes mostly on one core
//! (key encoding, window assignment, the MERGE). When a run works through several
//! ingestion batches of a source (a backlog, a catch-up, the throughput benchmark's
//! 5M events in four batches), each job batch consumes the next one, so the read of
//! batch k+1's new rows can start as soon as batch k has its own and run on the other
//! core while batch k computes.
//!
//! It is the same read, and gives the same rows:
//! - the same plan: rows of `_batch_id` in `(k, k+1]`, the columns batch k+1 asks for,
//!   from the same table of the same kind of session; a prefetch is taken only by a read
//!   naming exactly that source, table, range and schema, anything else reads bronze;
//! - a completed ingestion batch's bronze rows never change: they are committed before
//!   its run-log entry, which is what makes a job plan it, and a compaction rewrites files
//!   with the same rows. Only the order of the rows may differ between two reads, as it
//!   already may between two scans of several files; nothing a job computes depends on it;
//! - only the next batch is read ahead, and only when the run has already seen that
//!   ingestion batch completed ([`Prefetch::new`]: the positions the job's batches are
//!   planned from), and not when this process holds its rows in memory
//!   ([`super::fresh`]): those need no read.
//!
//! `KESTREL_NEW_ROWS=bronze` ([`super::fresh::ENV`]) turns it off with the handover:
//! every job batch then reads its new rows from bronze when it runs.
//!
//! A prefetch that is not taken (the run stopped, a batch failed, the plan differed) is
//! cancelled when the job's batches end. It holds one batch of the job's input columns
//! (≈ 50 MB for 1.4M orders) beside the batch computing. The always-on stream, whose
//! next batch has not landed yet, and a cluster's reads do not prefetch.

use std::collections::BTreeMap;
use std::sync::Mutex;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::prelude::SessionContext;
use futures::future::BoxFuture;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::job::plan::Input;

/// Which read a prefetch is.
#[derive(Debug, Clone, PartialEq)]
struct Key {
    source: String,
    table: String,
    after: i64,
    upto: i64,
    target: SchemaRef,
}

/// A read ahead: planned, or running.
enum Ahead {
    Planned(BoxFuture<'static, Result<RecordBatch>>),
    Running(JoinHandle<Result<RecordBatch>>),
}

/// One job's read-ahead of its next batch's new rows (one per run of its batches).
pub struct Prefetch {
    /// Per source, the last completed ingestion batch the job's batches may consume.
    ingested: Mutex<BTreeMap<String, i64>>,
    started: Mutex<Vec<(Key, Ahead)>>,
}

/// Whether job batches read ahead (unless [`super::fresh::ENV`] says `bronze`).
pub fn enabled() -> bool {
    !std::env::var(super::fresh::ENV).is_ok_and(|v| v.eq_ignore_ascii_case("bronze"))
}

impl Prefetch {
    /// A read-ahead within the completed ingestion batches `ingested` (per source).
    pub fn new(ingested: BTreeMap<String, i64>) -> Self {
        Prefetch {
            ingested: Mutex::new(ingested),
            started: Mutex::new(Vec::new()),
        }
    }

    /// `source` completed ingestion batch `batch` since the job's batches started (a job
    /// following its source's ingestion: [`crate::runner::follow`]).
    pub fn completed(&self, source: &str, batch: i64) {
        if let Ok(mut i) = self.ingested.lock() {
            let at = i.entry(source.to_string()).or_insert(batch);
            *at = (*at).max(batch);
        }
    }

    /// The rows of the read `(source, table, input, target)` when it was started ahead:
    /// None when it was not (read them now).
    pub async fn take(
        &self,
        source: &str,
        table: &str,
        input: &Input,
        target: &SchemaRef,
    ) -> Option<Result<RecordBatch>> {
        let key = Key {
            source: source.to_string(),
            table: table.to_string(),
            after: input.after_batch,
            upto: input.upto_batch,
            target: target.clone(),
        };
        let ahead = {
            let mut started = self.started.lock().ok()?;
            let at = started.iter().position(|(k, _)| *k == key)?;
            started.swap_remove(at).1
        };
        Some(match ahead {
            // Never launched: read now.
            Ahead::Planned(read) => read.await,
            Ahead::Running(handle) => handle.await.unwrap_or_else(|source| {
                Err(Error::Task {
                    what: format!("read ahead of {}'s new rows", key.source),
                    source,
                })
            }),
        })
    }

    /// Start the reads planned ahead ([`Prefetch::plan_next`]). An operator calls it once
    /// its batch's own reads are done, so that the read ahead does not compete with them
    /// but with the batch's single-core work; the runner calls it after the operator
    /// in any case.
    pub fn launch(&self) {
        let Ok(mut started) = self.started.lock() else {
            return;
        };
        *started = std::mem::take(&mut *started)
            .into_iter()
            .map(|(key, ahead)| match ahead {
                Ahead::Planned(read) => (key, Ahead::Running(tokio::spawn(read))),
                running => (key, running),
            })
            .collect();
    }

    /// After a batch read `input`'s rows of `source`: plan reading the next ingestion
    /// batch's (`read`, over `ctx`'s `table` with the `target` columns) when the job
    /// will consume it next and `held` (whether this process holds that batch in memory)
    /// says no. It starts at [`Prefetch::launch`].
    pub fn plan_next<F>(
        &self,
        source: &str,
        table: &str,
        input: &Input,
        target: &SchemaRef,
        held: impl FnOnce(&Input) -> bool,
        read: impl FnOnce(Input) -> F,
    ) where
        F: std::future::Future<Output = Result<RecordBatch>> + Send + 'static,
    {
        let next = Input {
            after_batch: input.upto_batch,
            upto_batch: input.upto_batch + 1,
            bronze_version: None,
        };
        let completed = self
            .ingested
            .lock()
            .ok()
            .and_then(|i| i.get(source).copied())
            .unwrap_or(0);
        if next.upto_batch > completed || held(&next) {
            return;
        }
        let key = Key {
            source: source.to_string(),
            table: table.to_string(),
            after: next.after_batch,
            upto: next.upto_batch,
            target: target.clone(),
        };
        let Ok(mut started) = self.started.lock() else {
            return;
        };
        if started.iter().any(|(k, _)| *k == key) {
            return;
        }
        started.push((key, Ahead::Planned(Box::pin(read(next)))));
    }

    /// Reads planned or started and not taken yet.
    pub fn pending(&self) -> usize {
        self.started.lock().map_or(0, |s| s.len())
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        if let Ok(started) = self.started.get_mut() {
            for (_, ahead) in started.drain(..) {
                if let Ahead::Running(h) = ahead {
                    h.abort();
                }
            }
        }
    }
}

/// Read `(after, upto]`'s new rows of `table` in `ctx` with the `target` columns, as
/// [`super::read::take_new_rows`] does: what a prefetch runs.
pub async fn read_new(
    ctx: SessionContext,
    table: String,
    input: Input,
    target: SchemaRef,
) -> Result<RecordBatch> {
    let between = super::read::batches_between(input.after_batch, input.upto_batch);
    super::read::read(&ctx, &table, between, &target).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn schema(name: &str) -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new(name, DataType::Int64, false)]))
    }

    fn input(after: i64, upto: i64) -> Input {
        Input {
            after_batch: after,
            upto_batch: upto,
            bronze_version: None,
        }
    }

    fn rows(target: &SchemaRef, batch: i64) -> RecordBatch {
        RecordBatch::try_new(
            target.clone(),
            vec![Arc::new(Int64Array::from(vec![batch]))],
        )
        .unwrap()
    }

    #[tokio::test]
    async fn only_the_next_completed_batch_is_read_ahead_and_taken_by_the_same_read() {
        let p = Prefetch::new(BTreeMap::from([("orders".to_string(), 3)]));
        let target = schema("x");
        let reads = Arc::new(AtomicUsize::new(0));
        let start = |after: i64, upto: i64, held: bool| {
            let (t, reads) = (target.clone(), reads.clone());
            p.plan_next(
                "orders",
                "bronze",
                &input(after, upto),
                &target,
                |_| held,
                move |next| {
                    reads.fetch_add(1, Ordering::SeqCst);
                    async move { Ok(rows(&t, next.upto_batch)) }
                },
            );
        };
        // After batch 1: batch 2 is read ahead, once.
        start(0, 1, false);
        start(0, 1, false);
        p.launch();
        assert_eq!((p.pending(), reads.load(Ordering::SeqCst)), (1, 1));
        // Another range, table, source or schema does not take it.
        assert!(p
            .take("orders", "bronze", &input(1, 3), &target)
            .await
            .is_none());
        assert!(p
            .take("orders", "other", &input(1, 2), &target)
            .await
            .is_none());
        assert!(p
            .take("payments", "bronze", &input(1, 2), &target)
            .await
            .is_none());
        assert!(p
            .take("orders", "bronze", &input(1, 2), &schema("y"))
            .await
            .is_none());
        let got = p.take("orders", "bronze", &input(1, 2), &target).await;
        let got = got.unwrap().unwrap();
        assert_eq!(got, rows(&target, 2));
        // Taken once.
        assert!(p
            .take("orders", "bronze", &input(1, 2), &target)
            .await
            .is_none());
        // Batch 4 has not completed; a batch held in memory is not read.
        start(2, 3, false);
        start(1, 2, true);
        assert_eq!((p.pending(), reads.load(Ordering::SeqCst)), (0, 1));
        // Another source has completed nothing.
        p.plan_next(
            "payments",
            "bronze",
            &input(0, 1),
            &target,
            |_| false,
            |_| async { Ok(RecordBatch::new_empty(schema("x"))) },
        );
        assert_eq!(p.pending(), 0);
    }

    #[tokio::test]
    async fn a_read_planned_and_never_launched_is_read_when_taken() {
        let p = Prefetch::new(BTreeMap::from([("orders".to_string(), 2)]));
        let target = schema("x");
        let t = target.clone();
        p.plan_next(
            "orders",
            "bronze",
            &input(0, 1),
            &target,
            |_| false,
            move |next| async move { Ok(rows(&t, next.upto_batch)) },
        );
        let got = p.take("orders", "bronze", &input(1, 2), &target).await;
        assert_eq!(got.unwrap().unwrap(), rows(&target, 2));
        assert_eq!(p.pending(), 0);
    }

    #[tokio::test]
    async fn a_failed_read_ahead_is_the_reads_error_and_an_untaken_one_is_cancelled() {
        let p = Prefetch::new(BTreeMap::from([("orders".to_string(), 9)]));
        let target = schema("x");
        p.plan_next(
            "orders",
            "bronze",
            &input(0, 1),
            &target,
            |_| false,
            |_| async { Err(Error::Poisoned("test read")) },
        );
        p.launch();
        let got = p.take("orders", "bronze", &input(1, 2), &target).await;
        assert!(matches!(got, Some(Err(Error::Poisoned("test read")))));
        // Never finishes: dropping the read-ahead cancels it.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        p.plan_next(
            "orders",
            "bronze",
            &input(1, 2),
            &target,
            |_| false,
            |_| async move {
                let _tx = tx;
                std::future::pending::<()>().await;
                Ok(RecordBatch::new_empty(schema("x")))
            },
        );
        p.launch();
        tokio::task::yield_now().await;
        drop(p);
        // The task's sender is dropped with it.
        assert!(rx.await.is_err());
    }
}
