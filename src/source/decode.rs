//! Decoding landed files (NDJSON, gzip NDJSON, Parquet) into validated bronze rows.
//!
//! NDJSON is parsed one line at a time with a serde visitor that borrows strings from the
//! file buffer and hands typed [`Cell`]s to the [`RowAssembler`] — one pass, no
//! intermediate JSON values, and (unlike arrow-json) no coercion of quoted numbers or
//! truncation of fractions. The common line (a flat object of escape-free strings,
//! integers and nulls) is read by [`super::flat`] first, which declines anything else to
//! the visitor. A bad line is quarantined; the rest of the file goes on.
//! A file that cannot be read whole (truncated gzip, Parquet with the wrong schema,
//! empty) is rejected whole.

use std::borrow::Cow;
use std::fmt;
use std::io::Read;
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Int64Type, TimeUnit, TimestampMicrosecondType};
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::cdc::{push_change, ChangeLayout};
use super::discover::Format;
use super::flat;
use super::validate::{Cell, FileContext, RowAssembler};
use crate::error::Result;
use crate::schema::cdc::CdcSpec;
use crate::schema::{FieldType, SourceSchema};

/// A record that failed validation.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rejected {
    /// 1-based line (NDJSON) or row (Parquet) number; None when the whole file is rejected.
    pub line: Option<i64>,
    /// The raw text of the record (Parquet: the row rendered as JSON).
    pub raw: Option<String>,
    /// Why it was rejected.
    pub reason: String,
}

/// The outcome of decoding one file.
#[derive(Debug)]
pub enum Decoded {
    /// The file was read whole: valid rows (bronze-shaped) and per-record rejects.
    Rows {
        batch: Option<RecordBatch>,
        rejects: Vec<Rejected>,
        /// Records seen (valid + rejected).
        records: usize,
    },
    /// The file cannot be read whole; nothing of it goes to bronze.
    FileRejected { reason: String },
}

/// A gzip file that decompresses to more than this is rejected whole: its rows are held
/// in memory until the file is committed, and a small file can decompress to many
/// gigabytes.
pub const MAX_GUNZIPPED_BYTES: u64 = 2 << 30;

/// Decode one file's bytes.
pub fn decode_file(
    bytes: Bytes,
    format: Format,
    schema: &Arc<SourceSchema>,
    ctx: &FileContext,
) -> Result<Decoded> {
    match format {
        Format::Ndjson => decode_ndjson(&bytes, schema, ctx),
        Format::NdjsonGz => decode_ndjson_read(&bytes[..], true, MAX_GUNZIPPED_BYTES, schema, ctx),
        Format::Parquet => decode_parquet(bytes, schema, ctx),
    }
}

/// A record (NDJSON line) longer than this is rejected without being parsed: no event
/// is that large, and a file without newlines would otherwise be parsed, and quarantined,
/// as one record of its whole size.
pub const MAX_RECORD_BYTES: usize = 4 << 20;

/// How much of an over-long record the quarantine keeps as its raw text (the landed file
/// itself stays in the landing zone, and the ledger names it).
pub const MAX_RAW_BYTES: usize = 64 << 10;

/// The piece size in which a reader's (decompressed) bytes are fed to the decoder.
const PIECE_BYTES: usize = 1 << 20;

/// Decode NDJSON read from `r` (gzip members when `gzip`), piece by piece: memory is
/// bounded by the piece and record sizes plus the rows decoded, not by the file. A read
/// or decompression error rejects the file whole (nothing of it goes to bronze), as does
/// gzip that decompresses to more than `gunzip_limit` bytes.
pub fn decode_ndjson_read<R: Read>(
    r: R,
    gzip: bool,
    gunzip_limit: u64,
    schema: &Arc<SourceSchema>,
    ctx: &FileContext,
) -> Result<Decoded> {
    let mut src: Box<dyn Read> = if gzip {
        Box::new(flate2::read::MultiGzDecoder::new(r))
    } else {
        Box::new(r)
    };
    let mut dec = NdjsonDecoder::new(schema.clone(), ctx.landed_at_us);
    let mut buf = vec![0u8; PIECE_BYTES];
    let mut total = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let reason = if gzip {
                    format!("truncated or corrupt gzip: {e}")
                } else {
                    format!("read failed: {e}")
                };
                return Ok(Decoded::FileRejected { reason });
            }
        };
        total += n as u64;
        if gzip && total > gunzip_limit {
            return Ok(Decoded::FileRejected {
                reason: format!(
                    "gzip decompresses to more than {gunzip_limit} bytes: split it into smaller files"
                ),
            });
        }
        dec.feed(&buf[..n]);
    }
    dec.finish(ctx)
}

