//! Strict per-record validation into Arrow builders.
//!
//! Decoders hand over one record at a time as [`Cell`]s (one per schema field); the
//! [`RowAssembler`] checks types, required fields, enums and timestamp sanity and either
//! appends the row to its builders or returns the reasons it was rejected. No coercion:
//! a quoted number is not an integer and `3.0` is not an integer.

use std::borrow::Cow;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, Date32Builder, Int64Array, Int64Builder, RecordBatch, StringBuilder,
    TimestampMicrosecondArray, TimestampMicrosecondBuilder,
};
use chrono::{DateTime, Utc};

use crate::error::Result;
use crate::schema::{FieldType, SourceSchema};

/// 2000-01-01T00:00:00Z in microseconds: earlier event times are absurd.
pub const MIN_EVENT_TS_US: i64 = 946_684_800_000_000;
/// An event may be at most this far after its file landed (clock skew allowance).
pub const MAX_AHEAD_OF_LANDING_US: i64 = 86_400_000_000;
const US_PER_DAY: i64 = 86_400_000_000;

/// One decoded JSON/Parquet value, before validation.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell<'a> {
    /// Field not present in the record.
    Missing,
    /// Explicit null.
    Null,
    /// A string.
    Str(Cow<'a, str>),
    /// An integer that fits in i64.
    Int(i64),
    /// An integer outside the i64 range.
    BigInt,
    /// A number with a fraction.
    Float,
    /// A number written as a float (`3.0`, `1e3`) whose value is a whole number.
    FloatWhole,
    /// true/false.
    Bool,
    /// An object or array.
    Nested,
    /// A timestamp already typed by the file format (Parquet), microseconds UTC.
    TsMicros(i64),
    /// A typed timestamp (Parquet) too far from 1970 for 64-bit microseconds.
    TsOutOfRange,
}

impl Cell<'_> {
    /// What the value is, for messages (`a string`, `null`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            Cell::Missing => "nothing",
            Cell::Null => "null",
            Cell::Str(_) => "a string",
            Cell::Int(_) => "an integer",
            Cell::BigInt => "an integer out of the 64-bit range",
            Cell::Float => "a number with a fraction",
            Cell::FloatWhole => {
                "a floating-point number (write integers without `.` or an exponent)"
            }
            Cell::Bool => "a boolean",
            Cell::Nested => "an object or array",
            Cell::TsMicros(_) => "a timestamp",
            Cell::TsOutOfRange => "a timestamp outside the range of 64-bit microseconds since 1970",
        }
    }
}

/// Parse an RFC 3339 timestamp with an offset; returns microseconds since the epoch (UTC).
pub fn parse_rfc3339_us(s: &str) -> Option<i64> {
    parse_rfc3339_us_with(s, &mut LastDay::default())
}

/// [`parse_rfc3339_us`] remembering the last date it read in `day`.
fn parse_rfc3339_us_with(s: &str, day: &mut LastDay) -> Option<i64> {
    fast_rfc3339_us(s.as_bytes(), day).or_else(|| {
        DateTime::parse_from_rfc3339(s)
            .ok()
            .map(|d| d.with_timezone(&Utc).timestamp_micros())
    })
}

/// The last `YYYY-MM-DD` the fast path read, with its day number: a file's events are
/// mostly of one or two dates, so checking and converting the date once and then
/// comparing its ten bytes (≈ 2 ns) spares most lines that part of the parse.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LastDay(Option<([u8; 10], i64)>);

impl LastDay {
    /// Days since 1970-01-01 of the valid date `date` (`YYYY-MM-DD`), None when it is
    /// not one.
    fn days(&mut self, date: &[u8]) -> Option<i64> {
        let date: [u8; 10] = date.try_into().ok()?;
        if let Some((last, days)) = self.0 {
            if last == date {
                return Some(days);
            }
        }
        let days = civil_days(&date)?;
        self.0 = Some((date, days));
        Some(days)
    }
}

/// The value of ASCII digits, None if any byte is not one.
fn digits(b: &[u8]) -> Option<i64> {
    let mut v = 0i64;
    for &c in b {
        if !c.is_ascii_digit() {
            return None;
        }
        v = v * 10 + i64::from(c - b'0');
    }
    Some(v)
}

