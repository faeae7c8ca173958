//! Checkpoints of the always-on stream's in-memory state: per source, its dedup set and
//! the ingestion batch it reflects, under `_kestrel/state/<job>/`.
//!
//! Everything else the stream knows is committed to Delta with every poll (plans,
//! results, `gold/sku_availability`), so the dedup set is the only state a restart would
//! otherwise rebuild from bronze.
//!
//! The set is kept as one hash set per hour of arrival, and only the newest hours still
//! change, so a checkpoint is **incremental**: each hour is a chunk file
//! (`<source>/<hour>.ids`, an Arrow IPC stream of 128-bit id hashes) rewritten only when
//! its count changed since it was last written, then a small manifest
//! (`<source>.ckpt`) naming the chunks is written with one PUT — the switch to the new
//! checkpoint is atomic, and a crash leaves the previous one. Chunks of hours that aged
//! out are deleted after the manifest. At a day of ids at 200 events/s, the first
//! checkpoint writes everything; the next ones write one hour's chunk (see Benchmarks).
//!
//! The manifest names its operator by a stable id and carries a format version: a
//! restarted binary reads the same or an older format and refuses a newer one (or
//! another operator's) with a message that says why — never misreads it. Layout:
//! `"KESTRELCKPT" u32 format` then the JSON manifest.

use std::collections::BTreeMap;
use std::io::Cursor;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, AsArray, RecordBatch, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema, UInt64Type};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::names;
use crate::sink::delta::Warehouse;
use crate::source::dedup::DedupSet;
use crate::time::Micros;

const MAGIC: &[u8; 11] = b"KESTRELCKPT";
/// The format this binary writes (and the newest it reads).
pub const FORMAT: u32 = 1;
/// Stable id of the state a stream checkpoints.
pub const OPERATOR: &str = "kestrel.stream.dedup";

/// What a checkpoint says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub operator_id: String,
    pub format: u32,
    pub job: String,
    pub source: String,
    /// Increases by one per checkpoint of this stream run.
    pub seq: u64,
    pub created_at_us: Micros,
    /// The last ingestion batch of `source` whose ids the set holds.
    pub position: i64,
    pub ttl_s: u64,
}

/// The manifest: the header and, per hour of arrival, how many ids its chunk holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub header: Header,
    pub chunks: Vec<(Micros, usize)>,
}

/// Chunks on storage: hour → ids the chunk holds.
pub type Written = BTreeMap<Micros, usize>;

/// A loaded checkpoint.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub header: Header,
    pub dedup: DedupSet,
    pub written: Written,
}

/// What one checkpoint wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Saved {
    pub ms: u64,
    /// Bytes written (chunks + manifest).
    pub bytes: usize,
    pub chunks_written: usize,
    /// Ids the checkpoint covers.
    pub ids: usize,
}

/// One hour's ids as an Arrow IPC stream of (hi, lo).
pub fn encode_chunk(ids: &[u128]) -> Result<Vec<u8>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("hi", DataType::UInt64, false),
        Field::new("lo", DataType::UInt64, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from_iter_values(
            ids.iter().map(|i| (i >> 64) as u64),
        )),
        Arc::new(UInt64Array::from_iter_values(ids.iter().map(|i| *i as u64))),
    ];
    let batch = RecordBatch::try_new(schema.clone(), cols)?;
    let mut out = Vec::with_capacity(ids.len() * 16 + 512);
    {
        let mut w = StreamWriter::try_new(&mut out, &schema)?;
        w.write(&batch)?;
        w.finish()?;
    }
    Ok(out)
}

/// Decode [`encode_chunk`].
pub fn decode_chunk(bytes: &[u8], what: &str) -> Result<Vec<u128>> {
    let bad = |reason: String| Error::Plan {
        path: what.to_string(),
        reason,
    };
    let reader = StreamReader::try_new(Cursor::new(bytes), None)
        .map_err(|e| bad(format!("unreadable chunk: {e}")))?;
    let mut out = Vec::new();
    for b in reader {
        let b = b.map_err(|e| bad(format!("unreadable chunk: {e}")))?;
        let (Some(hi), Some(lo)) = (
            b.column(0).as_primitive_opt::<UInt64Type>(),
            b.column(1).as_primitive_opt::<UInt64Type>(),
        ) else {
            return Err(bad("chunk columns of the wrong type".into()));
        };
        out.extend(
            hi.values()
                .iter()
                .zip(lo.values())
                .map(|(h, l)| (u128::from(*h) << 64) | u128::from(*l)),
        );
    }
    Ok(out)
}

