//! Typed access to the columns of Arrow batches, for operators and bookkeeping alike:
//! by name for rows kestrel built (bronze, gold, state), by position for query results
//! (DataFusion may hand strings back as `Utf8View`, integers as another width).

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef, TimestampMicrosecondType};

/// A column that is not there or not of the type its reader needs: a broken invariant
/// between the code that wrote the rows and the code reading them, not bad input.
#[derive(Debug, thiserror::Error)]
pub enum ColumnError {
    #[error("rows without column {0}")]
    Missing(String),
    #[error("column {name} has type {found}, expected {expected}")]
    Type {
        name: String,
        found: DataType,
        expected: &'static str,
    },
    #[error("column {0} does not exist in a result of {1} columns")]
    OutOfRange(usize, usize),
    #[error("a column of {n} copies of a {len}-byte string exceeds Arrow's 2 GiB string offsets")]
    TooLong { len: usize, n: usize },
    #[error("column {name}: {source}")]
    Cast {
        name: String,
        #[source]
        source: arrow::error::ArrowError,
    },
}

type Result<T> = std::result::Result<T, ColumnError>;

fn by_name<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a dyn Array> {
    b.column_by_name(name)
        .map(|c| c.as_ref())
        .ok_or_else(|| ColumnError::Missing(name.to_string()))
}

fn wrong(name: &str, c: &dyn Array, expected: &'static str) -> ColumnError {
    ColumnError::Type {
        name: name.to_string(),
        found: c.data_type().clone(),
        expected,
    }
}

/// `value` repeated `n` times: the values buffer and offsets built at once, not from a
/// `Vec` of `n` slices (the stamp columns of every decoded file — its path, partition —
/// are this).
pub fn repeated_str(value: &str, n: usize) -> Result<StringArray> {
    let len = value.len();
    let too_long = || ColumnError::TooLong { len, n };
    let total = len
        .checked_mul(n)
        .filter(|t| i32::try_from(*t).is_ok())
        .ok_or_else(too_long)?;
    let step = i32::try_from(len).map_err(|_| too_long())?;
    let offsets: Vec<i32> = std::iter::successors(Some(0i32), |o| Some(o + step))
        .take(n + 1)
        .collect();
    let mut values = Vec::with_capacity(total);
    for _ in 0..n {
        values.extend_from_slice(value.as_bytes());
    }
    StringArray::try_new(
        arrow::buffer::OffsetBuffer::new(offsets.into()),
        values.into(),
        None,
    )
    .map_err(|source| ColumnError::Cast {
        name: "repeated".into(),
        source,
    })
}

/// Event times of a bronze batch (micros, UTC).
pub fn event_ts(b: &RecordBatch) -> Result<&TimestampMicrosecondArray> {
    ts(b, "event_ts")
}

/// Column `name` as timestamps (micros).
pub fn ts<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a TimestampMicrosecondArray> {
    let c = by_name(b, name)?;
    c.as_primitive_opt::<TimestampMicrosecondType>()
        .ok_or_else(|| wrong(name, c, "timestamp(µs)"))
}

/// Column `name` as Utf8 strings.
pub fn string<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a StringArray> {
    let c = by_name(b, name)?;
    c.as_string_opt::<i32>()
        .ok_or_else(|| wrong(name, c, "utf8"))
}

/// Column `name` as Int32.
pub fn int32<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a arrow::array::Int32Array> {
    let c = by_name(b, name)?;
    c.as_primitive_opt::<arrow::datatypes::Int32Type>()
        .ok_or_else(|| wrong(name, c, "int32"))
}

/// Column `name` as Int64 (timestamps as their micros, narrower integers widened).
pub fn int64(b: &RecordBatch, name: &str) -> Result<Int64Array> {
    let c = by_name(b, name)?;
    let a = cast(c, &DataType::Int64).map_err(|source| ColumnError::Cast {
        name: name.to_string(),
        source,
    })?;
    Ok(a.as_primitive::<Int64Type>().clone())
}

fn at(b: &RecordBatch, i: usize) -> Result<&dyn Array> {
    if i < b.num_columns() {
        Ok(b.column(i).as_ref())
    } else {
        Err(ColumnError::OutOfRange(i, b.num_columns()))
    }
}

/// Column `i` of a query result as Utf8.
pub fn string_at(b: &RecordBatch, i: usize) -> Result<StringArray> {
    let a = cast(at(b, i)?, &DataType::Utf8).map_err(|source| ColumnError::Cast {
        name: format!("#{i}"),
        source,
    })?;
    Ok(a.as_string::<i32>().clone())
}

