//! Property tests over the decoders and validation (proptest, on stable): whatever the
//! bytes, no panic, and every record is accounted for exactly once — a bronze row or a
//! quarantined reject — or the file is rejected whole with a reason. `KESTREL_FUZZ_CASES`
//! raises the number of cases (CI runs the default, a few hundred per property).

use std::io::Write;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray, TimestampMillisecondArray};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use bytes::Bytes;
use proptest::prelude::*;

use super::decode::{decode_file, decode_ndjson, read_line, Decoded, NdjsonDecoder};
use super::discover::Format;
use super::flat;
use super::validate::{Cell, FileContext};
use crate::schema::SourceSchema;

fn orders() -> Arc<SourceSchema> {
    crate::schema::load_all(std::path::Path::new("/none")).unwrap()["orders"].clone()
}

fn ctx() -> FileContext {
    FileContext {
        source_file: "orders/fuzz.ndjson".into(),
        partition: "default".into(),
        landed_at_us: 1_764_000_000_000_000,
        batch_id: 1,
        ingested_at_us: 0,
    }
}

fn config() -> ProptestConfig {
    let cases = std::env::var("KESTREL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A JSON value of any shape, small.
fn json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(serde_json::Value::from),
        ".{0,12}".prop_map(serde_json::Value::from),
        Just(serde_json::Value::from("2025-11-24T10:00:00Z")),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(serde_json::Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..3)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An order event line: mostly right, each field possibly missing, null or of any shape;
/// sometimes extra fields.
fn order_line() -> impl Strategy<Value = String> {
    let field = |good: serde_json::Value| {
        prop_oneof![
            6 => Just(Some(good)),
            1 => Just(None),
            1 => Just(Some(serde_json::Value::Null)),
            2 => json().prop_map(Some),
        ]
    };
    (
        field("e-1".into()),
        field("2025-11-24T10:00:00Z".into()),
        field("o-1".into()),
        field("sku-1".into()),
        field(2.into()),
        field(500.into()),
        prop::option::of(json()),
    )
        .prop_map(|(id, ts, order, sku, q, a, extra)| {
            let mut m = serde_json::Map::new();
            for (k, v) in [
                ("event_id", id),
                ("event_ts", ts),
                ("order_id", order),
                ("sku", sku),
                ("quantity", q),
                ("amount_cents", a),
                ("extra", extra),
            ] {
                if let Some(v) = v {
                    m.insert(k.to_string(), v);
                }
            }
            serde_json::Value::Object(m).to_string()
        })
}

/// A line of a landed file: an order event, any JSON, or any bytes (no newline).
fn line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => order_line().prop_map(String::into_bytes),
        2 => json().prop_map(|v| v.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..40),
        1 => Just(b"   ".to_vec()),
    ]
}

/// (rows, rejects, records) of a decoded file; None when it was rejected whole.
fn accounting(d: Decoded) -> Option<(usize, usize, usize)> {
    match d {
        Decoded::Rows {
            batch,
            rejects,
            records,
        } => Some((batch.map_or(0, |b| b.num_rows()), rejects.len(), records)),
        Decoded::FileRejected { reason } => {
            assert!(!reason.is_empty());
            None
        }
    }
}

fn records_in(text: &[u8]) -> usize {
    text.split(|b| *b == b'\n')
        .filter(|l| {
            !l.strip_suffix(b"\r")
                .unwrap_or(l)
                .iter()
                .all(u8::is_ascii_whitespace)
        })
        .count()
}

/// An order line with a few bytes changed, inserted or removed, from the characters
/// that decide the flat reader's cases (quotes, escapes, digits, signs, fractions,
/// separators, whitespace, `null`'s letters, non-ASCII and invalid UTF-8).
fn edited_line() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop::sample::select(b"\"\\-+0123456789.eE,:{}[] \t\rnul\x01\xc3\xa9\xff".to_vec());
    let edit = (any::<prop::sample::Index>(), 0..3u8, byte);
    (order_line(), prop::collection::vec(edit, 0..4)).prop_map(|(line, edits)| {
        let mut b = line.into_bytes();
        for (at, kind, c) in edits {
            let i = at.index(b.len() + 1);
            match kind {
                0 if i < b.len() => b[i] = c,
                1 if i < b.len() => {
                    b.remove(i);
                }
                _ => b.insert(i, c),
            }
        }
        b
    })
}

/// The cells the decoder's full (serde) path makes of a line, or None when it fails.
fn full_read<'a>(line: &'a [u8], names: &[&str]) -> Option<Vec<Cell<'a>>> {
    let mut cells = Vec::new();
    read_line(line, names, &mut cells).ok()?;
    Some(cells)
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

