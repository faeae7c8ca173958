//! `kestrel lag --source S`: how late events arrive, and which `watermark_delay` that
//! calls for.
//!
//! Lateness of an event is `_landed_at − event_ts` (arrival minus event time), read from
//! bronze. Its distribution (p50, p90, p99, p99.9, max; overall and per source
//! partition) describes the source; it is not yet the answer, because what makes a
//! correction is whether the watermark had already passed the event's window when it
//! arrived. So the suggestion replays the arrivals: events in arrival order (a file's
//! events arrive together), each partition's newest event time so far, the watermark
//! `W = min over partitions − delay` just before each arrival (idleness ignored, which
//! errs towards a larger delay), and for every candidate delay the events that would have
//! come after their window was final (`W ≥ window end`: a correction) and those beyond
//! the lookback (`event_ts < W − lookback`: too late, side output). The suggested delay is
//! the smallest whole second that keeps the corrections' fraction at or under `target`.

use std::collections::HashMap;

use arrow::array::{Array, StringArray, TimestampMicrosecondArray};
use datafusion::prelude::col;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::sink::delta::ts_lit;
use crate::sink::delta::{self, Warehouse};
use crate::time::Micros;

const SEC: Micros = 1_000_000;

/// What to analyse.
#[derive(Debug, Clone)]
pub struct LagOptions {
    pub source: String,
    /// Only events that landed at or after this time (micros).
    pub since: Option<Micros>,
    /// Acceptable fraction of events arriving after their window was final.
    pub target: f64,
    /// Window size the corrections are judged against.
    pub window: Micros,
    /// The job's lookback.
    pub lookback: Micros,
    /// Delays replayed besides the standard ones and the suggestion (a job's
    /// `watermark_delay`, for the decision record).
    pub delays: Vec<Micros>,
}

/// Percentiles of lateness in seconds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Quantiles {
    pub events: usize,
    pub p50_s: f64,
    pub p90_s: f64,
    pub p99_s: f64,
    pub p999_s: f64,
    pub max_s: f64,
}

/// One candidate delay and what it would have done.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Candidate {
    pub delay_s: f64,
    /// Events that would have arrived after their window was final.
    pub corrections: usize,
    pub correction_fraction: f64,
    /// Events that would have been beyond the lookback (too late, side output).
    pub beyond_lookback: usize,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct LagReport {
    pub source: String,
    pub overall: Quantiles,
    pub partitions: Vec<(String, Quantiles)>,
    pub target: f64,
    pub window_s: f64,
    pub lookback_s: f64,
    /// The smallest whole-second delay meeting `target`.
    pub suggested_delay_s: f64,
    pub candidates: Vec<Candidate>,
    /// Lateness of every event in seconds, for the histogram.
    #[serde(skip)]
    pub lateness_s: Vec<f64>,
}

/// One event: source partition (index), event time, arrival time.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub partition: usize,
    pub event_ts: Micros,
    pub landed_at: Micros,
}