/// Decode NDJSON text held in memory.
pub fn decode_ndjson(
    data: &[u8],
    schema: &Arc<SourceSchema>,
    ctx: &FileContext,
) -> Result<Decoded> {
    let mut dec = NdjsonDecoder::new(schema.clone(), ctx.landed_at_us);
    dec.asm.size_for(estimated_lines(data), data.len());
    dec.feed(data);
    dec.finish(ctx)
}

/// Bytes at the head of a file whose lines estimate how many the file holds.
const LINE_SAMPLE_BYTES: usize = 64 << 10;

/// The shortest line [`estimated_lines`] counts on: no event is shorter, and a head of
/// blank or tiny lines does not size a large file's buffers for a line a byte.
const MIN_ESTIMATED_LINE_BYTES: usize = 16;

/// About how many lines `data` holds: those of its first [`LINE_SAMPLE_BYTES`], scaled
/// to its length, at most one per [`MIN_ESTIMATED_LINE_BYTES`] (counting every newline
/// of the file cost ≈ 1 % of the throughput benchmark's CPU).
fn estimated_lines(data: &[u8]) -> usize {
    let head = &data[..data.len().min(LINE_SAMPLE_BYTES)];
    let lines = memchr::memchr_iter(b'\n', head).count() + 1;
    let scaled = lines.saturating_mul(data.len()) / head.len().max(1);
    scaled.min(data.len() / MIN_ESTIMATED_LINE_BYTES + 1)
}

/// NDJSON decoding fed in pieces of any size (a file in memory is one piece; a large
/// file is fed as it is read, see [`super::read`]). Complete lines are parsed straight
/// from the piece they are in; only a line cut by a piece boundary is copied, and of a
/// line longer than [`MAX_RECORD_BYTES`] only its head is kept — memory is bounded by the
/// piece size and the record limit, not by the file.
pub struct NdjsonDecoder {
    schema: Arc<SourceSchema>,
    asm: RowAssembler,
    landed_at_us: i64,
    rejects: Vec<Rejected>,
    records: usize,
    /// Lines completed so far (blank ones included: line numbers are the file's).
    lines: i64,
    /// The start of a line cut by a piece boundary (of an over-long one, its head).
    carry: Vec<u8>,
    /// Set once the carried line is known to be over-long.
    overlong: Option<Overlong>,
    /// A change-data-capture source's spec: lines are change events.
    change: Option<(Arc<CdcSpec>, ChangeLayout)>,
}

/// What is known of an over-long line whose bytes are not kept.
struct Overlong {
    len: usize,
    all_ws: bool,
    last: u8,
}

impl NdjsonDecoder {
    /// A decoder for one file of `schema`'s source.
    pub fn new(schema: Arc<SourceSchema>, landed_at_us: i64) -> Self {
        let change = schema.cdc.clone().map(|c| {
            let layout = ChangeLayout::new(&c);
            (c, layout)
        });
        NdjsonDecoder {
            asm: RowAssembler::new(schema.clone()),
            schema,
            change,
            landed_at_us,
            rejects: Vec::new(),
            records: 0,
            lines: 0,
            carry: Vec::new(),
            overlong: None,
        }
    }

