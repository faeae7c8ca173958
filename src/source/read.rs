//! Reading a large landed file in ranges, decoding it as it arrives.
//!
//! A landed file is normally fetched whole and then decoded (the fastest path for the
//! many small files producers land). An NDJSON file larger than [`STREAM_ABOVE`] — plain
//! or gzip — is instead read in [`RANGE_BYTES`] ranges, each fetched on condition that
//! the object still has the e-tag it was planned with, and fed to the decoder as it
//! arrives: a 1 GiB file without a newline costs the range and the record limit, not
//! 1 GiB. (A file's valid rows are still held until its batch commits: a file is the
//! unit of exactly-once, and the batch bound `max_bytes_per_batch` counts landed bytes.)
//! Parquet needs random access to its footer and is read whole.
//!
//! A file read whole from a local directory is read into a buffer kept for the next
//! file ([`Whole`]): a fresh buffer per file is fresh memory (glibc
//! maps allocations above 1 MiB, [`crate::alloc`]), zeroed and faulted in page by page
//! and unmapped again — with 200 files of 4.5 MB that was a fifth of a run's page faults.

use std::io::{self, Read};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, GetResultPayload, ObjectStore, ObjectStoreExt};

use super::decode::{decode_file, decode_ndjson, decode_ndjson_read, Decoded, MAX_GUNZIPPED_BYTES};
use super::discover::Format;
use super::validate::FileContext;
use crate::error::{Error, Result};
use crate::schema::SourceSchema;

/// NDJSON files larger than this are read in ranges and decoded as they arrive.
pub const STREAM_ABOVE: u64 = 64 << 20;

/// The size of one ranged read.
pub const RANGE_BYTES: u64 = 8 << 20;

/// True when a planned file is read in ranges rather than whole.
pub fn streams(format: Format, size: u64) -> bool {
    format != Format::Parquet && size > STREAM_ABOVE
}

/// One landed object, for [`decode_in_ranges`].
pub struct Landed {
    pub store: Arc<dyn ObjectStore>,
    pub path: Path,
    /// The size it was planned with.
    pub size: u64,
    /// The e-tag it was listed with; every range is read on condition that it still holds.
    pub e_tag: Option<String>,
    /// How the file is named in messages.
    pub display: String,
}

/// Decode a landed NDJSON file read in ranges. Runs on a blocking thread: each range is
/// awaited with `handle`. A file changed or gone since it was planned is rejected whole
/// with the reason (as a whole read would); any other store error fails the batch.
pub fn decode_in_ranges(
    landed: Landed,
    format: Format,
    schema: &Arc<SourceSchema>,
    ctx: &FileContext,
    handle: &tokio::runtime::Handle,
) -> Result<Decoded> {
    let mut reader = RangeReader {
        landed: &landed,
        handle,
        pos: 0,
        buf: Bytes::new(),
        failure: None,
    };
    let gzip = format == Format::NdjsonGz;
    let decoded = decode_ndjson_read(&mut reader, gzip, MAX_GUNZIPPED_BYTES, schema, ctx)?;
    match reader.failure {
        None => Ok(decoded),
        Some(Failure::Changed(why)) => Ok(Decoded::FileRejected { reason: why }),
        Some(Failure::Store(e)) => Err(Error::storage(landed.display.clone(), e)),
    }
}

enum Failure {
    /// The object is no longer what was planned: rejected whole with this reason.
    Changed(String),
    Store(object_store::Error),
}

/// `Read` over consecutive conditional range requests. The error behind a failed read is
/// kept in `failure`: the decoder only sees that the read failed.
struct RangeReader<'a> {
    landed: &'a Landed,
    handle: &'a tokio::runtime::Handle,
    pos: u64,
    buf: Bytes,
    failure: Option<Failure>,
}

