//! `operator = "mirror"`: a change-data-capture source ([`crate::schema::cdc`]) kept as
//! a table — per primary key, the row as of the greatest log position applied — with an
//! optional SCD type-2 history beside it. The reads and Arrow around the pure logic in
//! [`apply`].
//!
//! Tables, each partitioned by `_bucket` (a stable hash of the key modulo
//! `[params] buckets`), so a batch reads and rewrites only the buckets its keys fall in:
//! - the job's table (`[sink] table`): the key, the row's columns, `_lsn` (and `_pos`
//!   for a two-part position), `_deleted` with `deletes = "soft"`;
//! - `_kestrel/mirror/<job>/deletes`: every delete applied (key, position, `deleted_at`)
//!   — what keeps a late older change of a deleted key out, and history's chain whole;
//! - with `history = true`, `<table>_history` (or `[params] history_table`): the key, the
//!   row's columns, `valid_from`, `valid_to` (null while current), `is_current`, `_lsn`.
//!
//! Commits go in that order, each with its own txn; the history (or deletes) commit
//! completes a batch. Each table's rows are computed from that table's own rows and the
//! deletes recorded before it, so a batch recomputed after a crash between two commits
//! writes the same rows to the tables it has not reached. Mirrors have no event-time
//! windows and no lateness: nothing is too late, and a backfill has no days to restate.
//!
//! ```toml
//! name = "customers"
//! schedule = "0 */5 * * * *"
//! sources = ["customers"]
//! operator = "mirror"
//! [params]
//! history = true      # default false
//! deletes = "hard"    # or "soft": keep the row, `_deleted = true`
//! buckets = 16        # hash partitions of the mirror tables
//! ```

pub mod apply;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Int32Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray, UInt32Array,
};
use arrow::compute::{interleave, take};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::prelude::{col, lit};

use crate::columns::{conform, formatters, row_string};
use crate::error::Result;
use crate::job::aggregate::{self as agg};
use crate::job::plan::{JobPlan, JobState};
use crate::job::spec::{Fields, JobSpec};
use crate::names;
use crate::operator::metrics::{InputCounts, Metrics};
use crate::operator::read::{self, take_new_rows, NewRows};
use crate::operator::{Computed, Context, DayInput, GoldRows, Operator, Output, Restated, Write};
use crate::schema::cdc;
use crate::schema::{arrow_type, ts_type, SourceSchema};
use apply::{Applied, Change, Current, CurrentWrite, Deleted, Held, Pos, Src, Version};

/// Partition column of every mirror table: a hash bucket of the key.
pub const BUCKET: &str = "_bucket";
const PARTITIONS: [&str; 1] = [BUCKET];
/// Soft-delete flag of the current table (`deletes = "soft"`).
pub const DELETED: &str = "_deleted";
/// Default number of key buckets.
pub const DEFAULT_BUCKETS: u32 = 16;

/// A mirror of one CDC source.
#[derive(Debug, Clone, PartialEq)]
pub struct Mirror {
    /// The source's primary key columns.
    pub key: Vec<String>,
    /// The row's columns, in the schema's order (the key among them).
    pub columns: Vec<Field>,
    /// Position columns: `_lsn` (and `_pos`).
    pub position: Vec<&'static str>,
    /// `deletes = "soft"`: keep deleted rows with `_deleted = true`.
    pub soft: bool,
    /// `history = true`: the history table, when `[params] history_table` names one.
    pub history: Option<Option<String>>,
    pub buckets: u32,
}

/// What one batch of a mirror job did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MirrorMetrics {
    pub input: InputCounts,
    /// Distinct keys with changes in the batch.
    pub keys: i64,
    /// Current rows written (inserted, updated or soft-deleted), and removed.
    pub upserted: i64,
    pub deleted: i64,
    /// Changes at a position their key already had (redeliveries).
    pub redelivered: i64,
    /// Changes older than their key's newest position (history only).
    pub superseded: i64,
    /// Deletes recorded, and history versions written.
    pub deletes_recorded: i64,
    pub history_versions: i64,
}