    /// Decode the next piece of the file.
    pub fn feed(&mut self, mut data: &[u8]) {
        if !self.carry.is_empty() || self.overlong.is_some() {
            let Some(i) = memchr::memchr(b'\n', data) else {
                self.extend_carry(data);
                return;
            };
            self.extend_carry(&data[..i]);
            self.end_carried_line();
            data = &data[i + 1..];
        }
        let Some(end) = memchr::memrchr(b'\n', data) else {
            self.extend_carry(data);
            return;
        };
        let schema = self.schema.clone();
        let names: Vec<&str> = schema.fields.iter().map(|f| f.name.as_str()).collect();
        let mut cells: Vec<Cell<'_>> = Vec::with_capacity(names.len());
        let mut from = 0;
        for nl in memchr::memchr_iter(b'\n', &data[..=end]) {
            self.lines += 1;
            self.line(&data[from..nl], &names, &mut cells);
            from = nl + 1;
        }
        self.extend_carry(&data[end + 1..]);
    }

    /// The decoded file: its rows and rejects (the last line needs no newline).
    pub fn finish(mut self, ctx: &FileContext) -> Result<Decoded> {
        if !self.carry.is_empty() || self.overlong.is_some() {
            self.end_carried_line();
        }
        finish(self.asm, self.rejects, self.records, ctx)
    }

    /// Add the next bytes of the line being carried over a piece boundary, keeping only
    /// the head of an over-long one.
    fn extend_carry(&mut self, piece: &[u8]) {
        let Some(&last) = piece.last() else {
            return;
        };
        if let Some(o) = &mut self.overlong {
            o.len += piece.len();
            o.all_ws = o.all_ws && piece.iter().all(u8::is_ascii_whitespace);
            o.last = last;
            return;
        }
        // A trailing `\r` is not part of the record: one byte of slack before a line is
        // known to be over-long.
        let len = self.carry.len() + piece.len();
        if len <= MAX_RECORD_BYTES + 1 {
            self.carry.extend_from_slice(piece);
            return;
        }
        let all_ws = self.carry.iter().all(u8::is_ascii_whitespace)
            && piece.iter().all(u8::is_ascii_whitespace);
        let keep = MAX_RAW_BYTES
            .saturating_sub(self.carry.len())
            .min(piece.len());
        self.carry.extend_from_slice(&piece[..keep]);
        self.carry.truncate(MAX_RAW_BYTES);
        self.carry.shrink_to_fit();
        self.overlong = Some(Overlong { len, all_ws, last });
    }

    /// The carried line is complete.
    fn end_carried_line(&mut self) {
        self.lines += 1;
        let line = std::mem::take(&mut self.carry);
        match self.overlong.take() {
            Some(o) => {
                if !o.all_ws {
                    self.records += 1;
                    let len = o.len - usize::from(o.last == b'\r');
                    self.reject_overlong(&line, len);
                }
            }
            None => {
                let schema = self.schema.clone();
                let names: Vec<&str> = schema.fields.iter().map(|f| f.name.as_str()).collect();
                let mut cells: Vec<Cell<'_>> = Vec::with_capacity(names.len());
                self.line(&line, &names, &mut cells);
            }
        }
        self.carry = line;
        self.carry.clear();
    }