impl RangeReader<'_> {
    fn fill(&mut self) -> std::result::Result<(), Failure> {
        let l = self.landed;
        let end = (self.pos + RANGE_BYTES).min(l.size);
        let opts = GetOptions {
            range: Some(GetRange::Bounded(self.pos..end)),
            if_match: l.e_tag.clone(),
            ..Default::default()
        };
        let got = self.handle.block_on(async {
            let r = l.store.get_opts(&l.path, opts).await?;
            if r.meta.size != l.size {
                return Ok(Err(r.meta.size));
            }
            r.bytes().await.map(Ok)
        });
        match got {
            Ok(Ok(b)) if b.is_empty() => Err(Failure::Changed(format!(
                "file changed while being processed (ended at byte {} of {} planned)",
                self.pos, l.size
            ))),
            Ok(Ok(b)) => {
                self.pos += b.len() as u64;
                self.buf = b;
                Ok(())
            }
            Ok(Err(found)) => Err(Failure::Changed(changed_size(l.size, found))),
            Err(object_store::Error::Precondition { .. }) => Err(Failure::Changed(
                "file changed while being processed (its e-tag is not the one planned)".into(),
            )),
            Err(object_store::Error::NotFound { .. }) => Err(Failure::Changed(
                "file disappeared after it was planned".into(),
            )),
            Err(e) => Err(Failure::Store(e)),
        }
    }
}

impl Read for RangeReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.buf.is_empty() {
            if self.pos >= self.landed.size || self.failure.is_some() {
                return Ok(0);
            }
            if let Err(f) = self.fill() {
                self.failure = Some(f);
                return Err(io::Error::other("landed file read failed"));
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf.split_to(n));
        Ok(n)
    }
}

/// A landed file fetched whole, to be decoded on a blocking thread ([`Whole::decode`]).
pub enum Whole {
    /// The store handed over the local file (of the size planned): read into a pooled
    /// buffer.
    File(std::fs::File),
    /// The bytes, as an object store returns them.
    Bytes(Bytes),
}

/// The largest read buffer kept for the next file (a larger file's buffer is freed
/// after it).
pub const KEEP_READ_BUFFER: usize = 16 << 20;

/// At most this many read buffers are kept (a source's files are decoded one per core at
/// a time, so as many buffers as cores are in use at once).
const KEPT_BUFFERS: usize = 8;

/// Read buffers free for the next local file read whole ([`Whole::decode`]). A pool
/// rather than one per thread: tokio's blocking pool runs the decodes on whichever of
/// its threads is free, and a buffer per thread that ever decoded held 70–110 MB more
/// at the peak of a 5M-event run than the pool does.
static READ_BUFFERS: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A buffer of at least `len` bytes from the pool (or a new one).
fn take_buffer(len: usize) -> Vec<u8> {
    let pooled = READ_BUFFERS.lock().ok().and_then(|mut p| p.pop());
    let mut buf = pooled.unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, 0);
    }
    buf
}

/// Return a buffer to the pool (unless it is too large, or the pool full).
fn give_back(buf: Vec<u8>) {
    if buf.len() > KEEP_READ_BUFFER {
        return;
    }
    if let Ok(mut p) = READ_BUFFERS.lock() {
        if p.len() < KEPT_BUFFERS {
            p.push(buf);
        }
    }
}

/// Free the pooled read buffers: a source's ingestion calls this when it is done, so an
/// idle process holds none.
pub fn release_buffers() {
    if let Ok(mut p) = READ_BUFFERS.lock() {
        p.clear();
        p.shrink_to_fit();
    }
}

/// Fetch a landed file of `size` bytes whole. `Ok(Err(reason))` when it is gone or no
/// longer the size planned (rejected whole, as in [`decode_in_ranges`]).
pub async fn fetch_whole(
    store: &Arc<dyn ObjectStore>,
    path: &Path,
    size: u64,
    display: &str,
) -> Result<std::result::Result<Whole, String>> {
    let r = match store.get(path).await {
        Ok(r) => r,
        Err(object_store::Error::NotFound { .. }) => {
            return Ok(Err("file disappeared after it was planned".into()))
        }
        Err(e) => return Err(Error::storage(display, e)),
    };
    if r.meta.size != size {
        return Ok(Err(changed_size(size, r.meta.size)));
    }
    match r.payload {
        GetResultPayload::File(file, _) => Ok(Ok(Whole::File(file))),
        GetResultPayload::Stream(_) => {
            let b = r.bytes().await.map_err(|e| Error::storage(display, e))?;
            Ok(Ok(Whole::Bytes(b)))
        }
    }
}

/// Why a file whose size is no longer the one planned is rejected.
fn changed_size(planned: u64, found: u64) -> String {
    format!("file changed while being processed ({planned} bytes planned, {found} found)")
}

