//! Checkpoints of the always-on stream's in-memory state: per source, its dedup set and
//! the ingestion batch it reflects, at `_kestrel/state/<job>/<source>.ckpt`.
//!
//! Everything else the stream knows is committed to Delta with every poll (plans,
//! results, `gold/sku_availability`), so the dedup set is the only state a restart would
//! otherwise rebuild from bronze. A checkpoint names its operator by a stable id and
//! carries a format version: a restarted binary reads the same or an older format and
//! refuses a newer one (or another operator's) with a message that says why — never
//! misreads it. Layout:
//!
//! ```text
//! "KESTRELCKPT" u32 format  u64 n  header (JSON, n bytes)  u64 n  ids (Arrow IPC, n bytes)
//! ```
//!
//! The ids are an Arrow IPC stream of (hour, hi, lo): 128-bit id hashes per arrival hour,
//! so tens of millions encode at memory speed. A checkpoint is written with one PUT
//! (atomic on local disk and object stores), so a crash leaves the previous one.

use std::io::Cursor;
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch, UInt64Array};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, UInt64Type};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
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

/// A decoded checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub header: Header,
    pub dedup: DedupSet,
}

/// Object key of a stream's checkpoint for `source`.
pub fn key(job: &str, source: &str) -> String {
    format!("_kestrel/state/{job}/{source}.ckpt")
}

