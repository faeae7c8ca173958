//! Gold's clustered layout: a gold table is partitioned by date alone, and within a date
//! each file holds the rows of one hour (`window_hour`, `order_hour`) — written so by
//! kestrel's MERGE ([`crate::sink::delta::write_clustered`]) and kept so by the open
//! day's compaction here, which merges an hour's small files into one file of that hour.
//! A batch's MERGE picks the files of the hours it touches by their statistics
//! ([`stats_admit`]), as it picked hour partitions before, and the daily maintenance
//! compacts a closed date into one file, where 24 hour partitions kept 24: every read
//! and commit of a Delta table pays per active file (README "Cost over time").

use std::collections::HashSet;

use datafusion::common::ScalarValue;
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::DeltaTable;

use crate::error::{Error, Result};
use crate::sink::delta;

/// Hour columns a new gold table clusters its files by within a date partition, rather
/// than partitions by.
pub const COLUMNS: [&str; 2] = ["window_hour", "order_hour"];

/// The column `table` clusters its files by: one of [`COLUMNS`] that it holds and does
/// not partition by (a table created before clustering partitions by its hour).
pub fn column_of(table: &DeltaTable) -> Result<Option<String>> {
    let url = table.table_url().to_string();
    let snap = table.snapshot().map_err(|e| Error::delta(&url, e))?;
    let parts = snap.metadata().partition_columns();
    let schema = snap.snapshot().arrow_schema();
    Ok(COLUMNS
        .iter()
        .find(|c| schema.field_with_name(c).is_ok() && !parts.iter().any(|p| p == *c))
        .map(|c| c.to_string()))
}

/// An integer (or date) value as an `i64`, for comparing with file statistics.
pub(crate) fn integer_of(v: &ScalarValue) -> Option<i64> {
    match v {
        ScalarValue::Int8(Some(x)) => Some(i64::from(*x)),
        ScalarValue::Int16(Some(x)) => Some(i64::from(*x)),
        ScalarValue::Int32(Some(x)) | ScalarValue::Date32(Some(x)) => Some(i64::from(*x)),
        ScalarValue::Int64(Some(x)) => Some(*x),
        _ => None,
    }
}

/// `column`'s `minValues` and `maxValues` in a file's Delta statistics (the add
/// action's JSON), when both are integers.
fn range(stats: &serde_json::Value, column: &str) -> Option<(i64, i64)> {
    let bound = |which: &str| stats.get(which)?.get(column)?.as_i64();
    Some((bound("minValues")?, bound("maxValues")?))
}

/// Whether a file whose Delta statistics are `stats` may hold a row with one of the
/// values of each `(column, values)`: its min–max range of the column holds one of
/// them, or the statistics do not say (no statistics, or none for the column: nothing
/// is assumed about what they do not describe).
pub(crate) fn stats_admit(stats: Option<&str>, ranged: &[(String, Vec<i64>)]) -> bool {
    let Some(stats) = stats.and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok()) else {
        return true;
    };
    ranged
        .iter()
        .all(|(column, values)| match range(&stats, column) {
            Some((lo, hi)) => values.iter().any(|v| (lo..=hi).contains(v)),
            None => true,
        })
}

/// The one value of `column` a file holds, by its statistics (min = max), if so.
pub(crate) fn single_value(stats: Option<&str>, column: &str) -> Option<i64> {
    let stats = serde_json::from_str::<serde_json::Value>(stats?).ok()?;
    // A file whose column is all null has no min/max: it is no hour's.
    range(&stats, column).and_then(|(lo, hi)| (lo == hi).then_some(lo))
}

/// What [`compact_hour`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HourCompacted {
    pub files_removed: u64,
    pub files_added: u64,
}

/// Rewrite the files `paths` of `table` — small files of one date partition holding
/// rows of `column = value` only — as one file, in a commit that changes no data
/// (`dataChange = false`, an `OPTIMIZE`): incremental readers skip it. Delta's conflict
/// checks apply as to delta-rs's optimize: a MERGE that removed one of the files first
/// makes this commit fail with a conflict (the caller gives up; the next batch tries
/// again); one that commits after this sees the files it added and is planned again.
pub async fn compact_hour(
    table: DeltaTable,
    column: &str,
    value: i64,
    paths: &HashSet<String>,
    props: WriterProperties,
    target_size: u64,
) -> Result<(DeltaTable, HourCompacted)> {
    let url = table.table_url().to_string();
    let partitions = vec![(column, vec![ScalarValue::Int64(Some(value))])];
    let mut target = match crate::sink::compact::files_of(&table, partitions, Some(column))? {
        Ok(t) => t,
        Err(why) => {
            tracing::debug!(table = %delta::shown(url), why, "not compacted by hour");
            return Ok((table, HourCompacted::default()));
        }
    };
    target.files.retain(|f| paths.contains(&f.path.to_string()));
    let predicate = format!("{column} = {value}");
    // One file of the hour: its small files are far below the target together.
    let (table, done) =
        crate::sink::compact::rewrite(table, target, props, u64::MAX, target_size, predicate)
            .await?;
    Ok((
        table,
        HourCompacted {
            files_removed: done.files_removed,
            files_added: done.files_added,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clustering_columns_are_the_gold_hours() {
        assert_eq!(
            COLUMNS,
            [
                crate::job::aggregate::WINDOW_HOUR,
                crate::operator::payments::matching::ORDER_HOUR
            ]
        );
    }

    #[test]
    fn statistics_admit_files_whose_range_holds_a_value() {
        let s = r#"{"numRecords":3,"minValues":{"h":3,"k":"a"},"maxValues":{"h":5,"k":"z"},"nullCount":{"h":0}}"#;
        let ranged = |v: Vec<i64>| vec![("h".to_string(), v)];
        assert!(stats_admit(Some(s), &ranged(vec![4])));
        assert!(stats_admit(Some(s), &ranged(vec![1, 5])));
        assert!(!stats_admit(Some(s), &ranged(vec![2, 6])));
        // Unknown column, no statistics, unreadable statistics: read the file.
        assert!(stats_admit(Some(s), &[("x".to_string(), vec![1])]));
        assert!(stats_admit(None, &ranged(vec![9])));
        assert!(stats_admit(Some("{"), &ranged(vec![9])));
        assert_eq!(single_value(Some(s), "h"), None);
        let one = r#"{"minValues":{"h":7},"maxValues":{"h":7}}"#;
        assert_eq!(single_value(Some(one), "h"), Some(7));
        assert_eq!(
            single_value(Some(r#"{"minValues":{},"maxValues":{}}"#), "h"),
            None
        );
    }
}