    /// Validate one complete line (without its newline).
    fn line<'de>(&mut self, line: &'de [u8], names: &[&str], cells: &mut Vec<Cell<'de>>) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        self.records += 1;
        if line.len() > MAX_RECORD_BYTES {
            self.reject_overlong(line, line.len());
            return;
        }
        if let Some((spec, layout)) = &self.change {
            let pushed = push_change(
                line,
                spec,
                layout,
                &mut self.asm,
                self.lines,
                self.landed_at_us,
            );
            if let Err(reason) = pushed {
                self.rejects.push(Rejected {
                    line: Some(self.lines),
                    raw: Some(String::from_utf8_lossy(line).into_owned()),
                    reason,
                });
            }
            return;
        }
        cells.clear();
        cells.resize(names.len(), Cell::Missing);
        let parsed = if flat::object(line, names, cells) {
            Ok(())
        } else {
            read_line(line, names, cells)
        };
        let outcome = match parsed {
            Ok(()) => self.asm.push(cells, self.lines, self.landed_at_us),
            Err(e) => Err(format!("malformed JSON: {e}")),
        };
        if let Err(reason) = outcome {
            self.rejects.push(Rejected {
                line: Some(self.lines),
                raw: Some(String::from_utf8_lossy(line).into_owned()),
                reason,
            });
        }
    }

    /// Reject a record of `len` bytes whose head is `head`, unparsed.
    fn reject_overlong(&mut self, head: &[u8], len: usize) {
        let head = String::from_utf8_lossy(&head[..head.len().min(MAX_RAW_BYTES)]);
        self.rejects.push(Rejected {
            line: Some(self.lines),
            raw: Some(format!("{head}… [{len} bytes in all]")),
            reason: format!(
                "record of {len} bytes is longer than the limit of {MAX_RECORD_BYTES} bytes (is the file newline-delimited JSON?)"
            ),
        });
    }
}

/// The outcome of a file read whole: its rows, or an empty-file rejection.
fn finish(
    mut asm: RowAssembler,
    rejects: Vec<Rejected>,
    records: usize,
    ctx: &FileContext,
) -> Result<Decoded> {
    if records == 0 {
        return Ok(Decoded::FileRejected {
            reason: "empty file: no records".into(),
        });
    }
    Ok(Decoded::Rows {
        batch: asm.finish(ctx)?,
        rejects,
        records,
    })
}

/// One line read the full way (serde's visitor) into `cells`, one per name of `names`,
/// each reset to [`Cell::Missing`] first.
pub(super) fn read_line<'de>(
    line: &'de [u8],
    names: &[&str],
    cells: &mut Vec<Cell<'de>>,
) -> serde_json::Result<()> {
    cells.clear();
    cells.resize(names.len(), Cell::Missing);
    let mut de = serde_json::Deserializer::from_slice(line);
    let seed = RowSeed { names, cells };
    seed.deserialize(&mut de).and_then(|()| de.end())
}

pub(super) struct RowSeed<'s, 'de> {
    pub(super) names: &'s [&'s str],
    pub(super) cells: &'s mut Vec<Cell<'de>>,
}

impl<'de> DeserializeSeed<'de> for RowSeed<'_, 'de> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RowSeed<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            match self.names.iter().position(|n| *n == key.as_ref()) {
                Some(i) => {
                    if self.cells[i] != Cell::Missing {
                        return Err(de::Error::custom(format!("duplicate field `{key}`")));
                    }
                    self.cells[i] = map.next_value::<CellValue<'de>>()?.0;
                }
                None => {
                    // Fields outside the schema are ignored (forward compatibility).
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

pub(super) struct Key<'de>(pub(super) Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Key<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> std::result::Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_str(V)
    }
}

pub(super) struct CellValue<'de>(pub(super) Cell<'de>);

impl<'de> de::Deserialize<'de> for CellValue<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CellValue<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(Cell::Str(Cow::Borrowed(v))))
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(Cell::Str(Cow::Owned(v.to_string()))))
            }
            fn visit_i64<E>(self, v: i64) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(Cell::Int(v)))
            }
            fn visit_u64<E>(self, v: u64) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(
                    i64::try_from(v).map(Cell::Int).unwrap_or(Cell::BigInt),
                ))
            }
            fn visit_f64<E>(self, v: f64) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(float_cell(v)))
            }
            fn visit_bool<E>(self, _: bool) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(Cell::Bool))
            }
            fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(Cell::Null))
            }
            fn visit_none<E>(self) -> std::result::Result<Self::Value, E> {
                Ok(CellValue(Cell::Null))
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(CellValue(Cell::Nested))
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut s: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(CellValue(Cell::Nested))
            }
        }
        d.deserialize_any(V)
    }
}

