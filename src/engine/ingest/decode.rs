//! Stage 1 of a distributed ingestion: decode and validate a group of planned files.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{
    new_null_array, Array, ArrayRef, AsArray, Int64Array, RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::error::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
    SendableRecordBatchStream,
};
use futures::{StreamExt, TryStreamExt};

use super::{df_err, stage_schema, FileMeta, IngestTask};
use crate::error::Result as KResult;
use crate::ledger::FileAction;
use crate::schema::{SourceSchema, EVENT_DATE};
use crate::source::decode::Decoded;

/// Decodes planned files, one task per partition of its input: rows of `(task, file)`
/// naming the decode task and the plan index of each file it decodes ([`assignments`]).
/// The files travel as data, in an in-memory scan, because Ballista gives each task
/// only its partitions of such a scan; a leaf of kestrel's own would be run whole by
/// every task. Outputs valid rows with their plan order, and one outcome row per file.
#[derive(Debug)]
pub struct DecodeExec {
    pub(crate) task: Arc<IngestTask>,
    storage: BTreeMap<String, String>,
    schema: Arc<SourceSchema>,
    input: Arc<dyn ExecutionPlan>,
    props: Arc<PlanProperties>,
}

/// Columns of [`DecodeExec`]'s input.
pub(crate) fn assignment_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("task", DataType::Int64, false),
        Field::new("file", DataType::Int64, true),
    ]))
}

/// The in-memory scan assigning `task`'s files to its decode tasks: file `i` (a file to
/// read) to task `i % decode_tasks`, a task without files as a row with a null file.
pub fn assignments(task: &IngestTask) -> KResult<Arc<dyn ExecutionPlan>> {
    let n = task.decode_tasks.max(1);
    let mut parts: Vec<(Vec<i64>, Vec<Option<i64>>)> = vec![(Vec::new(), Vec::new()); n];
    for (i, f) in task.files.iter().enumerate() {
        if f.action == FileAction::Ingest {
            let (t, files) = &mut parts[i % n];
            t.push((i % n) as i64);
            files.push(Some(i as i64));
        }
    }
    let schema = assignment_schema();
    let mut partitions = Vec::with_capacity(n);
    for (p, (mut t, mut files)) in parts.into_iter().enumerate() {
        if t.is_empty() {
            t.push(p as i64);
            files.push(None);
        }
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(t)),
                Arc::new(Int64Array::from(files)),
            ],
        )?;
        partitions.push(vec![b]);
    }
    let exec = MemorySourceConfig::try_new_exec(&partitions, schema, None)
        .map_err(|e| crate::error::Error::query("assign files to decode tasks", e))?;
    Ok(exec)
}

impl DecodeExec {
    /// Stage 1 of `task` over its file assignments, opening stores with `storage`.
    pub fn try_new(
        task: Arc<IngestTask>,
        storage: BTreeMap<String, String>,
        input: Arc<dyn ExecutionPlan>,
    ) -> KResult<Self> {
        let schema = task.source_schema()?;
        let partitions = input.properties().partitioning.partition_count();
        let props = PlanProperties::new(
            EquivalenceProperties::new(stage_schema(&schema.bronze)),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Final,
            Boundedness::Bounded,
        );
        Ok(DecodeExec {
            task,
            storage,
            schema,
            input,
            props: Arc::new(props),
        })
    }
}

impl DisplayAs for DecodeExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "KestrelDecodeExec: {} batch {}, {} files",
            self.task.source,
            self.task.batch_id,
            self.task.files.len()
        )
    }
}

impl ExecutionPlan for DecodeExec {
    fn name(&self) -> &str {
        "KestrelDecodeExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.props
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
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
            datafusion::error::DataFusionError::Internal(
                "KestrelDecodeExec needs its file assignments".into(),
            )
        })?;
        let d =
            DecodeExec::try_new(self.task.clone(), self.storage.clone(), input).map_err(df_err)?;
        Ok(Arc::new(d))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let out = stage_schema(&self.schema.bronze);
        let input = self.input.execute(partition, context)?;
        let (task, storage, schema) =
            (self.task.clone(), self.storage.clone(), self.schema.clone());
        let batches = futures::stream::once(async move {
            let assigned: Vec<RecordBatch> = input.try_collect().await?;
            let mut decode_task = None;
            let mut files = Vec::new();
            for b in &assigned {
                let t = b.column(0).as_primitive::<Int64Type>();
                let f = b.column(1).as_primitive::<Int64Type>();
                for i in 0..b.num_rows() {
                    decode_task = Some(t.value(i) as usize);
                    if f.is_valid(i) {
                        files.push(f.value(i) as usize);
                    }
                }
            }
            let Some(decode_task) = decode_task else {
                return Ok(Vec::new());
            };
            decode_files(&task, &storage, &schema, decode_task, &files)
                .await
                .map_err(df_err)
        })
        .map_ok(|v| futures::stream::iter(v.into_iter().map(Ok)))
        .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            out,
            batches.boxed(),
        )))
    }
}