impl Metrics for MirrorMetrics {
    fn input(&self) -> InputCounts {
        self.input
    }
    fn outputs(&self) -> (i64, i64, i64) {
        (self.upserted, self.deleted, self.superseded)
    }
}

/// The `mirror` operator: one CDC source, `[params] history`, `history_table`,
/// `deletes`, `buckets`.
pub(crate) fn parse(
    top: &Fields<'_>,
    sources: &[String],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<Arc<dyn Operator>> {
    let [source] = sources else {
        return Err(top.err(
            "sources",
            "exactly one change-data-capture source for a mirror job",
        ));
    };
    let Some(spec) = schemas[source].cdc.as_ref() else {
        return Err(top.err(
            "sources",
            format!("a change-data-capture source (`\"kind\": \"cdc\"` in its schema); `{source}` is an event source"),
        ));
    };
    let mut m = Mirror {
        key: spec.key.clone(),
        columns: spec
            .columns
            .iter()
            .map(|f| Field::new(&f.name, arrow_type(f.ty), true))
            .collect(),
        position: spec.position_columns().to_vec(),
        soft: false,
        history: None,
        buckets: DEFAULT_BUCKETS,
    };
    if let Some(p) = top.sub("params")? {
        p.only(&["history", "history_table", "deletes", "buckets"])?;
        let history = match p.table.get("history") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| p.err("history", format!("true or false, got {}", v.type_str())))?,
        };
        let table = p.str_opt("history_table")?;
        if let Some(t) = table {
            if !names::table::is_gold(t) {
                return Err(p.err("history_table", format!("a path under gold/, got {t:?}")));
            }
            if !history {
                return Err(p.err("history_table", "nothing unless `history = true`"));
            }
        }
        m.history = history.then(|| table.map(str::to_string));
        m.soft = match p.str_opt("deletes")? {
            None | Some("hard") => false,
            Some("soft") => true,
            Some(other) => {
                return Err(p.err("deletes", format!("\"hard\" or \"soft\", got {other:?}")))
            }
        };
        if let Some(v) = p.table.get("buckets") {
            m.buckets = v
                .as_integer()
                .filter(|n| (1..=1024).contains(n))
                .map(|n| n as u32)
                .ok_or_else(|| p.err("buckets", format!("an integer from 1 to 1024, got {v}")))?;
        }
    }
    Ok(Arc::new(m))
}

/// The bucket of a key's text (FNV-1a, stable across releases and platforms).
pub fn bucket_of(key: &str, buckets: u32) -> i32 {
    (crate::job::keys::fnv1a(key.as_bytes()) % u64::from(buckets.max(1))) as i32
}

/// The batch's keys: an id per distinct key, its text and bucket, and the row of its
/// first change (for the keyed reads).
#[derive(Default)]
struct Keys {
    ids: HashMap<String, u32>,
    buckets: Vec<i32>,
    first_row: Vec<u32>,
}

impl Keys {
    fn intern(&mut self, text: String, row: usize, buckets: u32) -> u32 {
        let next = self.ids.len() as u32;
        *self.ids.entry(text).or_insert_with_key(|t| {
            self.buckets.push(bucket_of(t, buckets));
            self.first_row.push(row as u32);
            next
        })
    }
}

/// Rows of one table the batch reads, with each row's key id.
struct HeldRows {
    rows: RecordBatch,
    keys: Vec<u32>,
}

impl Mirror {
    fn history_table(&self, spec: &JobSpec) -> Option<String> {
        self.history.as_ref().map(|t| {
            t.clone()
                .unwrap_or_else(|| format!("{}_history", spec.table))
        })
    }

    /// The row's columns (what every table carries first).
    fn values_schema(&self) -> SchemaRef {
        Arc::new(Schema::new(self.columns.clone()))
    }

    fn with(&self, extra: Vec<Field>) -> SchemaRef {
        let mut f = self.columns.clone();
        f.extend(extra);
        Arc::new(Schema::new(f))
    }