/// Days since 1970-01-01 of `YYYY-MM-DD` (proleptic Gregorian), None when the bytes are
/// not a valid date of that shape.
fn civil_days(b: &[u8; 10]) -> Option<i64> {
    if b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let (y, mo, d) = (digits(&b[0..4])?, digits(&b[5..7])?, digits(&b[8..10])?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let mdays = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1..=12).contains(&mo) || d < 1 || d > mdays[(mo - 1) as usize] {
        return None;
    }
    // days from civil (proleptic Gregorian), Howard Hinnant's algorithm
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some(era * 146_097 + doe - 719_468)
}

/// Fast path for the common shape `YYYY-MM-DDTHH:MM:SS[.f{1,9}](Z|±HH:MM)`; None for
/// anything else (which then goes through chrono's full RFC 3339 parser).
fn fast_rfc3339_us(b: &[u8], day: &mut LastDay) -> Option<i64> {
    if b.len() < 20 || b[10] != b'T' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let days = day.days(&b[..10])?;
    let (h, mi, sec) = (
        digits(&b[11..13])?,
        digits(&b[14..16])?,
        digits(&b[17..19])?,
    );
    if h > 23 || mi > 59 || sec > 59 {
        return None;
    }
    let mut i = 19;
    let mut frac_us = 0i64;
    if b[i] == b'.' {
        let start = i + 1;
        i = start;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let frac = &b[start..i];
        if frac.is_empty() || frac.len() > 9 {
            return None;
        }
        let mut v = digits(frac)?;
        for _ in frac.len()..6 {
            v *= 10;
        }
        for _ in 6..frac.len() {
            v /= 10;
        }
        frac_us = v;
    }
    let offset_s = match &b[i..] {
        [b'Z'] => 0,
        [sign @ (b'+' | b'-'), oh1, oh2, b':', om1, om2] => {
            let oh = digits(&[*oh1, *oh2])?;
            let om = digits(&[*om1, *om2])?;
            if oh > 23 || om > 59 {
                return None;
            }
            let o = oh * 3600 + om * 60;
            if *sign == b'-' {
                -o
            } else {
                o
            }
        }
        _ => return None,
    };
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset_s;
    Some(secs * 1_000_000 + frac_us)
}

enum Col {
    Str(StringBuilder),
    Int(Int64Builder),
    Ts(TimestampMicrosecondBuilder),
}

/// Per-file context stamped on every row.
#[derive(Debug, Clone)]
pub struct FileContext {
    pub source_file: String,
    pub partition: String,
    pub landed_at_us: i64,
    pub batch_id: i64,
    pub ingested_at_us: i64,
}

/// Accumulates valid rows of one file into a bronze-shaped RecordBatch.
pub struct RowAssembler {
    schema: Arc<SourceSchema>,
    cols: Vec<Col>,
    event_date: Date32Builder,
    lines: Int64Builder,
    ts_index: usize,
    rows: usize,
    reasons: Vec<String>,
    values_us: Vec<Option<i64>>,
    /// The date the last timestamp string was of.
    last_day: LastDay,
    /// Rows and bytes the file is expected to hold ([`RowAssembler::size_for`]); 0 rows
    /// when unknown.
    expected: usize,
    expected_bytes: usize,
}

/// Rows whose string lengths size the string buffers of a file of known length
/// ([`RowAssembler::size_for`]).
const SIZING_SAMPLE: usize = 64;

impl RowAssembler {
    /// New assembler for a source schema.
    pub fn new(schema: Arc<SourceSchema>) -> Self {
        let cols = schema
            .fields
            .iter()
            .map(|f| match f.ty {
                FieldType::String => Col::Str(StringBuilder::new()),
                FieldType::Int64 => Col::Int(Int64Builder::new()),
                FieldType::Timestamp => Col::Ts(TimestampMicrosecondBuilder::new()),
            })
            .collect();
        let ts_index = schema.event_ts_index();
        let n = schema.fields.len();
        RowAssembler {
            schema,
            cols,
            event_date: Date32Builder::new(),
            lines: Int64Builder::new(),
            ts_index,
            rows: 0,
            reasons: Vec::new(),
            values_us: vec![None; n],
            last_day: LastDay::default(),
            expected: 0,
            expected_bytes: 0,
        }
    }