/// Encode a manifest.
pub fn encode_manifest(m: &Manifest) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(m)?;
    let mut out = Vec::with_capacity(16 + json.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Decode a manifest; `what` names it in errors. Refuses a newer format and another
/// operator's state.
pub fn decode_manifest(bytes: &[u8], what: &str) -> Result<Manifest> {
    let bad = |reason: String| Error::Plan {
        path: what.to_string(),
        reason,
    };
    let rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| bad("not a kestrel checkpoint (bad magic)".into()))?;
    let (fmt, json) = rest
        .split_first_chunk::<4>()
        .ok_or_else(|| bad("truncated".into()))?;
    let format = u32::from_le_bytes(*fmt);
    if format > FORMAT {
        return Err(bad(format!(
            "written in checkpoint format {format} by a newer kestrel; this binary reads formats up to {FORMAT}: run the newer binary, or delete the file to rebuild the state from bronze"
        )));
    }
    let m: Manifest = serde_json::from_slice(json).map_err(|e| bad(format!("manifest: {e}")))?;
    if m.header.operator_id != OPERATOR {
        return Err(bad(format!(
            "holds the state of operator `{}`, not `{OPERATOR}`",
            m.header.operator_id
        )));
    }
    Ok(m)
}

/// A checkpoint ready to write: encoded while the set is at hand, written without it.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Changed chunks, then the manifest (written last: the atomic switch).
    puts: Vec<(String, Vec<u8>)>,
    /// Chunks of hours the set no longer holds (deleted after the manifest).
    deletes: Vec<String>,
    written: Written,
    ids: usize,
    chunks: usize,
    encode_ms: u64,
}

/// Encode a checkpoint of `set`: the chunks whose hour changed since `written`, and the
/// manifest.
pub fn prepare(header: &Header, set: &DedupSet, written: &Written) -> Result<Prepared> {
    let t = Instant::now();
    let counts = set.hour_counts();
    let mut puts = Vec::new();
    let mut next = written.clone();
    for (hour, n) in &counts {
        if written.get(hour) == Some(n) {
            continue;
        }
        puts.push((
            names::key::checkpoint_ids(&header.job, &header.source, *hour),
            encode_chunk(&set.hour_ids(*hour))?,
        ));
        next.insert(*hour, *n);
    }
    let chunks = puts.len();
    puts.push((
        names::key::checkpoint(&header.job, &header.source),
        encode_manifest(&Manifest {
            header: header.clone(),
            chunks: counts.clone(),
        })?,
    ));
    let gone: Vec<Micros> = next
        .keys()
        .filter(|h| !counts.iter().any(|(c, _)| c == *h))
        .copied()
        .collect();
    let deletes = gone
        .iter()
        .map(|h| names::key::checkpoint_ids(&header.job, &header.source, *h))
        .collect();
    for h in gone {
        next.remove(&h);
    }
    Ok(Prepared {
        puts,
        deletes,
        written: next,
        ids: counts.iter().map(|(_, n)| n).sum(),
        chunks,
        encode_ms: t.elapsed().as_millis() as u64,
    })
}

/// Write a prepared checkpoint; returns what was written and the chunks now on storage.
pub async fn write(wh: &Warehouse, p: Prepared) -> Result<(Saved, Written)> {
    let t = Instant::now();
    let mut bytes = 0;
    for (k, b) in p.puts {
        bytes += b.len();
        wh.loc.put(&k, b).await?;
    }
    for k in &p.deletes {
        wh.loc.delete_if_exists(k).await?;
    }
    Ok((
        Saved {
            ms: p.encode_ms + t.elapsed().as_millis() as u64,
            bytes,
            chunks_written: p.chunks,
            ids: p.ids,
        },
        p.written,
    ))
}

/// [`prepare`] and [`write`] in one step; updates `written`.
pub async fn save(
    wh: &Warehouse,
    header: &Header,
    set: &DedupSet,
    written: &mut Written,
) -> Result<Saved> {
    let (saved, next) = write(wh, prepare(header, set, written)?).await?;
    *written = next;
    Ok(saved)
}

