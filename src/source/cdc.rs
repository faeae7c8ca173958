//! Decoding one change event of a CDC source (an NDJSON line) into the flattened change
//! bronze holds ([`crate::schema::cdc`]), as strictly as an event: one serde pass over
//! the envelope, `before`/`after` parsed by the same visitor as an event's fields.
//!
//! Accepted: `{"op", "ts_ms", "before", "after", "source": {…}}`, or the same inside
//! Debezium's `{"schema": …, "payload": {…}}`. Fields outside these are ignored (a
//! `transaction` block, `source.db`, …). Rejected with a reason: an unknown or missing
//! `op`, a missing or non-integer `ts_ms` or position part, a `c`/`u`/`r` without an
//! `after` row or with a required column missing, a `d` without its key in `before`, any
//! column of the wrong type, a duplicate field.

use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::decode::{CellValue, Key, RowSeed};
use super::validate::{check_ts, Cell, RowAssembler};
use crate::schema::cdc::{CdcSpec, PositionPath, OPS};

/// One part of the envelope that should be an object (`before`, `after`, `source`).
#[derive(Debug, Default)]
enum Part<'de> {
    #[default]
    Missing,
    Null,
    Row(Vec<Cell<'de>>),
    /// Something else: what it was.
    Other(&'static str),
}

#[derive(Debug)]
struct Envelope<'de> {
    op: Cell<'de>,
    ts_ms: Cell<'de>,
    before: Part<'de>,
    after: Part<'de>,
    source: Part<'de>,
}

/// The names a change's parts are read by, computed once per file.
pub(super) struct ChangeLayout {
    columns: Vec<String>,
    source: Vec<String>,
}

impl ChangeLayout {
    pub(super) fn new(spec: &CdcSpec) -> Self {
        ChangeLayout {
            columns: spec.columns.iter().map(|f| f.name.clone()).collect(),
            source: spec
                .position
                .iter()
                .filter_map(|p| match p {
                    PositionPath::Source(n) => Some(n.clone()),
                    PositionPath::TsMs => None,
                })
                .collect(),
        }
    }
}

/// Validate one change (a line without its newline) and push its flattened row to
/// `asm`, or say why it was rejected.
pub(super) fn push_change(
    line: &[u8],
    spec: &CdcSpec,
    layout: &ChangeLayout,
    asm: &mut RowAssembler,
    line_no: i64,
    landed_at_us: i64,
) -> Result<(), String> {
    let columns: Vec<&str> = layout.columns.iter().map(String::as_str).collect();
    let source: Vec<&str> = layout.source.iter().map(String::as_str).collect();
    let mut env = Envelope {
        op: Cell::Missing,
        ts_ms: Cell::Missing,
        before: Part::Missing,
        after: Part::Missing,
        source: Part::Missing,
    };
    let mut de = serde_json::Deserializer::from_slice(line);
    EnvelopeSeed {
        columns: &columns,
        source: &source,
        env: &mut env,
        seen: 0,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end())
    .map_err(|e| format!("malformed JSON: {e}"))?;
    let cells = flatten(&env, spec, layout, landed_at_us)?;
    let part = if matches!(env.op, Cell::Str(ref s) if s == "d") {
        "before"
    } else {
        "after"
    };
    asm.push(&cells, line_no, landed_at_us)
        .map_err(|r| format!("{part}: {r}"))
}