/// Decode task `decode_task`'s `files` (plan indices), then store the event dates they
/// touch.
async fn decode_files(
    task: &IngestTask,
    storage: &BTreeMap<String, String>,
    schema: &Arc<SourceSchema>,
    decode_task: usize,
    files: &[usize],
) -> KResult<Vec<RecordBatch>> {
    let landing = super::open_store(&task.landing, storage, "landing zone")?;
    let out = stage_schema(&schema.bronze);
    let date_idx = schema.bronze.index_of(EVENT_DATE)?;
    let mut batches = Vec::new();
    let mut dates = BTreeSet::new();
    for &i in files {
        let pf = task
            .files
            .get(i)
            .ok_or_else(|| crate::engine::EngineError::Stage {
                what: format!("decode {} batch {}", task.source, task.batch_id),
                reason: format!("the plan has no file {i}"),
            })?;
        let decoded = crate::runner::ingest::decode_planned(
            &landing,
            pf,
            schema,
            task.batch_id,
            task.ingested_at_us,
        )
        .await?;
        let meta = match decoded {
            Some(Decoded::Rows {
                batch,
                rejects,
                records,
            }) => {
                if let Some(b) = batch.filter(|b| b.num_rows() > 0) {
                    crate::runner::ingest::event_dates(&b, date_idx, &mut dates);
                    batches.push(data_rows(&out, &b, i)?);
                }
                FileMeta {
                    index: i,
                    records,
                    rejects,
                    file_rejected: None,
                }
            }
            Some(Decoded::FileRejected { reason }) => FileMeta {
                index: i,
                records: 0,
                rejects: Vec::new(),
                file_rejected: Some(reason),
            },
            None => continue,
        };
        batches.push(file_row(&out, &meta)?);
    }
    // Stage 2 deduplicates against bronze in the dates the whole batch touches: each
    // decode task leaves its share (the same content on every attempt).
    let warehouse = super::open_store(&task.warehouse, storage, "warehouse")?;
    let text = serde_json::to_vec(&dates).map_err(|e| crate::engine::EngineError::Stage {
        what: "encode event dates".into(),
        reason: e.to_string(),
    })?;
    warehouse.put(&task.dates_key(decode_task), text).await?;
    tracing::info!(
        source = %task.source,
        batch = task.batch_id,
        decode_task,
        rows = batches.iter().map(|b| b.num_rows()).sum::<usize>(),
        "ingestion decode task"
    );
    Ok(batches)
}

/// `b`'s rows as stage rows of file `file`.
fn data_rows(out: &SchemaRef, b: &RecordBatch, file: usize) -> KResult<RecordBatch> {
    let base = (file as i64) << 32;
    let mut cols: Vec<ArrayRef> = b.columns().to_vec();
    cols.push(Arc::new(Int64Array::from_iter_values(
        (0..b.num_rows() as i64).map(|r| base + r),
    )));
    cols.push(new_null_array(
        &arrow::datatypes::DataType::Utf8,
        b.num_rows(),
    ));
    Ok(RecordBatch::try_new(out.clone(), cols)?)
}

/// A file's outcome as one stage row (null bronze columns).
fn file_row(out: &SchemaRef, meta: &FileMeta) -> KResult<RecordBatch> {
    let json = serde_json::to_string(meta).map_err(|e| crate::engine::EngineError::Stage {
        what: "encode a file outcome".into(),
        reason: e.to_string(),
    })?;
    let n = out.fields().len();
    let mut cols: Vec<ArrayRef> = out.fields()[..n - 2]
        .iter()
        .map(|f| new_null_array(f.data_type(), 1))
        .collect();
    cols.push(Arc::new(Int64Array::from(vec![(meta.index as i64) << 32])));
    cols.push(Arc::new(StringArray::from(vec![json])));
    Ok(RecordBatch::try_new(out.clone(), cols)?)
}