proptest! {
    #![proptest_config(config())]

    /// NDJSON and gzip NDJSON: every non-blank line is a row or a reject, never both,
    /// never lost; a reject has a reason.
    #[test]
    fn ndjson_lines_are_each_accounted_for_once(lines in prop::collection::vec(line(), 0..24)) {
        let text = lines.join(&b'\n');
        let schema = orders();
        let plain = decode_file(Bytes::from(text.clone()), Format::Ndjson, &schema, &ctx()).unwrap();
        let want = records_in(&text);
        let Some((rows, rejects, records)) = accounting(plain) else {
            // Only a file without a record is rejected whole (an empty file).
            prop_assert_eq!(want, 0);
            return Ok(());
        };
        prop_assert_eq!(records, want);
        prop_assert_eq!(rows + rejects, want);
        let gz = decode_file(Bytes::from(gzip(&text)), Format::NdjsonGz, &schema, &ctx()).unwrap();
        prop_assert_eq!(accounting(gz), Some((rows, rejects, records)));
    }

    /// The flat reader (the fast path of the common line) reads a line exactly as the full
    /// reader does, or declines it.
    #[test]
    fn the_flat_reader_reads_as_the_full_one_or_declines(
        line in prop_oneof![4 => edited_line(), 1 => line()],
    ) {
        let schema = orders();
        let names: Vec<&str> = schema.fields.iter().map(|f| f.name.as_str()).collect();
        let mut cells = vec![Cell::Missing; names.len()];
        if flat::object(&line, &names, &mut cells) {
            prop_assert_eq!(Some(cells), full_read(&line, &names), "{}", String::from_utf8_lossy(&line));
        }
    }

    /// NDJSON fed in pieces cut anywhere (as a large file is read in ranges) decodes
    /// exactly as the whole buffer: the same rows, rejects, line numbers and reasons.
    #[test]
    fn ndjson_fed_in_pieces_decodes_as_whole(
        lines in prop::collection::vec(line(), 0..24),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        crlf in any::<bool>(),
    ) {
        let text = lines.join(if crlf { &b"\r\n"[..] } else { &b"\n"[..] });
        let schema = orders();
        let whole = decode_ndjson(&text, &schema, &ctx()).unwrap();
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(text.len() + 1)).collect();
        at.push(0);
        at.push(text.len());
        at.sort_unstable();
        let mut dec = NdjsonDecoder::new(schema.clone(), ctx().landed_at_us);
        for w in at.windows(2) {
            dec.feed(&text[w[0]..w[1]]);
        }
        let pieces = dec.finish(&ctx()).unwrap();
        prop_assert_eq!(format!("{whole:?}"), format!("{pieces:?}"));
    }

    /// Cut gzip and any bytes as Parquet: rejected whole, or decoded with every record
    /// accounted for; no panic.
    #[test]
    fn damaged_files_are_rejected_or_accounted_for(
        lines in prop::collection::vec(order_line(), 1..8),
        cut in any::<prop::sample::Index>(),
        noise in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let schema = orders();
        let gz = gzip(lines.join("\n").as_bytes());
        let cut = &gz[..cut.index(gz.len())];
        if let Some((rows, rejects, records)) =
            accounting(decode_file(Bytes::from(cut.to_vec()), Format::NdjsonGz, &schema, &ctx()).unwrap())
        {
            prop_assert_eq!(rows + rejects, records);
        }
        let junk = decode_file(Bytes::from(noise), Format::Parquet, &schema, &ctx()).unwrap();
        prop_assert!(accounting(junk).is_none_or(|(r, j, n)| r + j == n));
    }

    /// Parquet with the right columns and any values (nulls, timestamps far outside the
    /// microsecond range): every row is a bronze row or a reject with a reason.
    #[test]
    fn parquet_rows_are_each_accounted_for_once(
        rows in prop::collection::vec(
            (
                prop::option::of(".{0,8}"),
                prop::option::of(any::<i64>()),
                prop::option::of(any::<i64>()),
            ),
            1..40,
        )
    ) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("event_ts", DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())), true),
            Field::new("order_id", DataType::Utf8, true),
            Field::new("sku", DataType::Utf8, true),
            Field::new("quantity", DataType::Int64, true),
            Field::new("amount_cents", DataType::Int64, true),
        ]));
        let n = rows.len();
        let cols: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>())),
            Arc::new(TimestampMillisecondArray::from(rows.iter().map(|r| r.1).collect::<Vec<_>>()).with_timezone("UTC")),
            Arc::new(StringArray::from(vec![Some("o"); n])),
            Arc::new(StringArray::from(vec![Some("s"); n])),
            Arc::new(Int64Array::from(rows.iter().map(|r| r.2).collect::<Vec<_>>())),
            Arc::new(Int64Array::from(vec![Some(1); n])),
        ];
        let batch = RecordBatch::try_new(schema.clone(), cols).unwrap();
        let mut buf = Vec::new();
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, schema, None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let d = decode_file(Bytes::from(buf), Format::Parquet, &orders(), &ctx()).unwrap();
        let Decoded::Rows { batch, rejects, records } = d else {
            return Err(TestCaseError::fail("a well-formed Parquet file was rejected whole"));
        };
        prop_assert_eq!(records, n);
        prop_assert_eq!(batch.map_or(0, |b| b.num_rows()) + rejects.len(), n);
        for r in &rejects {
            prop_assert!(!r.reason.is_empty());
            // A timestamp is out of range, never "null" when it was not.
            if r.reason.contains("field `event_ts` is null") {
                let row = r.line.unwrap() as usize - 1;
                prop_assert!(rows[row].1.is_none(), "{}", r.reason);
            }
        }
    }
}

