//! Discovery: list what has landed for a source and diff it against what was processed.
//!
//! Incremental listing: per source partition, only keys that sort after the partition's
//! cursor (the greatest key already processed) are listed — S3 `StartAfter` on object
//! stores, a pruned directory walk on local disks — so the cost grows with new files,
//! not with every file ever landed. A full listing every `full_scan_every` batches (or on
//! request) catches files whose names sort before the cursor and files that changed after
//! being processed.

use std::collections::BTreeMap;
use std::path::Path;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::storage::Location;

/// Partition name used when a file has no `partition=N` path segment.
pub const DEFAULT_PARTITION: &str = "default";

/// File formats kestrel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// Newline-delimited JSON (`.ndjson`, `.jsonl`).
    Ndjson,
    /// Gzip-compressed NDJSON (`.ndjson.gz`, `.jsonl.gz`).
    NdjsonGz,
    /// Parquet (`.parquet`).
    Parquet,
}

/// Format of a file name, or None for names kestrel does not read.
pub fn format_of(name: &str) -> Option<Format> {
    let n = name.to_ascii_lowercase();
    if n.ends_with(".ndjson.gz") || n.ends_with(".jsonl.gz") {
        Some(Format::NdjsonGz)
    } else if n.ends_with(".ndjson") || n.ends_with(".jsonl") {
        Some(Format::Ndjson)
    } else if n.ends_with(".parquet") {
        Some(Format::Parquet)
    } else {
        None
    }
}

/// True when any segment below the source directory starts with `.` or `_`
/// (uploads in progress: writers land a temporary name, then rename).
pub fn is_ignored(rel_in_source: &str) -> bool {
    rel_in_source
        .split('/')
        .any(|seg| seg.starts_with('.') || seg.starts_with('_'))
}

/// The source partition named by a `partition=N` segment, or [`DEFAULT_PARTITION`].
pub fn partition_of(rel_in_source: &str) -> String {
    rel_in_source
        .split('/')
        .find_map(|seg| seg.strip_prefix("partition="))
        .map(str::to_string)
        .unwrap_or_else(|| DEFAULT_PARTITION.to_string())
}

/// One landed file as seen by a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LandedFile {
    /// Key relative to the landing root, e.g. `orders/partition=0/2026-11-29T1300.ndjson`.
    pub path: String,
    /// Source partition.
    pub partition: String,
    /// Size in bytes.
    pub size: u64,
    /// Object-store e-tag (local: inode-mtime-size).
    pub e_tag: Option<String>,
    /// Arrival time: the object's last-modified time, microseconds since the epoch.
    pub landed_at_us: i64,
    /// Decoder to use.
    pub format: Format,
}

impl LandedFile {
    /// Arrival time.
    pub fn landed_at(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_micros(self.landed_at_us).unwrap_or_default()
    }
}

fn landed_from_meta(
    source: &str,
    rel: String,
    size: u64,
    e_tag: Option<String>,
    modified: DateTime<Utc>,
) -> Option<LandedFile> {
    let in_source = rel.strip_prefix(source)?.strip_prefix('/')?;
    if is_ignored(in_source) {
        return None;
    }
    let name = in_source.rsplit('/').next().unwrap_or(in_source);
    let format = format_of(name)?;
    Some(LandedFile {
        partition: partition_of(in_source),
        path: rel,
        size,
        e_tag,
        landed_at_us: modified.timestamp_micros(),
        format,
    })
}

/// List a source. `cursors`: per partition, the greatest key already processed; `None`
/// lists everything (full scan). Returned files are sorted by key.
pub async fn list_source(
    landing: &Location,
    source: &str,
    cursors: Option<&BTreeMap<String, String>>,
) -> Result<Vec<LandedFile>> {
    let empty = BTreeMap::new();
    let cursors = cursors.unwrap_or(&empty);
    let full = cursors.is_empty();
    let mut out = match &landing.local_dir {
        Some(dir) => list_local(dir, source, cursors, full)?,
        None => list_store(landing, source, cursors, full).await?,
    };
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Offset for a key under a partition: keys after it are new.
fn offset_for<'a>(in_source: &str, cursors: &'a BTreeMap<String, String>) -> Option<&'a str> {
    cursors.get(&partition_of(in_source)).map(String::as_str)
}

async fn list_store(
    landing: &Location,
    source: &str,
    cursors: &BTreeMap<String, String>,
    full: bool,
) -> Result<Vec<LandedFile>> {
    let store = &landing.store;
    let root = landing.path(source);
    let url = landing.display(source);
    let mut prefixes: Vec<(ObjPath, Option<String>)> = Vec::new();
    if full {
        prefixes.push((root.clone(), None));
    } else {
        // One delimiter listing finds the partition directories; each is listed after its cursor.
        let top = store
            .list_with_delimiter(Some(&root))
            .await
            .map_err(|e| Error::storage(&url, e))?;
        let mut other = false;
        for dir in top.common_prefixes {
            let rel = landing.relative(&dir);
            let in_source = rel
                .strip_prefix(source)
                .unwrap_or(&rel)
                .trim_start_matches('/');
            if in_source.starts_with("partition=") {
                let off = offset_for(in_source, cursors).map(|c| c.to_string());
                prefixes.push((dir, off));
            } else {
                other = true;
            }
        }
        if other || !top.objects.is_empty() {
            prefixes.push((root.clone(), cursors.get(DEFAULT_PARTITION).cloned()));
        }
    }
    let mut out = Vec::new();
    for (prefix, offset) in prefixes {
        let metas: Vec<ObjectMeta> = match &offset {
            Some(off) => {
                let off = landing.path(off);
                store
                    .list_with_offset(Some(&prefix), &off)
                    .try_collect()
                    .await
            }
            None => store.list(Some(&prefix)).try_collect().await,
        }
        .map_err(|e| Error::storage(&url, e))?;
        for m in metas {
            let rel = landing.relative(&m.location);
            if let Some(f) = landed_from_meta(source, rel, m.size, m.e_tag.clone(), m.last_modified)
            {
                // The root listing of a partitioned source only contributes the default partition.
                if !full && prefix == root && f.partition != DEFAULT_PARTITION {
                    continue;
                }
                out.push(f);
            }
        }
    }
    Ok(out)
}

