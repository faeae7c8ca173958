//! Event schemas (`schemas/<source>.json`) → Arrow schemas plus validation rules.
//!
//! The shipped schemas are compiled in; a `schemas/` directory next to the config may
//! override them or add sources. A schema is an event source's (`"kind": "events"`, the
//! default) or a change-data-capture source's (`"kind": "cdc"`, see [`cdc`]).

pub mod cdc;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::Deserialize;

use crate::error::{Error, Result};

/// The ingestion batch a bronze row came in (the job positions count these).
pub const BATCH_ID: &str = "_batch_id";

/// Name of the event date partition column of bronze tables.
pub const EVENT_DATE: &str = "event_date";
/// Bookkeeping columns kestrel adds to every bronze row.
pub const META_COLUMNS: [&str; 6] = [
    "_source_partition",
    "_landed_at",
    "_source_file",
    "_source_line",
    "_batch_id",
    "_ingested_at",
];

const BUILTIN: [(&str, &str); 5] = [
    (
        "clickstream",
        include_str!("../../schemas/clickstream.json"),
    ),
    ("orders", include_str!("../../schemas/orders.json")),
    ("payments", include_str!("../../schemas/payments.json")),
    ("inventory", include_str!("../../schemas/inventory.json")),
    ("customers", include_str!("../../schemas/customers.json")),
];

/// The type of one event field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FieldType {
    /// UTF-8 string.
    String,
    /// 64-bit signed integer; a JSON number without fraction, never a quoted number.
    Int64,
    /// RFC 3339 with an offset (normalised to UTC) or integer epoch milliseconds.
    Timestamp,
}

/// One field of an event schema.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldSpec {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: FieldType,
    #[serde(default)]
    pub nullable: bool,
    #[serde(default, rename = "enum")]
    pub enum_values: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SchemaFile {
    source: String,
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    /// `events` (default) or `cdc`.
    #[serde(default)]
    kind: Option<String>,
    /// CDC only: the row's primary key column(s).
    #[serde(default)]
    primary_key: Option<cdc::OneOrMany>,
    /// CDC only: where a change's log position is (`source.lsn`, or `ts_ms` and
    /// `source.pos`).
    #[serde(default)]
    position: Option<cdc::OneOrMany>,
    fields: Vec<FieldSpec>,
}

/// A source's event schema with the derived Arrow schemas.
#[derive(Debug, Clone)]
pub struct SourceSchema {
    /// Source name (`orders`, …).
    pub name: String,
    /// Event fields in declaration order.
    pub fields: Vec<FieldSpec>,
    /// Bronze table schema: event fields, `event_date`, then the meta columns.
    pub bronze: SchemaRef,
    /// A change-data-capture source's key, position and row columns (its `fields` are
    /// then the flattened change, see [`cdc`]).
    pub cdc: Option<Arc<cdc::CdcSpec>>,
    /// The schema document it was parsed from (a cluster's executors parse it again,
    /// see [`crate::engine::ingest`]).
    pub text: Arc<str>,
}

impl SourceSchema {
    /// Whether column `name` can hold nulls: a schema field marked nullable. Required
    /// fields are validated non-null (bronze declares every column nullable only so that
    /// older tables stay appendable), and columns a job derives (window starts, minutes)
    /// are never null.
    pub fn may_be_null(&self, name: &str) -> bool {
        self.fields.iter().any(|f| f.name == name && f.nullable)
    }

    fn from_file(mut file: SchemaFile, origin: &Path) -> Result<Self> {
        let err = |message: String| Error::Schema {
            file: origin.to_path_buf(),
            message,
        };
        let cdc = match file.kind.as_deref() {
            None | Some("events") => {
                for (f, v) in [
                    ("primary_key", &file.primary_key),
                    ("position", &file.position),
                ] {
                    if v.is_some() {
                        return Err(err(format!(
                            "`{f}` is only for change-data-capture sources (`\"kind\": \"cdc\"`)"
                        )));
                    }
                }
                None
            }
            Some("cdc") => {
                let spec = cdc::CdcSpec::from_schema(
                    &file.fields,
                    file.primary_key.take(),
                    file.position.take(),
                )
                .map_err(err)?;
                file.fields = spec.flat_fields();
                Some(Arc::new(spec))
            }
            Some(other) => {
                return Err(err(format!(
                    "`kind` must be \"events\" or \"cdc\", got {other:?}"
                )))
            }
        };
        let mut seen = std::collections::HashSet::new();
        for f in &file.fields {
            if !seen.insert(f.name.as_str()) {
                return Err(err(format!("field `{}` is declared twice", f.name)));
            }
            if (f.name.starts_with('_') && cdc.is_none()) || f.name == EVENT_DATE {
                return Err(err(format!(
                    "field `{}`: names starting with `_` and `{EVENT_DATE}` are reserved for kestrel",
                    f.name
                )));
            }
            if f.enum_values.is_some() && f.ty != FieldType::String {
                return Err(err(format!(
                    "field `{}`: `enum` is only allowed on string fields",
                    f.name
                )));
            }
        }
        for (name, ty) in [
            ("event_id", FieldType::String),
            ("event_ts", FieldType::Timestamp),
        ] {
            match file.fields.iter().find(|f| f.name == name) {
                Some(f) if f.ty == ty && !f.nullable => {}
                Some(_) => {
                    return Err(err(format!(
                        "field `{name}` must be a required {}",
                        if ty == FieldType::String {
                            "string"
                        } else {
                            "timestamp"
                        }
                    )))
                }
                None => return Err(err(format!("every source needs a field `{name}`"))),
            }
        }
        let mut arrow_fields: Vec<Field> = file
            .fields
            .iter()
            .map(|f| Field::new(&f.name, arrow_type(f.ty), true))
            .collect();
        arrow_fields.push(Field::new(EVENT_DATE, DataType::Date32, true));
        arrow_fields.push(Field::new("_source_partition", DataType::Utf8, true));
        arrow_fields.push(Field::new("_landed_at", ts_type(), true));
        arrow_fields.push(Field::new("_source_file", DataType::Utf8, true));
        arrow_fields.push(Field::new("_source_line", DataType::Int64, true));
        arrow_fields.push(Field::new("_batch_id", DataType::Int64, true));
        arrow_fields.push(Field::new("_ingested_at", ts_type(), true));
        Ok(SourceSchema {
            name: file.source,
            fields: file.fields,
            bronze: Arc::new(Schema::new(arrow_fields)),
            cdc,
            text: Arc::from(""),
        })
    }