impl Whole {
    /// Decode the file (`size` bytes planned; `display` names it in errors). A local
    /// NDJSON file is read into a pooled buffer; Parquet keeps its bytes (its reader
    /// wants them owned).
    pub fn decode(
        self,
        size: u64,
        display: &str,
        format: Format,
        schema: &Arc<SourceSchema>,
        ctx: &FileContext,
    ) -> Result<Decoded> {
        let file = match self {
            Whole::Bytes(b) => return decode_file(b, format, schema, ctx),
            Whole::File(file) => file,
        };
        let len = usize::try_from(size)
            .map_err(|_| Error::io(display, io::Error::other("file too large to read whole")))?;
        if format == Format::Parquet {
            let mut buf = vec![0; len];
            return match read_exactly(&file, &mut buf, display)? {
                Ok(()) => decode_file(Bytes::from(buf), format, schema, ctx),
                Err(reason) => Ok(Decoded::FileRejected { reason }),
            };
        }
        let mut buf = take_buffer(len);
        let decoded = match read_exactly(&file, &mut buf[..len], display) {
            Ok(Ok(())) => match format {
                Format::NdjsonGz => {
                    decode_ndjson_read(&buf[..len], true, MAX_GUNZIPPED_BYTES, schema, ctx)
                }
                _ => decode_ndjson(&buf[..len], schema, ctx),
            },
            Ok(Err(reason)) => Ok(Decoded::FileRejected { reason }),
            Err(e) => Err(e),
        };
        give_back(buf);
        decoded
    }
}

