//! The operator contract: what a job's operator declares about itself and the two
//! things it computes — one micro-batch from its state, and one day's restatement for a
//! backfill. The runner (`runner::batch`, `runner::backfill`) owns the protocol around
//! them (plans, durable results, late side output, MERGEs, the run log, leases) and is
//! the same for every operator. [`parse`] and [`of`] are the registry: the one place that
//! maps an operator's name and a job's kind to its operator; nothing else matches on
//! the kind.
//!
//! One module per operator, each holding its batch compute, its state handling and its
//! restatement, with its pure logic over Arrow batches beside it:
//! - [`windowed`]: the declarative windowed aggregates (tumbling, sliding, session); its
//!   pure window assignment and aggregation is `job::aggregate`, which also holds the
//!   column helpers the other operators and the runner share;
//! - [`payments`]: order/payment matching (`payments_fast`, `payment_reconciliation`),
//!   pure logic in `payments::matching`;
//! - [`stockout`]: stock-out alerts and availability, pure logic in `stockout::detect`,
//!   which `kestrel stream` runs always-on over the same code.
//!
//! Adding an operator: a module here implementing [`Operator`] with its `[params]` parser,
//! a `JobKind` variant holding what it parsed, and a line in each half of the registry
//! ([`parse`], [`of`]) plus its name in [`NAMES`].

pub mod payments;
pub mod stockout;
pub mod windowed;

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;

use crate::error::Result;
use crate::job::plan::{JobPlan, JobState};
use crate::job::spec::{Fields, JobKind, JobSpec, PaymentMode};
use crate::names;
use crate::runner::backfill::{DayInput, Restated};
use crate::runner::batch::{Computed, JobRunner};
use crate::schema::SourceSchema;

/// One table an operator writes, and the txn app id its commits carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub table: String,
    pub app: String,
}

/// A job's operator.
#[async_trait]
pub trait Operator: Send + Sync {
    /// Gold tables written after the job's own `[sink] table`, in commit order (the last
    /// commit of a batch completes it).
    fn more_outputs(&self, _spec: &JobSpec) -> Vec<Output> {
        Vec::new()
    }

    /// Whether `kestrel stream` can run the job always-on.
    fn can_stream(&self) -> bool {
        false
    }

    /// The gold merge keys: `given` (`[sink] merge_keys`, never empty) checked, or the
    /// operator's default; Err names what `merge_keys` must be.
    fn merge_keys(&self, given: Option<Vec<String>>) -> std::result::Result<Vec<String>, String>;

    /// Compute batch `plan` from the state `before` it: new rows, watermark, touched
    /// output rows, too-late rows and the state after it.
    async fn process(
        &self,
        rt: &JobRunner,
        spec: &JobSpec,
        plan: &JobPlan,
        before: JobState,
    ) -> Result<Computed>;

    /// The job's gold rows of `day`, recomputed from everything it consumed.
    async fn restate(
        &self,
        rt: &JobRunner,
        spec: &JobSpec,
        day: i32,
        input: &DayInput,
    ) -> Result<Restated>;
}

/// The merge keys of an operator whose gold rows have a natural key (`whose`, for the
/// message): `[sink] merge_keys` must name exactly `natural`, and must be given.
pub(crate) fn natural_keys(
    given: Option<Vec<String>>,
    natural: &[&str],
    whose: &str,
) -> std::result::Result<Vec<String>, String> {
    match given {
        Some(k) if k != natural => Err(format!("{natural:?} ({whose}), got {k:?}")),
        Some(k) => Ok(k),
        None => Err("the operator's natural key columns".into()),
    }
}

/// The operators a job file names with `operator = "…"`; a file without one is a
/// declarative windowed aggregate ([`windowed::parse`]).
pub const NAMES: [&str; 3] = ["payments_fast", "payment_reconciliation", "stockout"];

