//! Job definitions (`jobs/<name>.toml`), validated at load: every error names the file,
//! the field and what was expected.
//!
//! Two kinds: declarative windowed aggregates (keys, a window, SQL aggregate expressions
//! checked by planning them with DataFusion against the source's bronze schema) and Rust
//! operators configured by name. The shipped jobs are compiled in; a `jobs/` directory
//! next to the config may override them or add more.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{files_with_extension, parse_duration};
use crate::error::{Error, Result};
use crate::names;
use crate::schema::SourceSchema;
use crate::time::window::WindowSpec;

const BUILTIN: [(&str, &str); 8] = [
    (
        "clickstream_5m",
        include_str!("../../jobs/clickstream_5m.toml"),
    ),
    ("revenue_5m", include_str!("../../jobs/revenue_5m.toml")),
    ("revenue_1h", include_str!("../../jobs/revenue_1h.toml")),
    ("sessions", include_str!("../../jobs/sessions.toml")),
    (
        "payments_fast",
        include_str!("../../jobs/payments_fast.toml"),
    ),
    (
        "payment_reconciliation",
        include_str!("../../jobs/payment_reconciliation.toml"),
    ),
    ("stockout", include_str!("../../jobs/stockout.toml")),
    ("customers", include_str!("../../jobs/customers.toml")),
];

/// What happens to events too late for the job (both are counted in the run log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatePolicy {
    /// Written to `late/<job>` with the reason.
    SideOutput,
    /// Only counted.
    Drop,
}

/// Event-time settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TimeSpec {
    pub watermark_delay: Duration,
    pub idle_timeout: Duration,
    pub lookback: Duration,
    pub late_policy: LatePolicy,
}

pub use crate::operator::payments::matching::{PaymentMode, PaymentParams};

/// One job definition.
#[derive(Debug, Clone)]
pub struct JobSpec {
    pub name: String,
    /// Where it came from (for messages).
    pub file: String,
    /// Six-field cron (`sec min hour dom month dow`), UTC.
    pub schedule: String,
    pub sources: Vec<String>,
    /// The operator that computes it, holding its parsed `[params]`.
    pub operator: Arc<dyn crate::operator::Operator>,
    pub time: TimeSpec,
    /// Gold table path, default `gold/<name>`.
    pub table: String,
    /// MERGE keys of the gold table.
    pub merge_keys: Vec<String>,
    /// Service-level objectives (`[slo]`), checked by `kestrel status --check`.
    pub slo: Slo,
}

/// A job's service-level objectives (`[slo]`); each is optional, and `kestrel status`
/// reports every measure whether or not it has an objective.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Slo {
    /// p99 of end-to-end latency (a file landed → its rows committed to gold) over the
    /// job's last batches.
    pub max_latency: Option<Duration>,
    /// Age of the oldest file of the job's sources landed and not yet ingested.
    pub max_consumer_lag: Option<Duration>,
    /// Event-time skew between the partitions of one of the job's sources.
    pub max_skew: Option<Duration>,
    /// Fraction of the events the job read over the last day that were too late.
    pub max_late_rate: Option<f64>,
    /// The job's state: durable bytes plus its stream's in-memory bytes.
    pub max_state_bytes: Option<u64>,
    /// Duration of the last batch that resumed an interrupted run.
    pub max_recovery: Option<Duration>,
    /// CPU seconds per million events read, over the last day of batches.
    pub max_cpu_s_per_million: Option<f64>,
}

