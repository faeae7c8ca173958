//! Folding a batch's applied rows into the windows gold already holds, for aggregates
//! that combine exactly: `count`, `sum` of integers, `min` and `max`, without DISTINCT or
//! an ORDER BY. Pure functions over Arrow record batches (no I/O).
//!
//! A window's gold row is, by induction over the job's batches, the aggregate of every
//! applied row of the window: each batch writes the windows its applied rows touch and
//! those the watermark finalises, from every applied row of them. For these aggregates
//! that equals the gold row combined with the aggregate of the batch's own applied rows
//! (a count or sum adds, a minimum takes the smaller), so a batch need not read back
//! the older bronze rows of the windows it touches. Integer sums wrap the same way in
//! either order; float sums would not (their rounding depends on the order), so a job
//! with one keeps recomputing, as do sessions and every other aggregate.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::logical_expr::Expr;

use super::aggregate::aggregate_parts;
use crate::columns::conform;
use crate::error::Result;

/// How a window's partial aggregate combines with another of the same window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fold {
    Count,
    Sum,
    Min,
    Max,
}

impl Fold {
    /// How the aggregate `expr` (planned) combines, when its result of type `output`
    /// does so exactly; None otherwise.
    pub fn of(expr: &Expr, output: &DataType) -> Option<Fold> {
        let expr = match expr {
            Expr::Alias(a) => a.expr.as_ref(),
            e => e,
        };
        let Expr::AggregateFunction(f) = expr else {
            return None;
        };
        if f.params.distinct || !f.params.order_by.is_empty() {
            return None;
        }
        let fold = match f.func.name() {
            "count" => Fold::Count,
            "sum" => Fold::Sum,
            "min" => Fold::Min,
            "max" => Fold::Max,
            _ => return None,
        };
        match fold {
            Fold::Count | Fold::Sum if !output.is_integer() => None,
            _ => Some(fold),
        }
    }

    /// The SQL aggregate that combines partials.
    fn combine(self) -> &'static str {
        match self {
            Fold::Count | Fold::Sum => "sum",
            Fold::Min => "min",
            Fold::Max => "max",
        }
    }
}

/// `schema` with every field nullable (what a union of partials and gold rows holds).
fn nullable(schema: &Schema) -> SchemaRef {
    Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .map(|f| Field::new(f.name(), f.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ))
}

/// The windows of `partial` (the aggregates of a batch's applied rows: keys,
/// `window_start`, one column per aggregate, of schema `schema`) combined with `held`
/// (gold's rows of the windows the batch writes, with the same columns): one row per
/// window of either, of schema `schema`.
pub async fn fold(
    partial: Vec<RecordBatch>,
    schema: &SchemaRef,
    held: RecordBatch,
    keys: &[String],
    aggregates: &[(String, String)],
    folds: &[Fold],
) -> Result<Vec<RecordBatch>> {
    if held.num_rows() == 0 {
        return Ok(partial);
    }
    let loose = nullable(schema);
    let mut rows = Vec::with_capacity(partial.len() + 1);
    for b in partial.iter().chain(std::iter::once(&held)) {
        rows.push(conform(b, &loose)?);
    }
    // The same aggregate as the partials', of each column by how it combines.
    let combined: Vec<(String, String)> = aggregates
        .iter()
        .zip(folds)
        .map(|((c, _), f)| (c.clone(), format!("{}(\"{c}\")", f.combine())))
        .collect();
    let (_, out) = aggregate_parts(rows, keys, &combined, false).await?;
    out.iter().map(|b| conform(b, schema)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::aggregate::WINDOW_START;
    use arrow::array::{AsArray, Int64Array, StringArray};
    use arrow::datatypes::Int64Type;
    use datafusion::prelude::SessionContext;

    fn planned(sql: &str) -> Expr {
        let ctx = SessionContext::new();
        let schema = Schema::new(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("f", DataType::Float64, true),
            Field::new("s", DataType::Utf8, true),
        ]);
        let df = datafusion::common::DFSchema::try_from(schema).unwrap();
        ctx.state().create_logical_expr(sql, &df).unwrap()
    }

    #[test]
    fn only_aggregates_that_combine_exactly_fold() {
        let of = |sql: &str, t: DataType| Fold::of(&planned(sql), &t);
        assert_eq!(of("count(*)", DataType::Int64), Some(Fold::Count));
        assert_eq!(of("count(s)", DataType::Int64), Some(Fold::Count));
        assert_eq!(of("sum(a)", DataType::Int64), Some(Fold::Sum));
        assert_eq!(
            of("sum(a * 2) FILTER (WHERE a > 1)", DataType::Int64),
            Some(Fold::Sum)
        );
        assert_eq!(of("min(s)", DataType::Utf8), Some(Fold::Min));
        assert_eq!(of("max(f)", DataType::Float64), Some(Fold::Max));
        assert_eq!(of("sum(f)", DataType::Float64), None);
        assert_eq!(of("avg(a)", DataType::Float64), None);
        assert_eq!(of("count(DISTINCT s)", DataType::Int64), None);
        assert_eq!(of("sum(a) / 100", DataType::Int64), None);
        assert_eq!(of("approx_distinct(s)", DataType::UInt64), None);
    }

    fn windows(
        schema: &SchemaRef,
        keys: &[&str],
        starts: &[i64],
        n: &[Option<i64>],
        lo: &[&str],
    ) -> RecordBatch {
        RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from(keys.to_vec())),
                Arc::new(Int64Array::from(starts.to_vec())),
                Arc::new(Int64Array::from(n.to_vec())),
                Arc::new(StringArray::from(lo.to_vec())),
            ],
        )
        .unwrap()
    }

    /// A window in both adds its counts and takes the smaller minimum; a window in one
    /// keeps its row; a null sum (no values yet) takes the other side's.
    #[tokio::test]
    async fn partials_combine_with_held_windows() {
        let schema: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new(WINDOW_START, DataType::Int64, false),
            Field::new("n", DataType::Int64, true),
            Field::new("lo", DataType::Utf8, true),
        ]));
        let partial = windows(&schema, &["a", "b"], &[0, 0], &[Some(2), None], &["m", "x"]);
        let held = windows(
            &schema,
            &["a", "b", "c"],
            &[0, 0, 5],
            &[Some(3), Some(4), Some(1)],
            &["q", "c", "z"],
        );
        let aggs = vec![
            ("n".to_string(), "sum(x)".to_string()),
            ("lo".to_string(), "min(y)".to_string()),
        ];
        let out = fold(
            vec![partial],
            &schema,
            held,
            &["k".to_string()],
            &aggs,
            &[Fold::Sum, Fold::Min],
        )
        .await
        .unwrap();
        let all = arrow::compute::concat_batches(&schema, &out).unwrap();
        let mut got: Vec<(String, i64, i64, String)> = (0..all.num_rows())
            .map(|i| {
                (
                    all.column(0).as_string::<i32>().value(i).to_string(),
                    all.column(1).as_primitive::<Int64Type>().value(i),
                    all.column(2).as_primitive::<Int64Type>().value(i),
                    all.column(3).as_string::<i32>().value(i).to_string(),
                )
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                ("a".into(), 0, 5, "m".into()),
                ("b".into(), 0, 4, "c".into()),
                ("c".into(), 5, 1, "z".into())
            ]
        );
        assert_eq!(all.schema(), schema);
    }
}
