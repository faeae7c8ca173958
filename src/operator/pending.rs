//! Rows of a deferred output not yet committed to its table: the always-on mode's state
//! between polls.
//!
//! An operator whose second output is its own state (stock-out's `sku_availability`:
//! one row per sku, partitioned by a hash bucket) declares it a [`DeferredOutput`]. In
//! the always-on mode the runner then commits that table less often than the batches
//! run — a poll's ~2,000 events touch every bucket of a million-sku table, so a MERGE per
//! poll rewrote all of it every second. Until a partition is committed its rows live
//! here, per partition in batch order, and the operator reads a key's state from here
//! before the table ([`Pending::rows_for`]): table + pending is always the state after
//! the last complete batch. Pure, in memory; durability (a file per batch) and the
//! commits are the runner's ([`crate::runner::deferred`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use arrow::array::{Array, RecordBatch, UInt32Array};
use arrow::compute::{concat_batches, filter_record_batch, take_record_batch};

use crate::columns::{int32, string};
use crate::error::Result;

/// Rows a deferred output cannot hold: a broken invariant of the operator that made them.
#[derive(Debug, thiserror::Error)]
pub enum PendingError {
    #[error("deferred output: a row with a null `{0}`")]
    Null(&'static str),
    #[error("deferred output: no rows to pick from")]
    Empty,
}

/// An output the always-on mode may commit later than its batches: rows keyed by one
/// string column (at most one row per key), partitioned by one int32 column whose values
/// are `parts`. Each partition's commits carry their own app id ([`DeferredOutput::part_app`]);
/// the table holds the state after batch max(txn `app`, txn `part_app(p)`) for the keys of
/// partition `p`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeferredOutput {
    pub table: String,
    pub app: String,
    pub key: &'static str,
    pub partition: &'static str,
    pub parts: std::ops::Range<i32>,
}

impl DeferredOutput {
    /// The app id of commits of partition `p` alone.
    pub fn part_app(&self, p: i32) -> String {
        format!("{}-part-{p}", self.app)
    }
}

/// Pending rows of one [`DeferredOutput`].
#[derive(Debug)]
pub struct Pending {
    out: DeferredOutput,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Per partition: rows of complete batches not in the table yet, oldest first, and
    /// the first batch among them.
    parts: BTreeMap<i32, (i64, Vec<RecordBatch>)>,
    /// The last complete batch whose rows were added (or, at start, the batch the table
    /// is complete up to).
    upto: i64,
}

impl Pending {
    /// Nothing pending; the table holds every batch up to `upto`.
    pub fn new(out: DeferredOutput, upto: i64) -> Self {
        Pending {
            out,
            inner: Mutex::new(Inner {
                parts: BTreeMap::new(),
                upto,
            }),
        }
    }

