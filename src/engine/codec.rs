//! kestrel's logical plan codec for Ballista: Ballista's own, plus in-memory tables.
//!
//! Plans reach the scheduler as protobuf. DataFusion encodes Parquet listing tables and
//! empty tables itself; an in-memory table (a keyed read's keys, a table read locally
//! because the cluster cannot read it, see [`super::port`]) needs this codec: its rows
//! travel as an Arrow IPC stream behind a header naming the kestrel version that encoded
//! it, and a process of another version refuses the plan with both versions named.
//! An ingestion ([`super::ingest`]) travels as its task (JSON): as a table in the
//! logical plan, and as its two stage nodes in the physical plans Ballista sends
//! executors ([`KestrelPhysicalCodec`]); its stores are opened with the receiving
//! process's own `[storage]`. Registered on the client session, the scheduler and the
//! executors alike.

use std::io::Cursor;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use datafusion::catalog::TableProvider;
use datafusion::common::TableReference;
use datafusion::datasource::file_format::FileFormatFactory;
use datafusion::datasource::MemTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::{AggregateUDF, Extension, LogicalPlan, ScalarUDF, WindowUDF};
use datafusion_proto::logical_plan::LogicalExtensionCodec;

use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};

use super::ingest::{DecodeExec, IngestScan, IngestTask, WriteExec};
use super::{kestrel_version, stores, EngineError};

/// First bytes of an encoded in-memory table.
const MAGIC: &[u8; 4] = b"KMT1";
/// First bytes of an encoded ingestion scan, decode stage and write stage.
const INGEST: &[u8; 4] = b"KIN1";
const DECODE: &[u8; 4] = b"KDE1";
const WRITE: &[u8; 4] = b"KWR1";

/// Ballista's logical codec with kestrel's in-memory tables added.
#[derive(Debug)]
pub struct KestrelLogicalCodec {
    inner: Arc<dyn LogicalExtensionCodec>,
}

impl Default for KestrelLogicalCodec {
    fn default() -> Self {
        KestrelLogicalCodec {
            inner: Arc::new(ballista_core::serde::BallistaLogicalExtensionCodec::default()),
        }
    }
}

/// The codec as Ballista's configuration takes it.
pub fn logical() -> Arc<dyn LogicalExtensionCodec> {
    Arc::new(KestrelLogicalCodec::default())
}

/// Start an encoded node: its magic, then the kestrel version that encoded it.
fn header(magic: &[u8; 4], buf: &mut Vec<u8>) {
    buf.extend_from_slice(magic);
    let v = kestrel_version().as_bytes();
    buf.push(v.len() as u8);
    buf.extend_from_slice(v);
}

/// The body after `magic` and the version, refused when another kestrel encoded it.
fn body<'a>(magic: &[u8; 4], buf: &'a [u8]) -> Result<&'a [u8]> {
    let bad = || DataFusionError::Internal("not a node kestrel encoded".into());
    let rest = buf.strip_prefix(magic.as_slice()).ok_or_else(bad)?;
    let (&n, rest) = rest.split_first().ok_or_else(bad)?;
    if rest.len() < n as usize {
        return Err(bad());
    }
    let (version, body) = rest.split_at(n as usize);
    let version = String::from_utf8_lossy(version);
    if version != kestrel_version() {
        return Err(DataFusionError::External(Box::new(
            EngineError::PlanVersion {
                theirs: version.into_owned(),
                ours: kestrel_version().into(),
            },
        )));
    }
    Ok(body)
}

fn encode_mem(table: &MemTable, buf: &mut Vec<u8>) -> Result<()> {
    let mut batches: Vec<RecordBatch> = Vec::new();
    for part in &table.batches {
        let rows = part
            .try_read()
            .map_err(|_| DataFusionError::Execution("in-memory table is being written".into()))?;
        batches.extend(rows.iter().cloned());
    }
    header(MAGIC, buf);
    let mut w = StreamWriter::try_new(&mut *buf, &table.schema())?;
    for b in &batches {
        w.write(b)?;
    }
    w.finish()?;
    Ok(())
}

fn decode_mem(buf: &[u8], schema: SchemaRef) -> Result<MemTable> {
    let ipc = body(MAGIC, buf)?;
    let reader = StreamReader::try_new(Cursor::new(ipc), None)?;
    let batches = reader.collect::<std::result::Result<Vec<_>, _>>()?;
    MemTable::try_new(schema, vec![batches])
}

/// An ingestion's task, behind `magic` (the scan, and each of its stages).
fn encode_task(magic: &[u8; 4], task: &IngestTask, buf: &mut Vec<u8>) -> Result<()> {
    header(magic, buf);
    serde_json::to_writer(&mut *buf, task).map_err(|e| DataFusionError::External(Box::new(e)))
}

