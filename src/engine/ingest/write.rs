//! Stage 2 of a distributed ingestion: deduplicate one hash partition of the batch's
//! rows and write the survivors into bronze (uncommitted).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch, StringArray};
use arrow::compute::{concat_batches, filter_record_batch, is_null, sort_to_indices, take};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, Partitioning, PlanProperties,
    SendableRecordBatchStream,
};
use futures::{StreamExt, TryStreamExt};

use super::{df_err, output_schema, Counts, IngestTask, FILE_META, ORDER};
use crate::engine::EngineError;
use crate::error::{Error, Result as KResult};
use crate::schema::{SourceSchema, EVENT_DATE};
use crate::sink::delta::{self, Warehouse};
use crate::storage::Location;

/// Deduplicates and writes each hash partition (by `event_id`) of its input.
#[derive(Debug)]
pub struct WriteExec {
    pub(crate) task: Arc<IngestTask>,
    storage: BTreeMap<String, String>,
    schema: Arc<SourceSchema>,
    input: Arc<dyn ExecutionPlan>,
    props: Arc<PlanProperties>,
}

impl WriteExec {
    /// Stage 2 of `task` over `input` (stage 1, hash-partitioned by `event_id`).
    pub fn try_new(
        task: Arc<IngestTask>,
        storage: BTreeMap<String, String>,
        input: Arc<dyn ExecutionPlan>,
    ) -> KResult<Self> {
        let schema = task.source_schema()?;
        let partitions = input.properties().partitioning.partition_count();
        let props = PlanProperties::new(
            EquivalenceProperties::new(output_schema()),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Final,
            Boundedness::Bounded,
        );
        Ok(WriteExec {
            task,
            storage,
            schema,
            input,
            props: Arc::new(props),
        })
    }

    /// The hash partitioning stage 2 needs: every copy of an id in one task.
    pub fn partitioning(schema: &SourceSchema, tasks: usize) -> Partitioning {
        let id = schema.event_id_index();
        let name = schema.bronze.field(id).name();
        Partitioning::Hash(vec![Arc::new(Column::new(name, id))], tasks.max(1))
    }
}

impl DisplayAs for WriteExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "KestrelWriteExec: {} batch {} (write: {})",
            self.task.source, self.task.batch_id, self.task.write
        )
    }
}

impl ExecutionPlan for WriteExec {
    fn name(&self) -> &str {
        "KestrelWriteExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.props
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn required_input_distribution(&self) -> Vec<Distribution> {
        let id = self.schema.event_id_index();
        let name = self.schema.bronze.field(id).name();
        vec![Distribution::KeyPartitioned(vec![Arc::new(Column::new(
            name, id,
        ))])]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
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
            datafusion::error::DataFusionError::Internal("KestrelWriteExec needs an input".into())
        })?;
        let w =
            WriteExec::try_new(self.task.clone(), self.storage.clone(), input).map_err(df_err)?;
        Ok(Arc::new(w))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let (task, storage, schema) =
            (self.task.clone(), self.storage.clone(), self.schema.clone());
        let out = futures::stream::once(async move {
            let rows: Vec<RecordBatch> = input.try_collect().await?;
            write_partition(&task, &storage, &schema, rows)
                .await
                .map_err(df_err)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            output_schema(),
            out.boxed(),
        )))
    }
}

fn stage_err(what: &str, reason: impl ToString) -> Error {
    Error::from(EngineError::Stage {
        what: what.to_string(),
        reason: reason.to_string(),
    })
}

/// The event dates the whole batch touches, as stage 1's tasks stored them.
async fn batch_dates(task: &IngestTask, warehouse: &Location) -> KResult<BTreeSet<i32>> {
    let mut all = BTreeSet::new();
    for t in 0..task.decode_tasks.max(1) {
        let key = task.dates_key(t);
        let text = warehouse.get_opt(&key).await?.ok_or_else(|| {
            stage_err(
                &format!("ingest {} batch {}", task.source, task.batch_id),
                format!(
                    "decode task {t} left no event dates at {}",
                    warehouse.display(&key)
                ),
            )
        })?;
        let dates: BTreeSet<i32> =
            serde_json::from_slice(&text).map_err(|e| stage_err(&warehouse.display(&key), e))?;
        all.extend(dates);
    }
    Ok(all)
}