    pub fn output(&self) -> &DeferredOutput {
        &self.out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The last complete batch whose rows are held (or in the table).
    pub fn upto(&self) -> i64 {
        self.lock().upto
    }

    /// Rows pending, and partitions holding them.
    pub fn size(&self) -> (usize, usize) {
        let g = self.lock();
        let rows = g
            .parts
            .values()
            .flat_map(|(_, v)| v.iter().map(RecordBatch::num_rows))
            .sum();
        (rows, g.parts.len())
    }

    /// Add the rows of complete batch `n` (split by partition).
    pub fn add(&self, n: i64, rows: &RecordBatch) -> Result<()> {
        let mut split: BTreeMap<i32, Vec<u32>> = BTreeMap::new();
        if rows.num_rows() > 0 {
            let part = int32(rows, self.out.partition)?;
            for i in 0..rows.num_rows() {
                if part.is_null(i) {
                    return Err(PendingError::Null(self.out.partition).into());
                }
                split.entry(part.value(i)).or_default().push(i as u32);
            }
        }
        let mut g = self.lock();
        for (p, idx) in split {
            let b = take_record_batch(rows, &UInt32Array::from(idx))?;
            g.parts
                .entry(p)
                .or_insert_with(|| (n, Vec::new()))
                .1
                .push(b);
        }
        g.upto = g.upto.max(n);
        Ok(())
    }

    /// The latest pending row of each of `keys` that has one.
    pub fn rows_for(&self, keys: &HashSet<&str>) -> Result<Option<RecordBatch>> {
        let g = self.lock();
        let mut picked = Vec::new();
        for (_, batches) in g.parts.values() {
            for b in batches {
                let k = string(b, self.out.key)?;
                let mask: arrow::array::BooleanArray = (0..b.num_rows())
                    .map(|i| Some(k.is_valid(i) && keys.contains(k.value(i))))
                    .collect();
                let f = filter_record_batch(b, &mask)?;
                if f.num_rows() > 0 {
                    picked.push(f);
                }
            }
        }
        drop(g);
        if picked.is_empty() {
            return Ok(None);
        }
        latest_per_key(&picked, self.out.key).map(Some)
    }

    /// The partition pending longest (None: nothing pending) with its rows, latest per
    /// key, and the batch they bring the partition to.
    pub fn oldest(&self) -> Result<Option<(i32, RecordBatch, i64)>> {
        let g = self.lock();
        let Some((p, (_, batches))) = g.parts.iter().min_by_key(|(p, (since, _))| (*since, **p))
        else {
            return Ok(None);
        };
        let rows = latest_per_key(batches, self.out.key)?;
        Ok(Some((*p, rows, g.upto)))
    }

    /// Every pending row, latest per key, and the batch they bring the table to.
    pub fn all(&self) -> Result<(Option<RecordBatch>, i64)> {
        let g = self.lock();
        let batches: Vec<RecordBatch> = g
            .parts
            .values()
            .flat_map(|(_, v)| v.iter().cloned())
            .collect();
        let upto = g.upto;
        drop(g);
        if batches.is_empty() {
            return Ok((None, upto));
        }
        Ok((Some(latest_per_key(&batches, self.out.key)?), upto))
    }

    /// Partition `p`'s rows are committed (as of batch `upto`): drop them.
    pub fn committed(&self, p: i32) {
        self.lock().parts.remove(&p);
    }

    /// Every pending row is committed.
    pub fn committed_all(&self) {
        self.lock().parts.clear();
    }
}

/// One row per key of `batches` (same schema), the last one in order winning.
pub fn latest_per_key(batches: &[RecordBatch], key: &'static str) -> Result<RecordBatch> {
    let Some(first) = batches.first() else {
        return Err(PendingError::Empty.into());
    };
    let all = concat_batches(&first.schema(), batches)?;
    let k = string(&all, key)?;
    let mut last: HashMap<&str, u32> = HashMap::with_capacity(all.num_rows());
    for i in 0..all.num_rows() {
        if k.is_null(i) {
            return Err(PendingError::Null(key).into());
        }
        last.insert(k.value(i), i as u32);
    }
    let mut idx: Vec<u32> = last.into_values().collect();
    idx.sort_unstable();
    Ok(take_record_batch(&all, &UInt32Array::from(idx))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    fn out() -> DeferredOutput {
        DeferredOutput {
            table: "gold/t".into(),
            app: "app".into(),
            key: "sku",
            partition: "bucket",
            parts: 0..4,
        }
    }

    fn rows(v: &[(&str, i32, i64)]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("sku", DataType::Utf8, false),
            Field::new("bucket", DataType::Int32, true),
            Field::new("on_hand", DataType::Int64, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter_values(v.iter().map(|r| r.0))),
                Arc::new(Int32Array::from_iter_values(v.iter().map(|r| r.1))),
                Arc::new(Int64Array::from_iter_values(v.iter().map(|r| r.2))),
            ],
        )
        .unwrap()
    }

    fn cells(b: &RecordBatch) -> Vec<(String, i64)> {
        let k = string(b, "sku").unwrap();
        let v = b
            .column_by_name("on_hand")
            .unwrap()
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        let mut out: Vec<(String, i64)> = (0..b.num_rows())
            .map(|i| (k.value(i).to_string(), v.value(i)))
            .collect();
        out.sort();
        out
    }

    /// The latest row of a key wins, partitions flush oldest first, and a committed
    /// partition's rows are gone while the others stay.
    #[test]
    fn latest_rows_per_key_by_partition_oldest_first() {
        let p = Pending::new(out(), 4);
        p.add(5, &rows(&[("a", 1, 10), ("b", 2, 20)])).unwrap();
        p.add(6, &rows(&[("a", 1, 11), ("c", 3, 30)])).unwrap();
        p.add(7, &rows(&[])).unwrap();
        assert_eq!((p.upto(), p.size()), (7, (4, 3)));
        let keys: HashSet<&str> = ["a", "c", "z"].into_iter().collect();
        let got = p.rows_for(&keys).unwrap().unwrap();
        assert_eq!(cells(&got), [("a".into(), 11), ("c".into(), 30)]);
        // Partitions 1 and 2 wait since batch 5; the lower one goes first.
        let (part, r, upto) = p.oldest().unwrap().unwrap();
        assert_eq!((part, cells(&r), upto), (1, vec![("a".into(), 11)], 7));
        p.committed(1);
        assert_eq!(p.oldest().unwrap().unwrap().0, 2);
        let (all, upto) = p.all().unwrap();
        assert_eq!(
            (cells(&all.unwrap()), upto),
            (vec![("b".into(), 20), ("c".into(), 30)], 7)
        );
        p.committed_all();
        assert!(p.oldest().unwrap().is_none());
        assert!(p.rows_for(&keys).unwrap().is_none());
        assert!(p.add(8, &rows(&[("a", 9, 1)])).is_ok());
    }
}
