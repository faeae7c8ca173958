//! A local table's immutable log files, and its small data files, read once per process.
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
//!
//! Data files up to [`DATA_LARGEST`] are kept the same way, apart ([`DATA_BUDGET`]): a
//! scan reads a Parquet file as several ranges (footer, page index, bloom filters,
//! column chunks), each an open, a read and a close on a blocking thread, and a run
//! reads the same small files again and again — the two payments jobs read each of
//! their sources five times a run (twice keyed over the 7-day horizon), the dedup
//! probe and the jobs read the open day's appends. A five-minute run of small drops
//! opened data files ≈ 470 times (`strace`, `--bench jobs -- age small 24`). Larger
//! files are read range by range, as before: a day's compacted bronze at Kestrel's
//! scale, and also, with small drops, a closed day of orders or payments (≈ 400 KB), so
//! the horizon's closed days are still read by range (README, "Cost over time").

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

/// Bytes of small data files kept at most (per process), apart from the log files.
pub const DATA_BUDGET: usize = 16 << 20;

/// Data files larger than this are read, and answered, by the wrapped store: a scan of a
/// large file reads the row groups and columns it needs, not the file.
pub const DATA_LARGEST: u64 = 256 << 10;

/// Files up to this size are read on the calling thread.
const INLINE: u64 = 256 << 10;

struct Kept {
    files: HashMap<String, (String, Bytes)>,
    order: VecDeque<String>,
    bytes: usize,
}

/// Gets answered from kept bytes since the process started (for tests).
static HITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn empty() -> Mutex<Kept> {
    Mutex::new(Kept {
        files: HashMap::new(),
        order: VecDeque::new(),
        bytes: 0,
    })
}

/// Log files (commits, checkpoints).
static KEPT: LazyLock<Mutex<Kept>> = LazyLock::new(empty);

/// Small data files, kept apart so that a scan of many of them does not push the log
/// files out.
static DATA: LazyLock<Mutex<Kept>> = LazyLock::new(empty);

/// Which kind of immutable file a path names, and where it is kept.
#[derive(Clone, Copy)]
enum Kind {
    Log,
    Data,
}

impl Kind {
    fn largest(self) -> u64 {
        match self {
            Kind::Log => LARGEST,
            Kind::Data => DATA_LARGEST,
        }
    }

    fn budget(self) -> usize {
        match self {
            Kind::Log => BUDGET,
            Kind::Data => DATA_BUDGET,
        }
    }