    /// The event fields alone as Arrow (bronze's leading columns): what a plain JSON
    /// reader of the landed records would decode into.
    pub fn event_schema(&self) -> SchemaRef {
        Arc::new(Schema::new(
            self.bronze.fields()[..self.fields.len()].to_vec(),
        ))
    }

    /// Index of a field by name.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.fields.iter().position(|f| f.name == name)
    }

    /// Index of `event_id` (validated to exist at load).
    pub fn event_id_index(&self) -> usize {
        self.index_of("event_id").unwrap_or(0)
    }

    /// Index of `event_ts` (validated to exist at load).
    pub fn event_ts_index(&self) -> usize {
        self.index_of("event_ts").unwrap_or(1)
    }
}

/// Arrow type of a field type. Timestamps are Delta TIMESTAMP: microseconds, UTC.
pub fn arrow_type(ty: FieldType) -> DataType {
    match ty {
        FieldType::String => DataType::Utf8,
        FieldType::Int64 => DataType::Int64,
        FieldType::Timestamp => ts_type(),
    }
}

/// `Timestamp(Microsecond, "UTC")`, the Arrow form of a Delta TIMESTAMP.
pub fn ts_type() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

/// Load the built-in schemas, then `dir/*.json` (which may override them).
pub fn load_all(dir: &Path) -> Result<BTreeMap<String, Arc<SourceSchema>>> {
    let mut out = BTreeMap::new();
    for (name, text) in BUILTIN {
        let origin = PathBuf::from(format!("(built-in) schemas/{name}.json"));
        let s = parse(text, &origin)?;
        out.insert(s.name.clone(), Arc::new(s));
    }
    for p in crate::config::files_with_extension(dir, "json")? {
        let text =
            std::fs::read_to_string(&p).map_err(|e| Error::io(p.display().to_string(), e))?;
        let s = parse(&text, &p)?;
        let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        if stem != s.name {
            return Err(Error::Schema {
                file: p.clone(),
                message: format!(
                    "`source` is `{}` but the file is named `{stem}.json`",
                    s.name
                ),
            });
        }
        out.insert(s.name.clone(), Arc::new(s));
    }
    Ok(out)
}

/// Parse one schema document.
pub fn parse(text: &str, origin: &Path) -> Result<SourceSchema> {
    let file: SchemaFile = serde_json::from_str(text).map_err(|e| Error::Schema {
        file: origin.to_path_buf(),
        message: format!("expected {{\"source\", \"kind\"?: events|cdc, \"fields\": [{{\"name\", \"type\": string|int64|timestamp, \"nullable\"?, \"enum\"?}}], and for cdc \"primary_key\" and \"position\"}}: {e}"),
    })?;
    let mut schema = SourceSchema::from_file(file, origin)?;
    schema.text = Arc::from(text);
    Ok(schema)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_schemas_load() {
        let all = load_all(Path::new("/nonexistent")).unwrap();
        assert_eq!(all.len(), 5);
        assert!(all["customers"].cdc.is_some() && all["orders"].cdc.is_none());
        let p = &all["payments"];
        let status = &p.fields[p.index_of("status").unwrap()];
        assert_eq!(status.enum_values.as_ref().unwrap().len(), 4);
        assert_eq!(
            p.bronze.field_with_name("event_ts").unwrap().data_type(),
            &ts_type()
        );
        assert!(all["clickstream"].fields[4].nullable);
        let events = all["orders"].event_schema();
        let names: Vec<&str> = events.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(
            names,
            [
                "event_id",
                "event_ts",
                "order_id",
                "sku",
                "quantity",
                "amount_cents"
            ]
        );
        assert_eq!(events.field(1).data_type(), &ts_type());
    }

    #[test]
    fn rejects_bad_schema() {
        let e = parse(
            r#"{"source":"x","fields":[{"name":"event_id","type":"string"}]}"#,
            Path::new("x.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("event_ts"), "{e}");
        let e = parse(
            r#"{"source":"x","fields":[{"name":"a","type":"float"}]}"#,
            Path::new("x.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("x.json") && e.contains("float"), "{e}");
    }
}