    /// Size the buffers for about `rows` rows of `bytes` bytes in all (a file's line count
    /// and length), before the first row: each buffer is allocated once instead of
    /// doubling from a kilobyte, which copied every column's values several times a file
    /// and faulted in twice the memory. String values are sized once the first
    /// [`SIZING_SAMPLE`] rows show their lengths, a column at most the file's length. An
    /// estimate off either way only costs the growth it would have anyway.
    pub fn size_for(&mut self, rows: usize, bytes: usize) {
        if self.rows > 0 || rows <= SIZING_SAMPLE {
            return;
        }
        self.expected = rows;
        self.expected_bytes = bytes;
        for col in &mut self.cols {
            *col = match col {
                Col::Str(_) => Col::Str(StringBuilder::with_capacity(rows, 0)),
                Col::Int(_) => Col::Int(Int64Builder::with_capacity(rows)),
                Col::Ts(_) => Col::Ts(TimestampMicrosecondBuilder::with_capacity(rows)),
            };
        }
        self.event_date = Date32Builder::with_capacity(rows);
        self.lines = Int64Builder::with_capacity(rows);
    }

    /// Give each string column room for the expected rows at the mean length of the
    /// sample's values (an eighth more), keeping the sample's values.
    fn size_strings(&mut self) {
        let (rows, expected) = (self.rows, self.expected);
        for col in &mut self.cols {
            let Col::Str(b) = col else { continue };
            let per_row = b.values_slice().len().div_ceil(rows.max(1));
            let want = per_row
                .saturating_mul(expected)
                .saturating_add(per_row.saturating_mul(expected) / 8)
                .min(self.expected_bytes);
            if want <= b.values_capacity() {
                continue;
            }
            let sample = b.finish();
            let mut sized = StringBuilder::with_capacity(expected, want);
            // A sample of a few rows cannot overflow the offsets of a larger buffer.
            if sized.append_array(&sample).is_err() {
                sized = StringBuilder::new();
                sample.iter().for_each(|v| sized.append_option(v));
            }
            *b = sized;
        }
    }

    /// The schema.
    pub fn schema(&self) -> &Arc<SourceSchema> {
        &self.schema
    }