    fn lock(self) -> std::sync::MutexGuard<'static, Kept> {
        let m = match self {
            Kind::Log => &KEPT,
            Kind::Data => &DATA,
        };
        match m.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

/// Forget every kept file (what a new process starts with).
pub fn clear() {
    for kind in [Kind::Log, Kind::Data] {
        let mut g = kind.lock();
        g.files.clear();
        g.order.clear();
        g.bytes = 0;
    }
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

/// The file `location` names on disk (the local store is rooted at `/`) and its kind
/// when it is an immutable log file or a data file with a plain path, else None. A data
/// file is any Parquet file outside `_delta_log`: Delta writes each once, under a new
/// name, and never changes it (compaction and MERGE write new files and remove the old
/// ones from the log).
fn immutable_file(location: &Path) -> Option<(std::path::PathBuf, Kind)> {
    let mut parts: Vec<_> = location.parts().collect();
    let name = parts.pop()?;
    let in_log = parts.iter().any(|p| p.as_ref() == "_delta_log");
    let kind = match parts.last()?.as_ref() == "_delta_log" {
        true if immutable(name.as_ref()) => Kind::Log,
        false if !in_log && name.as_ref().ends_with(".parquet") => Kind::Data,
        _ => return None,
    };
    if !location.parts().all(|p| super::loglist::plain(p.as_ref())) {
        return None;
    }
    Some((
        std::path::PathBuf::from(format!("/{}", location.as_ref())),
        kind,
    ))
}

/// Open `path` and read it whole with its metadata (the open file's, so both describe
/// the same file); None when the wrapped store should answer instead.
fn read(path: &std::path::Path, largest: u64) -> Option<(std::fs::Metadata, Vec<u8>)> {
    let mut f = std::fs::File::open(path).ok()?;
    let meta = f.metadata().ok()?;
    if !meta.is_file() || meta.len() > largest {
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
    let (path, kind) = immutable_file(location)?;
    let largest = kind.largest();
    let key = location.as_ref().to_string();
    // The e-tag of what is on disk now, so a file deleted and written again under the
    // same name is not answered from an older copy.
    let on_disk = std::fs::metadata(&path)
        .ok()
        .filter(|m| m.len() <= largest)?;
    let meta = super::loglist::object_meta(key.clone(), &on_disk)?;
    let etag = meta.e_tag.clone()?;
    let kept = {
        let g = kind.lock();
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
                    read(&path, largest)?
                } else {
                    let p = path.clone();
                    tokio::task::spawn_blocking(move || read(&p, largest))
                        .await
                        .ok()??
                };
            let meta = super::loglist::object_meta(key.clone(), &fresh)?;
            let bytes = Bytes::from(buf);
            keep(kind, key, meta.e_tag.clone()?, bytes.clone());
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

fn keep(kind: Kind, key: String, etag: String, bytes: Bytes) {
    let budget = kind.budget();
    let mut g = kind.lock();
    if let Some((_, old)) = g.files.remove(&key) {
        g.bytes -= old.len();
        g.order.retain(|k| *k != key);
    }
    while g.bytes + bytes.len() > budget {
        let Some(oldest) = g.order.pop_front() else {
            break;
        };
        if let Some((_, b)) = g.files.remove(&oldest) {
            g.bytes -= b.len();
        }
    }
    if bytes.len() > budget {
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

    /// A small data file's ranges are answered as the store answers them, from memory
    /// after the first read; a large one, and a file in `_delta_log` that is neither a
    /// commit nor a checkpoint, are always the store's.
    #[tokio::test]
    async fn small_data_files_read_once_large_ones_by_range() {
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("t/event_date=2026-06-01");
        std::fs::create_dir_all(&part).unwrap();
        std::fs::create_dir_all(dir.path().join("t/_delta_log")).unwrap();
        let small: Vec<u8> = (0..5_000u32).map(|i| (i % 251) as u8).collect();
        let large: Vec<u8> = (0..(DATA_LARGEST as u32 + 10))
            .map(|i| (i % 13) as u8)
            .collect();
        std::fs::write(part.join("part-00000-a-c000.snappy.parquet"), &small).unwrap();
        std::fs::write(part.join("part-00001-b-c000.snappy.parquet"), &large).unwrap();
        std::fs::write(dir.path().join("t/_delta_log/x.parquet"), &small).unwrap();
        let local: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new());
        let cached = LogListing::new(local.clone());
        let at = |p: std::path::PathBuf| Path::from_absolute_path(p).unwrap();
        let small_at = at(part.join("part-00000-a-c000.snappy.parquet"));
        let large_at = at(part.join("part-00001-b-c000.snappy.parquet"));
        let stray_at = at(dir.path().join("t/_delta_log/x.parquet"));
        let asks = [
            GetOptions {
                range: Some(GetRange::Suffix(8)),
                ..Default::default()
            },
            GetOptions {
                range: Some(GetRange::Bounded(100..4_000)),
                ..Default::default()
            },
            GetOptions::default(),
        ];
        let before = HITS.load(Ordering::Relaxed);
        for path in [&small_at, &large_at, &stray_at] {
            for ask in &asks {
                let want = body(local.get_opts(path, ask.clone()).await.unwrap()).await;
                let got = body(cached.get_opts(path, ask.clone()).await.unwrap()).await;
                assert_eq!(got, want);
            }
        }
        assert!(immutable_file(&small_at).is_some_and(|(_, k)| matches!(k, Kind::Data)));
        assert!(immutable_file(&stray_at).is_none());
        let again = body(cached.get_opts(&small_at, asks[1].clone()).await.unwrap()).await;
        assert_eq!(&again.2[..], &small[100..4_000]);
        // Three of the small file's four gets could be answered from memory (a
        // concurrent test's `tables::clear` costs at most a re-read); the large file is
        // never kept.
        assert!(HITS.load(Ordering::Relaxed) >= before + 2);
        assert!(!Kind::Data.lock().files.contains_key(large_at.as_ref()));
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
