//! What one batch of an operator did. Each operator has its own metrics type with named
//! fields (windows and sessions, orders, alerts and skus); every one starts with the
//! [`InputCounts`] all batches share. They are logged with the batch (`job batch done`),
//! kept by name in the batch's durable result and its [`crate::runlog::JobEntry`], and
//! mapped onto the run log's uniform columns ([`JobCounts`]: outputs upserted, deleted,
//! corrections), so `_kestrel/runs` has one shape for every operator.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::error::Result;
use crate::job::plan::JobCounts;
use crate::time::Micros;

/// The counts every operator's batch has: its new rows and its watermark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct InputCounts {
    /// New bronze rows read.
    pub rows_in: i64,
    /// New rows applied (not too late).
    pub applied: i64,
    /// New rows too late for the job (side output and/or counted).
    pub too_late: i64,
    pub watermark_before: Option<Micros>,
    pub watermark_after: Option<Micros>,
    /// Arrival time of the oldest file whose rows the batch read.
    pub oldest_landed: Option<Micros>,
}

impl InputCounts {
    /// The counts of a batch's new rows as the cut-off split them (`applied` and
    /// `too_late` out of `new`), with its watermark before and after.
    pub fn of(
        new: &arrow::array::RecordBatch,
        applied: &arrow::array::RecordBatch,
        too_late: &arrow::array::RecordBatch,
        (watermark_before, watermark_after): (Option<Micros>, Option<Micros>),
        oldest_landed: Option<Micros>,
    ) -> Self {
        InputCounts {
            rows_in: new.num_rows() as i64,
            applied: applied.num_rows() as i64,
            too_late: too_late.num_rows() as i64,
            watermark_before,
            watermark_after,
            oldest_landed,
        }
    }
}

/// An operator's batch metrics.
pub trait Metrics: Serialize {
    /// The input counts.
    fn input(&self) -> InputCounts;
    /// Output rows upserted, output rows deleted, and changes to output rows that were
    /// already final (corrections): the run log's uniform columns.
    fn outputs(&self) -> (i64, i64, i64);

    /// The run log's view of them.
    fn counts(&self) -> JobCounts {
        let i = self.input();
        let (upserted, deleted, corrections) = self.outputs();
        JobCounts {
            rows_in: i.rows_in,
            applied: i.applied,
            too_late: i.too_late,
            windows_recomputed: upserted,
            deleted,
            corrections,
            watermark_before: i.watermark_before,
            watermark_after: i.watermark_after,
            oldest_landed: i.oldest_landed,
        }
    }
}

/// The integer fields of `m` by name (nested structs flattened, absent values left out).
pub(crate) fn named(m: &impl Metrics) -> Result<BTreeMap<String, i64>> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, i64>) {
        match v {
            serde_json::Value::Object(o) => {
                for (k, v) in o {
                    walk(k, v, out);
                }
            }
            serde_json::Value::Number(n) => {
                if let Some(n) = n.as_i64() {
                    out.insert(prefix.to_string(), n);
                }
            }
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    walk("", &serde_json::to_value(m)?, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Example {
        input: InputCounts,
        things: i64,
        gone: i64,
    }

    impl Metrics for Example {
        fn input(&self) -> InputCounts {
            self.input
        }
        fn outputs(&self) -> (i64, i64, i64) {
            (self.things, self.gone, 0)
        }
    }

    /// Named fields come out flat and by name; the run log's columns are mapped.
    #[test]
    fn metrics_are_named_and_mapped_onto_the_run_log() {
        let m = Example {
            input: InputCounts {
                rows_in: 5,
                applied: 4,
                too_late: 1,
                watermark_before: None,
                watermark_after: Some(7),
                oldest_landed: None,
            },
            things: 3,
            gone: 2,
        };
        let n = named(&m).unwrap();
        let want: Vec<(&str, i64)> = vec![
            ("applied", 4),
            ("gone", 2),
            ("rows_in", 5),
            ("things", 3),
            ("too_late", 1),
            ("watermark_after", 7),
        ];
        assert_eq!(
            n.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(),
            want
        );
        let c = m.counts();
        assert_eq!(
            (c.rows_in, c.windows_recomputed, c.deleted, c.corrections),
            (5, 3, 2, 0)
        );
        assert_eq!(c.watermark_after, Some(7));
    }
}
