//! The read port: the one way an operator reaches the tables it reads. An operator names
//! a table by its warehouse path (`bronze/orders`, its own gold table, its late ledger)
//! and gets it registered in a DataFusion session; its reads are DataFusion plans over
//! that session (see [`super::read`]), so filters and key joins prune the same way
//! whatever holds the rows.
//!
//! Two implementations: the warehouse's Delta tables ([`Warehouse`], what `kestrel run`,
//! `schedule`, `stream` and `backfill` use) and [`MemoryPort`], tables held as Arrow
//! batches in memory, for operator tests with no storage at all. A distributed engine
//! plugs in here too: a port whose sessions execute remotely.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use arrow::array::{BooleanArray, RecordBatch};
use arrow::compute::{concat_batches, filter_record_batch};
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;

use super::GoldRows;
use crate::error::{Error, Result};
use crate::job::aggregate::{merge_schema, OP};
use crate::sink::delta::{self, Warehouse};

/// Where an operator's reads go.
#[async_trait]
pub trait ReadPort: Send + Sync {
    /// Register the table at warehouse path `path` in `ctx` as `alias`; `false` when
    /// there is no such table (yet): an operator then reads no rows from it.
    async fn register(&self, ctx: &SessionContext, path: &str, alias: &str) -> Result<bool>;

    /// A new session for reads, configured as every kestrel read is
    /// ([`delta::session`]: plain strings, keyed reads handed to the scan as lists).
    fn session(&self) -> SessionContext {
        delta::session()
    }
}

/// `path` registered alone in a new session as `alias`; None when there is no such table.
pub async fn open(port: &dyn ReadPort, path: &str, alias: &str) -> Result<Option<SessionContext>> {
    let ctx = port.session();
    Ok(port.register(&ctx, path, alias).await?.then_some(ctx))
}

/// The warehouse's Delta tables, opened at their latest version.
#[async_trait]
impl ReadPort for Warehouse {
    async fn register(&self, ctx: &SessionContext, path: &str, alias: &str) -> Result<bool> {
        match self.open(path).await? {
            Some(t) => {
                delta::register(ctx, &t, alias).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// Tables held in memory as Arrow batches, by warehouse path.
#[derive(Debug, Default)]
pub struct MemoryPort {
    tables: Mutex<HashMap<String, (SchemaRef, Vec<RecordBatch>)>>,
}

impl MemoryPort {
    /// An empty port: every table is absent until [`MemoryPort::put`] adds it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replace the rows of table `path` (`batches` share `schema`).
    pub fn put(&self, path: &str, schema: SchemaRef, batches: Vec<RecordBatch>) {
        if let Ok(mut t) = self.tables.lock() {
            t.insert(path.to_string(), (schema, batches));
        }
    }

    /// Drop table `path` (a warehouse from before the table existed).
    pub fn remove(&self, path: &str) {
        if let Ok(mut t) = self.tables.lock() {
            t.remove(path);
        }
    }

    /// Append `batches` to table `path`, creating it with their schema.
    pub fn append(&self, path: &str, batches: Vec<RecordBatch>) {
        let Some(schema) = batches.first().map(|b| b.schema()) else {
            return;
        };
        if let Ok(mut t) = self.tables.lock() {
            t.entry(path.to_string())
                .or_insert_with(|| (schema, Vec::new()))
                .1
                .extend(batches);
        }
    }

    /// Apply a batch's gold rows to their table as its MERGE does: every existing row
    /// whose `out.keys` match a row of `out` goes, and the rows with `_op = 'upsert'`
    /// come in (without `_op`); the table is created with `out.schema` if absent. Rows
    /// that replace the table ([`super::Write::Replace`]) become its rows.
    pub fn merge(&self, out: &GoldRows) -> Result<()> {
        use crate::columns::{conform, formatters, row_string};
        if out.write == super::Write::Replace {
            let rows = out
                .rows
                .iter()
                .map(|b| conform(b, &out.schema))
                .collect::<Result<Vec<_>>>()?;
            self.put(&out.table, out.schema.clone(), rows);
            return Ok(());
        }
        let keys: Vec<String> = out.keys.iter().map(|(k, _)| k.clone()).collect();
        let target = merge_schema(&out.schema);
        let rows = out
            .rows
            .iter()
            .map(|b| conform(b, &target))
            .collect::<Result<Vec<_>>>()?;
        let incoming = concat_batches(&target, &rows)?;
        let fk = formatters(&incoming, &keys)?;
        let touched: HashSet<String> = (0..incoming.num_rows())
            .map(|i| row_string(&fk, i))
            .collect();
        let mut parts = Vec::new();
        if let Some(existing) = self.rows(&out.table) {
            let existing = existing
                .iter()
                .map(|b| conform(b, &out.schema))
                .collect::<Result<Vec<_>>>()?;
            let existing = concat_batches(&out.schema, &existing)?;
            let fe = formatters(&existing, &keys)?;
            let keep: BooleanArray = (0..existing.num_rows())
                .map(|i| Some(!touched.contains(&row_string(&fe, i))))
                .collect();
            parts.push(filter_record_batch(&existing, &keep)?);
        }
        let ops = crate::columns::string(&incoming, OP)?;
        let upsert: BooleanArray = ops.iter().map(|o| Some(o == Some("upsert"))).collect();
        parts.push(conform(
            &filter_record_batch(&incoming, &upsert)?,
            &out.schema,
        )?);
        let merged = concat_batches(&out.schema, &parts)?;
        self.put(&out.table, out.schema.clone(), vec![merged]);
        Ok(())
    }

    /// The rows of table `path`, if it exists.
    pub fn rows(&self, path: &str) -> Option<Vec<RecordBatch>> {
        let t = self.tables.lock().ok()?;
        t.get(path).map(|(_, b)| b.clone())
    }
}

#[async_trait]
impl ReadPort for MemoryPort {
    async fn register(&self, ctx: &SessionContext, path: &str, alias: &str) -> Result<bool> {
        let table = match self.tables.lock() {
            Ok(t) => t.get(path).cloned(),
            Err(_) => None,
        };
        let Some((schema, batches)) = table else {
            return Ok(false);
        };
        let what = format!("in-memory table {path}");
        let mem = MemTable::try_new(schema, vec![batches]).map_err(|e| Error::query(&what, e))?;
        ctx.register_table(alias, Arc::new(mem))
            .map_err(|e| Error::query(&what, e))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::prelude::{col, lit};

    /// The in-memory port registers what was put, reports what was not, and its rows
    /// are read with the same filters as a Delta table's.
    #[tokio::test]
    async fn memory_tables_read_like_warehouse_tables() {
        let port = MemoryPort::new();
        let schema = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)]));
        let b = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from(vec![1, 2, 3]))],
        )
        .unwrap();
        port.append("bronze/x", vec![b.clone()]);
        port.append("bronze/x", vec![b]);
        assert!(open(&port, "bronze/none", "x").await.unwrap().is_none());
        let ctx = open(&port, "bronze/x", "x").await.unwrap().unwrap();
        let rows = super::super::read::read(&ctx, "x", col("n").gt(lit(1i64)), &schema)
            .await
            .unwrap();
        assert_eq!(rows.num_rows(), 4);
        assert_eq!(port.rows("bronze/x").unwrap().len(), 2);
    }
}