    fn position_fields(&self) -> Vec<Field> {
        self.position
            .iter()
            .map(|p| Field::new(*p, DataType::Int64, true))
            .collect()
    }

    /// `gold/<table>`: the row, its position, `_deleted` (soft), the bucket.
    fn current_schema(&self) -> SchemaRef {
        let mut extra = self.position_fields();
        if self.soft {
            extra.push(Field::new(DELETED, DataType::Boolean, true));
        }
        extra.push(Field::new(BUCKET, DataType::Int32, true));
        self.with(extra)
    }

    /// The history: the row, its validity, its position, the bucket.
    fn history_schema(&self) -> SchemaRef {
        let mut extra = vec![
            Field::new("valid_from", ts_type(), true),
            Field::new("valid_to", ts_type(), true),
            Field::new("is_current", DataType::Boolean, true),
        ];
        extra.extend(self.position_fields());
        extra.push(Field::new(BUCKET, DataType::Int32, true));
        self.with(extra)
    }

    /// The deletes: the key, the delete's position and time, the bucket.
    fn deletes_schema(&self) -> SchemaRef {
        let mut f: Vec<Field> = self
            .columns
            .iter()
            .filter(|c| self.key.contains(c.name()))
            .cloned()
            .collect();
        f.extend(self.position_fields());
        f.push(Field::new("deleted_at", ts_type(), true));
        f.push(Field::new(BUCKET, DataType::Int32, true));
        Arc::new(Schema::new(f))
    }

    fn positions(&self, b: &RecordBatch) -> Result<Vec<Pos>> {
        let lsn = crate::columns::int64(b, cdc::LSN)?;
        let pos = match self.position.get(1) {
            Some(p) => Some(crate::columns::int64(b, p)?),
            None => None,
        };
        Ok((0..b.num_rows())
            .map(|i| (lsn.value(i), pos.as_ref().map_or(0, |p| p.value(i))))
            .collect())
    }

    /// The rows of `table` whose key is one of the batch's (in the buckets they fall in).
    async fn held(
        &self,
        cx: &Context<'_>,
        table: &str,
        keys: &Keys,
        first_keys: &RecordBatch,
        schema: &SchemaRef,
    ) -> Result<HeldRows> {
        let empty = HeldRows {
            rows: RecordBatch::new_empty(schema.clone()),
            keys: Vec::new(),
        };
        if keys.ids.is_empty() {
            return Ok(empty);
        }
        let Some(ctx) = cx.open(table, "held").await? else {
            return Ok(empty);
        };
        let buckets: BTreeSet<i32> = keys.buckets.iter().copied().collect();
        let filter = col(BUCKET).in_list(
            buckets
                .iter()
                .map(|b| lit(ScalarValue::Int32(Some(*b))))
                .collect(),
            false,
        );
        let rows = read::read_keys(&ctx, "held", filter, &self.key[0], first_keys, schema).await?;
        // Exact on the whole key (the read matched its first column).
        let f = formatters(&rows, &self.key)?;
        let mut ids = Vec::with_capacity(rows.num_rows());
        let keep: BooleanArray = (0..rows.num_rows())
            .map(|i| {
                let id = keys.ids.get(&row_string(&f, i)).copied();
                ids.extend(id);
                Some(id.is_some())
            })
            .collect();
        Ok(HeldRows {
            rows: arrow::compute::filter_record_batch(&rows, &keep)?,
            keys: ids,
        })
    }
}

/// The columns of `schema` for `srcs`, gathered from `inputs` (by [`Src::input`]).
fn gather(inputs: &[&RecordBatch], srcs: &[Src], schema: &SchemaRef) -> Result<Vec<ArrayRef>> {
    let idx: Vec<(usize, usize)> = srcs.iter().map(|s| (s.input as usize, s.row)).collect();
    schema
        .fields()
        .iter()
        .map(|f| {
            let cols = inputs
                .iter()
                .map(|b| {
                    b.column_by_name(f.name()).ok_or_else(|| {
                        crate::columns::ColumnError::Missing(f.name().clone()).into()
                    })
                })
                .collect::<Result<Vec<&ArrayRef>>>()?;
            let refs: Vec<&dyn Array> = cols.iter().map(|c| c.as_ref()).collect();
            Ok(interleave(&refs, &idx)?)
        })
        .collect()
}

