//! The table a distributed ingestion is queried as: its scan is the two stages.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::datasource::TableType;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::ExecutionPlan;

use super::{df_err, output_schema, DecodeExec, IngestTask, WriteExec};

/// `SELECT * FROM` it ingests one batch ([`super::run`]); the plan travels to the
/// scheduler through kestrel's codec ([`crate::engine::codec`]).
#[derive(Debug)]
pub struct IngestScan {
    pub(crate) task: Arc<IngestTask>,
    storage: BTreeMap<String, String>,
}

impl IngestScan {
    /// The ingestion of `task`, its stores opened with `storage` where the plan runs in
    /// this process (a cluster process uses its own, see [`crate::engine::stores`]).
    pub fn new(task: Arc<IngestTask>, storage: BTreeMap<String, String>) -> Self {
        IngestScan { task, storage }
    }
}

#[async_trait]
impl TableProvider for IngestScan {
    fn schema(&self) -> SchemaRef {
        output_schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Temporary
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if projection.is_some_and(|p| *p != [0, 1]) {
            return Err(DataFusionError::NotImplemented(
                "an ingestion is read whole (kind, json)".into(),
            ));
        }
        let schema = self.task.source_schema().map_err(df_err)?;
        let files = super::decode::assignments(&self.task).map_err(df_err)?;
        let decode = Arc::new(
            DecodeExec::try_new(self.task.clone(), self.storage.clone(), files).map_err(df_err)?,
        );
        let shuffled = Arc::new(RepartitionExec::try_new(
            decode,
            WriteExec::partitioning(&schema, self.task.write_tasks),
        )?);
        let write = WriteExec::try_new(self.task.clone(), self.storage.clone(), shuffled)
            .map_err(df_err)?;
        Ok(Arc::new(write))
    }
}