/// The registry, part one: parse the `[params]` (and check the sources) of the
/// operator a job file names.
pub(crate) fn parse(
    name: &str,
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<JobKind> {
    match name {
        "payments_fast" => payments::parse(top, PaymentMode::Fast, sources, schemas),
        "payment_reconciliation" => payments::parse(top, PaymentMode::Reconcile, sources, schemas),
        "stockout" => stockout::parse(top, sources, schemas),
        other => Err(top.err(
            "operator",
            format!("one of {}, got {other:?}", NAMES.join(", ")),
        )),
    }
}

/// The registry, part two: the operator of a job's kind, holding its parsed `[params]`.
pub fn of(kind: &JobKind) -> Box<dyn Operator + '_> {
    match kind {
        JobKind::Aggregate {
            keys,
            window,
            aggregates,
            inputs,
        } => Box::new(windowed::Windowed {
            keys,
            window,
            aggregates,
            inputs,
        }),
        JobKind::Payments { mode, params } => Box::new(payments::Payments {
            mode: *mode,
            params,
        }),
        JobKind::Stockout { availability_table } => {
            Box::new(stockout::Stockout { availability_table })
        }
    }
}

impl JobSpec {
    /// The job's operator.
    pub fn operator(&self) -> Box<dyn Operator + '_> {
        of(&self.kind)
    }

    /// The gold tables this job writes, in the order a batch commits them.
    pub fn outputs(&self) -> Vec<Output> {
        let mut out = vec![Output {
            table: self.table.clone(),
            app: names::app::job(&self.name),
        }];
        out.extend(self.operator().more_outputs(self));
        out
    }

    /// The output whose commit of batch `n` completes the batch's gold writes.
    pub fn completing_output(&self) -> Output {
        let mut out = self.outputs();
        // `outputs` always holds the job's own table.
        out.pop().unwrap_or_else(|| Output {
            table: self.table.clone(),
            app: names::app::job(&self.name),
        })
    }

    /// Every table the job's batches write: its outputs and its late ledger.
    pub fn tables(&self) -> Vec<String> {
        let mut t: Vec<String> = self.outputs().into_iter().map(|o| o.table).collect();
        t.push(names::table::late(&self.name));
        t
    }

    /// Whether `kestrel stream` can run this job always-on (the same operator code over
    /// a poll's rows).
    pub fn can_stream(&self) -> bool {
        self.operator().can_stream()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The shipped jobs: stock-out writes alerts then availability (the second commit
    /// completes its batch) and is the one that streams; the others write one table.
    #[tokio::test]
    async fn shipped_jobs_declare_their_outputs() {
        let schemas = crate::schema::load_all(Path::new("/none")).unwrap();
        let jobs = crate::job::spec::load_all(Path::new("/none"), &schemas)
            .await
            .unwrap();
        let so = &jobs["stockout"];
        let tables: Vec<String> = so.outputs().into_iter().map(|o| o.table).collect();
        assert_eq!(tables, ["gold/stockout_alerts", "gold/sku_availability"]);
        assert_eq!(
            so.completing_output().app,
            "kestrel-job-stockout-availability"
        );
        assert!(so.can_stream());
        assert_eq!(so.tables().last().unwrap(), "late/stockout");
        let r = &jobs["revenue_5m"];
        assert_eq!(r.outputs().len(), 1);
        assert_eq!(r.completing_output().table, "gold/revenue_5m");
        assert_eq!(r.completing_output().app, "kestrel-job-revenue_5m");
        assert!(!r.can_stream() && !jobs["payments_fast"].can_stream());
    }

    /// A natural key is checked and named as before the operators shared the check.
    #[test]
    fn natural_keys_are_required_and_checked() {
        let k = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            super::natural_keys(k(&["sku", "minute"]), &["sku", "minute"], "the alerts' key"),
            Ok(vec!["sku".to_string(), "minute".to_string()])
        );
        assert_eq!(
            super::natural_keys(k(&["sku"]), &["sku", "minute"], "the alerts' key"),
            Err(r#"["sku", "minute"] (the alerts' key), got ["sku"]"#.to_string())
        );
        assert_eq!(
            super::natural_keys(None, &["order_id"], "the payments operators' key"),
            Err("the operator's natural key columns".to_string())
        );
    }
}