fn ids_batch(d: &DedupSet) -> Result<RecordBatch> {
    let snap = d.snapshot();
    let n: usize = snap.iter().map(|(_, v)| v.len()).sum();
    let (mut hour, mut hi, mut lo) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (h, ids) in &snap {
        for id in ids {
            hour.push(*h);
            hi.push((id >> 64) as u64);
            lo.push(*id as u64);
        }
    }
    let schema = Arc::new(Schema::new(vec![
        Field::new("hour", DataType::Int64, false),
        Field::new("hi", DataType::UInt64, false),
        Field::new("lo", DataType::UInt64, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(hour)),
        Arc::new(UInt64Array::from(hi)),
        Arc::new(UInt64Array::from(lo)),
    ];
    Ok(RecordBatch::try_new(schema, cols)?)
}

/// Encode `dedup` with `header`.
pub fn encode(header: &Header, dedup: &DedupSet) -> Result<Vec<u8>> {
    let head = serde_json::to_vec(header).map_err(|e| Error::Other(e.to_string()))?;
    let batch = ids_batch(dedup)?;
    let mut ids = Vec::new();
    {
        let mut w = StreamWriter::try_new(&mut ids, &batch.schema())?;
        w.write(&batch)?;
        w.finish()?;
    }
    let mut out = Vec::with_capacity(32 + head.len() + ids.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    for part in [&head, &ids] {
        out.extend_from_slice(&(part.len() as u64).to_le_bytes());
        out.extend_from_slice(part);
    }
    Ok(out)
}

/// Decode bytes written by [`encode`]; `what` names them in errors. Refuses a newer
/// format and another operator's state.
pub fn decode(bytes: &[u8], what: &str) -> Result<Checkpoint> {
    let bad = |reason: String| Error::Plan {
        path: what.to_string(),
        reason,
    };
    let rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| bad("not a kestrel checkpoint (bad magic)".into()))?;
    let (fmt, mut rest) = rest
        .split_first_chunk::<4>()
        .ok_or_else(|| bad("truncated".into()))?;
    let format = u32::from_le_bytes(*fmt);
    if format > FORMAT {
        return Err(bad(format!(
            "written in checkpoint format {format} by a newer kestrel; this binary reads formats up to {FORMAT}: run the newer binary, or delete the file to rebuild the state from bronze"
        )));
    }
    let mut parts: Vec<&[u8]> = Vec::with_capacity(2);
    for _ in 0..2 {
        let (len, r) = rest
            .split_first_chunk::<8>()
            .ok_or_else(|| bad("truncated".into()))?;
        let len = usize::try_from(u64::from_le_bytes(*len)).unwrap_or(usize::MAX);
        if r.len() < len {
            return Err(bad("truncated".into()));
        }
        parts.push(&r[..len]);
        rest = &r[len..];
    }
    let header: Header =
        serde_json::from_slice(parts[0]).map_err(|e| bad(format!("header: {e}")))?;
    if header.operator_id != OPERATOR {
        return Err(bad(format!(
            "holds the state of operator `{}`, not `{OPERATOR}`",
            header.operator_id
        )));
    }
    let reader = StreamReader::try_new(Cursor::new(parts[1]), None)?;
    let mut hours: Vec<(Micros, Vec<u128>)> = Vec::new();
    for b in reader {
        let b = b?;
        let (Some(h), Some(hi), Some(lo)) = (
            b.column(0).as_primitive_opt::<Int64Type>(),
            b.column(1).as_primitive_opt::<UInt64Type>(),
            b.column(2).as_primitive_opt::<UInt64Type>(),
        ) else {
            return Err(bad("ids: wrong column types".into()));
        };
        for i in 0..b.num_rows() {
            let id = (u128::from(hi.value(i)) << 64) | u128::from(lo.value(i));
            match hours.last_mut() {
                Some((hh, v)) if *hh == h.value(i) => v.push(id),
                _ => hours.push((h.value(i), vec![id])),
            }
        }
    }
    let ttl = std::time::Duration::from_secs(header.ttl_s);
    Ok(Checkpoint {
        header,
        dedup: DedupSet::restore(ttl, hours),
    })
}

/// Write a checkpoint (one PUT); returns its size in bytes.
pub async fn save(wh: &Warehouse, header: &Header, dedup: &DedupSet) -> Result<usize> {
    let bytes = encode(header, dedup)?;
    let n = bytes.len();
    wh.loc.put(&key(&header.job, &header.source), bytes).await?;
    Ok(n)
}

/// Read the checkpoint of `job`'s `source`, if there is one.
pub async fn load(wh: &Warehouse, job: &str, source: &str) -> Result<Option<Checkpoint>> {
    let k = key(job, source);
    let Some(bytes) = wh.loc.get_opt(&k).await? else {
        return Ok(None);
    };
    decode(&bytes, &wh.loc.display(&k)).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Header, DedupSet) {
        let mut d = DedupSet::new(std::time::Duration::from_secs(26 * 3600));
        d.insert("e9", 5);
        d.insert("e10", 3_600_000_000 * 2);
        let h = Header {
            operator_id: OPERATOR.into(),
            format: FORMAT,
            job: "stockout".into(),
            source: "inventory".into(),
            seq: 7,
            created_at_us: 1,
            position: 12,
            ttl_s: 26 * 3600,
        };
        (h, d)
    }

    #[test]
    fn round_trip() {
        let (h, d) = sample();
        let c = decode(&encode(&h, &d).unwrap(), "x").unwrap();
        assert_eq!(c.header, h);
        assert_eq!(c.dedup.snapshot(), d.snapshot());
        assert_eq!(c.dedup.ttl(), d.ttl());
    }

    #[test]
    fn newer_formats_other_operators_and_damage_are_refused_with_a_reason() {
        let (h, d) = sample();
        let mut bytes = encode(&h, &d).unwrap();
        bytes[MAGIC.len()..MAGIC.len() + 4].copy_from_slice(&(FORMAT + 1).to_le_bytes());
        let e = decode(&bytes, "ck").unwrap_err().to_string();
        assert!(e.contains("ck") && e.contains("newer kestrel"), "{e}");
        let mut other = h.clone();
        other.operator_id = "kestrel.sessions".into();
        let e = decode(&encode(&other, &d).unwrap(), "ck")
            .unwrap_err()
            .to_string();
        assert!(e.contains("kestrel.sessions"), "{e}");
        let e = decode(b"garbage", "ck").unwrap_err().to_string();
        assert!(e.contains("bad magic"), "{e}");
        let full = encode(&h, &d).unwrap();
        let e = decode(&full[..full.len() - 3], "ck")
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
    }
}
