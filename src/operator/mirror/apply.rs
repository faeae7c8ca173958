//! The mirror's pure logic: a batch's changes of some keys, with what the mirror already
//! holds of those keys, in → the rows to write out. No I/O, no Arrow: rows are named by
//! where their column values are ([`Src`]), and the caller gathers them.
//!
//! Order is the log position alone (lsn, or the two-part position). Per key:
//! - a change at a position the mirror already knows (the current row's, a recorded
//!   delete's, a history version's) is a redelivery and changes nothing;
//! - the current row follows the change of the greatest position the key has ever had:
//!   an upsert (`c`, `u`, `r`) writes the row, a delete removes it (hard) or marks it
//!   `_deleted` with its last values (soft); a change older than that position does
//!   not touch the current row — so a late older change after a delete is ignored;
//! - every delete is recorded (its key, position, time), so that ordering survives the
//!   row it removed;
//! - history (SCD type 2) is the key's versions in position order: each upsert opens a
//!   version valid from its `ts_ms`, closed by the next change (upsert or delete) at that
//!   change's `ts_ms`. A late change between two known ones splits the version it falls
//!   in; only versions whose validity changed are written.

use std::collections::{BTreeMap, HashSet};

use crate::time::Micros;

/// A change's position in the log: (lsn, second part or 0).
pub type Pos = (i64, i64);

/// Where a row's column values are: which input and which row of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Src {
    pub input: u8,
    pub row: usize,
}

/// Input 0: the batch's changes; 1: the current rows; 2: the history rows.
pub const CHANGES: u8 = 0;
pub const CURRENT: u8 = 1;
pub const HISTORY: u8 = 2;

/// One change of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub key: u32,
    pub pos: Pos,
    /// `ts_ms`, in microseconds.
    pub ts: Micros,
    pub delete: bool,
    pub src: Src,
}

/// A key's current row as the mirror holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Current {
    pub key: u32,
    pub pos: Pos,
    /// Soft-deleted (`_deleted`).
    pub deleted: bool,
    pub src: Src,
}

/// A recorded delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    pub key: u32,
    pub pos: Pos,
    pub ts: Micros,
}

/// A history version: valid from `from` until `to` (None while current).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version {
    pub key: u32,
    pub pos: Pos,
    pub from: Micros,
    pub to: Option<Micros>,
    pub src: Src,
}

/// A write to the current table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CurrentWrite {
    /// The key's row: values from `src`, position `pos`, soft-deleted or not.
    Upsert { pos: Pos, deleted: bool, src: Src },
    /// Remove the key's row (`src` holds the key).
    Delete { src: Src },
}

/// What the mirror holds of the batch's keys, and the batch's changes.
#[derive(Debug, Default)]
pub struct Held {
    pub current: Vec<Current>,
    pub deleted: Vec<Deleted>,
    pub versions: Vec<Version>,
}

/// The rows to write, and what the batch did.
#[derive(Debug, Default, PartialEq)]
pub struct Applied {
    pub current: Vec<CurrentWrite>,
    /// New deletes to record.
    pub deletes: Vec<Change>,
    /// History versions to upsert (new ones, and known ones whose validity changed).
    pub versions: Vec<Version>,
    /// Changes at a position the key already had (redeliveries).
    pub redelivered: i64,
    /// Changes older than the key's newest position (they reach history only).
    pub superseded: i64,
    /// Keys whose current row changed.
    pub keys_changed: i64,
}

