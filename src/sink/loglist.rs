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
//!
//! Skipping by name still reads the whole directory, and ext4 hashes every entry of a
//! large directory on each read (≈ 1 µs a file): a table keeps a week of five-minute
//! commits (≈ 2,500 log files), so a commit still cost ≈ 5 ms more at the end of the week
//! than at its start. A listing after a version-named offset (what the Delta kernel and
//! delta-rs ask for) is therefore answered by probing names instead ([`probe_after`]):
//! Delta commits are contiguous (`put-if-absent` of version n + 1 only after n), so the
//! commits from version S on are `S.json`, `S+1.json`, … up to the first one missing; at
//! each version the classic checkpoint and the CRC file are probed too. A few `stat`s a
//! version, whatever the log holds. The probe gives up and the directory is read whenever
//! it cannot be sure it saw what a listing would show the kernel (see [`probe_after`]).

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
pub(crate) fn plain(s: &str) -> bool {
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
    if let Some(v) = probe_after(&dir, prefix.as_ref(), offset.as_ref()) {
        return Some(v);
    }
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
        out.push(object_meta(location, &meta)?);
    }
    Some(())
}

/// Versions a probe reads forward at most; a longer run of commits (a listing from
/// version 0 of an uncheckpointed log, a history) costs less as one directory read.
const MAX_PROBED_VERSIONS: u64 = 256;

/// The log files a listing of `dir` (the `_delta_log` at object path `at`) after `offset`
/// would show the Delta kernel, found by name: for each version v from the offset's on,
/// `{v:020}.checkpoint.parquet`, `{v:020}.crc` and `{v:020}.json`, up to the first version
/// after the offset's with no commit.
///
/// None (read the directory) when the offset is not version-named; when a name is a
/// symlink, a directory or unreadable; when more than [`MAX_PROBED_VERSIONS`] versions
/// follow; when neither the offset's version nor the next has a commit or checkpoint and
/// the version before has none either (a log cleaned up past the offset); and when
/// `_last_checkpoint` names a version at or after the offset's whose checkpoint the probe
/// did not find. That last rule covers a multi-part or V2 checkpoint (which only a listing
/// shows) and a log cleaned up while it was probed: a cleanup deletes only below a
/// checkpoint, so a gap in the probed commits has the hint beyond it.
///
/// Left out, as the listing's readers do without them: multi-part and V2 checkpoints after
/// the hint's version (the kernel replays those commits instead), log compaction files,
/// `_last_checkpoint` itself, staged commits and sidecars (the kernel stops reading a
/// listing at the first name that is not version-named).
fn probe_after(dir: &std::path::Path, at: &str, offset: &str) -> Option<Vec<ObjectMeta>> {
    let tail = offset.strip_prefix(at)?.strip_prefix('/')?;
    let digits = tail.get(..20)?;
    if !digits.bytes().all(|b| b.is_ascii_digit())
        || !matches!(tail.as_bytes().get(20), None | Some(b'.'))
    {
        return None;
    }
    let start: u64 = digits.parse().ok()?;
    let mut out = Vec::new();
    let mut checkpoints = Vec::new();
    let mut found = false;
    let mut v = start;
    loop {
        if v - start > MAX_PROBED_VERSIONS {
            return None;
        }
        let (commit, checkpoint) = probe_version(dir, at, offset, v, &mut out)?;
        if checkpoint {
            checkpoints.push(v);
        }
        found |= commit || checkpoint;
        if !commit && v > start {
            break;
        }
        v += 1;
    }
    if !found {
        // Nothing at the offset's version or the next: an offset just after the last
        // commit if the version before has one, else a log cleaned up past the offset.
        let before = match start.checked_sub(1) {
            Some(b) => probe_version(dir, at, offset, b, &mut Vec::new())?,
            None => (false, false),
        };
        if before == (false, false) {
            return None;
        }
    }
    match std::fs::read(dir.join("_last_checkpoint")) {
        Ok(bytes) => {
            let hint: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
            let version = hint.get("version")?.as_u64()?;
            if version >= start && !checkpoints.contains(&version) {
                return None;
            }
        }
        // No checkpoint was ever written, so no log was cleaned up either.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(_) => return None,
    }
    out.sort_unstable_by(|a, b| a.location.cmp(&b.location));
    Some(out)
}

/// Probe version `v`'s classic checkpoint, CRC and commit in `dir`, adding those after
/// `offset` to `out`. Returns whether the commit and the checkpoint exist; None when a
/// name is not a plain file or cannot be read.
fn probe_version(
    dir: &std::path::Path,
    at: &str,
    offset: &str,
    v: u64,
    out: &mut Vec<ObjectMeta>,
) -> Option<(bool, bool)> {
    let (mut commit, mut checkpoint) = (false, false);
    for suffix in ["checkpoint.parquet", "crc", "json"] {
        let name = format!("{v:020}.{suffix}");
        let meta = match std::fs::symlink_metadata(dir.join(&name)) {
            Ok(m) if m.is_file() => m,
            Ok(_) => return None,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => return None,
        };
        match suffix {
            "json" => commit = true,
            "checkpoint.parquet" => checkpoint = true,
            _ => {}
        }
        let location = format!("{at}/{name}");
        if location.as_str() > offset {
            out.push(object_meta(location, &meta)?);
        }
    }
    Some((commit, checkpoint))
}

