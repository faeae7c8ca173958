//! Operator tests without storage: bronze rows decoded from NDJSON straight into a
//! [`MemoryPort`], one job batch at a time through the operator's `process`, its gold
//! rows applied to the port as its MERGE would, its too-late rows to its late ledger.
//! The same operator code the runner drives over Delta tables.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};

use super::port::{self, MemoryPort};
use super::Context;
use crate::job::plan::{Input, JobPlan, JobState};
use crate::job::spec::JobSpec;
use crate::names;
use crate::schema::SourceSchema;
use crate::source::decode::{decode_ndjson, Decoded};
use crate::source::validate::{parse_rfc3339_us, FileContext};
use crate::time::clock::Clock;
use crate::time::micros;

/// A warehouse in memory and the jobs' state between batches.
pub(crate) struct Harness {
    pub port: MemoryPort,
    pub schemas: BTreeMap<String, Arc<SourceSchema>>,
    pub clock: Clock,
    /// Last ingestion batch per source.
    ingested: BTreeMap<String, i64>,
    /// Per job: batches done and the state after the last one.
    jobs: BTreeMap<String, (i64, JobState)>,
}

/// An order line of one unit (`orders` source) with event id `id` at `ts` (HH:MM:SS on
/// 2026-12-01, UTC), order `o-<id>`.
pub(crate) fn order(id: &str, ts: &str, sku: &str, cents: i64) -> String {
    format!(
        r#"{{"event_id":"{id}","event_ts":"2026-12-01T{ts}Z","order_id":"o-{id}","sku":"{sku}","quantity":1,"amount_cents":{cents}}}"#
    )
}

pub(crate) fn us(ts: &str) -> i64 {
    parse_rfc3339_us(ts).unwrap_or_else(|| panic!("not RFC 3339: {ts}"))
}

impl Harness {
    /// The shipped source schemas, a clock fixed at `now`.
    pub fn new(now: &str) -> Self {
        Harness {
            port: MemoryPort::new(),
            schemas: crate::schema::load_all(std::path::Path::new("/none")).unwrap(),
            clock: Clock::fixed(us(now)),
            ingested: BTreeMap::new(),
            jobs: BTreeMap::new(),
        }
    }

    /// A job from TOML text, checked as `kestrel` checks job files.
    pub async fn job(&self, toml: &str) -> JobSpec {
        crate::job::spec::parse(toml, "jobs/test.toml", &self.schemas)
            .await
            .unwrap()
    }

    /// One landed file of `source` (NDJSON `lines`, partition `p0`) landed at `landed`,
    /// ingested as the source's next batch into `bronze/<source>`.
    pub fn land(&mut self, source: &str, landed: &str, lines: &[String]) {
        self.land_in(source, "p0", landed, lines)
    }

    /// Like [`Harness::land`], in source partition `partition`.
    pub fn land_in(&mut self, source: &str, partition: &str, landed: &str, lines: &[String]) {
        let n = self.ingested.get(source).copied().unwrap_or(0) + 1;
        let ctx = FileContext {
            source_file: format!("{source}/{partition}/{n}.ndjson"),
            partition: partition.to_string(),
            landed_at_us: us(landed),
            batch_id: n,
            ingested_at_us: self.clock.now_us(),
        };
        let text = lines.join("\n");
        match decode_ndjson(text.as_bytes(), &self.schemas[source], &ctx).unwrap() {
            Decoded::Rows {
                batch: Some(b),
                rejects,
                ..
            } if rejects.is_empty() => self.port.append(&names::table::bronze(source), vec![b]),
            other => panic!("{source}: not every line is valid: {other:?}"),
        }
        self.ingested.insert(source.to_string(), n);
    }

    /// A restart between batches: every job's state goes through its durable form (the
    /// batch result's JSON), as a new process reads it back.
    pub fn restart(&mut self) {
        for (_, state) in self.jobs.values_mut() {
            let json = serde_json::to_vec(state).unwrap();
            *state = serde_json::from_slice(&json).unwrap();
        }
    }

    /// Run `spec`'s next batch over everything ingested since its last; its metrics.
    pub async fn run(&mut self, spec: &JobSpec) -> BTreeMap<String, i64> {
        let (done, state) = self.jobs.remove(&spec.name).unwrap_or_else(|| {
            (
                0,
                JobState::initial(
                    &spec.sources,
                    micros(spec.time.watermark_delay),
                    micros(spec.time.idle_timeout),
                ),
            )
        });
        let inputs = spec
            .sources
            .iter()
            .map(|s| {
                let input = Input {
                    after_batch: state.positions.get(s).copied().unwrap_or(0),
                    upto_batch: self.ingested.get(s).copied().unwrap_or(0),
                    bronze_version: None,
                };
                (s.clone(), input)
            })
            .collect();
        let plan = JobPlan {
            job: spec.name.clone(),
            batch_id: done + 1,
            created_at: String::new(),
            inputs,
        };
        let cx = Context::new(&self.port, &self.schemas, &self.clock);
        let c = spec
            .operator
            .process(&cx, spec, &plan, state)
            .await
            .unwrap();
        if let Some(late) = &c.late {
            self.port
                .append(&names::table::late(&spec.name), vec![late.clone()]);
        }
        for out in &c.gold {
            self.port.merge(out).unwrap();
        }
        let metrics = c.result.metrics.clone();
        self.jobs
            .insert(spec.name.clone(), (done + 1, c.result.state));
        metrics
    }

    /// `sql` over table `path` registered as `t`, each row's values joined by `|`.
    pub async fn rows(&self, path: &str, sql: &str) -> Vec<String> {
        let Some(ctx) = port::open(&self.port, path, "t").await.unwrap() else {
            return Vec::new();
        };
        let batches: Vec<RecordBatch> = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let opts = FormatOptions::default().with_null("∅");
        let mut out = Vec::new();
        for b in &batches {
            let f: Vec<ArrayFormatter> = b
                .columns()
                .iter()
                .map(|c| ArrayFormatter::try_new(c.as_ref(), &opts).unwrap())
                .collect();
            for i in 0..b.num_rows() {
                let v: Vec<String> = f.iter().map(|f| f.value(i).to_string()).collect();
                out.push(v.join("|"));
            }
        }
        out
    }
}