/// Lines as producers write them take the flat reader's path, and it reads them as the
/// full reader does (the property above only compares the lines it takes).
#[test]
fn the_flat_reader_takes_the_common_line() {
    let schema = orders();
    let names: Vec<&str> = schema.fields.iter().map(|f| f.name.as_str()).collect();
    for line in [
        r#"{"event_id":"0b7e2c1a-6a43-4f0e-9d51-2f5c8f1e9a10","event_ts":"2025-11-24T10:00:00.123Z","order_id":"o-17","sku":"SKU-0042","quantity":2,"amount_cents":1998}"#,
        r#"{"event_id":"e2","event_ts":1763978400000,"order_id":"o-18","sku":"Café","quantity":-1,"amount_cents":0,"channel":"web"}"#,
        "{ \"event_id\" : \"e3\",\t\"event_ts\": \"2025-11-24T10:00:00+01:00\", \"order_id\": null, \"sku\": \"s\", \"quantity\": 1, \"amount_cents\": 5 }\r",
    ] {
        let mut cells = vec![Cell::Missing; names.len()];
        assert!(flat::object(line.as_bytes(), &names, &mut cells), "{line}");
        assert_eq!(Some(cells), full_read(line.as_bytes(), &names), "{line}");
    }
}

/// The reasons the fuzzing turned up as misleading: an integer out of the 64-bit range
/// and a whole number written as a float are called what they are, and a Parquet
/// timestamp too large for microseconds is out of range, not null.
#[test]
fn numbers_and_timestamps_out_of_range_are_named_as_such() {
    let reason = |q: &str| {
        let line = format!(
            r#"{{"event_id":"e","event_ts":"2025-11-24T10:00:00Z","order_id":"o","sku":"s","quantity":{q},"amount_cents":1}}"#
        );
        let d = decode_file(Bytes::from(line), Format::Ndjson, &orders(), &ctx()).unwrap();
        match d {
            Decoded::Rows { rejects, .. } => rejects
                .first()
                .map(|r| r.reason.clone())
                .unwrap_or_default(),
            Decoded::FileRejected { reason } => reason,
        }
    };
    assert!(
        reason("-9223372036854775809").contains("out of the 64-bit range"),
        "{}",
        reason("-9223372036854775809")
    );
    assert!(reason("18446744073709551616").contains("out of the 64-bit range"));
    assert!(
        reason("3.0").contains("floating-point number"),
        "{}",
        reason("3.0")
    );
    assert!(reason("1e3").contains("floating-point number"));
    assert!(reason("2.5").contains("a number with a fraction"));
    assert_eq!(reason("3"), "");

    let schema = Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Utf8, false),
        Field::new(
            "event_ts",
            DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
            false,
        ),
        Field::new("order_id", DataType::Utf8, false),
        Field::new("sku", DataType::Utf8, false),
        Field::new("quantity", DataType::Int64, false),
        Field::new("amount_cents", DataType::Int64, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(vec!["e"])),
        Arc::new(TimestampMillisecondArray::from(vec![i64::MAX / 10]).with_timezone("UTC")),
        Arc::new(StringArray::from(vec!["o"])),
        Arc::new(StringArray::from(vec!["s"])),
        Arc::new(Int64Array::from(vec![1])),
        Arc::new(Int64Array::from(vec![1])),
    ];
    let batch = RecordBatch::try_new(schema.clone(), cols).unwrap();
    let mut buf = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, schema, None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let Decoded::Rows { rejects, .. } =
        decode_file(Bytes::from(buf), Format::Parquet, &orders(), &ctx()).unwrap()
    else {
        panic!("rejected whole")
    };
    assert_eq!(rejects.len(), 1);
    assert!(
        rejects[0]
            .reason
            .contains("outside the range of 64-bit microseconds"),
        "{}",
        rejects[0].reason
    );
}
