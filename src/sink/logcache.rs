//! A local table's immutable log files, read once per process.
//!
//! Loading a Delta table (what every `kestrel run` does for each table it touches, as a
//! new process) reads its newest checkpoint and the commits after it — and the Delta
//! kernel reads them more than once: the protocol and metadata are replayed first, then
//! the files, and each pass over the checkpoint reads its footer and its column chunks
//! as separate requests. A load of a small bronze table opened log files 29 times, each
//! open handed to a blocking thread and back; with the files kept here, 11.
//!
//! Commit files (`<version>.json`) are written once, by put-if-absent, and checkpoints
//! (`<version>.checkpoint[.<part>.<parts>].parquet`) are whole when they appear; neither
//! is changed afterwards. Their bytes are kept here, by path, with the e-tag the local
//! store gives them (inode, modification time, size), checked against the file on disk
//! at every get, so a table deleted and created again under the same path is read
//! afresh; every later request — a range, a head — is answered from memory. Small
//! files are read on the calling thread: a few kilobytes from the page cache cost less
//! than the handoff. The kept bytes are bounded ([`BUDGET`]); the oldest go first.
//! Anything else (other files, `_last_checkpoint`, conditional requests, a path that
//! needs percent-encoding, an I/O error, a range the file does not have) goes to the
//! wrapped store, which answers it as before.
//!
//! Measured (opt-level 1, `cargo bench --bench jobs -- age small 72`, profiled): the
//! loads of a run's tables took 188 ms a run in its sixth hour, 265 ms without the kept
//! files; a run 0.49 s against 0.52–0.54 s (medians of hours 2–8, two alternating pairs).
//! Stores other than the local one (S3) are not wrapped: there the e-tag check would
//! itself be a request.

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::sync::{LazyLock, Mutex};

use bytes::Bytes;
use deltalake::logstore::object_store::path::Path;
use deltalake::logstore::object_store::{Attributes, GetOptions, GetResult, GetResultPayload};
use futures::StreamExt;

/// Bytes of log files kept at most (per process).
pub const BUDGET: usize = 32 << 20;

/// Log files larger than this are read, and answered, by the wrapped store.
const LARGEST: u64 = 8 << 20;

/// Files up to this size are read on the calling thread.
const INLINE: u64 = 256 << 10;

struct Kept {
    files: HashMap<String, (String, Bytes)>,
    order: VecDeque<String>,
    bytes: usize,
}

/// Gets answered from kept bytes since the process started (for tests).
static HITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

static KEPT: LazyLock<Mutex<Kept>> = LazyLock::new(|| {
    Mutex::new(Kept {
        files: HashMap::new(),
        order: VecDeque::new(),
        bytes: 0,
    })
});

fn lock() -> std::sync::MutexGuard<'static, Kept> {
    match KEPT.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Forget every kept file (what a new process starts with).
pub fn clear() {
    let mut g = lock();
    g.files.clear();
    g.order.clear();
    g.bytes = 0;
}

/// Whether `name` is a commit or a classic (possibly multi-part) checkpoint file name.
fn immutable(name: &str) -> bool {
    let Some((version, rest)) = name.split_once('.') else {
        return false;
    };
    if version.len() != 20 || !version.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    if rest == "json" || rest == "checkpoint.parquet" {
        return true;
    }
    // `<v>.checkpoint.<part>.<parts>.parquet`, both ten digits.
    let parts: Vec<&str> = rest.split('.').collect();
    matches!(parts.as_slice(), ["checkpoint", a, b, "parquet"]
        if [a, b].iter().all(|p| p.len() == 10 && p.bytes().all(|c| c.is_ascii_digit())))
}

/// The file `location` names on disk (the local store is rooted at `/`) when it is an
/// immutable log file with a plain path, else None.
fn log_file(location: &Path) -> Option<std::path::PathBuf> {
    let mut parts: Vec<_> = location.parts().collect();
    let name = parts.pop()?;
    let dir = parts.last()?;
    if dir.as_ref() != "_delta_log" || !immutable(name.as_ref()) {
        return None;
    }
    if !location.parts().all(|p| super::loglist::plain(p.as_ref())) {
        return None;
    }
    Some(std::path::PathBuf::from(format!("/{}", location.as_ref())))
}