/// Apply `changes` to what the mirror `held` of their keys.
pub fn apply(changes: &[Change], held: &Held, soft: bool, history: bool) -> Applied {
    #[derive(Default)]
    struct Key<'a> {
        changes: Vec<Change>,
        current: Option<&'a Current>,
        deleted: Vec<&'a Deleted>,
        versions: Vec<&'a Version>,
    }
    let mut keys: BTreeMap<u32, Key<'_>> = BTreeMap::new();
    for c in changes {
        keys.entry(c.key).or_default().changes.push(*c);
    }
    for c in &held.current {
        if let Some(k) = keys.get_mut(&c.key) {
            k.current = Some(c);
        }
    }
    for d in &held.deleted {
        if let Some(k) = keys.get_mut(&d.key) {
            k.deleted.push(d);
        }
    }
    for v in &held.versions {
        if let Some(k) = keys.get_mut(&v.key) {
            k.versions.push(v);
        }
    }
    let mut out = Applied::default();
    for k in keys.values_mut() {
        k.changes.sort_by_key(|c| c.pos);
        // The first delivery of a position wins (as ingestion's deduplication does).
        let delivered = k.changes.len();
        k.changes.dedup_by_key(|c| c.pos);
        // Each table is judged by what that table (and the deletes recorded) holds, not
        // by another table: a batch recomputed after a crash between its commits finds
        // its own rows in the tables it reached, and must still write the others.
        let deleted: HashSet<Pos> = k.deleted.iter().map(|d| d.pos).collect();
        let in_current = |p: Pos| k.current.is_some_and(|c| c.pos == p) || deleted.contains(&p);
        let in_history = |p: Pos| k.versions.iter().any(|v| v.pos == p) || deleted.contains(&p);
        let repeats = k
            .changes
            .iter()
            .filter(|c| in_current(c.pos) || in_history(c.pos))
            .count();
        out.redelivered += (delivered - k.changes.len() + repeats) as i64;
        out.deletes.extend(
            k.changes
                .iter()
                .filter(|c| c.delete && !deleted.contains(&c.pos)),
        );
        let newest_known = k
            .current
            .map(|c| c.pos)
            .into_iter()
            .chain(k.deleted.iter().map(|d| d.pos))
            .max();
        let fresh: Vec<&Change> = k
            .changes
            .iter()
            .filter(|c| newest_known.is_none_or(|p| c.pos > p))
            .collect();
        out.superseded += k
            .changes
            .iter()
            .filter(|c| {
                !in_current(c.pos) && !in_history(c.pos) && newest_known.is_some_and(|p| c.pos < p)
            })
            .count() as i64;
        if let Some(last) = fresh.last() {
            let write = if !last.delete {
                Some(CurrentWrite::Upsert {
                    pos: last.pos,
                    deleted: false,
                    src: last.src,
                })
            } else if soft {
                // The row as of just before the delete: the newest earlier upsert.
                let batch = fresh[..fresh.len() - 1]
                    .iter()
                    .rev()
                    .find(|c| !c.delete)
                    .map(|c| (c.pos, c.src));
                let held = k.current.filter(|c| !c.deleted).map(|c| (c.pos, c.src));
                batch
                    .into_iter()
                    .chain(held)
                    .max_by_key(|(p, _)| *p)
                    .map(|(_, src)| CurrentWrite::Upsert {
                        pos: last.pos,
                        deleted: true,
                        src,
                    })
            } else {
                k.current.map(|c| CurrentWrite::Delete { src: c.src })
            };
            if let Some(w) = write {
                out.current.push(w);
                out.keys_changed += 1;
            }
        }
        // History is replayed for every key with changes, known or not: a delete the
        // deletes record already holds (a batch recomputed after its deletes commit) is
        // an event of the replay from there, and still closes the version it ends.
        if history && !k.changes.is_empty() {
            let new: Vec<Change> = k
                .changes
                .iter()
                .filter(|c| !in_history(c.pos))
                .copied()
                .collect();
            out.versions
                .extend(versions(k.versions.as_slice(), &k.deleted, &new));
        }
    }
    out
}