fn ts_array(v: impl IntoIterator<Item = Option<i64>>) -> ArrayRef {
    Arc::new(TimestampMicrosecondArray::from_iter(v).with_timezone("UTC"))
}

/// Position columns (`_lsn`, `_pos`) of `pos`.
fn position_arrays(n_parts: usize, pos: &[Option<Pos>]) -> Vec<ArrayRef> {
    let mut out: Vec<ArrayRef> = vec![Arc::new(Int64Array::from_iter(
        pos.iter().map(|p| p.map(|p| p.0)),
    ))];
    if n_parts == 2 {
        out.push(Arc::new(Int64Array::from_iter(
            pos.iter().map(|p| p.map(|p| p.1)),
        )));
    }
    out
}

#[async_trait::async_trait]
impl Operator for Mirror {
    fn more_outputs(&self, spec: &JobSpec) -> Vec<Output> {
        let mut out = vec![Output {
            table: names::table::mirror_deletes(&spec.name),
            app: names::app::mirror_deletes(&spec.name),
        }];
        if let Some(table) = self.history_table(spec) {
            out.push(Output {
                table,
                app: names::app::mirror_history(&spec.name),
            });
        }
        out
    }

    fn merge_keys(&self, given: Option<Vec<String>>) -> std::result::Result<Vec<String>, String> {
        match given {
            None => Ok(self.key.clone()),
            Some(k) if k == self.key => Ok(k),
            Some(k) => Err(format!(
                "{:?} (the source's primary key), got {k:?}",
                self.key
            )),
        }
    }