/// The flattened change's cells (the order of [`CdcSpec::flat_fields`]), or every
/// envelope-level reason to reject it.
fn flatten<'de>(
    env: &Envelope<'de>,
    spec: &CdcSpec,
    layout: &ChangeLayout,
    landed_at_us: i64,
) -> Result<Vec<Cell<'de>>, String> {
    let mut reasons = Vec::new();
    let op = match &env.op {
        Cell::Str(s) if OPS.contains(&s.as_ref()) => Some(s.as_ref()),
        Cell::Str(s) => {
            reasons.push(format!(
                "field `op`: unknown value {s:?} (expected one of {})",
                OPS.join(", ")
            ));
            None
        }
        Cell::Missing => {
            reasons.push("missing required field `op`".to_string());
            None
        }
        other => {
            reasons.push(format!(
                "field `op`: expected a string, got {}",
                other.kind()
            ));
            None
        }
    };
    match &env.ts_ms {
        Cell::Int(ms) => match ms.checked_mul(1000) {
            Some(us) => {
                check_ts("ts_ms", us, landed_at_us, &mut reasons);
            }
            None => reasons.push(format!(
                "field `ts_ms`: epoch milliseconds {ms} out of range"
            )),
        },
        Cell::Missing => reasons.push("missing required field `ts_ms`".to_string()),
        other => reasons.push(format!(
            "field `ts_ms`: expected epoch milliseconds (an integer), got {}",
            other.kind()
        )),
    }
    let mut position = Vec::with_capacity(spec.position.len());
    for p in &spec.position {
        let cell = match p {
            PositionPath::TsMs => env.ts_ms.clone(),
            PositionPath::Source(n) => match &env.source {
                Part::Row(cells) => layout
                    .source
                    .iter()
                    .position(|s| s == n)
                    .and_then(|i| cells.get(i).cloned())
                    .unwrap_or(Cell::Missing),
                Part::Missing => Cell::Missing,
                Part::Null => Cell::Null,
                Part::Other(k) => {
                    reasons.push(format!("field `source`: expected an object, got {k}"));
                    continue;
                }
            },
        };
        match cell {
            Cell::Int(v) => position.push(v),
            Cell::Missing | Cell::Null if matches!(env.source, Part::Null) => {
                reasons.push(format!("missing required field `{p}` (`source` is null)"))
            }
            Cell::Missing => reasons.push(format!("missing required field `{p}`")),
            other => reasons.push(format!(
                "field `{p}`: expected an integer, got {}",
                other.kind()
            )),
        }
    }
    let delete = op == Some("d");
    let (name, part) = if delete {
        ("before", &env.before)
    } else {
        ("after", &env.after)
    };
    let row = match part {
        Part::Row(cells) => Some(cells),
        Part::Missing | Part::Null => {
            if let Some(op) = op {
                let what = if delete { "its key" } else { "the row" };
                let state = if matches!(part, Part::Null) {
                    "null"
                } else {
                    "missing"
                };
                reasons.push(format!(
                    "op `{op}` needs {what} in `{name}`, which is {state}"
                ));
            }
            None
        }
        Part::Other(k) => {
            reasons.push(format!("field `{name}`: expected an object, got {k}"));
            None
        }
    };
    if let (Some(row), false) = (row, delete) {
        for (f, c) in spec.columns.iter().zip(row) {
            if f.nullable || spec.is_key(&f.name) {
                continue;
            }
            match c {
                Cell::Missing => {
                    reasons.push(format!("after: missing required field `{}`", f.name))
                }
                Cell::Null => {
                    reasons.push(format!("after: field `{}` is null but required", f.name))
                }
                _ => {}
            }
        }
    }
    let (Some(op), Some(row), true) = (op, row, reasons.is_empty()) else {
        return Err(reasons.join("; "));
    };
    let mut cells = Vec::with_capacity(spec.columns.len() + 5);
    cells.push(Cell::Str(change_id(spec, row, &position).into()));
    cells.push(env.ts_ms.clone());
    cells.push(Cell::Str(op.to_string().into()));
    for (f, c) in spec.columns.iter().zip(row) {
        cells.push(if delete && !spec.is_key(&f.name) {
            Cell::Missing
        } else {
            c.clone()
        });
    }
    cells.extend(position.into_iter().map(Cell::Int));
    Ok(cells)
}

/// A change's identity, its `event_id` in bronze: the key and the position
/// (`C-0042@1017`; a composite key as a JSON array, a two-part position `…@t.p`).
fn change_id(spec: &CdcSpec, row: &[Cell<'_>], position: &[i64]) -> String {
    let parts: Vec<String> = spec
        .key
        .iter()
        .map(|k| {
            let i = spec.columns.iter().position(|f| &f.name == k);
            match i.and_then(|i| row.get(i)) {
                Some(Cell::Str(s)) => s.to_string(),
                Some(Cell::Int(v)) => v.to_string(),
                _ => String::new(),
            }
        })
        .collect();
    let key = match parts.as_slice() {
        [one] => one.clone(),
        _ => serde_json::to_string(&parts).unwrap_or_default(),
    };
    let pos: Vec<String> = position.iter().map(i64::to_string).collect();
    format!("{key}@{}", pos.join("."))
}

/// The envelope's top level (and a `payload` inside it, into the same [`Envelope`]).
struct EnvelopeSeed<'s, 'de> {
    columns: &'s [&'s str],
    source: &'s [&'s str],
    env: &'s mut Envelope<'de>,
    /// Which of the known fields were seen (a bit each), to reject duplicates.
    seen: u8,
}

