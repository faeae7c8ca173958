//! Listings of a local table's Delta log that cost the files after the offset, not the
//! whole log.
//!
//! After every commit delta-rs brings its snapshot forward by listing `_delta_log/` from
//! the committed version on (`list_with_offset`). On S3 that is a `ListObjectsV2` with
//! `start-after`: it returns only what follows. `object_store`'s local file system walks
//! the whole directory instead, following links and converting every entry to an object
//! path: ~5 µs per log file, so an append to a table whose log holds 10,000 commits took
//! 55 ms against 9 ms at 100 (`cargo bench --bench jobs -- age logcost`) — and a gold
//! table keeps a week of five-minute commits. [`LogListing`] answers those listings from
//! the directory's names: entries at or before the offset are skipped by name, and only
//! the rest are stat'ed. Anything it is not sure about (a prefix that is not a
//! `_delta_log`, a name that would need percent-encoding, a symlink, an I/O error) goes to
//! the wrapped store unchanged, as does every other operation. Listings of a `_delta_log`
//! come in name order, as an object store's do (see [`sorted`]).

use std::sync::Arc;

use chrono::{DateTime, Utc};
use deltalake::logstore::object_store::path::Path;
use deltalake::logstore::object_store::{
    self, CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};

/// A local object store (rooted at `/`, as delta-rs roots table stores) whose Delta-log
/// listings skip by name.
#[derive(Debug)]
pub struct LogListing {
    inner: Arc<dyn ObjectStore>,
}

impl LogListing {
    /// Wrap `inner`, a `LocalFileSystem` rooted at `/`.
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        LogListing { inner }
    }
}

impl std::fmt::Display for LogListing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LogListing({})", self.inner)
    }
}

/// Characters an object path segment keeps as they are on disk (no percent-encoding).
fn plain(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'='))
}

/// A file `object_store` lists: not one of its in-progress uploads (`name#123`).
fn listed(name: &str) -> bool {
    match name.split_once('#') {
        Some((_, suffix)) if !suffix.is_empty() => !suffix.bytes().all(|b| b.is_ascii_digit()),
        _ => true,
    }
}

/// The objects under `prefix` (a `_delta_log` directory) after `offset`, or None when
/// the wrapped store should answer.
fn log_after(prefix: &Path, offset: &Path) -> Option<Vec<ObjectMeta>> {
    if prefix.filename() != Some("_delta_log") || !prefix.parts().all(|p| plain(p.as_ref())) {
        return None;
    }
    let dir = std::path::PathBuf::from(format!("/{}", prefix.as_ref()));
    let mut out = Vec::new();
    walk(&dir, prefix.as_ref(), offset.as_ref(), &mut out)?;
    out.sort_unstable_by(|a, b| a.location.cmp(&b.location));
    Some(out)
}

/// `listing` in name order. The Delta kernel expects a log listing sorted by name from
/// every store but a `file` URL's (S3 lists in order; a local directory does not), and a
/// local warehouse's tables are opened under their own scheme
/// (`sink::delta::LOCAL_TABLE_SCHEME`).
fn sorted(
    listing: BoxStream<'static, object_store::Result<ObjectMeta>>,
) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
    async move {
        let mut all: Vec<ObjectMeta> = match listing.collect::<Vec<_>>().await.into_iter().collect()
        {
            Ok(v) => v,
            Err(e) => return futures::stream::iter([Err(e)]).boxed(),
        };
        all.sort_unstable_by(|a, b| a.location.cmp(&b.location));
        futures::stream::iter(all.into_iter().map(Ok)).boxed()
    }
    .flatten_stream()
    .boxed()
}

/// Whether `tail` (the offset below this directory) lies inside subdirectory `name`: its
/// entries may still follow the offset although `name` sorts before it.
fn offset_inside(tail: Option<&str>, name: &str) -> bool {
    tail.and_then(|t| t.strip_prefix(name))
        .is_some_and(|r| r.starts_with('/'))
}

fn walk(dir: &std::path::Path, at: &str, offset: &str, out: &mut Vec<ObjectMeta>) -> Option<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        // No log yet: an empty listing, as object_store gives.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(()),
        Err(_) => return None,
    };
    // `at/name` and the offset share `at/`: names compare as the locations would.
    let tail = offset
        .strip_prefix(at)
        .and_then(|r| r.strip_prefix('/'))
        .filter(|t| !t.is_empty());
    for entry in entries {
        let entry = entry.ok()?;
        let name = entry.file_name().into_string().ok()?;
        if tail.is_some_and(|t| name.as_str() <= t) && !offset_inside(tail, &name) {
            continue;
        }
        if !listed(&name) {
            continue; // an upload in progress
        }
        if !plain(&name) {
            return None;
        }
        let location = format!("{at}/{name}");
        let kind = entry.file_type().ok()?;
        if kind.is_symlink() {
            return None;
        }
        if kind.is_dir() {
            walk(&entry.path(), &location, offset, out)?;
            continue;
        }
        if location.as_str() <= offset {
            continue;
        }
        let meta = match entry.metadata() {
            Ok(m) => m,
            // Deleted since the directory was read (log cleanup): not listed.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => return None,
        };
        let modified = meta.modified().ok()?;
        let micros = modified
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        let inode = inode(&meta);
        out.push(ObjectMeta {
            location: Path::from(location),
            last_modified: DateTime::<Utc>::from(modified),
            size: meta.len(),
            // object_store's local e-tag: inode, mtime, size.
            e_tag: Some(format!("{inode:x}-{micros:x}-{:x}", meta.len())),
            version: None,
        });
    }
    Some(())
}