/// Local disks: walk directories in name order, skipping every directory whose keys all
/// sort at or before the cursor of its partition.
fn list_local(
    dir: &Path,
    source: &str,
    cursors: &BTreeMap<String, String>,
    full: bool,
) -> Result<Vec<LandedFile>> {
    let root = dir.join(source);
    let mut out = Vec::new();
    if !root.exists() {
        return Ok(out);
    }
    let mut stack = vec![(root, source.to_string())];
    while let Some((d, key)) = stack.pop() {
        let rd = std::fs::read_dir(&d).map_err(|e| Error::io(d.display().to_string(), e))?;
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(d.display().to_string(), e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name.starts_with('_') {
                continue;
            }
            let child_key = format!("{key}/{name}");
            let in_source = &child_key[source.len() + 1..];
            let ft = entry
                .file_type()
                .map_err(|e| Error::io(entry.path().display().to_string(), e))?;
            let offset = if full {
                None
            } else {
                offset_for(in_source, cursors)
            };
            if ft.is_dir() {
                if let Some(off) = offset {
                    let dir_prefix = format!("{child_key}/");
                    // every key under this dir is < off: nothing new in it
                    if off > dir_prefix.as_str() && !off.starts_with(&dir_prefix) {
                        continue;
                    }
                }
                stack.push((entry.path(), child_key));
            } else if ft.is_file() {
                if let Some(off) = offset {
                    if child_key.as_str() <= off {
                        continue;
                    }
                }
                let md = entry
                    .metadata()
                    .map_err(|e| Error::io(entry.path().display().to_string(), e))?;
                let modified: DateTime<Utc> = md
                    .modified()
                    .map(DateTime::<Utc>::from)
                    .map_err(|e| Error::io(entry.path().display().to_string(), e))?;
                let e_tag = local_etag(&md);
                if let Some(f) =
                    landed_from_meta(source, child_key, md.len(), Some(e_tag), modified)
                {
                    out.push(f);
                }
            }
        }
    }
    Ok(out)
}

/// Same form as object_store's LocalFileSystem e-tag: inode, mtime (µs) and size in hex.
fn local_etag(md: &std::fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    let mtime = md
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_micros())
        .unwrap_or(0);
    format!("{:x}-{:x}-{:x}", md.ino(), mtime, md.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_partitions() {
        assert_eq!(format_of("a.ndjson"), Some(Format::Ndjson));
        assert_eq!(format_of("a.JSONL.gz"), Some(Format::NdjsonGz));
        assert_eq!(format_of("a.parquet"), Some(Format::Parquet));
        assert_eq!(format_of("a.csv"), None);
        assert!(is_ignored("partition=1/_upload.ndjson"));
        assert!(is_ignored(".tmp/x.ndjson"));
        assert!(!is_ignored("partition=1/x.ndjson"));
        assert_eq!(partition_of("partition=3/2026/x.ndjson"), "3");
        assert_eq!(partition_of("2026/x.ndjson"), DEFAULT_PARTITION);
    }

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"{}\n").unwrap();
    }

    #[tokio::test]
    async fn local_listing_prunes_by_cursor_and_finds_all_on_full_scan() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        for p in [
            "orders/partition=0/2026-01-01/a.ndjson",
            "orders/partition=0/2026-01-02/b.ndjson",
            "orders/partition=1/2026-01-01/c.ndjson",
            "orders/partition=1/_up.ndjson",
            "orders/partition=1/notes.txt",
        ] {
            touch(&d.join(p));
        }
        let loc = Location::open(d.to_str().unwrap(), &BTreeMap::new(), false).unwrap();
        let all = list_source(&loc, "orders", None).await.unwrap();
        assert_eq!(all.len(), 3);
        let mut cur = BTreeMap::new();
        cur.insert(
            "0".to_string(),
            "orders/partition=0/2026-01-01/a.ndjson".to_string(),
        );
        cur.insert(
            "1".to_string(),
            "orders/partition=1/2026-01-01/c.ndjson".to_string(),
        );
        let new = list_source(&loc, "orders", Some(&cur)).await.unwrap();
        assert_eq!(new.len(), 1);
        assert_eq!(new[0].path, "orders/partition=0/2026-01-02/b.ndjson");
        assert_eq!(new[0].partition, "0");
    }
}
