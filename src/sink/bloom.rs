//! Parquet split-block bloom filters checked with hashes computed once.
//!
//! A dedup probe asks every row group of the touched dates about every incoming id.
//! `parquet::bloom_filter::Sbbf::check` hashes the value on each call, so K ids against
//! R row groups cost K × R xxHash64 computations; here each id is hashed once and each
//! filter check is a block lookup. The filter layout and hash are the Parquet spec's
//! (xxHash64, seed 0; blocks of eight 32-bit words with the spec's salts), read from the
//! filter's own serialized bitset, so they cannot drift from what the writer produced.

use deltalake::parquet::bloom_filter::Sbbf;

use crate::error::{Error, Result};

/// The Parquet spec's salts of the split-block bloom filter.
const SALT: [u32; 8] = [
    0x47b6137b, 0x44974d91, 0x8824ad5b, 0xa2b7289d, 0x705495c7, 0x2df1424b, 0x9efc4947, 0x5c6bfb31,
];

/// The Parquet bloom-filter hash of a value's plain bytes (xxHash64, seed 0).
pub fn hash(bytes: &[u8]) -> u64 {
    twox_hash::XxHash64::oneshot(0, bytes)
}

/// A bloom filter's blocks, checked by hash.
pub struct Filter {
    words: Vec<u32>,
}

impl Filter {
    /// The filter read from a file.
    pub fn from_sbbf(sbbf: &Sbbf) -> Result<Self> {
        let mut bytes = Vec::with_capacity(sbbf.num_blocks() * 32);
        sbbf.write_bitset(&mut bytes)
            .map_err(|e| Error::Other(format!("bloom filter: {e}")))?;
        let words = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Filter { words })
    }

    /// Whether a value with this [`hash`] may be in the filter (false: certainly not).
    pub fn check(&self, hash: u64) -> bool {
        let blocks = self.words.len() / 8;
        if blocks == 0 {
            return true;
        }
        let block = (((hash >> 32).saturating_mul(blocks as u64)) >> 32) as usize;
        let key = hash as u32;
        let words = &self.words[block * 8..block * 8 + 8];
        (0..8).all(|i| words[i] & (1u32 << (key.wrapping_mul(SALT[i]) >> 27)) != 0)
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
}
