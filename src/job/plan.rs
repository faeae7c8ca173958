//! Durable job batch plans and results (`_kestrel/plans/job/<job>/`).
//!
//! Plan `n` fixes a job batch's input before anything runs: per source, the ingestion
//! batches `(after, upto]` it consumes (bronze rows carry their ingestion `_batch_id`, so
//! compaction does not change what a range holds). Result `n` is written after compute
//! and before any commit: the job state after the batch (watermark, consumed positions,
//! lateness cut-offs) and the counts for the run log. Both are written put-if-absent, so
//! a replay after a crash uses exactly the same input and reports the same counts.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::names;
use crate::sink::delta::Warehouse;
use crate::time::watermark::Watermark;
use crate::time::Micros;

/// One source's input of a job batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Input {
    /// Ingestion batches after this one…
    pub after_batch: i64,
    /// …up to and including this one.
    pub upto_batch: i64,
    /// Bronze table version when planned (for the record).
    pub bronze_version: Option<i64>,
}

/// A durable job batch plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobPlan {
    pub job: String,
    pub batch_id: i64,
    pub created_at: String,
    pub inputs: BTreeMap<String, Input>,
}

impl JobPlan {
    /// The input of `source` (an error naming the plan if the plan has none).
    pub fn input(&self, source: &str) -> Result<&Input> {
        self.inputs.get(source).ok_or_else(|| Error::Plan {
            path: format!("job plan {} of {}", self.batch_id, self.job),
            reason: format!("no input for source {source}"),
        })
    }
}

/// The lateness cut-off applied to one range of ingestion batches: their rows with
/// event_ts < `cutoff` were too late for the job and never enter its windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cutoff {
    pub after_batch: i64,
    pub upto_batch: i64,
    pub cutoff: Micros,
}

/// Job state after a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobState {
    pub watermark: Watermark,
    /// Per source, the last ingestion batch consumed.
    pub positions: BTreeMap<String, i64>,
    /// Per source, cut-offs still able to exclude rows from a recompute (ascending).
    pub cutoffs: BTreeMap<String, Vec<Cutoff>>,
}

impl JobState {
    /// The state before a job's first batch.
    pub fn initial(sources: &[String], delay: Micros, idle_timeout: Micros) -> Self {
        let names: Vec<&str> = sources.iter().map(String::as_str).collect();
        JobState {
            watermark: Watermark::new(&names, delay, idle_timeout),
            positions: sources.iter().map(|s| (s.clone(), 0)).collect(),
            cutoffs: BTreeMap::new(),
        }
    }

    /// Record the cut-off applied to `source`'s batches `(after, upto]`; merges with the
    /// previous range when the cut-off did not move, and forgets cut-offs older than
    /// `keep_from` (no recompute reaches rows that old).
    pub fn push_cutoff(&mut self, source: &str, input: &Input, cutoff: Micros, keep_from: Micros) {
        let list = self.cutoffs.entry(source.to_string()).or_default();
        match list.last_mut() {
            Some(last) if last.cutoff == cutoff && last.upto_batch == input.after_batch => {
                last.upto_batch = input.upto_batch;
            }
            _ => list.push(Cutoff {
                after_batch: input.after_batch,
                upto_batch: input.upto_batch,
                cutoff,
            }),
        }
        list.retain(|c| c.cutoff > keep_from);
    }
}

/// Counts of one job batch (for the run log and the summary).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobCounts {
    /// New bronze rows read.
    pub rows_in: i64,
    /// Rows applied to the job's windows.
    pub applied: i64,
    /// Rows too late for the job (side output and/or counted).
    pub too_late: i64,
    /// Windows (or sessions) recomputed and upserted.
    pub windows_recomputed: i64,
    /// Stale sessions deleted (merged or split by a late event).
    pub deleted: i64,
    /// Recomputed windows that were already final: corrections.
    pub corrections: i64,
    pub watermark_before: Option<Micros>,
    pub watermark_after: Option<Micros>,
    /// Arrival time of the oldest file whose rows the batch read (None: no rows; and in
    /// results written before it was kept).
    #[serde(default)]
    pub oldest_landed: Option<Micros>,
}

