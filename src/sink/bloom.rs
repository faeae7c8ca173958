//! Parquet split-block bloom filters checked with hashes computed once.
//!
//! A dedup probe asks every row group of the touched dates about every incoming id.
//! `parquet::bloom_filter::Sbbf::check` hashes the value on each call, so K ids against
//! R row groups cost K × R xxHash64 computations; here each id is hashed once and each
//! filter check is a block lookup. The filter layout and hash are the Parquet spec's
//! (xxHash64, seed 0; blocks of eight 32-bit words with the spec's salts), read from the
//! filter's own serialized bitset, so they cannot drift from what the writer produced.

use bytes::Bytes;
use deltalake::parquet::bloom_filter::Sbbf;

use crate::error::Result;

/// The Parquet spec's salts of the split-block bloom filter.
const SALT: [u32; 8] = [
    0x47b6137b, 0x44974d91, 0x8824ad5b, 0xa2b7289d, 0x705495c7, 0x2df1424b, 0x9efc4947, 0x5c6bfb31,
];

/// Bytes of one block: eight little-endian 32-bit words.
const BLOCK: usize = 32;

/// The Parquet bloom-filter hash of a value's plain bytes (xxHash64, seed 0).
pub fn hash(bytes: &[u8]) -> u64 {
    twox_hash::XxHash64::oneshot(0, bytes)
}

/// A bloom filter's bitset, checked by hash where it lies (no copy).
pub struct Filter {
    bits: Bytes,
}

impl Filter {
    /// The filter read by the Parquet reader.
    pub fn from_sbbf(sbbf: &Sbbf) -> Result<Self> {
        let mut bytes = Vec::with_capacity(sbbf.num_blocks() * BLOCK);
        sbbf.write_bitset(&mut bytes)?;
        Ok(Filter { bits: bytes.into() })
    }

    /// The filter in `raw`, the bytes a column chunk's `bloom_filter_offset` and
    /// `bloom_filter_length` name: a Thrift header whose first field is the bitset's
    /// length, then the bitset. None when the header is not the plain form parquet
    /// writers produce (the caller then reads it the slow way).
    pub fn from_column_chunk(raw: Bytes) -> Option<Self> {
        // Field 1 (delta 1), type i32 (5) = 0x15, then a zig-zag varint.
        if raw.first() != Some(&0x15) {
            return None;
        }
        let mut n: u64 = 0;
        let mut shift = 0;
        let mut at = 1;
        loop {
            let b = *raw.get(at)?;
            n |= u64::from(b & 0x7f) << shift;
            at += 1;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 35 {
                return None;
            }
        }
        let num_bytes = usize::try_from((n >> 1) as i64 ^ -((n & 1) as i64)).ok()?;
        let ok = num_bytes >= BLOCK && num_bytes.is_power_of_two() && num_bytes + at < raw.len();
        if !ok {
            return None;
        }
        Some(Filter {
            bits: raw.slice(raw.len() - num_bytes..),
        })
    }

    /// Whether a value with this [`hash`] may be in the filter (false: certainly not).
    pub fn check(&self, hash: u64) -> bool {
        let blocks = self.bits.len() / BLOCK;
        if blocks == 0 {
            return true;
        }
        let block = (((hash >> 32).saturating_mul(blocks as u64)) >> 32) as usize;
        let key = hash as u32;
        let words = &self.bits[block * BLOCK..block * BLOCK + BLOCK];
        (0..8).all(|i| {
            let w = u32::from_le_bytes([
                words[i * 4],
                words[i * 4 + 1],
                words[i * 4 + 2],
                words[i * 4 + 3],
            ]);
            w & (1u32 << (key.wrapping_mul(SALT[i]) >> 27)) != 0
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_agree_with_the_parquet_filter_for_members_and_strangers() {
        let mut sbbf = Sbbf::new_with_ndv_fpp(1_000, 0.01).unwrap();
        let members: Vec<String> = (0..1_000).map(|i| format!("id-{i}")).collect();
        for m in &members {
            sbbf.insert(m.as_str());
        }
        let f = Filter::from_sbbf(&sbbf).unwrap();
        for m in &members {
            assert!(f.check(hash(m.as_bytes())), "{m}");
        }
        let mut disagree = 0;
        for i in 0..10_000 {
            let s = format!("other-{i}");
            if f.check(hash(s.as_bytes())) != sbbf.check(s.as_str()) {
                disagree += 1;
            }
        }
        assert_eq!(disagree, 0);
    }

    #[test]
    fn filters_read_from_a_written_file_agree_with_the_parquet_reader() {
        use arrow::array::{RecordBatch, StringArray};
        use arrow::datatypes::{DataType, Field, Schema};
        use deltalake::parquet::arrow::ArrowWriter;
        use std::sync::Arc;

        let schema = Arc::new(Schema::new(vec![Field::new(
            "event_id",
            DataType::Utf8,
            true,
        )]));
        let ids: Vec<String> = (0..5_000).map(|i| format!("{i:08x}-id")).collect();
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(StringArray::from(ids.clone()))],
        )
        .unwrap();
        let mut buf = Vec::new();
        let props = crate::sink::delta::bronze_writer_properties(["event_id"]);
        let mut w = ArrowWriter::try_new(&mut buf, schema, Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let file = Bytes::from(buf);
        let meta = deltalake::parquet::file::metadata::ParquetMetaDataReader::new()
            .parse_and_finish(&file)
            .unwrap();
        let col = meta.row_group(0).column(0);
        let (off, len) = (
            col.bloom_filter_offset().unwrap() as usize,
            col.bloom_filter_length().unwrap() as usize,
        );
        let sbbf = Sbbf::from_bytes(&file[off..off + len]).unwrap();
        let f = Filter::from_column_chunk(file.slice(off..off + len)).expect("plain header");
        assert_eq!(f.bits.len(), sbbf.num_blocks() * BLOCK);
        for id in &ids {
            assert!(f.check(hash(id.as_bytes())), "{id}");
        }
        for i in 0..20_000 {
            let s = format!("stranger-{i}");
            assert_eq!(f.check(hash(s.as_bytes())), sbbf.check(s.as_str()), "{s}");
        }
        // Not a filter header: refused, so the caller falls back.
        assert!(Filter::from_column_chunk(Bytes::from_static(b"\x19nope")).is_none());
    }
}
