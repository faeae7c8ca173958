//! `[engine] job_timeout`: a cluster job that gives no result within it fails its batch.
//!
//! Ballista 55's adaptive planner can lose a two-stage job after an executor is lost
//! ("Stage … is not in running" in the scheduler's log): the job never finishes and
//! never fails, and the client polls its status forever. Every plan a cluster session
//! runs is wrapped in [`DeadlineExec`] by [`DeadlinePlanner`] (which delegates the
//! planning itself to Ballista's): its stream ends with [`EngineError::JobTimeout`] once
//! the job has run for the timeout. The batch then fails like any other failed read —
//! nothing of it is committed, its lease is released, and the next run (or the daemon's
//! next tick) resumes it from its durable plan.
//!
//! A cluster that lost one job usually runs none for a while (its executor is gone, the
//! scheduler still counts the lost job's slots): once a job of a run has timed out, the
//! run's later plans fail at once with the same error ([`Lost`]) instead of each waiting
//! out the timeout; the next run tries the cluster again.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::TaskContext;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, SendableRecordBatchStream,
};
use futures::StreamExt;

use super::EngineError;

/// Whether a cluster job of the current run gave no result within its timeout; shared
/// by every session of one [`super::port::ClusterPort`] (and its clones).
#[derive(Debug, Clone, Default)]
pub struct Lost(Arc<std::sync::atomic::AtomicBool>);

impl Lost {
    fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A new run: try the cluster again.
    pub fn clear(&self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Plans as `inner` does, then bounds each plan's run by `timeout`.
#[derive(Debug)]
pub struct DeadlinePlanner {
    inner: Arc<dyn QueryPlanner + Send + Sync>,
    timeout: Duration,
    lost: Lost,
}

impl DeadlinePlanner {
    pub fn new(inner: Arc<dyn QueryPlanner + Send + Sync>, timeout: Duration, lost: Lost) -> Self {
        DeadlinePlanner {
            inner,
            timeout,
            lost,
        }
    }
}

/// The error of a job past `timeout` (`earlier`: another job of the run was).
fn timed_out(timeout: Duration, earlier: bool) -> DataFusionError {
    let e = EngineError::JobTimeout {
        timeout: humanised(timeout),
        earlier: if earlier {
            " (by an earlier job of this run: not submitted)"
        } else {
            ""
        },
    };
    DataFusionError::External(Box::new(e))
}

#[async_trait]
impl QueryPlanner for DeadlinePlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if self.lost.is_set() {
            return Err(timed_out(self.timeout, true));
        }
        let plan = self
            .inner
            .create_physical_plan(logical_plan, session)
            .await?;
        Ok(Arc::new(DeadlineExec::new(
            plan,
            self.timeout,
            self.lost.clone(),
        )))
    }
}

/// `input`, whose every output stream fails with [`EngineError::JobTimeout`] when it has
/// not ended `timeout` after it was started.
#[derive(Debug)]
pub struct DeadlineExec {
    input: Arc<dyn ExecutionPlan>,
    timeout: Duration,
    lost: Lost,
}

impl DeadlineExec {
    pub fn new(input: Arc<dyn ExecutionPlan>, timeout: Duration, lost: Lost) -> Self {
        DeadlineExec {
            input,
            timeout,
            lost,
        }
    }
}

impl DisplayAs for DeadlineExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "KestrelDeadlineExec: {:?}", self.timeout)
    }
}

impl ExecutionPlan for DeadlineExec {
    fn name(&self) -> &str {
        "KestrelDeadlineExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = children.pop().ok_or_else(|| {
            DataFusionError::Internal("KestrelDeadlineExec needs its input".into())
        })?;
        Ok(Arc::new(DeadlineExec::new(
            input,
            self.timeout,
            self.lost.clone(),
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let schema = self.input.schema();
        let input = self.input.execute(partition, context)?;
        let (timeout, lost) = (self.timeout, self.lost.clone());
        let deadline = tokio::time::Instant::now() + timeout;
        // (stream, ended): after the timeout's error the stream ends.
        let bounded = futures::stream::unfold((input, false), move |(mut input, ended)| {
            let lost = lost.clone();
            async move {
                if ended {
                    return None;
                }
                match tokio::time::timeout_at(deadline, input.next()).await {
                    Ok(Some(item)) => Some((item, (input, false))),
                    Ok(None) => None,
                    Err(_) => {
                        lost.set();
                        Some((Err(timed_out(timeout, false)), (input, true)))
                    }
                }
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, bounded)))
    }
}

/// `timeout` as the config writes it (`90s`, `30m`, `1h`, `250ms`).
fn humanised(timeout: Duration) -> String {
    let ms = timeout.as_millis();
    match ms {
        ms if ms % 3_600_000 == 0 && ms > 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 && ms > 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::EquivalenceProperties;
    use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
    use datafusion::physical_plan::Partitioning;
    use futures::TryStreamExt;

    #[test]
    fn timeouts_read_as_they_are_configured() {
        assert_eq!(humanised(Duration::from_secs(3600)), "1h");
        assert_eq!(humanised(Duration::from_secs(1800)), "30m");
        assert_eq!(humanised(Duration::from_secs(90)), "90s");
        assert_eq!(humanised(Duration::from_millis(250)), "250ms");
    }

    /// A job that never ends fails with the timeout named; one that ends in time
    /// returns its rows untouched.
    #[tokio::test]
    async fn a_stalled_plan_fails_after_the_timeout_and_a_quick_one_passes() {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from(vec![1, 2, 3]))],
        )
        .unwrap();
        let quick =
            MemorySourceConfig::try_new_exec(&[vec![batch.clone()]], schema.clone(), None).unwrap();
        let ctx = Arc::new(TaskContext::default());
        let lost = Lost::default();
        let exec = DeadlineExec::new(quick, Duration::from_secs(5), lost.clone());
        let rows: Vec<RecordBatch> = exec
            .execute(0, ctx.clone())
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        assert_eq!(rows, vec![batch]);

        let props = PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        let stalled = StalledExec(Arc::new(props));
        let exec = DeadlineExec::new(Arc::new(stalled), Duration::from_millis(50), lost.clone());
        let err = exec
            .execute(0, ctx)
            .unwrap()
            .try_collect::<Vec<_>>()
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("[engine] job_timeout (50ms)"), "{err}");
        assert!(lost.is_set(), "the run's later jobs fail at once");
        lost.clear();
        assert!(!lost.is_set());
    }

    /// A plan whose stream never yields (a job the scheduler lost).
    #[derive(Debug)]
    struct StalledExec(Arc<PlanProperties>);

    impl DisplayAs for StalledExec {
        fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "StalledExec")
        }
    }

    impl ExecutionPlan for StalledExec {
        fn name(&self) -> &str {
            "StalledExec"
        }
        fn properties(&self) -> &Arc<PlanProperties> {
            &self.0
        }
        fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
            Vec::new()
        }
        fn apply_expressions(
            &self,
            _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
        ) -> Result<TreeNodeRecursion> {
            Ok(TreeNodeRecursion::Continue)
        }
        fn with_new_children(
            self: Arc<Self>,
            _children: Vec<Arc<dyn ExecutionPlan>>,
        ) -> Result<Arc<dyn ExecutionPlan>> {
            Ok(self)
        }
        fn execute(&self, _p: usize, _c: Arc<TaskContext>) -> Result<SendableRecordBatchStream> {
            let schema = self.0.eq_properties.schema().clone();
            Ok(Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::pending(),
            )))
        }
    }
}
