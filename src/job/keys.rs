//! Key interning for operators: each distinct value of a job's key columns gets a small
//! id, so per-row work (window membership, session grouping) hashes a key once per row
//! and allocates once per distinct key.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, RecordBatch, StringArray};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Schema};
use arrow::row::{RowConverter, SortField};

use crate::error::Result;

/// A key's id within one job batch (see [`KeyEncoder`]).
pub type KeyId = u32;

/// Invariants between a job's schema, its rows and its interned keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("key column {column}: {source}")]
    NoSuchColumn {
        column: String,
        source: arrow::error::ArrowError,
    },
    #[error("rows without key column {0}")]
    MissingColumn(String),
    #[error("unknown key id {0}")]
    UnknownId(KeyId),
}

/// FNV-1a of `bytes`: a hash that is the same on every platform and in every release
/// (what hash partitions of stored tables are computed with).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Fast hash maps and sets for per-row work.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
/// See [`FastMap`].
pub type FastSet<K> = HashSet<K, foldhash::fast::RandomState>;

/// Interns key-column values: each distinct key gets a small id, so per-row work hashes
/// bytes once and allocates only per distinct key. Ids are valid within one encoder.
/// A single string key is hashed as is; other keys go through Arrow's row format.
pub struct KeyEncoder {
    keys: Vec<String>,
    /// None: a single Utf8 key (the common case), interned from its bytes.
    conv: Option<RowConverter>,
    ids: FastMap<Box<[u8]>, KeyId>,
    /// Interned keys by id: row-format bytes, or the string's bytes (None for null).
    values: Vec<Option<Box<[u8]>>>,
}

impl KeyEncoder {
    /// An encoder for `keys` of `schema`.
    pub fn new(schema: &Schema, keys: &[String]) -> Result<Self> {
        let types = keys
            .iter()
            .map(|k| {
                schema
                    .field_with_name(k)
                    .map(|f| f.data_type().clone())
                    .map_err(|source| KeyError::NoSuchColumn {
                        column: k.clone(),
                        source,
                    })
            })
            .collect::<std::result::Result<Vec<_>, KeyError>>()?;
        let conv = if types.len() == 1 && types[0] == DataType::Utf8 {
            None
        } else {
            Some(RowConverter::new(
                types.into_iter().map(SortField::new).collect(),
            )?)
        };
        Ok(KeyEncoder {
            keys: keys.to_vec(),
            conv,
            ids: FastMap::default(),
            values: Vec::new(),
        })
    }

    fn intern(&mut self, bytes: Option<&[u8]>) -> KeyId {
        // Nulls of a single string key get their own id via a marker no UTF-8 has.
        let lookup: &[u8] = bytes.unwrap_or(&[0xff, 0xfe]);
        if let Some(id) = self.ids.get(lookup) {
            return *id;
        }
        let id = self.values.len() as KeyId;
        self.ids.insert(lookup.into(), id);
        self.values.push(bytes.map(Into::into));
        id
    }

    /// Key ids of every row of `batch` (key columns looked up by name).
    pub fn encode(&mut self, batch: &RecordBatch) -> Result<Vec<KeyId>> {
        let cols = self
            .keys
            .iter()
            .map(|k| {
                batch
                    .column_by_name(k)
                    .cloned()
                    .ok_or_else(|| KeyError::MissingColumn(k.clone()))
            })
            .collect::<std::result::Result<Vec<ArrayRef>, KeyError>>()?;
        let mut out = Vec::with_capacity(batch.num_rows());
        if cols.is_empty() {
            // No key columns (a job of one row per window): every row has the one key.
            // The row format would give no rows at all, having no column to count them.
            let id = self.intern(Some(&[]));
            out.resize(batch.num_rows(), id);
            return Ok(out);
        }
        match &self.conv {
            None => {
                let c = cast(&cols[0], &DataType::Utf8)?;
                let strings = c.as_string::<i32>();
                for v in strings.iter() {
                    out.push(self.intern(v.map(str::as_bytes)));
                }
            }
            Some(conv) => {
                let rows = conv.convert_columns(&cols)?;
                for r in rows.iter() {
                    out.push(self.intern(Some(r.as_ref())));
                }
            }
        }
        Ok(out)
    }

    /// Key columns back from ids.
    pub fn decode(&self, ids: impl Iterator<Item = KeyId>) -> Result<Vec<ArrayRef>> {
        let values: Vec<Option<&[u8]>> = ids
            .map(|i| {
                self.values
                    .get(i as usize)
                    .map(|v| v.as_deref())
                    .ok_or(KeyError::UnknownId(i))
            })
            .collect::<std::result::Result<_, KeyError>>()?;
        match &self.conv {
            None => {
                let strings: StringArray = values
                    .into_iter()
                    .map(|v| v.map(|b| String::from_utf8_lossy(b).into_owned()))
                    .collect();
                Ok(vec![Arc::new(strings)])
            }
            Some(conv) => {
                let parser = conv.parser();
                let rows = values
                    .into_iter()
                    .map(|v| parser.parse(v.unwrap_or_default()));
                Ok(conv.convert_rows(rows)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::Field;

    #[test]
    fn key_ids_are_stable_and_decode_back_for_string_and_composite_keys() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8, true),
            Field::new("n", DataType::Int64, true),
        ]));
        let batch = |s: Vec<Option<&str>>, n: Vec<Option<i64>>| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from(s)),
                    Arc::new(Int64Array::from(n)),
                ],
            )
            .unwrap()
        };
        let a = batch(
            vec![Some("x"), None, Some("x")],
            vec![Some(1), Some(2), None],
        );
        let b = batch(vec![None, Some("y")], vec![Some(2), Some(1)]);
        // single string key (fast path), nulls included
        let mut one = KeyEncoder::new(&schema, &["s".to_string()]).unwrap();
        let ia = one.encode(&a).unwrap();
        let ib = one.encode(&b).unwrap();
        assert_eq!(ia, vec![0, 1, 0]);
        assert_eq!(ib, vec![1, 2]);
        let back = one.decode([0, 1, 2].into_iter()).unwrap();
        let back = back[0].as_string::<i32>();
        assert_eq!(
            back.iter().collect::<Vec<_>>(),
            vec![Some("x"), None, Some("y")]
        );
        // composite key (Arrow row format)
        let keys = vec!["s".to_string(), "n".to_string()];
        let mut two = KeyEncoder::new(&schema, &keys).unwrap();
        assert_eq!(two.encode(&a).unwrap(), vec![0, 1, 2]);
        assert_eq!(two.encode(&b).unwrap(), vec![1, 3]);
        let back = two.decode([3, 2].into_iter()).unwrap();
        assert_eq!(back[0].as_string::<i32>().value(0), "y");
        let n = back[1].as_primitive::<arrow::datatypes::Int64Type>();
        assert_eq!(n.iter().collect::<Vec<_>>(), vec![Some(1), None]);
    }
}
