//! Change-data-capture sources (`"kind": "cdc"`): landed files of Debezium-style change
//! events, `{"op", "before", "after", "source": {"lsn", …}, "ts_ms"}` (optionally wrapped
//! in Debezium's `{"schema", "payload"}`), described by the row's columns, its primary
//! key and where a change's log position is.
//!
//! Such a source's bronze rows are the changes flattened ([`CdcSpec::flat_fields`]):
//! `event_id` = the change's identity (key and position, so ingestion's deduplication
//! drops a redelivered change), `event_ts` = `ts_ms` (so bronze is partitioned by the
//! change's date and the time checks apply), `_cdc_op`, the row's columns (of `after`;
//! of a delete only the key, from `before`), then the position (`_lsn`, and `_pos` for a
//! two-part position). The mirror operator (`operator::mirror`) reads them.

use serde::Deserialize;

use super::{FieldSpec, FieldType};

/// Bronze column of a change's operation (`c`, `u`, `d`, `r`).
pub const OP: &str = "_cdc_op";
/// Bronze (and mirror) column of a change's position, first part.
pub const LSN: &str = "_lsn";
/// Bronze (and mirror) column of a two-part position's second part.
pub const POS: &str = "_pos";
/// The operations a change may carry: create, update, delete, read (snapshot).
pub const OPS: [&str; 4] = ["c", "u", "d", "r"];

/// A string or a list of strings in a schema file.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// Where one part of a change's position is in the envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PositionPath {
    /// The envelope's `ts_ms`.
    TsMs,
    /// A field of the envelope's `source` block (`source.lsn`, `source.pos`).
    Source(String),
}

impl std::fmt::Display for PositionPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PositionPath::TsMs => f.write_str("ts_ms"),
            PositionPath::Source(n) => write!(f, "source.{n}"),
        }
    }
}

/// A CDC source's row columns, primary key and position.
#[derive(Debug, Clone, PartialEq)]
pub struct CdcSpec {
    /// The primary key columns, in declaration order of `primary_key`.
    pub key: Vec<String>,
    /// The row's columns as declared (the key among them), with their declared
    /// nullability.
    pub columns: Vec<FieldSpec>,
    /// The position's parts, compared in order (one or two).
    pub position: Vec<PositionPath>,
}

impl CdcSpec {
    /// The spec a schema file declares; Err says what is wrong.
    pub(super) fn from_schema(
        fields: &[FieldSpec],
        primary_key: Option<OneOrMany>,
        position: Option<OneOrMany>,
    ) -> Result<Self, String> {
        if fields.is_empty() {
            return Err("`fields` must name the row's columns".into());
        }
        for f in fields {
            if f.name.starts_with('_') || ["event_id", "event_ts"].contains(&f.name.as_str()) {
                return Err(format!(
                    "field `{}`: in a cdc schema, names starting with `_`, `event_id`, `event_ts` and `event_date` are reserved for kestrel",
                    f.name
                ));
            }
        }
        let key = primary_key
            .map(OneOrMany::into_vec)
            .ok_or("a cdc schema needs `primary_key` (a column name or a list of them)")?;
        if key.is_empty() {
            return Err("`primary_key` must name at least one column".into());
        }
        for (i, k) in key.iter().enumerate() {
            if key[..i].contains(k) {
                return Err(format!("`primary_key` names `{k}` twice"));
            }
            match fields.iter().find(|f| &f.name == k) {
                None => return Err(format!("`primary_key`: `{k}` is not one of the fields")),
                Some(f) if f.nullable => {
                    return Err(format!("`primary_key`: `{k}` must not be nullable"))
                }
                Some(f) if f.ty == FieldType::Timestamp => {
                    return Err(format!(
                        "`primary_key`: `{k}` must be a string or int64 column"
                    ))
                }
                Some(_) => {}
            }
        }
        let paths = position.map(OneOrMany::into_vec).ok_or(
            "a cdc schema needs `position` (\"source.lsn\", or [\"ts_ms\", \"source.pos\"])",
        )?;
        if paths.is_empty() || paths.len() > 2 {
            return Err(format!(
                "`position` must have one or two parts, got {}",
                paths.len()
            ));
        }
        let mut position = Vec::with_capacity(paths.len());
        for p in &paths {
            let part = match p.strip_prefix("source.") {
                _ if p == "ts_ms" => PositionPath::TsMs,
                Some(n) if !n.is_empty() && !n.contains('.') => PositionPath::Source(n.into()),
                _ => {
                    return Err(format!(
                        "`position`: {p:?} must be \"ts_ms\" or a field of the change's source block (\"source.lsn\")"
                    ))
                }
            };
            if position.contains(&part) {
                return Err(format!("`position` names {p:?} twice"));
            }
            position.push(part);
        }
        Ok(CdcSpec {
            key,
            columns: fields.to_vec(),
            position,
        })
    }

