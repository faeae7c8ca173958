//! `[engine]`: where reads and aggregates execute.
//!
//! ```toml
//! [engine]
//! kind = "ballista"                 # default "local": this process, no services
//! scheduler = "df://10.0.0.5:50050" # required with kind = "ballista"
//! fallback = "local"                # default "none": an unreachable scheduler fails the run
//! parallel_days = 4                 # backfill days recomputed at once on the cluster
//! job_timeout = "1h"                # a cluster job without a result by then fails ("0": never)
//! ```

use crate::error::{Error, Result};

/// Which engine runs the operators' reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// DataFusion in this process (the embedded default).
    #[default]
    Local,
    /// A Ballista cluster (`kestrel cluster scheduler|executor`).
    Ballista,
}

/// What a run does when the cluster's scheduler cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fallback {
    /// Fail the run: one line naming the scheduler, non-zero exit, nothing committed.
    #[default]
    None,
    /// Run locally and say so.
    Local,
}

/// The `[engine]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// `df://host:port` of the scheduler (with `kind = Ballista`).
    pub scheduler: Option<String>,
    pub fallback: Fallback,
    /// Backfill days recomputed at once on the cluster (locally: one at a time).
    pub parallel_days: usize,
    /// A cluster job with no result after this fails its batch (None: wait forever);
    /// see [`super::deadline`].
    pub job_timeout: Option<std::time::Duration>,
}

/// Default of `[engine] parallel_days`.
pub const PARALLEL_DAYS: usize = 4;

/// Default of `[engine] job_timeout`: far beyond any job of a five-minute batch or of a
/// backfill day at Kestrel's scale, short enough that a lost job does not stall the
/// pipeline for longer than an hour.
pub const JOB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kind: EngineKind::default(),
            scheduler: None,
            fallback: Fallback::default(),
            parallel_days: PARALLEL_DAYS,
            job_timeout: Some(JOB_TIMEOUT),
        }
    }
}

impl EngineConfig {
    /// Parse `[engine]` of config `file`.
    pub fn parse(file: &str, t: &toml::Table) -> Result<Self> {
        let mut cfg = EngineConfig::default();
        for (key, value) in t {
            let field = format!("engine.{key}");
            let s = || {
                value.as_str().ok_or_else(|| {
                    Error::config(file, &field, format!("a string, got {}", value.type_str()))
                })
            };
            match key.as_str() {
                "kind" => {
                    let kinds = [
                        ("local", EngineKind::Local),
                        ("ballista", EngineKind::Ballista),
                    ];
                    cfg.kind = one_of(file, &field, s()?, &kinds)?;
                }
                "scheduler" => {
                    let url = s()?;
                    scheduler_addr(url).map_err(|e| Error::config(file, &field, e))?;
                    cfg.scheduler = Some(url.to_string());
                }
                "fallback" => {
                    let fallbacks = [("none", Fallback::None), ("local", Fallback::Local)];
                    cfg.fallback = one_of(file, &field, s()?, &fallbacks)?;
                }
                "parallel_days" => {
                    cfg.parallel_days = value
                        .as_integer()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| {
                            Error::config(
                                file,
                                &field,
                                format!("an integer from 1 to 256, got {value}"),
                            )
                        })? as usize;
                }
                "job_timeout" => {
                    let d = crate::config::parse_duration(s()?).map_err(|e| {
                        Error::config(
                            file,
                            &field,
                            format!("a duration such as \"1h\", or \"0\" for none ({e})"),
                        )
                    })?;
                    cfg.job_timeout = (!d.is_zero()).then_some(d);
                }
                other => {
                    return Err(Error::config(
                        file,
                        format!("engine.{other}"),
                        "one of kind, scheduler, fallback, parallel_days, job_timeout",
                    ))
                }
            }
        }
        if cfg.kind == EngineKind::Ballista && cfg.scheduler.is_none() {
            return Err(Error::config(
                file,
                "engine.scheduler",
                "the scheduler's URL, e.g. \"df://127.0.0.1:50050\" (required with kind = \"ballista\")",
            ));
        }
        Ok(cfg)
    }
}

/// The value `options` names `given`, or an error listing them.
fn one_of<T: Copy>(file: &str, field: &str, given: &str, options: &[(&str, T)]) -> Result<T> {
    match options.iter().find(|(name, _)| *name == given) {
        Some((_, v)) => Ok(*v),
        None => {
            let names: Vec<String> = options.iter().map(|(n, _)| format!("{n:?}")).collect();
            Err(Error::config(
                file,
                field,
                format!("{}, got {given:?}", names.join(" or ")),
            ))
        }
    }
}

/// `host:port` of a `df://host:port` scheduler URL (port 50050 when not given).
pub fn scheduler_addr(url: &str) -> std::result::Result<(String, u16), String> {
    let parsed = url::Url::parse(url)
        .map_err(|e| format!("a URL such as \"df://127.0.0.1:50050\" ({e}), got {url:?}"))?;
    if parsed.scheme() != "df" {
        return Err(format!(
            "a df://host:port URL, got scheme `{}` in {url:?}",
            parsed.scheme()
        ));
    }
    let host = parsed
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("a df://host:port URL with a host, got {url:?}"))?;
    Ok((host.to_string(), parsed.port().unwrap_or(50050)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<EngineConfig> {
        let t: toml::Table = text.parse().unwrap();
        EngineConfig::parse("k.toml", &t)
    }

    #[test]
    fn engine_table_parses_and_names_file_and_field_on_error() {
        assert_eq!(parse("").unwrap(), EngineConfig::default());
        let c =
            parse("kind = \"ballista\"\nscheduler = \"df://h:7\"\nfallback = \"local\"").unwrap();
        assert_eq!(c.kind, EngineKind::Ballista);
        assert_eq!(c.parallel_days, PARALLEL_DAYS);
        assert_eq!(parse("parallel_days = 8").unwrap().parallel_days, 8);
        assert_eq!(c.job_timeout, Some(JOB_TIMEOUT));
        let t = parse("job_timeout = \"90s\"").unwrap().job_timeout;
        assert_eq!(t, Some(std::time::Duration::from_secs(90)));
        assert_eq!(parse("job_timeout = \"0\"").unwrap().job_timeout, None);
        assert_eq!(c.fallback, Fallback::Local);
        assert_eq!(scheduler_addr("df://h:7").unwrap(), ("h".into(), 7));
        assert_eq!(scheduler_addr("df://h").unwrap(), ("h".into(), 50050));
        for (text, field) in [
            ("kind = \"spark\"", "engine.kind"),
            ("kind = \"ballista\"", "engine.scheduler"),
            ("scheduler = \"http://h:1\"", "engine.scheduler"),
            ("fallback = \"maybe\"", "engine.fallback"),
            ("nodes = 3", "engine.nodes"),
            ("parallel_days = 0", "engine.parallel_days"),
            ("parallel_days = \"4\"", "engine.parallel_days"),
            ("job_timeout = \"soon\"", "engine.job_timeout"),
            ("job_timeout = 60", "engine.job_timeout"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.starts_with(&format!("k.toml: field `{field}`")), "{e}");
        }
    }
}