/// Nearest-rank percentile of sorted values (`q` in 0..=1).
pub fn percentile(sorted: &[Micros], q: f64) -> Micros {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn quantiles(mut lateness: Vec<Micros>) -> Quantiles {
    lateness.sort_unstable();
    let s = |q| percentile(&lateness, q) as f64 / SEC as f64;
    Quantiles {
        events: lateness.len(),
        p50_s: s(0.5),
        p90_s: s(0.9),
        p99_s: s(0.99),
        p999_s: s(0.999),
        max_s: lateness.last().map_or(0.0, |m| *m as f64 / SEC as f64),
    }
}

/// For each event, in arrival order: the source watermark before it arrived with delay 0
/// (min over partitions seen so far of their newest event time), None for the first
/// arrivals.
fn watermarks_before(arrivals: &mut [Arrival], partitions: usize) -> Vec<Option<Micros>> {
    arrivals.sort_by_key(|a| (a.landed_at, a.partition, a.event_ts));
    let mut newest: Vec<Option<Micros>> = vec![None; partitions];
    let mut out = Vec::with_capacity(arrivals.len());
    let mut i = 0;
    while i < arrivals.len() {
        // Events landed at the same instant (one file) arrive together.
        let mut j = i;
        while j < arrivals.len() && arrivals[j].landed_at == arrivals[i].landed_at {
            j += 1;
        }
        let w = newest.iter().flatten().min().copied();
        out.extend(std::iter::repeat_n(w, j - i));
        for a in &arrivals[i..j] {
            let n = &mut newest[a.partition];
            *n = Some(n.map_or(a.event_ts, |v| v.max(a.event_ts)));
        }
        i = j;
    }
    out
}

/// Analyse `arrivals` (pure; the command reads them from bronze).
pub fn analyse(
    source: &str,
    partition_names: &[String],
    mut arrivals: Vec<Arrival>,
    opts: &LagOptions,
) -> LagReport {
    let lateness: Vec<Micros> = arrivals.iter().map(|a| a.landed_at - a.event_ts).collect();
    let mut per: Vec<Vec<Micros>> = vec![Vec::new(); partition_names.len()];
    for a in &arrivals {
        per[a.partition].push(a.landed_at - a.event_ts);
    }
    let w0 = watermarks_before(&mut arrivals, partition_names.len());
    // need: the delay at or under which the event would have been a correction
    // (W0 − delay ≥ window end ⇔ delay ≤ W0 − window end).
    let mut need: Vec<Micros> = Vec::new();
    // beyond: the delay under which it would have been beyond the lookback
    // (event_ts < W0 − delay − lookback ⇔ delay < W0 − lookback − event_ts).
    let mut beyond: Vec<Micros> = Vec::new();
    for (a, w) in arrivals.iter().zip(&w0) {
        let Some(w) = *w else { continue };
        let end = a.event_ts.div_euclid(opts.window) * opts.window + opts.window;
        if w >= end {
            need.push(w - end);
        }
        if w - opts.lookback > a.event_ts {
            beyond.push(w - opts.lookback - a.event_ts);
        }
    }
    need.sort_unstable();
    beyond.sort_unstable();
    let n = arrivals.len().max(1);
    let candidate = |d: Micros| {
        let corrections = need.len() - need.partition_point(|&x| x < d);
        Candidate {
            delay_s: d as f64 / SEC as f64,
            corrections,
            correction_fraction: corrections as f64 / n as f64,
            beyond_lookback: beyond.len() - beyond.partition_point(|&x| x <= d),
        }
    };
    // The smallest whole second d with corrections(d) / n ≤ target: corrections(d) counts
    // need ≥ d, so allow the `allowed` largest needs to stay above d.
    let allowed = (opts.target * n as f64).floor() as usize;
    let suggested = if need.len() <= allowed {
        0
    } else {
        let k = need[need.len() - allowed - 1]; // must exceed this need
        (k / SEC + 1) * SEC
    };
    let mut delays: Vec<Micros> = [0, 10, 30, 60, 120, 300, 600, 1800, 3600]
        .iter()
        .map(|s| s * SEC)
        .collect();
    delays.push(suggested);
    delays.extend(opts.delays.iter().copied().filter(|d| *d >= 0));
    delays.sort_unstable();
    delays.dedup();
    LagReport {
        source: source.to_string(),
        overall: quantiles(lateness.clone()),
        partitions: partition_names
            .iter()
            .cloned()
            .zip(per.into_iter().map(quantiles))
            .collect(),
        target: opts.target,
        window_s: opts.window as f64 / SEC as f64,
        lookback_s: opts.lookback as f64 / SEC as f64,
        suggested_delay_s: suggested as f64 / SEC as f64,
        candidates: delays.into_iter().map(candidate).collect(),
        lateness_s: lateness.iter().map(|l| *l as f64 / SEC as f64).collect(),
    }
}

/// Why `kestrel lag` cannot report.
#[derive(Debug, thiserror::Error)]
pub enum LagError {
    #[error("{0} has no bronze table yet: run `kestrel run` first")]
    NoBronze(String),
    #[error("no events of {name} in bronze{since}")]
    NoEvents { name: String, since: &'static str },
    #[error("{what}: {column} is not {expected}")]
    Column {
        what: String,
        column: &'static str,
        expected: &'static str,
    },
    /// No TrueType font for `--png` (the message lists the files tried).
    #[error("{0}")]
    NoFont(String),
    #[error("drawing {path}: {reason}")]
    Draw { path: String, reason: String },
}

/// Read the arrivals of `opts.source` from bronze and analyse them.
pub async fn run(wh: &Warehouse, opts: &LagOptions) -> Result<LagReport> {
    let a = read_arrivals(wh, opts).await?;
    Ok(analyse(&opts.source, &a.partitions, a.arrivals, opts))
}

/// A source's arrivals, as read from bronze.
#[derive(Debug, Clone)]
pub struct Arrivals {
    /// Partition names; [`Arrival::partition`] indexes them.
    pub partitions: Vec<String>,
    pub arrivals: Vec<Arrival>,
}

/// Read the arrivals of `opts.source` (landed since `opts.since`) from bronze.
pub async fn read_arrivals(wh: &Warehouse, opts: &LagOptions) -> Result<Arrivals> {
    let path = crate::names::table::bronze(&opts.source);
    let Some(table) = wh.open(&path).await? else {
        return Err(LagError::NoBronze(opts.source.clone()).into());
    };
    let ctx = delta::session_with(&table, "bronze").await?;
    let what = format!("read arrivals of {path}");
    let mut df = ctx
        .table("bronze")
        .await
        .map_err(|e| Error::query(&what, e))?
        .select(vec![
            col("_source_partition"),
            col("event_ts"),
            col("_landed_at"),
        ])
        .map_err(|e| Error::query(&what, e))?;
    if let Some(since) = opts.since {
        df = df
            .filter(col("_landed_at").gt_eq(ts_lit(since)))
            .map_err(|e| Error::query(&what, e))?;
    }
    let batches = df.collect().await.map_err(|e| Error::query(&what, e))?;
    let mut names: Vec<String> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut arrivals = Vec::new();
    for b in &batches {
        let part = arrow::compute::cast(b.column(0), &arrow::datatypes::DataType::Utf8)
            .map_err(|e| Error::query(&what, e.into()))?;
        let part = part
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or_else(|| LagError::Column {
                what: what.clone(),
                column: "_source_partition",
                expected: "text",
            })?;
        let ev = crate::columns::ts(b, "event_ts")?;
        let landed = b
            .column(2)
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .ok_or_else(|| LagError::Column {
                what: what.clone(),
                column: "_landed_at",
                expected: "a timestamp",
            })?;
        for i in 0..b.num_rows() {
            if ev.is_null(i) || landed.is_null(i) {
                continue;
            }
            let p = if part.is_null(i) { "" } else { part.value(i) };
            let idx = match index.get(p) {
                Some(i) => *i,
                None => {
                    names.push(p.to_string());
                    index.insert(p.to_string(), names.len() - 1);
                    names.len() - 1
                }
            };
            arrivals.push(Arrival {
                partition: idx,
                event_ts: ev.value(i),
                landed_at: landed.value(i),
            });
        }
    }
    if arrivals.is_empty() {
        return Err(LagError::NoEvents {
            name: opts.source.clone(),
            since: if opts.since.is_some() {
                " since --since"
            } else {
                ""
            },
        }
        .into());
    }
    Ok(Arrivals {
        partitions: names,
        arrivals,
    })
}

/// Font files tried for the chart's text (`KESTREL_FONT` first).
const FONTS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

fn register_font() -> Result<()> {
    use plotters::style::FontStyle;
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let mut tried = Vec::new();
        let env = std::env::var("KESTREL_FONT").ok();
        for p in env.iter().map(String::as_str).chain(FONTS) {
            tried.push(p.to_string());
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(format!(
            "--png needs a TrueType font: none of {} (set KESTREL_FONT, or install fonts-dejavu-core)",
            tried.join(", ")
        ))
    })
    .clone()
    .map_err(|e| LagError::NoFont(e).into())
}

/// Draw the lateness histogram (both axes log scale) with the percentiles and the
/// suggested delay marked, as a PNG at `path`.
pub fn draw_png(r: &LagReport, path: &std::path::Path) -> Result<()> {
    use plotters::prelude::*;
    register_font()?;
    let err = |reason: String| {
        Error::from(LagError::Draw {
            path: path.display().to_string(),
            reason,
        })
    };
    // Bins: 10 per decade from 0.1 s; earlier arrivals (and negative lateness, clock
    // skew) go to the first bin.
    let lo = 0.1f64;
    let max = r.overall.max_s.max(lo * 10.0);
    let decades = (max / lo).log10().ceil().max(1.0) as usize;
    let nbins = decades * 10;
    let mut counts = vec![0u64; nbins];
    for l in &r.lateness_s {
        let i = if *l <= lo {
            0
        } else {
            (((l / lo).log10() * 10.0).floor() as usize).min(nbins - 1)
        };
        counts[i] += 1;
    }
    let edge = |i: usize| lo * 10f64.powf(i as f64 / 10.0);
    let hi = edge(nbins);
    let ymax = counts.iter().copied().max().unwrap_or(1).max(1) as f64 * 3.0;
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let caption = format!(
        "{}: lateness (landed − event time) of {} events; suggested watermark_delay {} s",
        r.source, r.overall.events, r.suggested_delay_s
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), (0.8f64..ymax).log_scale())
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("lateness, seconds (log scale)")
        .y_desc("events (log scale)")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    chart
        .draw_series(
            counts
                .iter()
                .enumerate()
                .filter(|(_, c)| **c > 0)
                .map(|(i, c)| {
                    Rectangle::new(
                        [(edge(i), 0.8), (edge(i + 1), *c as f64)],
                        BLUE.mix(0.5).filled(),
                    )
                }),
        )
        .map_err(|e| err(e.to_string()))?;
    let q = &r.overall;
    let marks = [
        ("p50", q.p50_s, GREEN),
        ("p90", q.p90_s, CYAN),
        ("p99", q.p99_s, MAGENTA),
        ("p99.9", q.p999_s, RED),
        ("max", q.max_s, BLACK),
        (
            "suggested delay",
            r.suggested_delay_s,
            RGBColor(255, 140, 0),
        ),
    ];
    for (label, v, color) in marks {
        let x = v.clamp(lo, hi);
        chart
            .draw_series(LineSeries::new(
                vec![(x, 0.8), (x, ymax)],
                color.stroke_width(2),
            ))
            .map_err(|e| err(e.to_string()))?
            .label(format!("{label}: {v:.1} s"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_distribution() {
        let v: Vec<Micros> = (1..=1000).map(|s| s * SEC).collect();
        assert_eq!(percentile(&v, 0.5), 500 * SEC);
        assert_eq!(percentile(&v, 0.9), 900 * SEC);
        assert_eq!(percentile(&v, 0.99), 990 * SEC);
        assert_eq!(percentile(&v, 0.999), 999 * SEC);
        assert_eq!(percentile(&v, 1.0), 1000 * SEC);
    }

    #[test]
    fn the_suggestion_replays_arrivals_against_windows() {
        // One event per second of event time landing 1 s later, plus one event landing
        // 100 s late: with 1-minute windows only the straggler can be a correction.
        let mut a: Vec<Arrival> = (0..600)
            .map(|s| Arrival {
                partition: 0,
                event_ts: s * SEC,
                landed_at: (s + 1) * SEC,
            })
            .collect();
        a.push(Arrival {
            partition: 0,
            event_ts: 10 * SEC,
            landed_at: 110 * SEC + 500_000,
        });
        let opts = LagOptions {
            source: "s".into(),
            since: None,
            target: 0.0,
            window: 60 * SEC,
            lookback: 30 * SEC,
            delays: vec![45 * SEC],
        };
        let r = analyse("s", &["".into()], a, &opts);
        // W0 before the straggler = 109 s (the newest event landed before 110.5 s); its
        // window ends at 60 s: any delay ≤ 49 s makes it a correction, so 50 s.
        assert_eq!(r.suggested_delay_s, 50.0);
        let c = |d: f64| {
            r.candidates
                .iter()
                .find(|c| c.delay_s == d)
                .unwrap()
                .clone()
        };
        assert_eq!(c(30.0).corrections, 1);
        assert_eq!(c(50.0).corrections, 0);
        assert_eq!(c(45.0).corrections, 1, "an extra delay is replayed too");
        // beyond the lookback: 10 < 109 − d − 30 ⇔ d < 69.
        assert_eq!(c(30.0).beyond_lookback, 1);
        assert_eq!(c(120.0).beyond_lookback, 0);
        assert_eq!(r.overall.events, 601);
        assert_eq!(r.overall.max_s, 100.5);
        assert_eq!(r.overall.p50_s, 1.0);
    }
}