/// The objectives of `[slo]`.
fn parse_slo(s: &Fields<'_>) -> Result<Slo> {
    s.only(&[
        "max_latency",
        "max_consumer_lag",
        "max_skew",
        "max_late_rate",
        "max_state_bytes",
        "max_recovery",
        "max_cpu_s_per_million",
    ])?;
    let dur = |k: &str| -> Result<Option<Duration>> {
        s.str_opt(k)?
            .map(|v| {
                parse_duration(v).map_err(|e| s.err(k, format!("a duration such as \"60s\" ({e})")))
            })
            .transpose()
    };
    let number = |k: &str| -> Result<Option<f64>> {
        match s.table.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_float()
                .or_else(|| v.as_integer().map(|i| i as f64))
                .filter(|x| *x >= 0.0)
                .map(Some)
                .ok_or_else(|| s.err(k, format!("a number ≥ 0, got {v}"))),
        }
    };
    let bytes = match s.table.get("max_state_bytes") {
        None => None,
        Some(v) => Some(
            v.as_integer()
                .and_then(|i| u64::try_from(i).ok())
                .or_else(|| v.as_str().and_then(parse_bytes))
                .ok_or_else(|| {
                    s.err(
                        "max_state_bytes",
                        format!("bytes: an integer or a size such as \"512MiB\", got {v}"),
                    )
                })?,
        ),
    };
    let late = number("max_late_rate")?;
    if late.is_some_and(|r| r > 1.0) {
        return Err(s.err("max_late_rate", "a fraction from 0 to 1"));
    }
    Ok(Slo {
        max_latency: dur("max_latency")?,
        max_consumer_lag: dur("max_consumer_lag")?,
        max_skew: dur("max_skew")?,
        max_late_rate: late,
        max_state_bytes: bytes,
        max_recovery: dur("max_recovery")?,
        max_cpu_s_per_million: number("max_cpu_s_per_million")?,
    })
}

/// `"512MiB"`, `"2GB"`, `"100KiB"`, `"42B"` or `"42"` as bytes.
fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let m: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(m)
}

pub(crate) struct Fields<'a> {
    pub(crate) file: &'a str,
    pub(crate) prefix: &'a str,
    pub(crate) table: &'a toml::Table,
}