    /// Rows accepted so far.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// True when no row was accepted.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Validate one record; append it, or return why it was rejected.
    pub fn push(
        &mut self,
        cells: &[Cell<'_>],
        line: i64,
        landed_at_us: i64,
    ) -> std::result::Result<(), String> {
        self.reasons.clear();
        // First pass: check everything, remembering parsed timestamps.
        // Disjoint field borrows: no per-row Arc clone on this hot path.
        let (schema, reasons, values_us, last_day) = (
            &self.schema,
            &mut self.reasons,
            &mut self.values_us,
            &mut self.last_day,
        );
        for (i, f) in schema.fields.iter().enumerate() {
            let cell = cells.get(i).unwrap_or(&Cell::Missing);
            values_us[i] = None;
            match cell {
                Cell::Missing | Cell::Null => {
                    if !f.nullable {
                        reasons.push(if matches!(cell, Cell::Missing) {
                            format!("missing required field `{}`", f.name)
                        } else {
                            format!("field `{}` is null but required", f.name)
                        });
                    }
                    continue;
                }
                _ => {}
            }
            match (f.ty, cell) {
                (FieldType::String, Cell::Str(s)) => {
                    if let Some(allowed) = &f.enum_values {
                        if !allowed.iter().any(|a| a == s.as_ref()) {
                            reasons.push(format!(
                                "field `{}`: unknown value {:?} (expected one of {})",
                                f.name,
                                s,
                                allowed.join(", ")
                            ));
                        }
                    }
                }
                (FieldType::Int64, Cell::Int(_)) => {}
                (FieldType::Timestamp, Cell::Str(s)) => match parse_rfc3339_us_with(s, last_day) {
                    Some(us) => values_us[i] = check_ts(&f.name, us, landed_at_us, reasons),
                    None => reasons.push(format!(
                        "field `{}`: {:?} is not an RFC 3339 timestamp with an offset",
                        f.name, s
                    )),
                },
                (FieldType::Timestamp, Cell::Int(ms)) => match ms.checked_mul(1000) {
                    Some(us) => values_us[i] = check_ts(&f.name, us, landed_at_us, reasons),
                    None => reasons.push(format!(
                        "field `{}`: epoch milliseconds {ms} out of range",
                        f.name
                    )),
                },
                (FieldType::Timestamp, Cell::TsMicros(us)) => {
                    values_us[i] = check_ts(&f.name, *us, landed_at_us, reasons)
                }
                (ty, other) => {
                    let expected = match ty {
                        FieldType::String => "a string",
                        FieldType::Int64 => "an integer",
                        FieldType::Timestamp => "an RFC 3339 string or epoch milliseconds",
                    };
                    reasons.push(format!(
                        "field `{}`: expected {expected}, got {}",
                        f.name,
                        other.kind()
                    ));
                }
            }
        }
        if !self.reasons.is_empty() {
            return Err(self.reasons.join("; "));
        }
        // Second pass: append.
        for (i, col) in self.cols.iter_mut().enumerate() {
            let cell = cells.get(i).unwrap_or(&Cell::Missing);
            match col {
                Col::Str(b) => match cell {
                    Cell::Str(s) => b.append_value(s),
                    _ => b.append_null(),
                },
                Col::Int(b) => match cell {
                    Cell::Int(v) => b.append_value(*v),
                    _ => b.append_null(),
                },
                Col::Ts(b) => b.append_option(self.values_us[i]),
            }
        }
        let ts = self.values_us[self.ts_index].unwrap_or_default();
        self.event_date
            .append_value(ts.div_euclid(US_PER_DAY) as i32);
        self.lines.append_value(line);
        self.rows += 1;
        if self.rows == SIZING_SAMPLE && self.expected > SIZING_SAMPLE {
            self.size_strings();
        }
        Ok(())
    }

    /// Finish into a bronze-shaped batch (None when no row was accepted).
    pub fn finish(&mut self, ctx: &FileContext) -> Result<Option<RecordBatch>> {
        if self.rows == 0 {
            return Ok(None);
        }
        let n = self.rows;
        let mut arrays: Vec<ArrayRef> = Vec::with_capacity(self.cols.len() + 7);
        for col in &mut self.cols {
            arrays.push(match col {
                Col::Str(b) => Arc::new(b.finish()),
                Col::Int(b) => Arc::new(b.finish()),
                Col::Ts(b) => Arc::new(b.finish().with_timezone("UTC")),
            });
        }
        arrays.push(Arc::new(self.event_date.finish()));
        arrays.push(Arc::new(crate::columns::repeated_str(&ctx.partition, n)?));
        arrays.push(Arc::new(
            TimestampMicrosecondArray::from(vec![ctx.landed_at_us; n]).with_timezone("UTC"),
        ));
        arrays.push(Arc::new(crate::columns::repeated_str(&ctx.source_file, n)?));
        arrays.push(Arc::new(self.lines.finish()));
        arrays.push(Arc::new(Int64Array::from(vec![ctx.batch_id; n])));
        arrays.push(Arc::new(
            TimestampMicrosecondArray::from(vec![ctx.ingested_at_us; n]).with_timezone("UTC"),
        ));
        self.rows = 0;
        (self.expected, self.expected_bytes) = (0, 0);
        Ok(Some(RecordBatch::try_new(
            self.schema.bronze.clone(),
            arrays,
        )?))
    }
}

/// Check an event time's sanity: Some(us) when plausible, else a reason is recorded.
pub(super) fn check_ts(
    name: &str,
    us: i64,
    landed_at_us: i64,
    reasons: &mut Vec<String>,
) -> Option<i64> {
    if us < MIN_EVENT_TS_US {
        reasons.push(format!(
            "field `{name}`: {} is before 2000-01-01",
            fmt_us(us)
        ));
        None
    } else if us > landed_at_us.saturating_add(MAX_AHEAD_OF_LANDING_US) {
        reasons.push(format!(
            "field `{name}`: {} is more than a day after the file landed ({})",
            fmt_us(us),
            fmt_us(landed_at_us)
        ));
        None
    } else {
        Some(us)
    }
}

/// Format microseconds as RFC 3339 (for messages).
pub fn fmt_us(us: i64) -> String {
    DateTime::from_timestamp_micros(us)
        .map(|d| d.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
        .unwrap_or_else(|| format!("{us}µs"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::load_all;

    fn asm(src: &str) -> RowAssembler {
        let all = load_all(std::path::Path::new("/none")).unwrap();
        RowAssembler::new(all[src].clone())
    }

    const LANDED: i64 = 1_764_000_000_000_000;

    #[test]
    fn accepts_valid_and_rejects_with_reasons() {
        let mut a = asm("payments");
        let ok = [
            Cell::Str("e1".into()),
            Cell::Str("2025-11-24T15:59:00+01:00".into()),
            Cell::Str("p1".into()),
            Cell::Str("o1".into()),
            Cell::Int(500),
            Cell::Str("captured".into()),
        ];
        a.push(&ok, 1, LANDED).unwrap();
        let mut bad = ok.clone();
        bad[4] = Cell::Str("3".into());
        bad[5] = Cell::Str("pending".into());
        let e = a.push(&bad, 2, LANDED).unwrap_err();
        assert!(
            e.contains("`amount_cents`: expected an integer, got a string"),
            "{e}"
        );
        assert!(e.contains("unknown value \"pending\""), "{e}");
        let mut bad = ok.clone();
        bad[4] = Cell::Float;
        assert!(a.push(&bad, 3, LANDED).unwrap_err().contains("fraction"));
        let mut bad = ok.clone();
        bad[0] = Cell::Missing;
        assert!(a
            .push(&bad, 4, LANDED)
            .unwrap_err()
            .contains("missing required field `event_id`"));
        let mut bad = ok.clone();
        bad[1] = Cell::Int(100);
        assert!(a.push(&bad, 5, LANDED).unwrap_err().contains("before 2000"));
        let mut bad = ok.clone();
        bad[1] = Cell::Int(LANDED / 1000 + 86_400_001);
        assert!(a
            .push(&bad, 6, LANDED)
            .unwrap_err()
            .contains("more than a day after"));
        let mut bad = ok.clone();
        bad[1] = Cell::Str("2025-11-24 15:59:00".into());
        assert!(a.push(&bad, 7, LANDED).unwrap_err().contains("RFC 3339"));
        assert_eq!(a.len(), 1);
        let ctx = FileContext {
            source_file: "payments/x.ndjson".into(),
            partition: "default".into(),
            landed_at_us: LANDED,
            batch_id: 7,
            ingested_at_us: LANDED,
        };
        let b = a.finish(&ctx).unwrap().unwrap();
        assert_eq!(b.num_rows(), 1);
        let ts = b
            .column(1)
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .unwrap();
        // normalised to UTC
        assert_eq!(fmt_us(ts.value(0)), "2025-11-24T14:59:00Z");
    }

    #[test]
    fn fast_timestamp_path_agrees_with_chrono() {
        // One remembered date across every parse, as a file's rows share it; and each
        // string parsed with none remembered too.
        let mut day = LastDay::default();
        let mut fast = |s: &str| {
            let remembered = fast_rfc3339_us(s.as_bytes(), &mut day);
            assert_eq!(
                remembered,
                fast_rfc3339_us(s.as_bytes(), &mut LastDay::default())
            );
            remembered
        };
        let chrono_us = |s: &str| {
            DateTime::parse_from_rfc3339(s)
                .ok()
                .map(|d| d.timestamp_micros())
        };
        for s in [
            "2025-11-24T15:59:00Z",
            "2025-11-24T15:59:00.1Z",
            "2025-11-24T15:59:00.123456789+01:00",
            "2024-02-29T23:59:59.999-05:30",
            "2000-01-01T00:00:00Z",
            "1969-12-31T23:59:59.5Z",
            "2100-03-01T00:00:00+14:00",
        ] {
            assert_eq!(fast(s), chrono_us(s), "{s}");
        }
        for s in [
            "2025-02-29T00:00:00Z",
            "2025-11-24T24:00:00Z",
            "2025-11-24T15:59:00",
            "2025-11-24 15:59:00Z",
            "2025-11-24T15:59:00.Z",
        ] {
            assert_eq!(fast(s), None, "{s}");
        }
        // shapes outside the fast path still parse through chrono
        assert_eq!(
            parse_rfc3339_us("2025-11-24t15:59:00z"),
            chrono_us("2025-11-24T15:59:00Z")
        );
        let mut us = 946_684_800_000_000i64;
        for _ in 0..2000 {
            us += 7_777_777_777_777 % 9_999_999_999;
            let s = fmt_us(us);
            assert_eq!(fast(&s), Some(us), "{s}");
        }
    }

    #[test]
    fn nullable_fields_may_be_absent() {
        let mut a = asm("clickstream");
        let row = [
            Cell::Str("e1".into()),
            Cell::Int(LANDED / 1000),
            Cell::Str("anon".into()),
            Cell::Str("page_view".into()),
            Cell::Missing,
            Cell::Null,
        ];
        a.push(&row, 1, LANDED).unwrap();
        assert_eq!(a.len(), 1);
    }
}
