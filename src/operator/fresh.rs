//! New rows handed from ingestion to the jobs of the same process.
//!
//! A job batch's first read is its new rows: the bronze rows of the ingestion batch it
//! consumes (`_batch_id` in `(after, upto]`). When this process has just ingested that
//! batch it holds exactly those rows — the deduplicated rows it encoded into bronze's
//! files and committed with the batch's txn — so the jobs take them from memory instead
//! of planning and decoding a bronze read ([`super::read::take_new_rows`]). Bronze stays
//! the truth and the other path: catch-up after a crash, a backlog's earlier batches, a
//! batch too large to hold, backfill, another process's ingestion and the cluster's all
//! read it, and a held batch gives the same rows a bronze read of it would
//! (`tests/pipeline/handover.rs` replays a landing zone both ways and compares every
//! table).
//!
//! What is held, and when:
//! - a source's rows are handed over only once its ingestion batch is complete (bronze,
//!   quarantine, ledger and run log committed): before that no job plans the batch;
//! - only rows this process wrote: a replayed batch (bronze already held it) hands over
//!   nothing, nor does a batch whose files the cluster wrote;
//! - a batch of at most [`HOLD_BYTES`] of Arrow memory: a five-minute drop (at Kestrel's
//!   scale ≈ 10 MB for the largest source) is, a backlog's 256 MB batch is not. Held
//!   rows are a copy of the batch kept alive while bronze encodes it (the writers
//!   otherwise free each part as they go) and until the jobs run: on a 1.4M-row batch
//!   that raised the throughput benchmark's peak RSS by ≈ 180 MiB, and what it saved
//!   (≈ 85 ms of a 0.6 s job batch) was lost again in slower encoding, so large
//!   batches are read back from bronze;
//! - once the columns its jobs read are known — declared by every job of the run that
//!   reads the source before its first batch ([`FreshRows::want`]), or learnt when a job
//!   of the process has taken new rows of it (from here or from bronze) — only those
//!   columns ([`FreshRows::wanted`]), up to
//!   [`HOLD_COLUMNS_BYTES`]: each writer keeps those columns of what it encodes and frees
//!   the rest as it goes. A job that follows its source's ingestion
//!   ([`crate::runner::follow`]) says which columns it reads with its first batch and
//!   takes the later ones from here: on 5M orders in four batches its new-rows read of
//!   batches 2–4 went from 309–342 to 42–75 ms, at the same peak RSS. A job reading a
//!   column not held reads bronze, and too-late rows (which the late ledger keeps
//!   whole) are read from bronze when the held rows lack bronze columns;
//! - one batch per source, the latest: a source forgets its held rows when its next
//!   batch starts, so a backlog holds at most its last batch — or, when jobs follow the
//!   ingestion, when its next batch is handed over (or its jobs took it);
//! - `kestrel run` drops a batch as soon as every job of the run that reads its source
//!   has taken it ([`FreshRows::expect_takers`]; the job's own copy of the columns it
//!   reads is what stays, as a bronze read's result would), and everything when the
//!   run ends; the daemon drops them when no task is running; the always-on stream
//!   holds one poll's batch.
//!
//! `KESTREL_NEW_ROWS=bronze` turns the handover off, and the read-ahead of the next
//! batch's rows ([`super::prefetch`]) with it: every job batch reads bronze when it
//! runs, for comparing the paths.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;

use crate::job::plan::Input;

/// Environment variable that, set to `bronze`, makes jobs read their new rows from bronze.
pub const ENV: &str = "KESTREL_NEW_ROWS";

/// The largest batch handed over with every column (Arrow memory, counted by its
/// buffers): before any job of the process has said which columns it reads.
pub const HOLD_BYTES: usize = 64 << 20;

/// The largest batch handed over with only the columns the jobs read
/// ([`FreshRows::wanted`]): 1.4M orders with `revenue_5m`'s seven columns take ≈ 95 MB.
pub const HOLD_COLUMNS_BYTES: usize = 128 << 20;

/// One source's held batch.
struct Held {
    batch: i64,
    rows: Vec<RecordBatch>,
    /// Jobs still to take it (None: any number, until forgotten).
    left: Option<usize>,
}

/// The latest ingestion batch of each source, as committed to bronze by this process.
#[derive(Default)]
pub struct FreshRows {
    held: Mutex<BTreeMap<String, Held>>,
    /// Per source, the columns this process's jobs have read of its new rows: a batch is
    /// held with those columns only, once they are known ([`FreshRows::wanted`]).
    wanted: Mutex<BTreeMap<String, BTreeSet<String>>>,
    /// Per source, how many jobs take each of its batches ([`FreshRows::expect_takers`]).
    takers: Mutex<BTreeMap<String, usize>>,
    /// Job batches that took their new rows from here.
    taken: AtomicU64,
}