/// The key's versions to write: the known ones replayed with the recorded deletes and
/// the new changes in position order; new versions, and known ones whose end moved.
fn versions(held: &[&Version], deleted: &[&Deleted], changes: &[Change]) -> Vec<Version> {
    // (position, time, Some(values) for an upsert / None for a delete, known version)
    let mut events: Vec<(Pos, Micros, Option<Src>, Option<&Version>)> = held
        .iter()
        .map(|v| (v.pos, v.from, Some(v.src), Some(*v)))
        .chain(deleted.iter().map(|d| (d.pos, d.ts, None, None)))
        .chain(
            changes
                .iter()
                .map(|c| (c.pos, c.ts, (!c.delete).then_some(c.src), None)),
        )
        .collect();
    events.sort_by_key(|e| e.0);
    let Some(key) = held
        .first()
        .map(|v| v.key)
        .or(changes.first().map(|c| c.key))
    else {
        return Vec::new();
    };
    let mut replayed: Vec<(Version, Option<&Version>)> = Vec::new();
    let mut open: Option<usize> = None;
    for (pos, ts, src, known) in events {
        if let Some(o) = open.take() {
            replayed[o].0.to = Some(ts);
        }
        if let Some(src) = src {
            open = Some(replayed.len());
            replayed.push((
                Version {
                    key,
                    pos,
                    from: ts,
                    to: None,
                    src,
                },
                known,
            ));
        }
    }
    replayed
        .into_iter()
        .filter(|(v, known)| known.is_none_or(|k| k.to != v.to))
        .map(|(v, _)| v)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(key: u32, lsn: i64, ts: Micros, delete: bool, row: usize) -> Change {
        Change {
            key,
            pos: (lsn, 0),
            ts,
            delete,
            src: Src {
                input: CHANGES,
                row,
            },
        }
    }

    /// Apply batches one after another, keeping what the mirror holds the way the tables
    /// would; returns the final held state.
    fn replay(batches: &[Vec<Change>], soft: bool) -> Held {
        let mut held = Held::default();
        for b in batches {
            let a = apply(b, &held, soft, true);
            for w in a.current {
                let key = b[0].key;
                held.current.retain(|c| c.key != key);
                if let CurrentWrite::Upsert { pos, deleted, src } = w {
                    held.current.push(Current {
                        key,
                        pos,
                        deleted,
                        src,
                    });
                }
            }
            held.deleted.extend(a.deletes.iter().map(|c| Deleted {
                key: c.key,
                pos: c.pos,
                ts: c.ts,
            }));
            for v in a.versions {
                held.versions.retain(|h| h.pos != v.pos);
                held.versions.push(v);
            }
            held.versions.sort_by_key(|v| v.pos);
        }
        held
    }

    /// In order, out of order and redelivered changes of one key end in the same mirror
    /// and the same history; a late older change after a delete is ignored by the current
    /// row and splits the history where it belongs.
    #[test]
    fn order_is_the_log_position_whatever_the_arrival() {
        let c1 = ch(1, 10, 100, false, 0);
        let u2 = ch(1, 20, 200, false, 1);
        let u3 = ch(1, 30, 300, false, 2);
        let d4 = ch(1, 40, 400, true, 3);
        let in_order = replay(&[vec![c1], vec![u2], vec![u3], vec![d4]], false);
        let shuffled = replay(&[vec![u3], vec![d4, c1], vec![u2, u3]], false);
        let one_batch = replay(&[vec![d4, u2, c1, u3, c1]], false);
        for h in [&shuffled, &one_batch] {
            assert_eq!(h.current, in_order.current);
            assert_eq!(h.versions, in_order.versions);
            assert_eq!(h.deleted, in_order.deleted);
        }
        // Deleted: no current row; three closed versions, the last closed by the delete.
        assert!(in_order.current.is_empty());
        let spans: Vec<(i64, Micros, Option<Micros>)> = in_order
            .versions
            .iter()
            .map(|v| (v.pos.0, v.from, v.to))
            .collect();
        assert_eq!(
            spans,
            [
                (10, 100, Some(200)),
                (20, 200, Some(300)),
                (30, 300, Some(400))
            ]
        );
        // A late change older than the delete does not bring the row back…
        let late = ch(1, 25, 250, false, 9);
        let a = apply(&[late], &in_order, false, true);
        assert!(a.current.is_empty());
        assert_eq!(a.superseded, 1);
        // …but splits version 20 in history: 20 now ends at 250, 25 runs to 300.
        let v: Vec<(i64, Micros, Option<Micros>)> =
            a.versions.iter().map(|v| (v.pos.0, v.from, v.to)).collect();
        assert_eq!(v, [(20, 200, Some(250)), (25, 250, Some(300))]);
        // A key deleted and inserted again comes back.
        let again = ch(1, 50, 500, false, 4);
        let a = apply(&[again], &in_order, false, true);
        assert_eq!(
            a.current,
            [CurrentWrite::Upsert {
                pos: (50, 0),
                deleted: false,
                src: again.src
            }]
        );
        assert_eq!(a.versions.len(), 1);
        assert_eq!(a.versions[0].to, None);
        // A redelivery of anything known changes nothing.
        let a = apply(&[u2, d4], &in_order, false, true);
        assert_eq!(
            (a.redelivered, a.current.len(), a.versions.len()),
            (2, 0, 0)
        );
        assert!(a.deletes.is_empty());
    }

    /// A batch recomputed after a crash between its commits: the current table already
    /// holds the batch's row, history and deletes do not — they are still written, the
    /// current row is not written again.
    #[test]
    fn a_recomputed_batch_writes_the_tables_it_had_not_reached() {
        let c1 = ch(3, 10, 100, false, 0);
        let u2 = ch(3, 20, 200, false, 1);
        let first = apply(&[c1, u2], &Held::default(), false, true);
        let Some(CurrentWrite::Upsert { pos, src, .. }) = first.current.first().copied() else {
            panic!("{first:?}")
        };
        let reached = Held {
            current: vec![Current {
                key: 3,
                pos,
                deleted: false,
                src,
            }],
            ..Default::default()
        };
        let again = apply(&[c1, u2], &reached, false, true);
        assert!(again.current.is_empty());
        assert_eq!(again.versions, first.versions);
        assert_eq!(again.versions.len(), 2);
        // A batch of only a delete, recomputed after its current and deletes commits:
        // history still closes the open version.
        let held = Held {
            versions: first.versions.clone(),
            ..Default::default()
        };
        let d3 = ch(3, 30, 300, true, 2);
        let once = apply(&[d3], &held, false, true);
        let reached = Held {
            deleted: vec![Deleted {
                key: 3,
                pos: d3.pos,
                ts: d3.ts,
            }],
            ..held
        };
        let again = apply(&[d3], &reached, false, true);
        assert!(again.deletes.is_empty());
        assert_eq!(again.versions, once.versions);
        assert_eq!(again.versions.len(), 1);
        assert_eq!(again.versions[0].to, Some(300));
    }

    /// Soft deletes keep the row with its last values and `_deleted`; a delete of a key
    /// the mirror never held records the delete and writes no row.
    #[test]
    fn soft_deletes_keep_the_last_values() {
        let c1 = ch(7, 1, 10, false, 0);
        let u2 = ch(7, 2, 20, false, 1);
        let d3 = ch(7, 3, 30, true, 2);
        let h = replay(&[vec![c1], vec![u2, d3]], true);
        assert_eq!(
            h.current,
            [Current {
                key: 7,
                pos: (3, 0),
                deleted: true,
                src: u2.src
            }]
        );
        let a = apply(&[ch(8, 5, 50, true, 0)], &Held::default(), false, true);
        assert!(a.current.is_empty() && a.versions.is_empty());
        assert_eq!(a.deletes.len(), 1);
        // With the delete recorded, an older insert of that key stays out.
        let held = Held {
            deleted: vec![Deleted {
                key: 8,
                pos: (5, 0),
                ts: 50,
            }],
            ..Default::default()
        };
        let a = apply(&[ch(8, 4, 40, false, 0)], &held, false, true);
        assert!(a.current.is_empty());
        assert_eq!(a.versions.len(), 1);
        assert_eq!(a.versions[0].to, Some(50));
    }
}