/// The outcome of a computed job batch, durable before its commits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobResult {
    pub job: String,
    pub batch_id: i64,
    pub state: JobState,
    pub counts: JobCounts,
    /// The operator's own metrics by name (see [`crate::operator::metrics`]); empty in
    /// results written before they existed.
    #[serde(default)]
    pub metrics: std::collections::BTreeMap<String, i64>,
}

/// A JSON document of the warehouse's bookkeeping (plans, results, markers); None when
/// it does not exist, a plan error naming it when it does not parse.
pub(crate) async fn read_json<T: for<'de> Deserialize<'de>>(
    wh: &Warehouse,
    key: &str,
) -> Result<Option<T>> {
    let Some(bytes) = wh.loc.get_opt(key).await? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| Error::Plan {
            path: wh.loc.display(key),
            reason: e.to_string(),
        })
}

/// Write `value` unless the key exists; returns what is durable there.
async fn write_once<T>(wh: &Warehouse, key: &str, value: &T) -> Result<T>
where
    T: Serialize + for<'de> Deserialize<'de> + Clone,
{
    let body = serde_json::to_vec_pretty(value)?;
    if wh.loc.put_if_absent(key, body).await? {
        return Ok(value.clone());
    }
    read_json(wh, key).await?.ok_or_else(|| Error::Plan {
        path: wh.loc.display(key),
        reason: "reported as existing but cannot be read".into(),
    })
}

/// Delete `job`'s plans and results of batches before `keep_from` written more than
/// `older_than` ago (the maintenance retention). Result `n` is the state batch `n + 1`
/// starts from, so the last completed batch's is kept.
pub async fn expire(
    wh: &Warehouse,
    job: &str,
    keep_from: i64,
    older_than: std::time::Duration,
) -> Result<usize> {
    let prefix = names::key::job_plans(job);
    wh.loc
        .expire(&prefix, older_than, |key| {
            crate::names::key::plan_batch(key).is_some_and(|b| b < keep_from)
        })
        .await
}

/// Read plan `n` of `job`.
pub async fn read_plan(wh: &Warehouse, job: &str, n: i64) -> Result<Option<JobPlan>> {
    read_json(wh, &names::key::job_plan(job, n, "plan")).await
}

/// Make plan `n` durable (or return the one already there).
pub async fn write_plan(wh: &Warehouse, plan: &JobPlan) -> Result<JobPlan> {
    write_once(
        wh,
        &names::key::job_plan(&plan.job, plan.batch_id, "plan"),
        plan,
    )
    .await
}

/// Read result `n` of `job`.
pub async fn read_result(wh: &Warehouse, job: &str, n: i64) -> Result<Option<JobResult>> {
    read_json(wh, &names::key::job_plan(job, n, "result")).await
}

/// Make result `n` durable (or return the one already there).
pub async fn write_result(wh: &Warehouse, result: &JobResult) -> Result<JobResult> {
    write_once(
        wh,
        &names::key::job_plan(&result.job, result.batch_id, "result"),
        result,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cutoffs_merge_while_unchanged_and_age_out() {
        let mut s = JobState::initial(&["orders".into()], 0, 0);
        let inp = |a, b| Input {
            after_batch: a,
            upto_batch: b,
            bronze_version: None,
        };
        s.push_cutoff("orders", &inp(0, 1), 100, 0);
        s.push_cutoff("orders", &inp(1, 2), 100, 0);
        s.push_cutoff("orders", &inp(2, 3), 200, 0);
        assert_eq!(
            s.cutoffs["orders"],
            vec![
                Cutoff {
                    after_batch: 0,
                    upto_batch: 2,
                    cutoff: 100
                },
                Cutoff {
                    after_batch: 2,
                    upto_batch: 3,
                    cutoff: 200
                }
            ]
        );
        s.push_cutoff("orders", &inp(3, 4), 300, 150);
        assert_eq!(s.cutoffs["orders"].len(), 2);
        assert_eq!(s.cutoffs["orders"][0].cutoff, 200);
    }
}