#[cfg(unix)]
fn inode(meta: &std::fs::Metadata) -> u64 {
    std::os::unix::fs::MetadataExt::ino(meta)
}

#[cfg(not(unix))]
fn inode(_meta: &std::fs::Metadata) -> u64 {
    0
}

#[async_trait::async_trait]
impl ObjectStore for LogListing {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        match prefix {
            Some(p) if p.filename() == Some("_delta_log") => sorted(self.inner.list(prefix)),
            _ => self.inner.list(prefix),
        }
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let Some(prefix) = prefix.filter(|p| p.filename() == Some("_delta_log")) else {
            return self.inner.list_with_offset(prefix, offset);
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return match log_after(prefix, offset) {
                Some(v) => futures::stream::iter(v.into_iter().map(Ok)).boxed(),
                None => sorted(self.inner.list_with_offset(Some(prefix), offset)),
            };
        }
        let (inner, prefix, offset) = (self.inner.clone(), prefix.clone(), offset.clone());
        async move {
            let (p, o) = (prefix.clone(), offset.clone());
            let fast = tokio::task::spawn_blocking(move || log_after(&p, &o))
                .await
                .ok()
                .flatten();
            match fast {
                Some(v) => futures::stream::iter(v.into_iter().map(Ok)).boxed(),
                None => sorted(inner.list_with_offset(Some(&prefix), &offset)),
            }
        }
        .flatten_stream()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltalake::logstore::object_store::local::LocalFileSystem;
    use futures::TryStreamExt;

    async fn listing(store: &dyn ObjectStore, prefix: &Path, offset: &Path) -> Vec<ObjectMeta> {
        let mut v: Vec<ObjectMeta> = store
            .list_with_offset(Some(prefix), offset)
            .try_collect()
            .await
            .unwrap();
        v.sort_by(|a, b| a.location.cmp(&b.location));
        v
    }

    /// The same objects, sizes, times and e-tags as object_store's own listing: after the
    /// offset, subdirectories included, in-progress uploads left out.
    #[tokio::test]
    async fn log_listings_match_the_local_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("t/_delta_log");
        std::fs::create_dir_all(log.join("_commits")).unwrap();
        for v in 0..30u64 {
            std::fs::write(log.join(format!("{v:020}.json")), vec![b'x'; v as usize]).unwrap();
        }
        std::fs::write(log.join("00000000000000000020.checkpoint.parquet"), b"c").unwrap();
        std::fs::write(log.join("_last_checkpoint"), b"{}").unwrap();
        std::fs::write(log.join("00000000000000000031.json#1"), b"partial").unwrap();
        std::fs::write(log.join("_commits/00000000000000000031.uuid.json"), b"s").unwrap();
        let local: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new());
        let fast = LogListing::new(local.clone());
        let prefix = Path::from_absolute_path(&log).unwrap();
        for offset in [
            "00000000000000000000.json",
            "00000000000000000020.json",
            "00000000000000000029.json",
            "_commits/00000000000000000030.json",
            "_last_checkpoint",
        ] {
            let offset = Path::from(format!("{}/{offset}", prefix.as_ref()));
            let want = listing(local.as_ref(), &prefix, &offset).await;
            let got = listing(&fast, &prefix, &offset).await;
            assert_eq!(got, want, "after {offset}");
        }
        let offset = Path::from(format!("{}/00000000000000000025.json", prefix.as_ref()));
        let got = listing(&fast, &prefix, &offset).await;
        let names: Vec<&str> = got.iter().filter_map(|m| m.location.filename()).collect();
        // 26–29, the commit under _commits/ and _last_checkpoint ('_' sorts after digits).
        assert_eq!(names.len(), 6, "{names:?}");
        assert!(log_after(&prefix, &offset).is_some(), "answered by name");
        // Not a log directory: the wrapped store answers.
        let table = Path::from_absolute_path(dir.path().join("t")).unwrap();
        assert!(log_after(&table, &offset).is_none());
    }

    /// A log listing comes in name order as it is, whoever answers it (the Delta kernel
    /// trusts the order of every store but a `file` URL's): by name, and through the
    /// wrapped store for a log whose path needs percent-encoding.
    #[tokio::test]
    async fn log_listings_come_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        for table in ["t", "t %x"] {
            let log = dir.path().join(table).join("_delta_log");
            std::fs::create_dir_all(&log).unwrap();
            // Written out of order, so directory order is unlikely to be name order.
            for v in [7u64, 2, 9, 0, 5, 1, 8, 3, 6, 4, 11, 10] {
                std::fs::write(log.join(format!("{v:020}.json")), b"x").unwrap();
            }
            let fast = LogListing::new(Arc::new(LocalFileSystem::new()));
            let prefix = Path::from_absolute_path(&log).unwrap();
            let offset = Path::from(format!("{}/00000000000000000001.json", prefix.as_ref()));
            for got in [
                fast.list_with_offset(Some(&prefix), &offset)
                    .try_collect::<Vec<_>>()
                    .await
                    .unwrap(),
                fast.list(Some(&prefix))
                    .try_collect::<Vec<_>>()
                    .await
                    .unwrap(),
            ] {
                let names: Vec<String> = got
                    .iter()
                    .filter_map(|m| m.location.filename().map(str::to_string))
                    .collect();
                let mut want = names.clone();
                want.sort();
                assert_eq!(names, want, "{table}");
                assert!(names.len() >= 10, "{table}: {names:?}");
            }
        }
    }
}