/// Read the checkpoint of `job`'s `source`, if there is one.
pub async fn load(
    wh: &Warehouse,
    job: &str,
    source: &str,
    ttl: std::time::Duration,
) -> Result<Option<Loaded>> {
    let k = names::key::checkpoint(job, source);
    let Some(bytes) = wh.loc.get_opt(&k).await? else {
        return Ok(None);
    };
    let m = decode_manifest(&bytes, &wh.loc.display(&k))?;
    let mut hours = Vec::with_capacity(m.chunks.len());
    let mut written = Written::new();
    for (hour, n) in &m.chunks {
        let ck = names::key::checkpoint_ids(job, source, *hour);
        let what = wh.loc.display(&ck);
        let bytes = wh.loc.get_opt(&ck).await?.ok_or_else(|| Error::Plan {
            path: what.clone(),
            reason: format!("missing: the checkpoint {} names it", wh.loc.display(&k)),
        })?;
        let ids = decode_chunk(&bytes, &what)?;
        if ids.len() != *n {
            return Err(Error::Plan {
                path: what,
                reason: format!("holds {} ids, the manifest says {n}", ids.len()),
            });
        }
        written.insert(*hour, *n);
        hours.push((*hour, ids));
    }
    Ok(Some(Loaded {
        header: m.header,
        dedup: DedupSet::restore(ttl, hours),
        written,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            operator_id: OPERATOR.into(),
            format: FORMAT,
            job: "stockout".into(),
            source: "inventory".into(),
            seq: 7,
            created_at_us: 1,
            position: 12,
            ttl_s: 26 * 3600,
        }
    }

    #[test]
    fn chunks_and_manifests_round_trip() {
        let ids = vec![1u128, u128::MAX, 1 << 70];
        assert_eq!(
            decode_chunk(&encode_chunk(&ids).unwrap(), "c").unwrap(),
            ids
        );
        let m = Manifest {
            header: header(),
            chunks: vec![(0, 3), (3_600_000_000, 1)],
        };
        assert_eq!(
            decode_manifest(&encode_manifest(&m).unwrap(), "m").unwrap(),
            m
        );
    }

    #[test]
    fn newer_formats_other_operators_and_damage_are_refused_with_a_reason() {
        let m = Manifest {
            header: header(),
            chunks: vec![],
        };
        let mut bytes = encode_manifest(&m).unwrap();
        bytes[MAGIC.len()..MAGIC.len() + 4].copy_from_slice(&(FORMAT + 1).to_le_bytes());
        let e = decode_manifest(&bytes, "ck").unwrap_err().to_string();
        assert!(e.contains("ck") && e.contains("newer kestrel"), "{e}");
        let mut other = m.clone();
        other.header.operator_id = "kestrel.sessions".into();
        let e = decode_manifest(&encode_manifest(&other).unwrap(), "ck")
            .unwrap_err()
            .to_string();
        assert!(e.contains("kestrel.sessions"), "{e}");
        let e = decode_manifest(b"garbage", "ck").unwrap_err().to_string();
        assert!(e.contains("bad magic"), "{e}");
        let e = decode_chunk(b"garbage", "chunk").unwrap_err().to_string();
        assert!(e.contains("chunk") && e.contains("unreadable"), "{e}");
    }

    #[tokio::test]
    async fn saves_are_incremental_and_loads_restore_the_set() {
        let dir = tempfile::tempdir().unwrap();
        let wh = Warehouse::new(
            crate::storage::Location::open(dir.path().to_str().unwrap(), &Default::default(), true)
                .unwrap(),
        );
        let ttl = std::time::Duration::from_secs(26 * 3600);
        const H: Micros = 3_600_000_000;
        let mut set = DedupSet::new(ttl);
        for i in 0..100 {
            set.insert(&format!("a{i}"), H * (i % 3));
        }
        let mut written = Written::new();
        let s1 = save(&wh, &header(), &set, &mut written).await.unwrap();
        assert_eq!((s1.chunks_written, s1.ids), (3, 100));
        // New ids in the newest hour only: one chunk rewritten.
        set.insert("b1", 2 * H + 5);
        let s2 = save(&wh, &header(), &set, &mut written).await.unwrap();
        assert_eq!(s2.chunks_written, 1);
        assert!(s2.bytes < s1.bytes);
        let back = load(&wh, "stockout", "inventory", ttl)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back.dedup.snapshot(), set.snapshot());
        assert_eq!(back.written, written);
        // An hour that ages out loses its chunk after the next save.
        set.insert("late", 30 * H);
        save(&wh, &header(), &set, &mut written).await.unwrap();
        assert!(!written.contains_key(&0));
        assert!(!dir
            .path()
            .join("_kestrel/state/stockout/inventory/0.ids")
            .exists());
    }
}