/// Fill `buf` from the start of `file`; `Ok(Err(reason))` when the file ends first (it
/// was cut while being processed).
fn read_exactly(
    file: &std::fs::File,
    buf: &mut [u8],
    display: &str,
) -> Result<std::result::Result<(), String>> {
    // A file the store has just opened: read from its start.
    let mut file = file;
    let mut at = 0;
    while at < buf.len() {
        match file.read(&mut buf[at..]) {
            Ok(0) => {
                return Ok(Err(format!(
                    "file changed while being processed (ended at byte {at} of {} planned)",
                    buf.len()
                )))
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => return Err(Error::io(display, source)),
        }
    }
    Ok(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::load_all;
    use object_store::memory::InMemory;
    use object_store::{ObjectStoreExt, PutPayload};

    fn orders() -> Arc<SourceSchema> {
        load_all(std::path::Path::new("/none")).unwrap()["orders"].clone()
    }

    fn ctx() -> FileContext {
        FileContext {
            source_file: "orders/big.ndjson".into(),
            partition: "default".into(),
            landed_at_us: 1_764_000_000_000_000,
            batch_id: 1,
            ingested_at_us: 0,
        }
    }

    /// The rows, rejects and record count of a file decoded whole (a file rejected whole
    /// fails the test).
    fn rows_of(
        d: Decoded,
    ) -> (
        Option<arrow::array::RecordBatch>,
        Vec<super::super::decode::Rejected>,
        usize,
    ) {
        match d {
            Decoded::Rows {
                batch,
                rejects,
                records,
            } => (batch, rejects, records),
            other => panic!("rejected whole: {other:?}"),
        }
    }

    fn line(i: usize) -> String {
        format!(
            r#"{{"event_id":"e{i}","event_ts":"2025-11-24T10:00:00Z","order_id":"o{i}","sku":"s","quantity":1,"amount_cents":{i}}}"#
        )
    }

    /// A file read in ranges decodes exactly as the same bytes decoded whole, with lines
    /// cut by range boundaries, CRLF endings, a bad line and an over-long record that
    /// spans several ranges.
    #[test]
    fn a_file_read_in_ranges_decodes_as_it_would_whole() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut text = String::new();
        let mut i = 0;
        while text.len() < 3 * RANGE_BYTES as usize {
            text.push_str(&line(i));
            text.push_str(if i % 7 == 0 { "\r\n" } else { "\n" });
            if i == 1000 {
                text.push_str("{not json\n");
                text.push_str(&"x".repeat(super::super::decode::MAX_RECORD_BYTES * 3));
                text.push('\n');
            }
            i += 1;
        }
        text.push_str(&line(i)); // no final newline
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let path = Path::from("orders/big.ndjson");
        let put = rt
            .block_on(store.put(&path, PutPayload::from(text.clone().into_bytes())))
            .unwrap();
        let landed = Landed {
            store: store.clone(),
            path: path.clone(),
            size: text.len() as u64,
            e_tag: put.e_tag.clone(),
            display: "mem:///orders/big.ndjson".into(),
        };
        let ranged =
            decode_in_ranges(landed, Format::Ndjson, &orders(), &ctx(), rt.handle()).unwrap();
        let whole =
            super::super::decode::decode_ndjson(text.as_bytes(), &orders(), &ctx()).unwrap();
        let ((b1, r1, n1), (b2, r2, n2)) = (rows_of(ranged), rows_of(whole));
        assert_eq!((n1, n1), (n2, i + 3));
        assert_eq!(r1, r2);
        assert_eq!(r1.len(), 2);
        assert!(
            r1[1].reason.contains("longer than the limit"),
            "{:?}",
            r1[1]
        );
        assert_eq!(b1, b2);
        assert_eq!(b1.unwrap().num_rows(), i + 1);
    }

    /// A file replaced after it was planned is rejected whole as changed, and a missing
    /// one as gone — neither half-read into bronze.
    #[test]
    fn a_file_changed_or_gone_after_planning_is_rejected_whole() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let path = Path::from("orders/big.ndjson");
        let body = format!("{}\n", line(1)).repeat(1000);
        let put = rt
            .block_on(store.put(&path, PutPayload::from(body.clone().into_bytes())))
            .unwrap();
        rt.block_on(store.put(&path, PutPayload::from(body.clone().into_bytes())))
            .unwrap();
        let landed = |p: &str| Landed {
            store: store.clone(),
            path: Path::from(p),
            size: body.len() as u64,
            e_tag: put.e_tag.clone(),
            display: "mem:///x".into(),
        };
        for (path, why) in [
            ("orders/big.ndjson", "e-tag"),
            ("orders/gone.ndjson", "disappeared"),
        ] {
            let d = decode_in_ranges(landed(path), Format::Ndjson, &orders(), &ctx(), rt.handle())
                .unwrap();
            assert!(
                matches!(&d, Decoded::FileRejected { reason } if reason.contains(why)),
                "{path}: {d:?}"
            );
        }
    }

    /// A local file read whole into a pooled buffer decodes as its bytes do, whichever
    /// buffer it gets (a larger file's before it, a smaller one's); a file cut or removed
    /// after it was planned is rejected whole.
    #[test]
    fn local_files_read_into_pooled_buffers_decode_as_their_bytes() {
        use object_store::local::LocalFileSystem;
        let rt = tokio::runtime::Runtime::new().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ObjectStore> =
            Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap());
        let text = |lines: usize| -> String {
            (0..lines)
                .map(|i| format!("{}\n", line(i)))
                .collect::<String>()
                + "{bad\n"
        };
        for (name, lines) in [
            ("big.ndjson", 3000),
            ("small.ndjson", 10),
            ("mid.ndjson", 700),
        ] {
            std::fs::write(dir.path().join(name), text(lines)).unwrap();
        }
        let fetch = |name: &str, size: u64| {
            rt.block_on(fetch_whole(&store, &Path::from(name), size, name))
                .unwrap()
        };
        for _ in 0..2 {
            for (name, lines) in [
                ("big.ndjson", 3000),
                ("small.ndjson", 10),
                ("mid.ndjson", 700),
            ] {
                let body = text(lines);
                let whole = fetch(name, body.len() as u64).unwrap();
                assert!(
                    matches!(whole, Whole::File(_)),
                    "{name}: the local file itself"
                );
                let got = whole
                    .decode(body.len() as u64, name, Format::Ndjson, &orders(), &ctx())
                    .unwrap();
                let want = super::super::decode::decode_ndjson(body.as_bytes(), &orders(), &ctx())
                    .unwrap();
                let (got, want) = (rows_of(got), rows_of(want));
                assert_eq!(got, want, "{name}");
                assert_eq!(got.2, lines + 1);
                assert_eq!(got.0.map(|b| b.num_rows()), Some(lines));
            }
        }
        // Planned larger than it is now: changed; planned but gone: disappeared.
        let size = text(700).len() as u64;
        assert!(matches!(fetch("mid.ndjson", size + 5), Err(r) if r.contains("changed")));
        assert!(matches!(fetch("gone.ndjson", size), Err(r) if r.contains("disappeared")));
        // Cut between the listing's size and the read: the read ends early.
        let whole = fetch("mid.ndjson", size).unwrap();
        std::fs::write(dir.path().join("mid.ndjson"), "{}\n").unwrap();
        let d = whole
            .decode(size, "mid.ndjson", Format::Ndjson, &orders(), &ctx())
            .unwrap();
        assert!(
            matches!(&d, Decoded::FileRejected { reason } if reason.contains("ended at byte 3 of")),
            "{d:?}"
        );
        release_buffers();
    }
}