    fn no_days(&self) -> Option<&'static str> {
        Some("a mirror applies every change in log order, late or not, so it has no event-time days to restate")
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    async fn process(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        plan: &JobPlan,
        before: JobState,
    ) -> Result<Computed> {
        let mut state = before;
        let source = &spec.sources[0];
        let bronze = cx.source_schema(source)?.bronze.clone();
        let ctx = cx.open(&names::table::bronze(source), "bronze").await?;
        let mut reads: Vec<String> = vec![cdc::OP.to_string()];
        reads.extend(self.columns.iter().map(|f| f.name().clone()));
        reads.extend(self.position.iter().map(|p| p.to_string()));
        let target = agg::job_input_schema(&bronze, Some(&[&reads]));
        let w_before = state.watermark.current;
        // No lateness: every change is applied, whenever it arrives.
        let NewRows {
            new, oldest_landed, ..
        } = take_new_rows(
            cx.given_rows(),
            ctx.as_ref(),
            "bronze",
            source,
            plan.input(source)?,
            &target,
            &bronze,
            None,
            0,
            &mut state,
        )
        .await?;
        let w_after = state.watermark.advance();

        let mut keys = Keys::default();
        let change_keys: Vec<u32> = {
            let fk = formatters(&new, &self.key)?;
            (0..new.num_rows())
                .map(|i| keys.intern(row_string(&fk, i), i, self.buckets))
                .collect()
        };
        let ops = crate::columns::string(&new, cdc::OP)?;
        let ts = crate::columns::event_ts(&new)?;
        let changes: Vec<Change> = self
            .positions(&new)?
            .into_iter()
            .enumerate()
            .map(|(i, pos)| Change {
                key: change_keys[i],
                pos,
                ts: ts.value(i),
                delete: ops.value(i) == "d",
                src: Src {
                    input: apply::CHANGES,
                    row: i,
                },
            })
            .collect();
        let first_key = new
            .column_by_name(&self.key[0])
            .ok_or_else(|| crate::columns::ColumnError::Missing(self.key[0].clone()))?;
        let first_keys = {
            let k = take(first_key, &UInt32Array::from(keys.first_row.clone()), None)?;
            let schema = Schema::new(vec![Field::new("_key", k.data_type().clone(), false)]);
            RecordBatch::try_new(Arc::new(schema), vec![k])?
        };

        let current_schema = self.current_schema();
        let deletes_table = names::table::mirror_deletes(&spec.name);
        let history_table = self.history_table(spec);
        let current = self
            .held(cx, &spec.table, &keys, &first_keys, &current_schema)
            .await?;
        let deleted = self
            .held(
                cx,
                &deletes_table,
                &keys,
                &first_keys,
                &self.deletes_schema(),
            )
            .await?;
        let history = match &history_table {
            Some(t) => {
                self.held(cx, t, &keys, &first_keys, &self.history_schema())
                    .await?
            }
            None => HeldRows {
                rows: RecordBatch::new_empty(self.history_schema()),
                keys: Vec::new(),
            },
        };
        let held = Held {
            current: {
                let soft = current
                    .rows
                    .column_by_name(DELETED)
                    .and_then(|c| c.as_any().downcast_ref::<BooleanArray>().cloned());
                self.positions(&current.rows)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, pos)| Current {
                        key: current.keys[i],
                        pos,
                        deleted: soft.as_ref().is_some_and(|s| s.is_valid(i) && s.value(i)),
                        src: Src {
                            input: apply::CURRENT,
                            row: i,
                        },
                    })
                    .collect()
            },
            deleted: {
                let at = crate::columns::ts(&deleted.rows, "deleted_at")?;
                self.positions(&deleted.rows)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, pos)| Deleted {
                        key: deleted.keys[i],
                        pos,
                        ts: at.value(i),
                    })
                    .collect()
            },
            versions: {
                let from = crate::columns::ts(&history.rows, "valid_from")?;
                let to = crate::columns::ts(&history.rows, "valid_to")?;
                self.positions(&history.rows)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, pos)| Version {
                        key: history.keys[i],
                        pos,
                        from: from.value(i),
                        to: to.is_valid(i).then(|| to.value(i)),
                        src: Src {
                            input: apply::HISTORY,
                            row: i,
                        },
                    })
                    .collect()
            },
        };
        let applied = apply::apply(&changes, &held, self.soft, history_table.is_some());

        let values = self.values_schema();
        let inputs = [
            &conform(&new, &values)?,
            &conform(&current.rows, &values)?,
            &conform(&history.rows, &values)?,
        ];
        let key_of = |s: &Src| match s.input {
            apply::CHANGES => change_keys[s.row],
            apply::CURRENT => current.keys[s.row],
            _ => history.keys[s.row],
        };
        let bucket = |s: &Src| keys.buckets[key_of(s) as usize];
        let mut gold = vec![self.current_rows(cx, spec, &applied, &inputs, &held, &bucket)?];
        gold.push(self.delete_rows(spec, &applied, &inputs, &deletes_table, &bucket)?);
        if let Some(t) = &history_table {
            gold.push(self.history_rows(spec, &applied, &inputs, t, &bucket)?);
        }
        let (upserted, deleted_n) = applied.current.iter().fold((0, 0), |(u, d), w| match w {
            CurrentWrite::Upsert { .. } => (u + 1, d),
            CurrentWrite::Delete { .. } => (u, d + 1),
        });
        let metrics = MirrorMetrics {
            input: InputCounts {
                rows_in: new.num_rows() as i64,
                applied: new.num_rows() as i64,
                too_late: 0,
                watermark_before: w_before,
                watermark_after: w_after,
                oldest_landed,
            },
            keys: keys.ids.len() as i64,
            upserted,
            deleted: deleted_n,
            redelivered: applied.redelivered,
            superseded: applied.superseded,
            deletes_recorded: applied.deletes.len() as i64,
            history_versions: applied.versions.len() as i64,
        };
        Computed::new(plan, state, &metrics, None, gold)
    }

    async fn restate(
        &self,
        _cx: &Context<'_>,
        spec: &JobSpec,
        _day: i32,
        _input: &DayInput,
    ) -> Result<Restated> {
        Err(crate::runner::backfill::BackfillError::NoDays {
            job: spec.name.clone(),
            why: self.no_days().unwrap_or_default().to_string(),
        }
        .into())
    }
}