impl FreshRows {
    /// A handover, unless [`ENV`] says `bronze` (then None: jobs read bronze).
    pub fn from_env() -> Option<Self> {
        match std::env::var(ENV) {
            Ok(v) if v.eq_ignore_ascii_case("bronze") => None,
            _ => Some(Self::default()),
        }
    }

    /// Whether a batch whose rows take `bytes` is small enough to hold ([`HOLD_BYTES`]).
    pub fn would_hold(&self, bytes: usize) -> bool {
        bytes <= HOLD_BYTES
    }

    /// Whether a batch whose wanted columns take `bytes` is small enough to hold with
    /// those columns ([`HOLD_COLUMNS_BYTES`]).
    pub fn would_hold_columns(&self, bytes: usize) -> bool {
        bytes <= HOLD_COLUMNS_BYTES
    }

    /// Drop `source`'s held rows (its next ingestion batch is starting).
    pub fn forget(&self, source: &str) {
        if let Ok(mut g) = self.held.lock() {
            g.remove(source);
        }
    }

    /// Each batch of `source` handed over from now on is dropped as soon as `jobs` job
    /// batches have taken it (the jobs of a run that read it), not held until forgotten:
    /// its memory is free for the rest of their work.
    pub fn expect_takers(&self, source: &str, jobs: usize) {
        if let Ok(mut g) = self.takers.lock() {
            g.insert(source.to_string(), jobs);
        }
    }

    /// Drop every held row.
    pub fn clear(&self) {
        if let Ok(mut g) = self.held.lock() {
            g.clear();
        }
    }

    /// Ingestion batch `batch` of `source` is complete, and `rows` are exactly the bronze
    /// rows it committed (none: it wrote no row).
    pub fn hand_over(&self, source: &str, batch: i64, rows: Vec<RecordBatch>) {
        let left = self.takers.lock().ok().and_then(|t| t.get(source).copied());
        if left == Some(0) {
            return;
        }
        if let Ok(mut g) = self.held.lock() {
            g.insert(source.to_string(), Held { batch, rows, left });
        }
    }

    /// `columns` of `source`'s new rows are wanted from its next batch on, as if a job
    /// had taken them: what the jobs that read it declare before their first batch
    /// ([`crate::operator::Operator::new_row_columns`]).
    pub fn want(&self, source: &str, columns: impl IntoIterator<Item = String>) {
        if let Ok(mut w) = self.wanted.lock() {
            w.entry(source.to_string()).or_default().extend(columns);
        }
    }

    /// The columns of `source`'s new rows its jobs in this process have read (None: none
    /// has read any yet): what a batch of it is held with.
    pub fn wanted(&self, source: &str) -> Option<BTreeSet<String>> {
        self.wanted.lock().ok()?.get(source).cloned()
    }

    /// `source`'s new rows of `input` with (at least) the columns of `target`, when held:
    /// `input` is the one ingestion batch held for it, with those columns. None: read them
    /// from bronze. Either way, `target`'s columns are wanted of the source's next batches.
    pub fn take(&self, source: &str, input: &Input, target: &Schema) -> Option<Vec<RecordBatch>> {
        if let Ok(mut w) = self.wanted.lock() {
            let cols = w.entry(source.to_string()).or_default();
            for f in target.fields() {
                if !cols.contains(f.name()) {
                    cols.insert(f.name().clone());
                }
            }
        }
        if input.upto_batch != input.after_batch + 1 {
            return None;
        }
        let mut g = self.held.lock().ok()?;
        let held = g.get_mut(source).filter(|h| h.batch == input.upto_batch)?;
        if !held
            .rows
            .iter()
            .all(|b| crate::columns::has_columns(b, target))
        {
            return None;
        }
        self.taken.fetch_add(1, Ordering::Relaxed);
        match &mut held.left {
            Some(left) if *left <= 1 => g.remove(source).map(|h| h.rows),
            Some(left) => {
                *left -= 1;
                Some(held.rows.clone())
            }
            None => Some(held.rows.clone()),
        }
    }

    /// Whether `source`'s rows of `input` are held (a job batch consuming it would take
    /// them).
    pub fn holds(&self, source: &str, input: &Input) -> bool {
        input.upto_batch == input.after_batch + 1
            && self
                .held
                .lock()
                .is_ok_and(|g| g.get(source).is_some_and(|h| h.batch == input.upto_batch))
    }