impl<'a> Fields<'a> {
    pub(crate) fn name(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }
    pub(crate) fn err(&self, key: &str, expected: impl Into<String>) -> Error {
        Error::config(self.file, self.name(key), expected)
    }
    pub(crate) fn only(&self, known: &[&str]) -> Result<()> {
        for k in self.table.keys() {
            if !known.contains(&k.as_str()) {
                return Err(self.err(k, format!("one of the known fields ({})", known.join(", "))));
            }
        }
        Ok(())
    }
    pub(crate) fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.table.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("a string, got {}", v.type_str()))),
        }
    }
    pub(crate) fn str(&self, key: &str) -> Result<&'a str> {
        self.str_opt(key)?
            .ok_or_else(|| self.err(key, "a value (the field is required)"))
    }
    pub(crate) fn list(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some(v) = self.table.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(key, format!("an array of strings, got {}", v.type_str())))?;
        arr.iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.err(key, "an array of strings"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
    pub(crate) fn duration(&self, key: &str, default: Duration) -> Result<Duration> {
        match self.str_opt(key)? {
            None => Ok(default),
            Some(s) => parse_duration(s)
                .map_err(|e| self.err(key, format!("a duration such as \"5m\" ({e})"))),
        }
    }
    pub(crate) fn sub(&self, key: &'a str) -> Result<Option<Fields<'a>>> {
        match self.table.get(key) {
            None => Ok(None),
            Some(v) => {
                let t = v
                    .as_table()
                    .ok_or_else(|| self.err(key, format!("a table [{key}]")))?;
                Ok(Some(Fields {
                    file: self.file,
                    prefix: key,
                    table: t,
                }))
            }
        }
    }
}

pub(crate) fn is_identifier(s: &str) -> bool {
    let mut c = s.chars();
    c.next().is_some_and(|f| f.is_ascii_lowercase() || f == '_')
        && c.all(|x| x.is_ascii_lowercase() || x.is_ascii_digit() || x == '_')
}

/// Parse and validate one job definition.
pub async fn parse(
    text: &str,
    file: &str,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<JobSpec> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        Error::config(file, "(syntax)", format!("valid TOML ({})", e.message()))
    })?;
    let top = Fields {
        file,
        prefix: "",
        table: &table,
    };
    top.only(&[
        "name",
        "schedule",
        "sources",
        "keys",
        "window",
        "aggregates",
        "operator",
        "params",
        "time",
        "sink",
        "slo",
    ])?;
    let name = top.str("name")?.to_string();
    if !is_identifier(&name) {
        return Err(top.err("name", "a lower-case identifier (letters, digits, _)"));
    }
    let schedule = top.str("schedule")?.to_string();
    crate::config::check_cron(&schedule).map_err(|e| top.err("schedule", e))?;
    let sources = top
        .list("sources")?
        .ok_or_else(|| top.err("sources", "a list of source names"))?;
    if sources.is_empty() {
        return Err(top.err("sources", "at least one source"));
    }
    for s in &sources {
        if !schemas.contains_key(s) {
            let known: Vec<&str> = schemas.keys().map(String::as_str).collect();
            return Err(top.err(
                "sources",
                format!(
                    "sources with a schema ({}); `{s}` has none",
                    known.join(", ")
                ),
            ));
        }
    }

    let time = match top.sub("time")? {
        None => TimeSpec {
            watermark_delay: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
            lookback: Duration::from_secs(3 * 86_400),
            late_policy: LatePolicy::SideOutput,
        },
        Some(t) => {
            t.only(&["watermark_delay", "idle_timeout", "lookback", "late_policy"])?;
            TimeSpec {
                watermark_delay: t.duration("watermark_delay", Duration::from_secs(30))?,
                idle_timeout: t.duration("idle_timeout", Duration::from_secs(300))?,
                lookback: t.duration("lookback", Duration::from_secs(3 * 86_400))?,
                late_policy: match t.str_opt("late_policy")? {
                    None | Some("side_output") => LatePolicy::SideOutput,
                    Some("drop") => LatePolicy::Drop,
                    Some(other) => {
                        return Err(t.err(
                            "late_policy",
                            format!("\"side_output\" or \"drop\", got {other:?}"),
                        ))
                    }
                },
            }
        }
    };

    let sink = top.sub("sink")?;
    if let Some(s) = &sink {
        s.only(&["table", "merge_keys"])?;
    }
    let table_path = match sink
        .as_ref()
        .map(|s| s.str_opt("table"))
        .transpose()?
        .flatten()
    {
        Some(t) if names::table::is_gold(t) => t.to_string(),
        Some(t) => {
            return Err(Error::config(
                file,
                "sink.table",
                format!("a path under gold/, got {t:?}"),
            ))
        }
        None => names::table::gold(&name),
    };
    let merge_keys_given = sink
        .as_ref()
        .map(|s| s.list("merge_keys"))
        .transpose()?
        .flatten();

    let operator = match top.str_opt("operator")? {
        Some(op) => {
            let known = crate::operator::names();
            if !known.contains(&op) {
                return Err(top.err(
                    "operator",
                    format!("one of {}, got {op:?}", known.join(", ")),
                ));
            }
            for f in ["keys", "window", "aggregates"] {
                if table.contains_key(f) {
                    return Err(
                        top.err(f, "nothing: operator jobs are configured by their operator")
                    );
                }
            }
            crate::operator::parse(op, &top, &sources, schemas)?
        }
        None => crate::operator::windowed::parse(&top, &sources, schemas).await?,
    };
    let merge_keys = match merge_keys_given {
        Some(k) if k.is_empty() => {
            return Err(Error::config(
                file,
                "sink.merge_keys",
                "at least one column",
            ))
        }
        given => operator
            .merge_keys(given)
            .map_err(|want| Error::config(file, "sink.merge_keys", want))?,
    };
    let slo = match top.sub("slo")? {
        Some(s) => parse_slo(&s)?,
        None => Slo::default(),
    };
    Ok(JobSpec {
        slo,
        name,
        file: file.to_string(),
        schedule,
        sources,
        operator,
        time,
        table: table_path,
        merge_keys,
    })
}