/// Why a Parquet column cannot feed a schema field, or None when it can.
/// What a JSON number serde_json read as a float is: an integer literal outside the i64
/// range also arrives here (`-9223372036854775809`), as does `3.0`.
fn float_cell(v: f64) -> Cell<'static> {
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    if v.fract() != 0.0 || !v.is_finite() {
        Cell::Float
    } else if v.abs() >= TWO_63 {
        Cell::BigInt
    } else {
        Cell::FloatWhole
    }
}

fn parquet_type_problem(ty: FieldType, dt: &DataType) -> Option<String> {
    let ok = match ty {
        FieldType::String => matches!(
            dt,
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        ),
        FieldType::Int64 => matches!(
            dt,
            DataType::Int64
                | DataType::Int32
                | DataType::Int16
                | DataType::Int8
                | DataType::UInt32
                | DataType::UInt16
                | DataType::UInt8
        ),
        FieldType::Timestamp => matches!(
            dt,
            DataType::Timestamp(_, Some(_))
                | DataType::Int64
                | DataType::Utf8
                | DataType::LargeUtf8
                | DataType::Utf8View
        ),
    };
    if ok {
        None
    } else {
        let want = match ty {
            FieldType::String => "a string column",
            FieldType::Int64 => "an integer column",
            FieldType::Timestamp => {
                "a timestamp with time zone, epoch-millisecond Int64 or RFC 3339 string column"
            }
        };
        Some(format!("is {dt}, expected {want}"))
    }
}

/// Decode a Parquet file. Its schema must provide every required field with a compatible
/// type; otherwise the file is rejected whole.
pub fn decode_parquet(
    bytes: Bytes,
    schema: &Arc<SourceSchema>,
    ctx: &FileContext,
) -> Result<Decoded> {
    if schema.cdc.is_some() {
        return decode_parquet_changes(bytes, schema, ctx);
    }
    let builder = match ParquetRecordBatchReaderBuilder::try_new(bytes) {
        Ok(b) => b,
        Err(e) => {
            return Ok(Decoded::FileRejected {
                reason: format!("unreadable Parquet: {e}"),
            })
        }
    };
    let file_schema = builder.schema().clone();
    let mut columns: Vec<Option<usize>> = Vec::with_capacity(schema.fields.len());
    let mut problems = Vec::new();
    for f in &schema.fields {
        match file_schema.index_of(&f.name) {
            Ok(i) => {
                if let Some(p) = parquet_type_problem(f.ty, file_schema.field(i).data_type()) {
                    problems.push(format!("column `{}` {p}", f.name));
                }
                columns.push(Some(i));
            }
            Err(_) if f.nullable => columns.push(None),
            Err(_) => {
                problems.push(format!("required column `{}` is missing", f.name));
                columns.push(None);
            }
        }
    }
    if !problems.is_empty() {
        return Ok(Decoded::FileRejected {
            reason: format!("wrong schema: {}", problems.join("; ")),
        });
    }
    let reader = match builder.with_batch_size(8192).build() {
        Ok(r) => r,
        Err(e) => {
            return Ok(Decoded::FileRejected {
                reason: format!("unreadable Parquet: {e}"),
            })
        }
    };
    let mut asm = RowAssembler::new(schema.clone());
    let mut rejects = Vec::new();
    let mut records = 0usize;
    for batch in reader {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                return Ok(Decoded::FileRejected {
                    reason: format!("unreadable Parquet: {e}"),
                })
            }
        };
        // Normalise each used column once per batch.
        let mut norm: Vec<Option<Arc<dyn Array>>> = Vec::with_capacity(columns.len());
        // Typed timestamps as read, where the cast to microseconds can overflow (a value
        // the cast turned null was out of range, not null).
        let mut typed_ts: Vec<Option<&Arc<dyn Array>>> = Vec::with_capacity(columns.len());
        for (f, c) in schema.fields.iter().zip(&columns) {
            let Some(c) = c else {
                norm.push(None);
                typed_ts.push(None);
                continue;
            };
            let a = batch.column(*c);
            let target = match (f.ty, a.data_type()) {
                (FieldType::String, _) => DataType::Utf8,
                (FieldType::Int64, _) => DataType::Int64,
                (FieldType::Timestamp, DataType::Timestamp(_, _)) => {
                    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
                }
                (FieldType::Timestamp, DataType::Int64) => DataType::Int64,
                (FieldType::Timestamp, _) => DataType::Utf8,
            };
            typed_ts.push(matches!(a.data_type(), DataType::Timestamp(_, _)).then_some(a));
            norm.push(Some(cast(a, &target)?));
        }
        let mut cells: Vec<Cell<'_>> = Vec::with_capacity(schema.fields.len());
        for row in 0..batch.num_rows() {
            records += 1;
            cells.clear();
            for (a, typed) in norm.iter().zip(&typed_ts) {
                let cell = match a {
                    None => Cell::Missing,
                    Some(a) if a.is_null(row) && typed.is_some_and(|t| !t.is_null(row)) => {
                        Cell::TsOutOfRange
                    }
                    Some(a) if a.is_null(row) => Cell::Null,
                    Some(a) => match a.data_type() {
                        DataType::Utf8 => Cell::Str(Cow::Borrowed(a.as_string::<i32>().value(row))),
                        DataType::Int64 => Cell::Int(a.as_primitive::<Int64Type>().value(row)),
                        DataType::Timestamp(_, _) => {
                            Cell::TsMicros(a.as_primitive::<TimestampMicrosecondType>().value(row))
                        }
                        _ => Cell::Nested,
                    },
                };
                cells.push(cell);
            }
            let line = records as i64;
            if let Err(reason) = asm.push(&cells, line, ctx.landed_at_us) {
                rejects.push(Rejected {
                    line: Some(line),
                    raw: Some(render_row(schema, &cells)),
                    reason,
                });
            }
        }
    }
    finish(asm, rejects, records, ctx)
}

