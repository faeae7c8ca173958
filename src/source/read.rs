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

use std::io::{self, Read};
use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore};

use super::decode::{decode_ndjson_read, Decoded, MAX_GUNZIPPED_BYTES};
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
            Ok(Err(found)) => Err(Failure::Changed(format!(
                "file changed while being processed ({} bytes planned, {found} found)",
                l.size
            ))),
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
        let (
            Decoded::Rows {
                batch: b1,
                rejects: r1,
                records: n1,
            },
            Decoded::Rows {
                batch: b2,
                rejects: r2,
                records: n2,
            },
        ) = (ranged, whole)
        else {
            panic!("rejected whole")
        };
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
}
