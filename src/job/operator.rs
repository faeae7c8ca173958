//! What each operator declares about itself, answered in one place from a job's kind:
//! the gold tables it writes, in commit order, with the application id of each commit
//! (the last one completes a batch: a replay that finds it there skips the batch's gold
//! writes), and whether it can run always-on. Everything else that needs to know asks
//! here instead of matching on the kind.

use crate::job::spec::{JobKind, JobSpec};
use crate::names;

/// One table an operator writes, and the txn app id its commits carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub table: String,
    pub app: String,
}

impl JobSpec {
    /// The gold tables this job writes, in the order a batch commits them.
    pub fn outputs(&self) -> Vec<Output> {
        let mut out = vec![Output {
            table: self.table.clone(),
            app: names::app::job(&self.name),
        }];
        if let JobKind::Stockout { availability_table } = &self.kind {
            out.push(Output {
                table: availability_table.clone(),
                app: names::app::availability(&self.name),
            });
        }
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
    /// a poll's rows; only stock-out has a stream mode).
    pub fn can_stream(&self) -> bool {
        matches!(self.kind, JobKind::Stockout { .. })
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
}
