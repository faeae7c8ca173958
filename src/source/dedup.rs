//! An in-memory dedup set: event ids seen within `ttl` (default 26 h, DESIGN.md), with
//! its size reported. The always-on stream keeps one per source it ingests, so a poll
//! deduplicates without querying bronze (whose open day is many small files by then).
//!
//! Ids are kept as 128-bit hashes (two independent stable 64-bit hashes of the id
//! bytes), so an id costs 16 bytes plus the hash table's overhead whatever its length,
//! and the chance that two distinct ids of a day collide is about n²/2¹²⁹ — nil. Ids
//! live in one set per hour of arrival time (`_landed_at`, so a replay decides the same);
//! a whole hour is dropped once it is older than `ttl`, so expiry never scans.

use std::collections::{HashSet, VecDeque};

use crate::time::Micros;

const HOUR: Micros = 3_600_000_000;

/// A stable 128-bit hash of an event id (FNV-1a 64 and a seeded variant, each finished
/// with the splitmix64 mixer). Stable across releases and platforms.
pub fn id_hash(id: &str) -> u128 {
    fn fnv(bytes: &[u8], basis: u64) -> u64 {
        let mut h = basis;
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // splitmix64 finaliser: spreads FNV's weak high bits.
        h ^= h >> 30;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 27;
        h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^ (h >> 31)
    }
    let b = id.as_bytes();
    (u128::from(fnv(b, 0xcbf2_9ce4_8422_2325)) << 64) | u128::from(fnv(b, 0x8422_2325_cbf2_9ce4))
}

/// Ids seen within a TTL of arrival time.
#[derive(Debug, Clone)]
pub struct DedupSet {
    ttl: Micros,
    /// (hour start, ids that arrived in that hour), oldest first.
    hours: VecDeque<(Micros, HashSet<u128, foldhash::fast::FixedState>)>,
}

impl DedupSet {
    pub fn new(ttl: std::time::Duration) -> Self {
        DedupSet {
            ttl: i64::try_from(ttl.as_micros()).unwrap_or(Micros::MAX),
            hours: VecDeque::new(),
        }
    }

    /// The TTL in micros.
    pub fn ttl(&self) -> Micros {
        self.ttl
    }

    /// Record `id` arriving at `landed`; false if it was seen within the TTL (a
    /// duplicate). Expires hours older than the TTL first.
    pub fn insert(&mut self, id: &str, landed: Micros) -> bool {
        self.insert_hash(id_hash(id), landed)
    }

    /// Whether `h` was seen within the TTL of the newest hour held.
    pub fn contains_hash(&self, h: u128) -> bool {
        self.hours.iter().any(|(_, s)| s.contains(&h))
    }

    pub fn insert_hash(&mut self, h: u128, landed: Micros) -> bool {
        self.expire(landed);
        if self.hours.iter().any(|(_, s)| s.contains(&h)) {
            return false;
        }
        let hour = landed.div_euclid(HOUR) * HOUR;
        match self
            .hours
            .iter_mut()
            .rev()
            .find(|(start, _)| *start == hour)
        {
            Some((_, s)) => {
                s.insert(h);
            }
            None => {
                let mut s = HashSet::with_hasher(foldhash::fast::FixedState::default());
                s.insert(h);
                // Arrival times are not strictly ordered: keep hours sorted.
                let at = self.hours.partition_point(|(start, _)| *start < hour);
                self.hours.insert(at, (hour, s));
            }
        }
        true
    }

    /// Drop every hour that ended more than the TTL before `now` (arrival time).
    pub fn expire(&mut self, now: Micros) {
        while let Some((start, _)) = self.hours.front() {
            if start + HOUR <= now.saturating_sub(self.ttl) {
                self.hours.pop_front();
            } else {
                break;
            }
        }
    }

    /// Ids held.
    pub fn len(&self) -> usize {
        self.hours.iter().map(|(_, s)| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (hour start, ids held) per hour, oldest first.
    pub fn hour_counts(&self) -> Vec<(Micros, usize)> {
        self.hours.iter().map(|(h, s)| (*h, s.len())).collect()
    }

    /// The ids of one hour (unordered).
    pub fn hour_ids(&self, hour: Micros) -> Vec<u128> {
        self.hours
            .iter()
            .find(|(h, _)| *h == hour)
            .map(|(_, s)| s.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Snapshot: (hour start, sorted ids) per hour, oldest first.
    pub fn snapshot(&self) -> Vec<(Micros, Vec<u128>)> {
        self.hours
            .iter()
            .map(|(h, s)| {
                let mut v: Vec<u128> = s.iter().copied().collect();
                v.sort_unstable();
                (*h, v)
            })
            .collect()
    }

    /// Restore from [`DedupSet::snapshot`].
    pub fn restore(ttl: std::time::Duration, hours: Vec<(Micros, Vec<u128>)>) -> Self {
        let mut d = DedupSet::new(ttl);
        for (h, ids) in hours {
            let mut s =
                HashSet::with_capacity_and_hasher(ids.len(), foldhash::fast::FixedState::default());
            s.extend(ids);
            d.hours.push_back((h, s));
        }
        d.hours.make_contiguous().sort_by_key(|(h, _)| *h);
        d
    }

    /// Bytes the hash tables hold (capacity × (16-byte key + 1 control byte)).
    pub fn bytes(&self) -> usize {
        self.hours
            .iter()
            .map(|(_, s)| s.capacity() * (std::mem::size_of::<u128>() + 1))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_within_the_ttl_are_caught_and_expire_after_it() {
        let mut d = DedupSet::new(std::time::Duration::from_secs(26 * 3600));
        assert!(d.insert("e1", 0));
        assert!(
            !d.insert("e1", 10 * HOUR),
            "a redelivery 10 h later is a duplicate"
        );
        assert!(d.insert("e2", 25 * HOUR));
        // 27 h after e1's hour ended, that hour has expired: e1 is new again.
        assert!(d.insert("e1", 27 * HOUR + 1));
        assert!(
            !d.insert("e2", 27 * HOUR + 2),
            "e2's hour is within the TTL"
        );
        assert_eq!(d.len(), 2);
        assert!(d.bytes() >= 2 * 17);
    }

    #[test]
    fn out_of_order_arrivals_keep_their_hour() {
        let mut d = DedupSet::new(std::time::Duration::from_secs(26 * 3600));
        assert!(d.insert("late", 20 * HOUR));
        assert!(d.insert("early", 2 * HOUR));
        assert!(!d.insert("early", 20 * HOUR));
        // The early hour (ending at 3 h) expires first; the later one stays.
        assert!(d.insert("early", 29 * HOUR + 1));
        assert!(!d.insert("late", 31 * HOUR));
        assert_eq!(d.len(), 2);
        assert!(d.contains_hash(id_hash("late")));
    }

    #[test]
    fn the_id_hash_is_pinned() {
        // Pinned, so a future snapshot of the set stays readable across releases.
        assert_eq!(id_hash("e1"), id_hash("e1"));
        assert_ne!(id_hash("e1"), id_hash("e2"));
        // Computed independently (Python) from the definition above.
        assert_eq!(
            format!("{:032x}", id_hash("")),
            "f52a15e9a9b5e89bfe5361af3ba51714"
        );
        assert_eq!(
            format!("{:032x}", id_hash("evt-1")),
            "b08a34cff25e60bf20a35fe85b0c2c15"
        );
    }
}