    /// How many job batches took their new rows from here.
    pub fn taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    /// Rows held now, over every source.
    pub fn rows_held(&self) -> usize {
        self.held.lock().map_or(0, |g| {
            g.values()
                .flat_map(|h| h.rows.iter())
                .map(|b| b.num_rows())
                .sum()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use std::sync::Arc;

    fn rows(n: i64) -> Vec<RecordBatch> {
        let schema = Arc::new(arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("_batch_id", arrow::datatypes::DataType::Int64, false),
        ]));
        vec![RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![n; 3]))]).unwrap()]
    }

    /// The columns [`rows`] has.
    fn target() -> Schema {
        Schema::new(vec![arrow::datatypes::Field::new(
            "_batch_id",
            arrow::datatypes::DataType::Int64,
            false,
        )])
    }

    fn input(after: i64, upto: i64) -> Input {
        Input {
            after_batch: after,
            upto_batch: upto,
            bronze_version: None,
        }
    }

    #[test]
    fn only_the_one_held_batch_is_taken() {
        let f = FreshRows::default();
        assert!(f.take("orders", &input(0, 1), &target()).is_none());
        f.hand_over("orders", 2, rows(2));
        // Another batch, a range of two, another source: read bronze.
        assert!(f.take("orders", &input(0, 1), &target()).is_none());
        assert!(f.take("orders", &input(0, 2), &target()).is_none());
        assert!(f.take("payments", &input(1, 2), &target()).is_none());
        assert_eq!(f.taken(), 0);
        // Every job reading the source takes the same rows.
        for _ in 0..2 {
            let got = f.take("orders", &input(1, 2), &target()).unwrap();
            assert_eq!(got[0].num_rows(), 3);
        }
        assert_eq!((f.taken(), f.rows_held()), (2, 3));
        // The next batch starting forgets it.
        f.forget("orders");
        assert!(f.take("orders", &input(1, 2), &target()).is_none());
        // An empty batch is held as no rows, not as "unknown".
        f.hand_over("orders", 3, Vec::new());
        assert_eq!(
            f.take("orders", &input(2, 3), &target()).map(|r| r.len()),
            Some(0)
        );
        f.clear();
        assert_eq!(f.rows_held(), 0);
        assert!(f.take("orders", &input(2, 3), &target()).is_none());
    }

    /// Held or not by the memory the kept rows would take: a batch over the limit whose
    /// mask keeps half its rows is held.
    #[test]
    fn only_small_batches_are_held() {
        use crate::sink::delta::kept_bytes;
        let f = FreshRows::default();
        let small: Vec<_> = rows(1).into_iter().map(|b| (b, None)).collect();
        assert!(f.would_hold(kept_bytes(&small)));
        let n = HOLD_BYTES / 8 + 1;
        let big = arrow::array::Int64Array::from(vec![0i64; n]);
        let schema = Arc::new(arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("x", arrow::datatypes::DataType::Int64, false),
        ]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(big)]).unwrap();
        assert!(!f.would_hold(kept_bytes(&[(b.clone(), None)])));
        let half = arrow::array::BooleanArray::from((0..n).map(|i| i % 2 == 0).collect::<Vec<_>>());
        assert!(f.would_hold(kept_bytes(&[(b, Some(half))])));
    }

    /// The columns jobs read are learnt from their takes (held or not), and rows held
    /// without a column a job reads are not that job's.
    #[test]
    fn the_columns_jobs_read_are_wanted_and_rows_without_them_are_not_taken() {
        use arrow::datatypes::{DataType, Field};
        let f = FreshRows::default();
        assert_eq!(f.wanted("orders"), None);
        let wide = Schema::new(vec![
            Field::new("_batch_id", DataType::Int64, false),
            Field::new("sku", DataType::Utf8, true),
        ]);
        // A take that finds nothing held still says what the job reads.
        assert!(f.take("orders", &input(0, 1), &wide).is_none());
        assert!(f.take("orders", &input(0, 1), &target()).is_none());
        let want: BTreeSet<String> = ["_batch_id".to_string(), "sku".to_string()].into();
        assert_eq!(f.wanted("orders"), Some(want.clone()));
        assert_eq!(f.wanted("payments"), None);
        // Declared before any take: wanted as if taken, and added to.
        f.want("payments", ["sku".to_string()]);
        f.want("payments", ["_batch_id".to_string()]);
        assert_eq!(f.wanted("payments"), Some(want));
        // Held with `_batch_id` only: a job reading `sku` too reads bronze.
        f.hand_over("orders", 2, rows(2));
        assert!(f.take("orders", &input(1, 2), &wide).is_none());
        assert_eq!(
            f.take("orders", &input(1, 2), &target()).map(|r| r.len()),
            Some(1)
        );
    }

    #[test]
    fn a_batch_goes_once_its_jobs_have_taken_it() {
        let f = FreshRows::default();
        f.expect_takers("orders", 2);
        f.expect_takers("payments", 0);
        f.hand_over("orders", 1, rows(1));
        f.hand_over("payments", 1, rows(1));
        // No job reads payments: nothing is held for it.
        assert_eq!(f.rows_held(), 3);
        assert!(f.take("orders", &input(0, 1), &target()).is_some());
        assert_eq!(f.rows_held(), 3);
        // The second job takes the last reference.
        assert!(f.take("orders", &input(0, 1), &target()).is_some());
        assert_eq!(f.rows_held(), 0);
        assert!(f.take("orders", &input(0, 1), &target()).is_none());
        // The next batch is counted afresh.
        f.hand_over("orders", 2, rows(2));
        assert!(f.take("orders", &input(1, 2), &target()).is_some());
        assert_eq!(f.rows_held(), 3);
    }
}