/// Column `i` of a query result as Int64.
pub fn int64_at(b: &RecordBatch, i: usize) -> Result<Int64Array> {
    let a = cast(at(b, i)?, &DataType::Int64).map_err(|source| ColumnError::Cast {
        name: format!("#{i}"),
        source,
    })?;
    Ok(a.as_primitive::<Int64Type>().clone())
}

/// A one-column batch `_key` of `keys`, for [`read_keys`].
pub fn keys_batch<'a>(keys: impl Iterator<Item = &'a str>) -> crate::error::Result<RecordBatch> {
    let schema = Arc::new(Schema::new(vec![Field::new("_key", DataType::Utf8, false)]));
    let arr: ArrayRef = Arc::new(StringArray::from_iter_values(keys));
    Ok(RecordBatch::try_new(schema, vec![arr])?)
}

/// Whether `b` has a column of every name in `schema` (types aside: [`conform`] casts).
pub fn has_columns(b: &RecordBatch, schema: &Schema) -> bool {
    let have = b.schema();
    schema
        .fields()
        .iter()
        .all(|f| have.column_with_name(f.name()).is_some())
}

/// `b` with the columns of `target`, by name, cast to the target types.
pub fn conform(b: &RecordBatch, target: &SchemaRef) -> crate::error::Result<RecordBatch> {
    let cols = target
        .fields()
        .iter()
        .map(|f| {
            let c = b
                .column_by_name(f.name())
                .ok_or_else(|| ColumnError::Missing(f.name().to_string()))?;
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                Ok(cast(c, f.data_type())?)
            }
        })
        .collect::<crate::error::Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(target.clone(), cols)?)
}

/// Values of `columns` of row `i`, formatted and joined (a comparable identity).
pub(crate) fn row_string(formatters: &[arrow::util::display::ArrayFormatter], i: usize) -> String {
    let mut s = String::new();
    for f in formatters {
        s.push_str(&f.value(i).to_string());
        s.push('\u{1f}');
    }
    s
}

pub(crate) fn formatters<'a>(
    b: &'a RecordBatch,
    columns: &[String],
) -> crate::error::Result<Vec<arrow::util::display::ArrayFormatter<'a>>> {
    let opts = arrow::util::display::FormatOptions::default().with_null("∅");
    columns
        .iter()
        .map(|c| {
            let a = b
                .column_by_name(c)
                .ok_or_else(|| ColumnError::Missing(c.to_string()))?;
            arrow::util::display::ArrayFormatter::try_new(a.as_ref(), &opts)
                .map_err(crate::error::Error::from)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, StringViewArray};
    use arrow::datatypes::{Field, Schema};
    use std::sync::Arc;

    #[test]
    fn columns_by_name_and_position_convert_or_say_what_is_wrong() {
        let schema = Schema::new(vec![
            Field::new("n", DataType::Int32, true),
            Field::new("s", DataType::Utf8View, true),
            Field::new(
                "event_ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
        ]);
        let b = RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(Int32Array::from(vec![1, 2])),
                Arc::new(StringViewArray::from(vec!["a", "b"])),
                Arc::new(TimestampMicrosecondArray::from(vec![5, 6]).with_timezone("UTC")),
            ],
        )
        .unwrap();
        assert_eq!(int64(&b, "n").unwrap().values(), &[1, 2]);
        assert_eq!(int64(&b, "event_ts").unwrap().values(), &[5, 6]);
        assert_eq!(event_ts(&b).unwrap().value(1), 6);
        assert_eq!(string_at(&b, 1).unwrap().value(0), "a");
        assert_eq!(int64_at(&b, 0).unwrap().value(1), 2);
        assert!(matches!(int64(&b, "x"), Err(ColumnError::Missing(n)) if n == "x"));
        let e = string(&b, "s").unwrap_err().to_string();
        assert_eq!(e, "column s has type Utf8View, expected utf8");
        assert!(matches!(ts(&b, "n"), Err(ColumnError::Type { .. })));
        assert!(matches!(
            int64_at(&b, 3),
            Err(ColumnError::OutOfRange(3, 3))
        ));
    }

    /// A repeated string equals the array built from `n` slices, for empty strings and
    /// no rows too; one whose offsets would pass 2 GiB is an error, not a panic.
    #[test]
    fn repeated_strings_equal_the_array_of_slices() {
        for (v, n) in [("orders/p=1/f.ndjson", 5), ("", 3), ("x", 0), ("é", 2)] {
            assert_eq!(repeated_str(v, n).unwrap(), StringArray::from(vec![v; n]));
        }
        assert!(matches!(
            repeated_str("abcd", 1 << 30),
            Err(ColumnError::TooLong { len: 4, .. })
        ));
    }
}