const KNOWN: [&str; 6] = ["op", "ts_ms", "before", "after", "source", "payload"];

impl<'de> DeserializeSeed<'de> for EnvelopeSeed<'_, 'de> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for EnvelopeSeed<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a change event object (op, ts_ms, before, after, source)")
    }
    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            let Some(i) = KNOWN.iter().position(|k| *k == key.as_ref()) else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            if self.seen & (1 << i) != 0 {
                return Err(de::Error::custom(format!("duplicate field `{key}`")));
            }
            self.seen |= 1 << i;
            match KNOWN[i] {
                "op" => self.env.op = map.next_value::<CellValue<'de>>()?.0,
                "ts_ms" => self.env.ts_ms = map.next_value::<CellValue<'de>>()?.0,
                "before" => self.env.before = map.next_value_seed(PartSeed(self.columns))?,
                "after" => self.env.after = map.next_value_seed(PartSeed(self.columns))?,
                "source" => self.env.source = map.next_value_seed(PartSeed(self.source))?,
                _ => map.next_value_seed(EnvelopeSeed {
                    columns: self.columns,
                    source: self.source,
                    env: &mut *self.env,
                    seen: self.seen,
                })?,
            }
        }
        Ok(())
    }
}

/// `before`, `after` or `source`: an object whose `names` fields are read as cells, or
/// null.
struct PartSeed<'s>(&'s [&'s str]);

impl<'de> DeserializeSeed<'de> for PartSeed<'_> {
    type Value = Part<'de>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Part<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_> {
    type Value = Part<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object or null")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Part<'de>, A::Error> {
        let mut cells = vec![Cell::Missing; self.0.len()];
        RowSeed {
            names: self.0,
            cells: &mut cells,
        }
        .visit_map(map)?;
        Ok(Part::Row(cells))
    }
    fn visit_unit<E>(self) -> Result<Part<'de>, E> {
        Ok(Part::Null)
    }
    fn visit_none<E>(self) -> Result<Part<'de>, E> {
        Ok(Part::Null)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Part<'de>, E> {
        Ok(Part::Other("a boolean"))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Part<'de>, E> {
        Ok(Part::Other("a number"))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Part<'de>, E> {
        Ok(Part::Other("a number"))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Part<'de>, E> {
        Ok(Part::Other("a number"))
    }
    fn visit_str<E>(self, _: &str) -> Result<Part<'de>, E> {
        Ok(Part::Other("a string"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Part<'de>, A::Error> {
        while s.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Part::Other("an array"))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::Array;

    use crate::source::decode::{decode_ndjson, Decoded};
    use crate::source::validate::FileContext;

    fn ctx() -> FileContext {
        FileContext {
            source_file: "customers/a.ndjson".into(),
            partition: "default".into(),
            landed_at_us: 1_764_000_000_000_000,
            batch_id: 1,
            ingested_at_us: 0,
        }
    }

    fn customers() -> Arc<crate::schema::SourceSchema> {
        crate::schema::load_all(std::path::Path::new("/none")).unwrap()["customers"].clone()
    }

    const ROW: &str = r#"{"customer_id":"C1","email":"a@x","name":"A","tier":null,"credit_cents":5,"updated_at":"2025-11-24T10:00:00Z"}"#;

    /// Valid changes (plain, in a Debezium payload, a delete with its key in `before`)
    /// flatten into bronze rows; each kind of bad change is rejected with its reason.
    #[test]
    fn changes_flatten_and_bad_ones_say_why() {
        let ok = |op: &str, lsn: i64| {
            format!(
                r#"{{"op":"{op}","ts_ms":1763978400000,"before":null,"after":{ROW},"source":{{"lsn":{lsn},"db":"shop"}}}}"#
            )
        };
        let lines = [
            ok("c", 10),
            format!(
                r#"{{"schema":{{"type":"struct"}},"payload":{}}}"#,
                ok("u", 11)
            ),
            r#"{"op":"d","ts_ms":1763978400000,"before":{"customer_id":"C1"},"after":null,"source":{"lsn":12}}"#.to_string(),
            ok("x", 13),
            ok("c", 14).replace(r#""lsn":14"#, r#""lsn":"14""#),
            ok("c", 15).replace(r#","source":{"lsn":15,"db":"shop"}"#, ""),
            ok("u", 16).replace(&format!(r#""after":{ROW}"#), r#""after":null"#),
            r#"{"op":"d","ts_ms":1763978400000,"before":null,"after":null,"source":{"lsn":17}}"#
                .to_string(),
            ok("c", 18).replace(r#""email":"a@x","#, ""),
            ok("c", 19).replace(r#""credit_cents":5"#, r#""credit_cents":"5""#),
            ok("c", 20).replace(r#""ts_ms":1763978400000"#, r#""ts_ms":"now""#),
            ok("c", 21).replace(r#""op":"c","#, r#""op":"c","op":"u","#),
            ok("c", 22).replace(r#""ts_ms":1763978400000,"#, ""),
            ok("r", 23).replace(r#""after":{"customer_id":"C1","#, r#""after":{"#),
        ];
        let text = lines.join("\n");
        let Decoded::Rows {
            batch,
            rejects,
            records,
        } = decode_ndjson(text.as_bytes(), &customers(), &ctx()).unwrap()
        else {
            panic!("file rejected")
        };
        assert_eq!(records, lines.len());
        let b = batch.unwrap();
        assert_eq!(b.num_rows(), 3);
        let ids = crate::columns::string(&b, "event_id").unwrap();
        assert_eq!(
            ids.iter().flatten().collect::<Vec<_>>(),
            ["C1@10", "C1@11", "C1@12"]
        );
        let ops = crate::columns::string(&b, "_cdc_op").unwrap();
        assert_eq!(ops.iter().flatten().collect::<Vec<_>>(), ["c", "u", "d"]);
        // A delete keeps only the key.
        let email = crate::columns::string(&b, "email").unwrap();
        assert!(email.is_valid(1) && email.is_null(2));
        let reasons: Vec<(i64, &str)> = rejects
            .iter()
            .map(|r| (r.line.unwrap(), r.reason.as_str()))
            .collect();
        let want = [
            (
                4,
                "field `op`: unknown value \"x\" (expected one of c, u, d, r)",
            ),
            (5, "field `source.lsn`: expected an integer, got a string"),
            (6, "missing required field `source.lsn`"),
            (7, "op `u` needs the row in `after`, which is null"),
            (8, "op `d` needs its key in `before`, which is null"),
            (9, "after: missing required field `email`"),
            (
                10,
                "after: field `credit_cents`: expected an integer, got a string",
            ),
            (
                11,
                "field `ts_ms`: expected epoch milliseconds (an integer), got a string",
            ),
            (12, "malformed JSON: duplicate field `op`"),
            (13, "missing required field `ts_ms`"),
            (14, "after: missing required field `customer_id`"),
        ];
        assert_eq!(reasons.len(), want.len(), "{reasons:?}");
        for ((line, got), (wl, w)) in reasons.iter().zip(want) {
            assert_eq!(*line, wl);
            assert!(got.starts_with(w), "line {line}: {got:?}, want {w:?}");
        }
    }

    /// A Parquet file of change events (structs `before`, `after`, `source`) decodes by
    /// the same rules as NDJSON: valid rows flattened, a bad one quarantined as JSON.
    #[test]
    fn parquet_changes_follow_the_ndjson_rules() {
        use arrow::json::reader::{infer_json_schema, ReaderBuilder};
        let text = [
            format!(r#"{{"op":"c","ts_ms":1763978400000,"after":{ROW},"source":{{"lsn":1}}}}"#),
            format!(r#"{{"op":"q","ts_ms":1763978400000,"after":{ROW},"source":{{"lsn":2}}}}"#),
        ]
        .join("\n");
        let (schema, _) = infer_json_schema(std::io::Cursor::new(text.as_bytes()), None).unwrap();
        let batch = ReaderBuilder::new(Arc::new(schema))
            .build(std::io::Cursor::new(text.as_bytes()))
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
        let mut buf = Vec::new();
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let Decoded::Rows {
            batch,
            rejects,
            records,
        } = crate::source::decode::decode_parquet(bytes::Bytes::from(buf), &customers(), &ctx())
            .unwrap()
        else {
            panic!("file rejected")
        };
        assert_eq!(
            (records, batch.unwrap().num_rows(), rejects.len()),
            (2, 1, 1)
        );
        assert_eq!(rejects[0].line, Some(2));
        assert!(
            rejects[0].reason.contains("unknown value \"q\""),
            "{}",
            rejects[0].reason
        );
        assert!(rejects[0].raw.as_deref().unwrap().contains(r#""op":"q""#));
    }
}