/// Decode a Parquet file of change events (columns `op`, `ts_ms`, structs `before`,
/// `after`, `source`): each row is rendered as its JSON object and decoded as an NDJSON
/// change, so both formats follow one set of rules and reasons (row `n` is line `n`).
fn decode_parquet_changes(
    bytes: Bytes,
    schema: &Arc<SourceSchema>,
    ctx: &FileContext,
) -> Result<Decoded> {
    let unreadable = |e: &dyn std::fmt::Display| Decoded::FileRejected {
        reason: format!("unreadable Parquet: {e}"),
    };
    let reader = match ParquetRecordBatchReaderBuilder::try_new(bytes)
        .and_then(|b| b.with_batch_size(8192).build())
    {
        Ok(r) => r,
        Err(e) => return Ok(unreadable(&e)),
    };
    let mut dec = NdjsonDecoder::new(schema.clone(), ctx.landed_at_us);
    for batch in reader {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => return Ok(unreadable(&e)),
        };
        let mut w = arrow::json::LineDelimitedWriter::new(Vec::new());
        if let Err(e) = w.write(&batch) {
            return Ok(unreadable(&e));
        }
        if let Err(e) = w.finish() {
            return Ok(unreadable(&e));
        }
        dec.feed(&w.into_inner());
    }
    dec.finish(ctx)
}