    /// The bronze position columns: `_lsn`, and `_pos` for a two-part position.
    pub fn position_columns(&self) -> &'static [&'static str] {
        if self.position.len() == 2 {
            &[LSN, POS]
        } else {
            &[LSN]
        }
    }

    /// Whether `name` is one of the primary key columns.
    pub fn is_key(&self, name: &str) -> bool {
        self.key.iter().any(|k| k == name)
    }

    /// The flattened change: what the decoder validates and bronze holds. The row's
    /// columns other than the key are nullable here (a delete carries only the key); the
    /// decoder checks the declared ones are present in the row of a `c`, `u` or `r`.
    pub fn flat_fields(&self) -> Vec<FieldSpec> {
        let field = |name: &str, ty, nullable, enum_values: Option<Vec<String>>| FieldSpec {
            name: name.to_string(),
            ty,
            nullable,
            enum_values,
        };
        let mut out = vec![
            field("event_id", FieldType::String, false, None),
            field("event_ts", FieldType::Timestamp, false, None),
            field(
                OP,
                FieldType::String,
                false,
                Some(OPS.iter().map(|s| s.to_string()).collect()),
            ),
        ];
        for c in &self.columns {
            out.push(FieldSpec {
                nullable: c.nullable || !self.is_key(&c.name),
                ..c.clone()
            });
        }
        for p in self.position_columns() {
            out.push(field(p, FieldType::Int64, false, None));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use crate::schema::parse;
    use std::path::Path;

    const FIELDS: &str = r#""fields": [{"name":"id","type":"int64"},{"name":"email","type":"string","nullable":true}]"#;

    fn err(head: &str) -> String {
        let text = format!(r#"{{"source":"users","kind":"cdc",{head}{FIELDS}}}"#);
        parse(&text, Path::new("schemas/users.json"))
            .unwrap_err()
            .to_string()
    }

    /// A cdc schema compiles to the flattened change; bad ones name what is wrong.
    #[test]
    fn cdc_schemas_flatten_and_bad_ones_are_named() {
        let text = format!(
            r#"{{"source":"users","kind":"cdc","primary_key":"id","position":["ts_ms","source.pos"],{FIELDS}}}"#
        );
        let s = parse(&text, Path::new("schemas/users.json")).unwrap();
        let names: Vec<&str> = s.fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            ["event_id", "event_ts", "_cdc_op", "id", "email", "_lsn", "_pos"]
        );
        let cdc = s.cdc.as_ref().unwrap();
        assert_eq!(cdc.key, ["id"]);
        assert_eq!(cdc.position[1].to_string(), "source.pos");
        assert!(!s.may_be_null("id") && s.may_be_null("email"));
        for (head, want) in [
            (r#""position":"source.lsn","#, "needs `primary_key`"),
            (r#""primary_key":"id","#, "needs `position`"),
            (
                r#""primary_key":"nope","position":"source.lsn","#,
                "`nope` is not one",
            ),
            (
                r#""primary_key":"email","position":"source.lsn","#,
                "must not be nullable",
            ),
            (
                r#""primary_key":"id","position":"lsn","#,
                "must be \"ts_ms\" or a field",
            ),
            (
                r#""primary_key":"id","position":["ts_ms","source.a","source.b"],"#,
                "one or two parts",
            ),
        ] {
            let e = err(head);
            assert!(e.contains("users.json") && e.contains(want), "{e}");
        }
        let e = parse(
            r#"{"source":"o","primary_key":"id","fields":[{"name":"event_id","type":"string"},{"name":"event_ts","type":"timestamp"}]}"#,
            Path::new("o.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("only for change-data-capture"), "{e}");
        let e = parse(
            r#"{"source":"u","kind":"cdc","primary_key":"id","position":"source.lsn","fields":[{"name":"id","type":"string"},{"name":"_x","type":"string"}]}"#,
            Path::new("u.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("reserved for kestrel"), "{e}");
    }
}
