//! What an ingestion run knows of the bronze files it wrote itself: the filter hash
//! ([`crate::sink::bloom::hash`]) of each row's `event_id`, in row order, by file.
//!
//! A backlog is ingested in batches, and each batch's dedup probes bronze for the ids
//! of the dates it touches ([`crate::sink::probe`]). With random UUIDs a batch of a
//! million ids against earlier batches' row groups reads their `event_id` column whole
//! (asking a 16k–128k-row group's bloom filter about a million ids costs more than
//! reading it), so the probe of a backlog's k-th batch decoded the k − 1 batches before
//! it: 135, 200, 312 ms for the second to fourth 1.4M-row batch of 5M orders. The files
//! this run wrote need no read to be ruled out: their rows' hashes, kept when they were
//! encoded, tell which row groups hold a row whose hash is an incoming id's, and only
//! those are read and compared exactly, as any other. A file it did not write (another
//! process's, a compaction's) is probed as before.
//!
//! Held for one `ingest` of a source, at 8 bytes a row, at most [`Known::MAX_IDS`] rows
//! (the oldest files forgotten first: they are probed from bronze again).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The rows of one file: its size in bytes (so a file of the same name that is not this
/// one is not taken for it) and each row's `event_id` hash in row order (0 for a null).
#[derive(Debug)]
pub struct KnownFile {
    pub size: u64,
    pub hashes: Vec<u64>,
}

impl KnownFile {
    /// The row groups (by index, ascending) that hold a row whose hash `wanted` says is
    /// wanted; `rows` are the row groups' row counts in file order, as the file's footer
    /// gives them. None when they do not add up to this file's rows (then this is not the
    /// file it was taken for, and the caller reads it as any other).
    pub fn row_groups_where(
        &self,
        rows: &[usize],
        wanted: impl Fn(u64) -> bool,
    ) -> Option<Vec<usize>> {
        if rows.iter().sum::<usize>() != self.hashes.len() {
            return None;
        }
        let mut out = Vec::new();
        let mut start = 0;
        for (rg, n) in rows.iter().enumerate() {
            let group = &self.hashes[start..start + n];
            if group.iter().any(|h| wanted(*h)) {
                out.push(rg);
            }
            start += n;
        }
        Some(out)
    }
}

/// The files an ingestion run wrote, by file name (the last segment of its path: a
/// writer names each file after a fresh UUID).
#[derive(Debug, Clone)]
pub struct Known {
    files: HashMap<String, Arc<KnownFile>>,
    /// File names, oldest first.
    order: VecDeque<String>,
    rows: usize,
    limit: usize,
}

impl Default for Known {
    fn default() -> Self {
        Self::with_limit(Self::MAX_IDS)
    }
}

impl Known {
    /// Rows remembered at most (64 MiB of hashes): a day at Kestrel's scale is 14M
    /// clickstream events, a backlog of orders a fraction of that.
    pub const MAX_IDS: usize = 8 << 20;

    /// Remembering at most `limit` rows.
    pub fn with_limit(limit: usize) -> Self {
        Known {
            files: HashMap::new(),
            order: VecDeque::new(),
            rows: 0,
            limit,
        }
    }

    /// Remember `file` under `name`, forgetting the oldest files beyond the limit.
    pub fn insert(&mut self, name: String, file: KnownFile) {
        if file.hashes.len() > self.limit {
            return;
        }
        self.rows += file.hashes.len();
        if let Some(old) = self.files.insert(name.clone(), Arc::new(file)) {
            self.rows -= old.hashes.len();
            self.order.retain(|n| n != &name);
        }
        self.order.push_back(name);
        while self.rows > self.limit {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(f) = self.files.remove(&oldest) {
                self.rows -= f.hashes.len();
            }
        }
    }

    /// The file named `name` of `size` bytes, when this run wrote it.
    pub fn get(&self, name: &str, size: u64) -> Option<Arc<KnownFile>> {
        self.files.get(name).filter(|f| f.size == size).cloned()
    }

    /// Files remembered.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// No file remembered.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Rows remembered.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The name [`Known`] keys a file by: the last segment of its path.
pub fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(hashes: Vec<u64>) -> KnownFile {
        KnownFile { size: 10, hashes }
    }

    #[test]
    fn row_groups_holding_a_wanted_hash_and_only_those() {
        let f = file(vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(f.row_groups_where(&[3, 3, 1], |h| h == 5), Some(vec![1]));
        assert_eq!(
            f.row_groups_where(&[3, 3, 1], |h| h == 1 || h == 7),
            Some(vec![0, 2])
        );
        assert_eq!(f.row_groups_where(&[3, 3, 1], |_| false), Some(vec![]));
        // Footer rows that are not this file's: not used.
        assert_eq!(f.row_groups_where(&[3, 3], |_| true), None);
        assert_eq!(f.row_groups_where(&[4, 4], |_| true), None);
    }

    #[test]
    fn a_file_is_known_by_name_and_size_and_the_oldest_go_first() {
        let mut k = Known::with_limit(100);
        k.insert("a.parquet".into(), file(vec![1; 4]));
        assert!(k.get("a.parquet", 10).is_some());
        assert!(
            k.get("a.parquet", 11).is_none(),
            "another size: another file"
        );
        assert!(k.get("b.parquet", 10).is_none());
        k.insert("b.parquet".into(), file(vec![2; 96]));
        assert_eq!((k.len(), k.rows()), (2, 100));
        k.insert("c.parquet".into(), file(vec![3; 1]));
        assert!(k.get("a.parquet", 10).is_none(), "the oldest forgotten");
        assert!(k.get("b.parquet", 10).is_some() && k.get("c.parquet", 10).is_some());
        assert_eq!(k.rows(), 97);
        // The same name again replaces the file.
        k.insert("c.parquet".into(), file(vec![3; 2]));
        assert_eq!((k.len(), k.rows()), (2, 98));
        // Too large to hold at all: not remembered, nothing forgotten for it.
        k.insert("d.parquet".into(), file(vec![4; 101]));
        assert!(k.get("d.parquet", 10).is_none());
        assert_eq!(k.len(), 2);
        assert_eq!(
            file_name("event_date=2025-11-20/part-1.parquet"),
            "part-1.parquet"
        );
        assert_eq!(file_name("part-1.parquet"), "part-1.parquet");
    }
}