fn decode_task(magic: &[u8; 4], buf: &[u8]) -> Result<Arc<IngestTask>> {
    let task: IngestTask = serde_json::from_slice(body(magic, buf)?)
        .map_err(|e| DataFusionError::External(Box::new(e)))?;
    Ok(Arc::new(task))
}

impl LogicalExtensionCodec for KestrelLogicalCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[LogicalPlan],
        ctx: &TaskContext,
    ) -> Result<Extension> {
        self.inner.try_decode(buf, inputs, ctx)
    }

    fn try_encode(&self, node: &Extension, buf: &mut Vec<u8>) -> Result<()> {
        self.inner.try_encode(node, buf)
    }

    fn try_decode_table_provider(
        &self,
        buf: &[u8],
        table_ref: &TableReference,
        schema: SchemaRef,
        ctx: &TaskContext,
    ) -> Result<Arc<dyn TableProvider>> {
        if buf.starts_with(MAGIC) {
            return Ok(Arc::new(decode_mem(buf, schema)?));
        }
        if buf.starts_with(INGEST) {
            let task = decode_task(INGEST, buf)?;
            return Ok(Arc::new(IngestScan::new(task, stores::process_options())));
        }
        self.inner
            .try_decode_table_provider(buf, table_ref, schema, ctx)
    }

    fn try_encode_table_provider(
        &self,
        table_ref: &TableReference,
        node: Arc<dyn TableProvider>,
        buf: &mut Vec<u8>,
    ) -> Result<()> {
        if let Some(mem) = node.downcast_ref::<MemTable>() {
            return encode_mem(mem, buf);
        }
        if let Some(scan) = node.downcast_ref::<IngestScan>() {
            return encode_task(INGEST, &scan.task, buf);
        }
        self.inner.try_encode_table_provider(table_ref, node, buf)
    }

    fn try_decode_file_format(
        &self,
        buf: &[u8],
        ctx: &TaskContext,
    ) -> Result<Arc<dyn FileFormatFactory>> {
        self.inner.try_decode_file_format(buf, ctx)
    }

    fn try_encode_file_format(
        &self,
        buf: &mut Vec<u8>,
        node: Arc<dyn FileFormatFactory>,
    ) -> Result<()> {
        self.inner.try_encode_file_format(buf, node)
    }

    fn try_decode_udf(&self, name: &str, buf: &[u8]) -> Result<Arc<ScalarUDF>> {
        self.inner.try_decode_udf(name, buf)
    }

    fn try_encode_udf(&self, node: &ScalarUDF, buf: &mut Vec<u8>) -> Result<()> {
        self.inner.try_encode_udf(node, buf)
    }

    fn try_decode_udaf(&self, name: &str, buf: &[u8]) -> Result<Arc<AggregateUDF>> {
        self.inner.try_decode_udaf(name, buf)
    }

    fn try_encode_udaf(&self, node: &AggregateUDF, buf: &mut Vec<u8>) -> Result<()> {
        self.inner.try_encode_udaf(node, buf)
    }

    fn try_decode_udwf(&self, name: &str, buf: &[u8]) -> Result<Arc<WindowUDF>> {
        self.inner.try_decode_udwf(name, buf)
    }

    fn try_encode_udwf(&self, node: &WindowUDF, buf: &mut Vec<u8>) -> Result<()> {
        self.inner.try_encode_udwf(node, buf)
    }
}

/// Ballista's physical codec with kestrel's ingestion stages added.
#[derive(Debug)]
pub struct KestrelPhysicalCodec {
    inner: Arc<dyn PhysicalExtensionCodec>,
}

impl Default for KestrelPhysicalCodec {
    fn default() -> Self {
        KestrelPhysicalCodec {
            inner: Arc::new(ballista_core::serde::BallistaPhysicalExtensionCodec::default()),
        }
    }
}

/// The physical codec as Ballista's configuration takes it.
pub fn physical() -> Arc<dyn PhysicalExtensionCodec> {
    Arc::new(KestrelPhysicalCodec::default())
}

fn ingest_err(e: crate::error::Error) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