/// The window-start column of gold rows: `session_start` for sessions, else `window_start`.
pub fn window_start_column(w: &WindowSpec) -> &'static str {
    match w {
        WindowSpec::Session { .. } => "session_start",
        _ => "window_start",
    }
}

/// `source` has each of `needed` as a required field of that type.
pub(crate) fn check_columns(
    top: &Fields<'_>,
    source: &str,
    needed: &[(&str, crate::schema::FieldType)],
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<()> {
    let schema = &schemas[source];
    for (name, ty) in needed {
        let ok = schema
            .fields
            .iter()
            .any(|f| f.name == *name && f.ty == *ty && !f.nullable);
        if !ok {
            return Err(top.err(
                "sources",
                format!(
                    "`{source}` to have a required {ty:?} field `{name}` (the operator reads {})",
                    needed
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// Load the shipped jobs, then `dir/*.toml` (which may override them by name).
pub async fn load_all(
    dir: &Path,
    schemas: &BTreeMap<String, Arc<SourceSchema>>,
) -> Result<BTreeMap<String, JobSpec>> {
    let mut out = BTreeMap::new();
    for (name, text) in BUILTIN {
        let spec = parse(text, &format!("(built-in) jobs/{name}.toml"), schemas).await?;
        out.insert(spec.name.clone(), spec);
    }
    for p in files_with_extension(dir, "toml")? {
        let file = p.display().to_string();
        let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&file, e))?;
        let spec = parse(&text, &file, schemas).await?;
        let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        if stem != spec.name {
            return Err(Error::config(
                &file,
                "name",
                format!("the file's name `{stem}` (got `{}`)", spec.name),
            ));
        }
        out.insert(spec.name.clone(), spec);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::payments::Payments;
    use crate::operator::stockout::Stockout;
    use crate::operator::windowed::Windowed;

    fn schemas() -> BTreeMap<String, Arc<SourceSchema>> {
        crate::schema::load_all(Path::new("/none")).unwrap()
    }

    #[tokio::test]
    async fn shipped_jobs_load_as_designed() {
        let jobs = load_all(Path::new("/none"), &schemas()).await.unwrap();
        assert_eq!(jobs.len(), 8);
        let c = &jobs["customers"];
        let tables: Vec<String> = c.outputs().into_iter().map(|o| o.table).collect();
        assert_eq!(
            tables,
            [
                "gold/customers",
                "_kestrel/mirror/customers/deletes",
                "gold/customers_history"
            ]
        );
        assert_eq!(c.merge_keys, ["customer_id"]);
        assert!(c.operator.no_days().is_some() && !c.can_stream());
        let r = &jobs["revenue_1h"];
        match r.operator.as_any().downcast_ref::<Windowed>() {
            Some(Windowed {
                keys,
                window,
                aggregates,
                inputs,
                folds,
            }) => {
                assert_eq!(keys, &vec!["sku".to_string()]);
                use crate::job::fold::Fold;
                assert_eq!(folds, &Some(vec![Fold::Count, Fold::Sum, Fold::Sum]));
                // What it takes of the new orders, declared before its first batch.
                let all = schemas();
                let bronze = &all["orders"].bronze;
                let mut cols = r.operator.new_row_columns(r, "orders", bronze).unwrap();
                cols.sort();
                assert_eq!(
                    cols,
                    [
                        "_batch_id",
                        "_landed_at",
                        "_source_partition",
                        "amount_cents",
                        "event_ts",
                        "quantity",
                        "sku"
                    ]
                );
                assert_eq!(r.operator.new_row_columns(r, "payments", bronze), None);
                assert_eq!(inputs, &vec!["amount_cents", "quantity", "sku"]);
                assert_eq!(
                    *window,
                    WindowSpec::Sliding {
                        size: 3_600_000_000,
                        slide: 300_000_000
                    }
                );
                let names: Vec<&str> = aggregates.iter().map(|(n, _)| n.as_str()).collect();
                assert_eq!(names, vec!["orders", "units", "revenue_cents"]);
            }
            None => panic!("{:?}", r.operator),
        }
        assert_eq!(r.merge_keys, vec!["sku", "window_start"]);
        assert_eq!(r.table, "gold/revenue_1h");
        // Recomputes read only what the aggregates and keys use (not page, sku, ids).
        for job in ["sessions", "clickstream_5m"] {
            let Some(Windowed { inputs, .. }) = jobs[job].operator.as_any().downcast_ref() else {
                panic!("{job} is windowed")
            };
            assert_eq!(inputs, &["anonymous_id", "event_type"], "{job}");
        }
        let b = &schemas()["clickstream"].bronze;
        let Some(Windowed { inputs, .. }) = jobs["sessions"].operator.as_any().downcast_ref()
        else {
            panic!("sessions is windowed")
        };
        let read = crate::job::aggregate::job_input_schema(b, Some(&[inputs]));
        let names: Vec<&str> = read.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(
            names,
            [
                "event_ts",
                "anonymous_id",
                "event_type",
                "_source_partition",
                "_landed_at",
                "_batch_id"
            ]
        );
        assert_eq!(
            jobs["sessions"].merge_keys,
            vec!["anonymous_id", "session_start"]
        );
        assert_eq!(jobs["stockout"].table, "gold/stockout_alerts");
        assert_eq!(
            jobs["stockout"].operator.as_any().downcast_ref(),
            Some(&Stockout {
                availability_table: "gold/sku_availability".into()
            })
        );
        let so = "name = \"x\"\nschedule = \"0 * * * * *\"\noperator = \"stockout\"\n[sink]\nmerge_keys = [\"sku\", \"minute\"]\n";
        let e = err(&format!("sources = [\"orders\"]\n{so}")).await;
        assert!(
            e.contains("`sources`")
                && e.contains("`orders` to have a required String field `kind`"),
            "{e}"
        );
        let e = err(&format!(
            "sources = [\"inventory\"]\n{so}[params]\navailability_table = \"x\"\n"
        ))
        .await;
        assert!(e.contains("`params.availability_table`"), "{e}");
        assert_eq!(jobs["payment_reconciliation"].schedule, "0 0 * * * *");
        assert_eq!(
            jobs["clickstream_5m"].time.lookback,
            Duration::from_secs(3 * 86_400)
        );
    }

    async fn err(text: &str) -> String {
        parse(text, "jobs/x.toml", &schemas())
            .await
            .unwrap_err()
            .to_string()
    }

    const BASE: &str =
        "name = \"x\"\nschedule = \"0 */5 * * * *\"\nsources = [\"orders\"]\nkeys = [\"sku\"]\n";

    #[tokio::test]
    async fn bad_definitions_name_file_field_and_expectation() {
        let win = "[window]\nkind = \"tumbling\"\nsize = \"5m\"\n";
        let agg = "[aggregates]\nunits = \"sum(quantity)\"\n";
        let e = err(&format!(
            "{BASE}{win}[aggregates]\nunits = \"sum(quantityy)\"\n"
        ))
        .await;
        assert!(
            e.starts_with("jobs/x.toml: field `aggregates.units`"),
            "{e}"
        );
        let e = err(&format!(
            "{BASE}[window]\nkind = \"sliding\"\nsize = \"1h\"\nslide = \"7m\"\n{agg}"
        ))
        .await;
        assert!(
            e.contains("`window.slide`") && e.contains("divides the size"),
            "{e}"
        );
        let e = err(&format!(
            "{BASE}[window]\nkind = \"tumbling\"\nsize = \"5 parsecs\"\n{agg}"
        ))
        .await;
        assert!(e.contains("`window.size`") && e.contains("duration"), "{e}");
        let e = err(&format!("name = \"x\"\nschedule = \"*/5 * * * *\"\nsources = [\"orders\"]\nkeys = [\"sku\"]\n{win}{agg}")).await;
        assert!(e.contains("`schedule`") && e.contains("6-field"), "{e}");
        let e = err(&format!("name = \"x\"\nschedule = \"0 */5 * * * *\"\nsources = [\"orders\"]\nkeys = [\"skuu\"]\n{win}{agg}")).await;
        assert!(
            e.contains("`keys`") && e.contains("`skuu` is not one"),
            "{e}"
        );
        let e = err(&format!(
            "{BASE}{win}{agg}[time]\nlate_policy = \"ignore\"\n"
        ))
        .await;
        assert!(e.contains("`time.late_policy`"), "{e}");
        let e = err(&format!("{BASE}{win}{agg}colour = \"red\"\n")).await;
        assert!(e.contains("`aggregates.colour`"), "{e}");
        let e = err("name = \"x\"\nschedule = \"0 0 * * * *\"\nsources = [\"nope\"]\noperator = \"stockout\"\n").await;
        assert!(
            e.contains("`sources`") && e.contains("`nope` has none"),
            "{e}"
        );
        let e = err("name = \"x\"\nschedule = \"0 0 * * * *\"\nsources = [\"orders\"]\noperator = \"magic\"\n").await;
        assert!(e.contains("`operator`"), "{e}");
        let e = err(&format!("{BASE}{win}{agg}[sink]\ntable = \"silver/x\"\n")).await;
        assert!(e.contains("`sink.table`"), "{e}");
    }

    const PAY: &str = "name = \"x\"\nschedule = \"0 0 * * * *\"\noperator = \"payment_reconciliation\"\n[sink]\nmerge_keys = [\"order_id\"]\n";

    #[tokio::test]
    async fn payments_jobs_check_sources_keys_and_params() {
        let jobs = load_all(Path::new("/none"), &schemas()).await.unwrap();
        assert_eq!(
            jobs["payments_fast"].operator.as_any().downcast_ref(),
            Some(&Payments {
                mode: PaymentMode::Fast,
                params: PaymentParams::default()
            })
        );
        let two = "sources = [\"orders\", \"payments\"]\n";
        let ok = parse(
            &format!("{two}{PAY}[params]\nbusiness_window = \"2d\"\nhorizon = \"10d\"\n"),
            "jobs/x.toml",
            &schemas(),
        )
        .await
        .unwrap();
        match ok.operator.as_any().downcast_ref() {
            Some(Payments { mode, params }) => {
                assert_eq!(*mode, PaymentMode::Reconcile);
                assert_eq!(params.business_window, Duration::from_secs(2 * 86_400));
                assert_eq!(params.horizon, Duration::from_secs(10 * 86_400));
            }
            None => panic!("{:?}", ok.operator),
        }
        let e = err(&format!("sources = [\"payments\", \"orders\"]\n{PAY}")).await;
        assert!(
            e.contains("`sources`")
                && e.contains("`orders` to have a required String field `status`"),
            "{e}"
        );
        let e = err(&format!("sources = [\"orders\"]\n{PAY}")).await;
        assert!(e.contains("`sources`") && e.contains("two sources"), "{e}");
        let e = err(&format!("{two}{PAY}[params]\nhorizon = \"1d\"\n")).await;
        assert!(
            e.contains("`params.horizon`") && e.contains("business_window"),
            "{e}"
        );
        let e = err(&format!("{two}{PAY}[params]\nfast_within = \"1m\"\n")).await;
        assert!(e.contains("`params.fast_within`"), "{e}");
        let e = err(&format!(
            "{two}name = \"x\"\nschedule = \"0 0 * * * *\"\noperator = \"payments_fast\"\n[sink]\nmerge_keys = [\"sku\"]\n"
        ))
        .await;
        assert!(
            e.contains("`sink.merge_keys`") && e.contains("order_id"),
            "{e}"
        );
    }
}