/// Open `path` and read it whole with its metadata (the open file's, so both describe
/// the same file); None when the wrapped store should answer instead.
fn read(path: &std::path::Path) -> Option<(std::fs::Metadata, Vec<u8>)> {
    let mut f = std::fs::File::open(path).ok()?;
    let meta = f.metadata().ok()?;
    if !meta.is_file() || meta.len() > LARGEST {
        return None;
    }
    let mut buf = Vec::with_capacity(meta.len() as usize);
    f.read_to_end(&mut buf).ok()?;
    (buf.len() as u64 == meta.len()).then_some((meta, buf))
}

/// Answer a get of `location` from the kept bytes (reading and keeping them first when
/// needed), or None when the wrapped store should answer.
pub async fn get(location: &Path, options: &GetOptions) -> Option<GetResult> {
    if options.if_match.is_some()
        || options.if_none_match.is_some()
        || options.if_modified_since.is_some()
        || options.if_unmodified_since.is_some()
        || options.version.is_some()
    {
        return None;
    }
    let path = log_file(location)?;
    let key = location.as_ref().to_string();
    // The e-tag of what is on disk now, so a file deleted and written again under the
    // same name is not answered from an older copy.
    let on_disk = std::fs::metadata(&path)
        .ok()
        .filter(|m| m.len() <= LARGEST)?;
    let meta = super::loglist::object_meta(key.clone(), &on_disk)?;
    let etag = meta.e_tag.clone()?;
    let kept = {
        let g = lock();
        g.files
            .get(&key)
            .filter(|(e, _)| *e == etag)
            .map(|(_, b)| b.clone())
    };
    let (meta, bytes) = match kept {
        Some(b) => {
            HITS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (meta, b)
        }
        None => {
            let (fresh, buf) =
                if on_disk.len() <= INLINE || tokio::runtime::Handle::try_current().is_err() {
                    read(&path)?
                } else {
                    let p = path.clone();
                    tokio::task::spawn_blocking(move || read(&p)).await.ok()??
                };
            let meta = super::loglist::object_meta(key.clone(), &fresh)?;
            let bytes = Bytes::from(buf);
            keep(key, meta.e_tag.clone()?, bytes.clone());
            (meta, bytes)
        }
    };
    let range = match &options.range {
        Some(r) => r.as_range(meta.size).ok()?,
        None => 0..meta.size,
    };
    let body = match options.head {
        true => Bytes::new(),
        false => bytes.slice(range.start as usize..range.end as usize),
    };
    Some(GetResult {
        payload: GetResultPayload::Stream(futures::stream::once(async move { Ok(body) }).boxed()),
        meta,
        range,
        attributes: Attributes::default(),
    })
}