/// What object_store's local file system says of a file: size, modification time and
/// its e-tag (inode, mtime, size).
pub(crate) fn object_meta(location: String, meta: &std::fs::Metadata) -> Option<ObjectMeta> {
    let modified = meta.modified().ok()?;
    let micros = modified
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    let inode = inode(meta);
    Some(ObjectMeta {
        location: Path::from(location),
        last_modified: DateTime::<Utc>::from(modified),
        size: meta.len(),
        e_tag: Some(format!("{inode:x}-{micros:x}-{:x}", meta.len())),
        version: None,
    })
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
        if let Some(kept) = super::logcache::get(location, &options).await {
            return Ok(kept);
        }
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

    /// The version-named files of object_store's listing of `prefix` after `offset`.
    async fn version_named(prefix: &Path, offset: &Path) -> Vec<ObjectMeta> {
        let local = LocalFileSystem::new();
        listing(&local, prefix, offset)
            .await
            .into_iter()
            .filter(|m| {
                let name = &m.location.as_ref().as_bytes()[prefix.as_ref().len() + 1..];
                name.len() > 20
                    && name[..20].iter().all(u8::is_ascii_digit)
                    && !name.contains(&b'/')
            })
            .collect()
    }

    /// Listings after a version-named offset are answered by probing names, and show
    /// every commit, classic checkpoint and CRC file a directory read shows after it; where
    /// the probe cannot be sure (a log cleaned up past the offset, a checkpoint it cannot
    /// name, a gap in the commits) the directory is read and the listing is object_store's.
    #[tokio::test]
    async fn probed_log_listings_show_the_version_named_files() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("t/_delta_log");
        std::fs::create_dir_all(log.join("_commits")).unwrap();
        for v in 0..30u64 {
            std::fs::write(log.join(format!("{v:020}.json")), vec![b'x'; v as usize]).unwrap();
        }
        for v in [10u64, 20] {
            std::fs::write(log.join(format!("{v:020}.checkpoint.parquet")), b"c").unwrap();
        }
        std::fs::write(log.join("00000000000000000025.crc"), b"{}").unwrap();
        std::fs::write(log.join("_last_checkpoint"), br#"{"version":20,"size":3}"#).unwrap();
        std::fs::write(log.join("00000000000000000031.json#1"), b"partial").unwrap();
        std::fs::write(log.join("_commits/00000000000000000031.uuid.json"), b"s").unwrap();
        let fast = LogListing::new(Arc::new(LocalFileSystem::new()));
        let prefix = Path::from_absolute_path(&log).unwrap();
        let at = |name: &str| Path::from(format!("{}/{name}", prefix.as_ref()));
        for (offset, files) in [
            ("00000000000000000000", 33),
            ("00000000000000000000.json", 32),
            ("00000000000000000010.checkpoint.parquet", 22),
            ("00000000000000000020", 12),
            ("00000000000000000025.crc", 5),
            ("00000000000000000029", 1),
            // Just after the last commit: nothing new.
            ("00000000000000000030", 0),
        ] {
            let offset = at(offset);
            let got = probe_after(&log, prefix.as_ref(), offset.as_ref())
                .unwrap_or_else(|| panic!("probed after {offset}"));
            assert_eq!(got, version_named(&prefix, &offset).await, "after {offset}");
            assert_eq!(got.len(), files, "after {offset}");
            assert_eq!(
                listing(&fast, &prefix, &offset).await,
                got,
                "after {offset}"
            );
        }
        let probed = |offset: &str| probe_after(&log, prefix.as_ref(), at(offset).as_ref());
        // Not version-named: the directory.
        assert!(probed("_last_checkpoint").is_none());
        assert!(probed("_commits/00000000000000000030.json").is_none());
        // Past the end by more than one version: the probe cannot tell it from a log
        // cleaned up past the offset.
        assert!(probed("00000000000000000031").is_none());
        // The hint's checkpoint is one the probe cannot name (multi-part).
        std::fs::rename(
            log.join("00000000000000000020.checkpoint.parquet"),
            log.join("00000000000000000020.checkpoint.0000000001.0000000001.parquet"),
        )
        .unwrap();
        assert!(probed("00000000000000000012").is_none());
        // Before the hint's version, a multi-part checkpoint is nothing the reader needs.
        assert!(probed("00000000000000000021").is_some());
        std::fs::rename(
            log.join("00000000000000000020.checkpoint.0000000001.0000000001.parquet"),
            log.join("00000000000000000020.checkpoint.parquet"),
        )
        .unwrap();
        // A gap in the commits below the hint's checkpoint (a cleanup under way).
        std::fs::remove_file(log.join("00000000000000000015.json")).unwrap();
        assert!(probed("00000000000000000012").is_none());
        // A log cleaned up past the offset: nothing at 0, 1 or before.
        for v in 0..16u64 {
            let _ = std::fs::remove_file(log.join(format!("{v:020}.json")));
        }
        assert!(probed("00000000000000000000").is_none());
        // …and the listing is object_store's, from the directory.
        let offset = at("00000000000000000000");
        let want = listing(&LocalFileSystem::new(), &prefix, &offset).await;
        assert_eq!(listing(&fast, &prefix, &offset).await, want);
        assert!(want.len() > 15);
        // From the checkpoint on, the probe answers again.
        assert!(probed("00000000000000000020").is_some());
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