impl Mirror {
    /// Merge rows of the current table.
    fn current_rows(
        &self,
        cx: &Context<'_>,
        spec: &JobSpec,
        applied: &Applied,
        inputs: &[&RecordBatch],
        held: &Held,
        bucket: &dyn Fn(&Src) -> i32,
    ) -> Result<GoldRows> {
        let schema = self.current_schema();
        let srcs: Vec<Src> = applied
            .current
            .iter()
            .map(|w| match w {
                CurrentWrite::Upsert { src, .. } | CurrentWrite::Delete { src } => *src,
            })
            .collect();
        let mut cols = gather(inputs, &srcs, &self.values_schema())?;
        let pos: Vec<Option<Pos>> = applied
            .current
            .iter()
            .map(|w| match w {
                CurrentWrite::Upsert { pos, .. } => Some(*pos),
                CurrentWrite::Delete { src } => {
                    held.current.iter().find(|c| c.src == *src).map(|c| c.pos)
                }
            })
            .collect();
        cols.extend(position_arrays(self.position.len(), &pos));
        if self.soft {
            cols.push(Arc::new(BooleanArray::from_iter(
                applied
                    .current
                    .iter()
                    .map(|w| Some(matches!(w, CurrentWrite::Upsert { deleted: true, .. }))),
            )));
        }
        cols.push(Arc::new(Int32Array::from_iter_values(
            srcs.iter().map(bucket),
        )));
        cols.push(Arc::new(StringArray::from_iter_values(
            applied.current.iter().map(|w| match w {
                CurrentWrite::Upsert { .. } => "upsert",
                CurrentWrite::Delete { .. } => "delete",
            }),
        )));
        let rows = RecordBatch::try_new(agg::merge_schema(&schema), cols)?;
        Ok(cx.gold_output(spec, schema, vec![rows], &PARTITIONS, Vec::new()))
    }

    /// The new deletes, appended (the batch read the ones its keys had).
    fn delete_rows(
        &self,
        spec: &JobSpec,
        applied: &Applied,
        inputs: &[&RecordBatch],
        table: &str,
        bucket: &dyn Fn(&Src) -> i32,
    ) -> Result<GoldRows> {
        let schema = self.deletes_schema();
        let srcs: Vec<Src> = applied.deletes.iter().map(|c| c.src).collect();
        let keys_only = Arc::new(schema.project(&(0..self.key.len()).collect::<Vec<_>>())?);
        let mut cols = gather(inputs, &srcs, &keys_only)?;
        let pos: Vec<Option<Pos>> = applied.deletes.iter().map(|c| Some(c.pos)).collect();
        cols.extend(position_arrays(self.position.len(), &pos));
        cols.push(ts_array(applied.deletes.iter().map(|c| Some(c.ts))));
        cols.push(Arc::new(Int32Array::from_iter_values(
            srcs.iter().map(bucket),
        )));
        cols.push(Arc::new(StringArray::from(vec!["upsert"; srcs.len()])));
        let rows = RecordBatch::try_new(agg::merge_schema(&schema), cols)?;
        let mut out = self.output(table, names::app::mirror_deletes(&spec.name), schema, rows);
        out.write = Write::Append;
        Ok(out)
    }

    /// History versions to upsert, keyed by key and position.
    fn history_rows(
        &self,
        spec: &JobSpec,
        applied: &Applied,
        inputs: &[&RecordBatch],
        table: &str,
        bucket: &dyn Fn(&Src) -> i32,
    ) -> Result<GoldRows> {
        let schema = self.history_schema();
        let v = &applied.versions;
        let srcs: Vec<Src> = v.iter().map(|v| v.src).collect();
        let mut cols = gather(inputs, &srcs, &self.values_schema())?;
        cols.push(ts_array(v.iter().map(|v| Some(v.from))));
        cols.push(ts_array(v.iter().map(|v| v.to)));
        cols.push(Arc::new(BooleanArray::from_iter(
            v.iter().map(|v| Some(v.to.is_none())),
        )));
        let pos: Vec<Option<Pos>> = v.iter().map(|v| Some(v.pos)).collect();
        cols.extend(position_arrays(self.position.len(), &pos));
        cols.push(Arc::new(Int32Array::from_iter_values(
            srcs.iter().map(bucket),
        )));
        cols.push(Arc::new(StringArray::from(vec!["upsert"; srcs.len()])));
        let rows = RecordBatch::try_new(agg::merge_schema(&schema), cols)?;
        Ok(self.output(table, names::app::mirror_history(&spec.name), schema, rows))
    }