fn keep(key: String, etag: String, bytes: Bytes) {
    let mut g = lock();
    if let Some((_, old)) = g.files.remove(&key) {
        g.bytes -= old.len();
        g.order.retain(|k| *k != key);
    }
    while g.bytes + bytes.len() > BUDGET {
        let Some(oldest) = g.order.pop_front() else {
            break;
        };
        if let Some((_, b)) = g.files.remove(&oldest) {
            g.bytes -= b.len();
        }
    }
    if bytes.len() > BUDGET {
        return;
    }
    g.bytes += bytes.len();
    g.order.push_back(key.clone());
    g.files.insert(key, (etag, bytes));
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use deltalake::logstore::object_store::local::LocalFileSystem;
    use deltalake::logstore::object_store::{GetRange, ObjectStore, ObjectStoreExt};

    use super::*;
    use crate::sink::loglist::LogListing;

    async fn body(r: GetResult) -> (u64, std::ops::Range<u64>, Bytes) {
        let (size, range) = (r.meta.size, r.range.clone());
        (size, range, r.bytes().await.unwrap())
    }

    /// Whatever a get asks of a commit or checkpoint — all of it, a range, a suffix, its
    /// head — the answer is the local store's, from memory after the first read; a file
    /// deleted and written again under its name is read afresh, and `_last_checkpoint`
    /// (rewritten in place) is never kept.
    #[tokio::test]
    async fn log_files_read_once_answer_as_the_store_does() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("t/_delta_log");
        std::fs::create_dir_all(&log).unwrap();
        let commit = log.join("00000000000000000007.json");
        std::fs::write(&commit, b"{\"commitInfo\":{}}\n{\"add\":{}}\n").unwrap();
        std::fs::write(log.join("_last_checkpoint"), br#"{"version":0}"#).unwrap();
        let local: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new());
        let cached = LogListing::new(local.clone());
        let at = |name: &str| Path::from_absolute_path(log.join(name)).unwrap();
        let path = at("00000000000000000007.json");
        let asks = || {
            [
                GetOptions::default(),
                GetOptions {
                    range: Some(GetRange::Bounded(2..9)),
                    ..Default::default()
                },
                GetOptions {
                    range: Some(GetRange::Suffix(5)),
                    ..Default::default()
                },
                GetOptions {
                    range: Some(GetRange::Offset(20)),
                    ..Default::default()
                },
            ]
        };
        let hits = HITS.load(Ordering::Relaxed);
        for _ in 0..2 {
            for ask in asks() {
                let want = body(local.get_opts(&path, ask.clone()).await.unwrap()).await;
                assert_eq!(body(cached.get_opts(&path, ask).await.unwrap()).await, want);
            }
            assert_eq!(
                cached.head(&path).await.unwrap(),
                local.head(&path).await.unwrap()
            );
        }
        // Eight of the nine gets after the first could be answered from memory (a
        // concurrent test's `tables::clear` costs at most a re-read).
        assert!(HITS.load(Ordering::Relaxed) >= hits + 4);
        // A range past the end is the store's error.
        let past = GetOptions {
            range: Some(GetRange::Bounded(100..200)),
            ..Default::default()
        };
        assert!(cached.get_opts(&path, past).await.is_err());
        // Deleted: not found, as from the store.
        std::fs::remove_file(&commit).unwrap();
        let gone = cached.get_opts(&path, GetOptions::default()).await;
        assert!(matches!(
            gone,
            Err(deltalake::logstore::object_store::Error::NotFound { .. })
        ));
        // Written again with other bytes of the same length: those bytes.
        std::fs::write(&commit, b"{\"commitInfo\":{}}\n{\"rem\":{}}\n").unwrap();
        let (_, _, b) = body(cached.get_opts(&path, GetOptions::default()).await.unwrap()).await;
        assert_eq!(&b[..], b"{\"commitInfo\":{}}\n{\"rem\":{}}\n");
        // `_last_checkpoint` changes in place; each get reads it.
        let last = at("_last_checkpoint");
        let (_, _, b) = body(cached.get_opts(&last, GetOptions::default()).await.unwrap()).await;
        assert_eq!(&b[..], br#"{"version":0}"#);
        std::fs::write(log.join("_last_checkpoint"), br#"{"version":10}"#).unwrap();
        let (_, _, b) = body(cached.get_opts(&last, GetOptions::default()).await.unwrap()).await;
        assert_eq!(&b[..], br#"{"version":10}"#);
    }

    #[test]
    fn commits_and_checkpoints_are_immutable_and_nothing_else_is() {
        assert!(immutable("00000000000000000012.json"));
        assert!(immutable("00000000000000000010.checkpoint.parquet"));
        assert!(immutable(
            "00000000000000000010.checkpoint.0000000001.0000000002.parquet"
        ));
        assert!(!immutable("_last_checkpoint"));
        assert!(!immutable("00000000000000000012.crc"));
        assert!(!immutable("0000000000000000012.json"));
        assert!(!immutable("00000000000000000012.json.tmp"));
        assert!(!immutable("00000000000000000010.checkpoint.1.2.parquet"));
        assert!(!immutable(".00000000000000000012.json.abc"));
    }
}