impl PhysicalExtensionCodec for KestrelPhysicalCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if buf.starts_with(DECODE) {
            let task = decode_task(DECODE, buf)?;
            let input = inputs.first().cloned().ok_or_else(|| {
                DataFusionError::Internal("an ingestion's decode stage without its files".into())
            })?;
            let exec =
                DecodeExec::try_new(task, stores::process_options(), input).map_err(ingest_err)?;
            return Ok(Arc::new(exec));
        }
        if buf.starts_with(WRITE) {
            let task = decode_task(WRITE, buf)?;
            let input = inputs.first().cloned().ok_or_else(|| {
                DataFusionError::Internal("an ingestion's write stage without its input".into())
            })?;
            let exec =
                WriteExec::try_new(task, stores::process_options(), input).map_err(ingest_err)?;
            return Ok(Arc::new(exec));
        }
        self.inner.try_decode(buf, inputs, ctx, proto_converter)
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if let Some(d) = node.downcast_ref::<DecodeExec>() {
            return encode_task(DECODE, &d.task, buf);
        }
        if let Some(w) = node.downcast_ref::<WriteExec>() {
            return encode_task(WRITE, &w.task, buf);
        }
        self.inner.try_encode(node, buf, proto_converter)
    }

    fn try_decode_udf(&self, name: &str, buf: &[u8]) -> Result<Arc<ScalarUDF>> {
        self.inner.try_decode_udf(name, buf)
    }

    fn try_encode_udf(&self, node: &ScalarUDF, buf: &mut Vec<u8>) -> Result<()> {
        self.inner.try_encode_udf(node, buf)
    }

    fn try_decode_udaf(&self, name: &str, buf: &[u8]) -> Result<Arc<AggregateUDF>> {
        self.inner.try_decode_udaf(name, buf)
    }

    fn try_encode_udaf(&self, node: &AggregateUDF, buf: &mut Vec<u8>) -> Result<()> {
        self.inner.try_encode_udaf(node, buf)
    }

    fn try_decode_udwf(&self, name: &str, buf: &[u8]) -> Result<Arc<WindowUDF>> {
        self.inner.try_decode_udwf(name, buf)
    }

    fn try_encode_udwf(&self, node: &WindowUDF, buf: &mut Vec<u8>) -> Result<()> {
        self.inner.try_encode_udwf(node, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::StringArray;
    use arrow::datatypes::{DataType, Field, Schema};

    /// An in-memory table survives the round trip with its rows; one encoded by another
    /// kestrel version is refused with both versions named.
    #[tokio::test]
    async fn memory_tables_round_trip_and_other_versions_are_refused() {
        let schema = Arc::new(Schema::new(vec![Field::new("_key", DataType::Utf8, false)]));
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(StringArray::from(vec!["a", "b"]))],
        )
        .unwrap();
        let mem: Arc<dyn TableProvider> =
            Arc::new(MemTable::try_new(schema.clone(), vec![vec![b.clone()]]).unwrap());
        let codec = KestrelLogicalCodec::default();
        let mut buf = Vec::new();
        let t = TableReference::bare("keys");
        codec.try_encode_table_provider(&t, mem, &mut buf).unwrap();
        let ctx = datafusion::prelude::SessionContext::new();
        let task = ctx.task_ctx();
        let back = codec
            .try_decode_table_provider(&buf, &t, schema.clone(), &task)
            .unwrap();
        let back = back.downcast_ref::<MemTable>().unwrap();
        let rows = back.batches[0].read().await.clone();
        assert_eq!(rows, vec![b]);

        let mut other = buf.clone();
        let at = MAGIC.len() + 1;
        other[at] = b'9';
        let e = codec
            .try_decode_table_provider(&other, &t, schema, &task)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(kestrel_version()) && e.contains("kestrel 9"),
            "{e}"
        );
    }

    /// An ingestion's stages travel as their task and come back equal; an executor of
    /// another kestrel version refuses them with both versions named (every batch an
    /// ingestion on the cluster runs checks each executor it reaches).
    #[test]
    fn ingestion_stages_round_trip_and_other_versions_are_refused() {
        let task = IngestTask {
            source: "orders".into(),
            schema_text: "{}".into(),
            landing: "file:///l/".into(),
            warehouse: "file:///w/".into(),
            batch_id: 3,
            ingested_at_us: 7,
            bronze_version: 2,
            write: true,
            files: Vec::new(),
            decode_tasks: 2,
            write_tasks: 2,
            stage: "s".into(),
        };
        for magic in [DECODE, WRITE, INGEST] {
            let mut buf = Vec::new();
            encode_task(magic, &task, &mut buf).unwrap();
            assert_eq!(*decode_task(magic, &buf).unwrap(), task);
            let mut other = buf.clone();
            other[magic.len() + 1] = b'9';
            let e = decode_task(magic, &other).unwrap_err().to_string();
            assert!(
                e.contains(kestrel_version()) && e.contains("kestrel 9"),
                "{e}"
            );
        }
    }
}