/// One partition: file outcomes pass through; rows are deduplicated (first in plan
/// order, then against bronze) and written; the result rows say what was written.
async fn write_partition(
    task: &IngestTask,
    storage: &BTreeMap<String, String>,
    schema: &SourceSchema,
    rows: Vec<RecordBatch>,
) -> KResult<RecordBatch> {
    let mut kinds: Vec<&str> = Vec::new();
    let mut jsons: Vec<String> = Vec::new();
    let stage = super::stage_schema(&schema.bronze);
    let meta_idx = stage.index_of(FILE_META)?;
    let order_idx = stage.index_of(ORDER)?;
    let mut data = Vec::with_capacity(rows.len());
    for b in &rows {
        let metas = b.column(meta_idx);
        if metas.null_count() == b.num_rows() {
            data.push(b.clone());
            continue;
        }
        let m = metas
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or_else(|| stage_err("stage rows", "file outcomes are not text"))?;
        for i in 0..m.len() {
            if m.is_valid(i) {
                kinds.push("file");
                jsons.push(m.value(i).to_string());
            }
        }
        let d = filter_record_batch(b, &is_null(metas)?)?;
        if d.num_rows() > 0 {
            data.push(d);
        }
    }
    let all = concat_batches(&stage, &data)?;
    let mut counts = Counts {
        valid: all.num_rows() as u64,
        written: 0,
    };
    if all.num_rows() > 0 {
        // Plan order, then the bronze columns alone.
        let order = sort_to_indices(all.column(order_idx), None, None)?;
        let cols: Vec<ArrayRef> = all.columns()[..schema.bronze.fields().len()]
            .iter()
            .map(|c| take(c.as_ref(), &order, None))
            .collect::<std::result::Result<_, _>>()?;
        let batch = RecordBatch::try_new(schema.bronze.clone(), cols)?;
        let warehouse = super::open_store(&task.warehouse, storage, "warehouse")?;
        let dates = batch_dates(task, &warehouse).await?;
        let wh = Warehouse::new(warehouse);
        let rel = crate::names::table::bronze(&task.source);
        let mut bronze = wh
            .open(&rel)
            .await?
            .ok_or_else(|| stage_err(&wh.loc.display(&rel), "no bronze table to write into"))?;
        if bronze.version() != Some(task.bronze_version) {
            let url = bronze.table_url().to_string();
            bronze
                .load_version(task.bronze_version)
                .await
                .map_err(|e| Error::delta(url, e))?;
        }
        let rows = vec![batch];
        let masks =
            crate::runner::ingest::dedup_masks(&rows, &bronze, schema, task.batch_id, &dates, None)
                .await?;
        let parts = delta::with_masks(rows, masks);
        counts.written = delta::kept_count(&parts) as u64;
        if task.write && counts.written > 0 {
            let props = delta::bronze_writer_properties_for(
                schema.bronze.fields().iter().map(|f| f.name().as_str()),
                &parts,
            );
            // One writer: the executor's other cores run the other write tasks.
            let how = delta::KeptWrite {
                cut: Some(schema.bronze.index_of(EVENT_DATE)?),
                writers: 1,
                ..delta::KeptWrite::default()
            };
            let written = delta::write_kept(&bronze, parts, props, how).await?;
            for add in written.adds {
                kinds.push("add");
                jsons.push(serde_json::to_string(&add).map_err(|e| stage_err("an add action", e))?);
            }
        }
    }
    tracing::info!(
        source = %task.source,
        batch = task.batch_id,
        files = kinds.iter().filter(|k| **k == "file").count(),
        valid = counts.valid,
        written = counts.written,
        "ingestion write task"
    );
    kinds.push("counts");
    jsons.push(serde_json::to_string(&counts).map_err(|e| stage_err("counts", e))?);
    Ok(RecordBatch::try_new(
        output_schema(),
        vec![
            Arc::new(StringArray::from(kinds)),
            Arc::new(StringArray::from(jsons)),
        ],
    )?)
}