/// Render a Parquet row as a JSON object for the quarantine's raw text.
fn render_row(schema: &SourceSchema, cells: &[Cell<'_>]) -> String {
    let mut m = serde_json::Map::new();
    for (f, c) in schema.fields.iter().zip(cells) {
        let v = match c {
            Cell::Missing => continue,
            Cell::Str(s) => serde_json::Value::String(s.to_string()),
            Cell::Int(i) => serde_json::Value::from(*i),
            Cell::TsMicros(us) => serde_json::Value::String(super::validate::fmt_us(*us)),
            _ => serde_json::Value::Null,
        };
        m.insert(f.name.clone(), v);
    }
    serde_json::Value::Object(m).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::load_all;

    fn ctx() -> FileContext {
        FileContext {
            source_file: "orders/a.ndjson".into(),
            partition: "default".into(),
            landed_at_us: 1_764_000_000_000_000,
            batch_id: 1,
            ingested_at_us: 0,
        }
    }

    fn orders() -> Arc<SourceSchema> {
        load_all(std::path::Path::new("/none")).unwrap()["orders"].clone()
    }

    /// A gzip file that decompresses past the limit is rejected whole, with a reason.
    #[test]
    fn a_gzip_bomb_is_rejected_whole() {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(&vec![b' '; 10 << 20]).unwrap();
        let gz = e.finish().unwrap();
        assert!(gz.len() < 100 << 10, "{}", gz.len());
        let bomb = decode_ndjson_read(&gz[..], true, 1 << 20, &orders(), &ctx()).unwrap();
        let Decoded::FileRejected { reason } = bomb else {
            panic!("{bomb:?}")
        };
        assert!(
            reason.contains("decompresses to more than 1048576 bytes"),
            "{reason}"
        );
        // Within the limit it is decompressed whole: an all-blank, empty file.
        let blank = decode_ndjson_read(&gz[..], true, 10 << 20, &orders(), &ctx()).unwrap();
        assert!(
            matches!(blank, Decoded::FileRejected { ref reason } if reason.contains("empty")),
            "{blank:?}"
        );
    }

    /// A file without newlines is one over-long record: rejected with a reason, not
    /// parsed, and only its head kept as raw text; the records around it are not affected.
    #[test]
    fn an_overlong_record_is_rejected_unparsed() {
        let good = br#"{"event_id":"e1","event_ts":"2025-11-24T10:00:00Z","order_id":"o1","sku":"s","quantity":2,"amount_cents":500}"#;
        let mut text = good.to_vec();
        text.push(b'\n');
        text.extend(std::iter::repeat_n(b'x', MAX_RECORD_BYTES + 1));
        text.push(b'\n');
        text.extend_from_slice(good);
        let Decoded::Rows {
            batch,
            rejects,
            records,
        } = decode_ndjson(&text, &orders(), &ctx()).unwrap()
        else {
            panic!("file rejected")
        };
        assert_eq!(
            (records, batch.unwrap().num_rows(), rejects.len()),
            (3, 2, 1)
        );
        assert_eq!(rejects[0].line, Some(2));
        assert!(
            rejects[0].reason.contains("longer than the limit"),
            "{}",
            rejects[0].reason
        );
        let raw = rejects[0].raw.as_ref().unwrap();
        assert!(raw.len() < MAX_RAW_BYTES + 100 && raw.ends_with("bytes in all]"));
    }

    /// The line estimate scales the head's lines to the file, and a head of blank lines
    /// does not make it one line a byte.
    #[test]
    fn lines_are_estimated_from_the_head_and_bounded() {
        let line = format!("{}\n", "x".repeat(99));
        let file = line.repeat(10_000);
        let est = estimated_lines(file.as_bytes());
        assert!((9_900..=10_100).contains(&est), "{est}");
        assert_eq!(estimated_lines(b""), 0);
        let blank_head = format!("{}{}", "\n".repeat(LINE_SAMPLE_BYTES), line.repeat(10_000));
        let len = blank_head.len();
        assert_eq!(
            estimated_lines(blank_head.as_bytes()),
            len / MIN_ESTIMATED_LINE_BYTES + 1
        );
    }

    /// A file read whole sizes its buffers from its line count and first rows; the rows
    /// are those of the same file read piece by piece (unsized), whether its later
    /// strings are longer, shorter or null, and with rejected lines among them.
    #[test]
    fn sized_buffers_hold_the_rows_of_unsized_ones() {
        let clicks = load_all(std::path::Path::new("/none")).unwrap()["clickstream"].clone();
        let line = |i: usize, sku: &str| {
            let sku = match i % 7 {
                0 => "null".to_string(),
                _ => format!("\"{sku}\""),
            };
            format!(
                r#"{{"event_id":"e{i}","event_ts":"2025-11-24T10:00:00Z","anonymous_id":"a{i}","event_type":"view","sku":{sku},"page":"/p/{i}"}}"#
            )
        };
        for (head, tail) in [
            ("s", "a-much-longer-sku-than-the-first"),
            ("a-long-sku-at-first", "s"),
        ] {
            let mut text = String::new();
            for i in 0..2000 {
                let sku = if i < 100 { head } else { tail };
                text.push_str(&if i % 301 == 5 {
                    "{bad".to_string()
                } else {
                    line(i, sku)
                });
                text.push('\n');
            }
            let sized = decode_ndjson(text.as_bytes(), &clicks, &ctx()).unwrap();
            let pieces = decode_ndjson_read(text.as_bytes(), false, u64::MAX, &clicks, &ctx());
            let (
                Decoded::Rows {
                    batch: Some(a),
                    rejects: ra,
                    records: na,
                },
                Ok(Decoded::Rows {
                    batch: Some(b),
                    rejects: rb,
                    records: nb,
                }),
            ) = (sized, pieces)
            else {
                panic!("file rejected")
            };
            assert_eq!((a.num_rows(), na, ra.len()), (1993, 2000, 7));
            assert_eq!(a.column(4).null_count(), 286);
            assert_eq!((a, na, ra), (b, nb, rb));
        }
    }

    #[test]
    fn ndjson_lines_are_validated_one_by_one() {
        let text = br#"{"event_id":"e1","event_ts":"2025-11-24T10:00:00Z","order_id":"o1","sku":"s","quantity":2,"amount_cents":500,"extra":{"a":[1]}}
{"event_id":"e2","event_ts":"2025-11-24T10:00:00Z","order_id":"o1","sku":"s","quantity":"2","amount_cents":500}
{not json

{"event_id":"e3","event_ts":1763978400000,"order_id":"o1","sku":"s\u00e9","quantity":2.5,"amount_cents":500}
{"event_id":"e4","event_id":"e4","event_ts":1763978400000,"order_id":"o1","sku":"s","quantity":2,"amount_cents":500}
[1,2]
"#;
        let Decoded::Rows {
            batch,
            rejects,
            records,
        } = decode_ndjson(text, &orders(), &ctx()).unwrap()
        else {
            panic!("file rejected")
        };
        assert_eq!(records, 6);
        assert_eq!(batch.unwrap().num_rows(), 1);
        let lines: Vec<i64> = rejects.iter().map(|r| r.line.unwrap()).collect();
        assert_eq!(lines, vec![2, 3, 5, 6, 7]);
        assert!(rejects[0]
            .reason
            .contains("expected an integer, got a string"));
        assert!(rejects[1].reason.starts_with("malformed JSON"));
        assert!(rejects[2].reason.contains("fraction"));
        assert!(rejects[3].reason.contains("duplicate field"));
        assert_eq!(rejects[1].raw.as_deref(), Some("{not json"));
    }

    #[test]
    fn truncated_gzip_and_empty_files_are_rejected_whole() {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        for i in 0..1000 {
            writeln!(enc, r#"{{"event_id":"e{i}","event_ts":1763978400000,"order_id":"o","sku":"s","quantity":1,"amount_cents":1}}"#).unwrap();
        }
        let gz = enc.finish().unwrap();
        let ok = decode_file(Bytes::from(gz.clone()), Format::NdjsonGz, &orders(), &ctx()).unwrap();
        assert!(matches!(ok, Decoded::Rows { records: 1000, .. }));
        let cut = Bytes::from(gz[..gz.len() / 2].to_vec());
        let bad = decode_file(cut, Format::NdjsonGz, &orders(), &ctx()).unwrap();
        assert!(
            matches!(bad, Decoded::FileRejected { ref reason } if reason.contains("gzip")),
            "{bad:?}"
        );
        let empty = decode_file(Bytes::new(), Format::Ndjson, &orders(), &ctx()).unwrap();
        assert!(matches!(empty, Decoded::FileRejected { ref reason } if reason.contains("empty")));
    }
}