    /// A table keyed by the key and the position (deletes, history).
    fn output(&self, table: &str, app: String, schema: SchemaRef, rows: RecordBatch) -> GoldRows {
        let keys = self
            .key
            .iter()
            .map(|k| k.as_str())
            .chain(self.position.iter().copied())
            .map(|k| (k.to_string(), false))
            .collect();
        GoldRows {
            table: table.to_string(),
            app,
            keys,
            schema,
            rows: vec![rows],
            partitions: PARTITIONS.to_vec(),
            cluster: None,
            extra_partitions: Vec::new(),
            write: Write::Merge,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::operator::testing::Harness;

    /// A change of customer `id` at `lsn` (`ts_ms` = 10:00 + lsn seconds on 2026-12-01);
    /// `credit` is the row's credit (a delete carries only the key).
    fn change(op: &str, id: &str, lsn: i64, credit: i64) -> String {
        let ts = 1_796_119_200_000 + lsn * 1000;
        let row = format!(
            r#"{{"customer_id":"{id}","email":"{id}@x","name":"N{id}","tier":null,"credit_cents":{credit},"updated_at":{ts}}}"#
        );
        let (before, after) = match op {
            "d" => (format!(r#"{{"customer_id":"{id}"}}"#), "null".to_string()),
            _ => ("null".to_string(), row),
        };
        format!(
            r#"{{"op":"{op}","ts_ms":{ts},"before":{before},"after":{after},"source":{{"lsn":{lsn}}}}}"#
        )
    }

    const CURRENT: &str = "SELECT customer_id, credit_cents, _lsn FROM t ORDER BY customer_id";
    const HISTORY: &str = "SELECT customer_id, credit_cents, valid_from, valid_to, is_current \
                           FROM t ORDER BY customer_id, _lsn";

    async fn tables(h: &Harness) -> (Vec<String>, Vec<String>) {
        (
            h.rows("gold/customers", CURRENT).await,
            h.rows("gold/customers_history", HISTORY).await,
        )
    }

    /// The shipped mirror over in-memory tables, the five cases adapted to log order: in
    /// order; the same changes out of order by lsn (same tables); a late older change
    /// after a delete (ignored by the mirror, placed in history); a redelivery (nothing
    /// changes); a restart between batches.
    #[tokio::test]
    async fn the_mirror_follows_log_order_whatever_the_arrival() {
        let landed = "2026-12-01T11:00:00Z";
        let all = [
            change("r", "A", 1, 100),
            change("c", "B", 2, 200),
            change("u", "A", 3, 110),
            change("u", "B", 4, 210),
            change("d", "B", 5, 0),
            change("c", "C", 6, 300),
            change("u", "A", 7, 120),
        ];
        // In order, one change per batch, a restart half-way.
        let mut ordered = Harness::new("2026-12-01T12:00:00Z");
        let job = ordered
            .job(include_str!("../../../jobs/customers.toml"))
            .await;
        for (i, c) in all.iter().enumerate() {
            ordered.land("customers", landed, std::slice::from_ref(c));
            ordered.run(&job).await;
            if i == 3 {
                ordered.restart();
            }
        }
        let want = tables(&ordered).await;
        assert_eq!(want.0, ["A|120|7", "C|300|6"]);
        assert_eq!(
            want.1,
            [
                "A|100|2026-12-01T10:00:01Z|2026-12-01T10:00:03Z|false",
                "A|110|2026-12-01T10:00:03Z|2026-12-01T10:00:07Z|false",
                "A|120|2026-12-01T10:00:07Z|∅|true",
                "B|200|2026-12-01T10:00:02Z|2026-12-01T10:00:04Z|false",
                "B|210|2026-12-01T10:00:04Z|2026-12-01T10:00:05Z|false",
                "C|300|2026-12-01T10:00:06Z|∅|true",
            ]
        );
        // Out of order, in three batches, with redeliveries: the same tables.
        let mut shuffled = Harness::new("2026-12-01T12:00:00Z");
        let batches: [&[usize]; 3] = [&[6, 4, 1], &[0, 5, 6, 4], &[3, 2, 1]];
        let mut metrics = Vec::new();
        for b in batches {
            let lines: Vec<String> = b.iter().map(|i| all[*i].clone()).collect();
            shuffled.land("customers", landed, &lines);
            metrics.push(shuffled.run(&job).await);
        }
        assert_eq!(tables(&shuffled).await, want);
        // Batch 2 redelivered lsn 7 and 5; batch 3: lsn 4 is older than B's delete, and
        // lsn 2 is a redelivery.
        assert_eq!(metrics[1]["redelivered"], 2);
        assert_eq!(metrics[2]["superseded"], 2);
        assert_eq!(metrics[2]["redelivered"], 1);
        // A late older change of a deleted key is ignored by the mirror; history places
        // it between the versions it falls in.
        let mut late = shuffled;
        late.land("customers", landed, &[change("u", "B", 3, 205)]);
        let m = late.run(&job).await;
        assert_eq!(
            (m["upserted"], m["superseded"], m["history_versions"]),
            (0, 1, 2)
        );
        let (current, history) = tables(&late).await;
        assert_eq!(current, want.0);
        assert!(
            history.contains(&"B|205|2026-12-01T10:00:03Z|2026-12-01T10:00:04Z|false".to_string())
        );
        // Deleted, then inserted again: the key comes back.
        late.land("customers", landed, &[change("c", "B", 8, 400)]);
        late.run(&job).await;
        assert_eq!(tables(&late).await.0, ["A|120|7", "B|400|8", "C|300|6"]);
    }

    /// Soft deletes keep the row with its last values and `_deleted = true`.
    #[tokio::test]
    async fn soft_deletes_mark_the_row() {
        let mut h = Harness::new("2026-12-01T12:00:00Z");
        let toml = include_str!("../../../jobs/customers.toml")
            .replace("deletes = \"hard\"", "deletes = \"soft\"\nbuckets = 4");
        let job = h.job(&toml).await;
        let landed = "2026-12-01T11:00:00Z";
        h.land(
            "customers",
            landed,
            &[change("c", "A", 1, 100), change("d", "A", 2, 0)],
        );
        h.run(&job).await;
        assert_eq!(
            h.rows(
                "gold/customers",
                "SELECT customer_id, credit_cents, _lsn, _deleted, _bucket < 4 FROM t"
            )
            .await,
            ["A|100|2|true|true"]
        );
    }

    /// `[params]` and source errors name the field and what was expected.
    #[tokio::test]
    async fn bad_mirror_jobs_are_named() {
        let h = Harness::new("2026-12-01T12:00:00Z");
        let base = include_str!("../../../jobs/customers.toml");
        for (from, to, want) in [
            (
                "deletes = \"hard\"",
                "deletes = \"gone\"",
                "`params.deletes`",
            ),
            ("history = true", "history = 1", "`params.history`"),
            ("deletes = \"hard\"", "buckets = 0", "`params.buckets`"),
            (
                "sources = [\"customers\"]",
                "sources = [\"orders\"]",
                "is an event source",
            ),
            (
                "merge_keys = [\"customer_id\"]",
                "merge_keys = [\"email\"]",
                "the source's primary key",
            ),
        ] {
            let text = base.replace(from, to);
            let e = crate::job::spec::parse(&text, "jobs/customers.toml", &h.schemas)
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains(want) && e.contains("jobs/customers.toml"), "{e}");
        }
    }
}
