//! `kestrel demo`: realistic events for the four event sources, and the `customers`
//! change stream, in a local landing zone.
//!
//! Event times span the last `hours` up to now. Each event gets an arrival time with
//! heavy-tailed lateness (p50 ≈ 0.4 s, p99 ≈ 4 s, p99.9 ≈ 28 s, max ≈ 16 min); events are
//! grouped into one file per source partition and arrival minute, whose modification time
//! is set to the minute's end (the file's arrival time). Some events are delivered twice
//! and a few lines are malformed, as in real feeds. Files are written under a temporary
//! `_` name and renamed, which is how the landing contract asks writers to land files.
//!
//! The `customers` stream is what a Debezium connector emits for an operational table:
//! a snapshot (`r`) of the rows at the start, then inserts, updates and deletes (and a
//! deleted customer coming back) in log order; a few changes reach the landing zone
//! minutes after later ones, and a few are delivered twice. It is drawn from its own
//! random stream, so the event sources' files are the same with or without it.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::error::{Error, Result};

/// Demo options.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Hours of event time to generate, ending now.
    pub hours: f64,
    /// Multiplies every event rate.
    pub scale: f64,
    /// RNG seed (same seed + same end time = same files).
    pub seed: u64,
    /// End of the generated period (default: now).
    pub end: Option<DateTime<Utc>>,
    /// Fraction of files written gzip-compressed.
    pub gzip_fraction: f64,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            hours: 1.0,
            scale: 1.0,
            seed: 42,
            end: None,
            gzip_fraction: 0.1,
        }
    }
}

/// What the demo wrote.
#[derive(Debug, Default, Clone)]
pub struct DemoReport {
    /// Per source: (files, lines).
    pub per_source: BTreeMap<String, (usize, usize)>,
    pub duplicates: usize,
    pub malformed: usize,
}

/// Lateness quantiles (fraction, seconds); log-linear between points.
const LATENESS: [(f64, f64); 6] = [
    (0.0, 0.02),
    (0.5, 0.4),
    (0.9, 1.6),
    (0.99, 4.0),
    (0.999, 28.0),
    (1.0, 960.0),
];

/// Sample an arrival delay in microseconds from the heavy-tailed lateness distribution.
pub fn sample_lateness_us(rng: &mut impl Rng) -> i64 {
    let u: f64 = rng.gen();
    let mut secs = LATENESS[LATENESS.len() - 1].1;
    for w in LATENESS.windows(2) {
        let ((u0, s0), (u1, s1)) = (w[0], w[1]);
        if u <= u1 {
            let t = (u - u0) / (u1 - u0);
            secs = (s0.ln() + t * (s1.ln() - s0.ln())).exp();
            break;
        }
    }
    (secs * 1e6) as i64
}

/// (source, partition, arrival minute) of a landed file.
type FileKey = (&'static str, u32, i64);

struct Ev {
    source: &'static str,
    partition: u32,
    ts_us: i64,
    body: serde_json::Value,
}

struct Gen {
    rng: StdRng,
    start: i64,
    end: i64,
    events: Vec<Ev>,
    prices: Vec<i64>,
    next_id: u64,
}

const SKUS: usize = 200;
const US: i64 = 1_000_000;

fn rfc3339(us: i64) -> String {
    DateTime::from_timestamp_micros(us)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl Gen {
    fn id(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        let r: u32 = self.rng.gen();
        format!("{prefix}-{:08x}{r:08x}", self.next_id)
    }

    fn sku(&mut self) -> usize {
        // Zipf-like popularity: low indexes are popular.
        let u: f64 = self.rng.gen();
        ((u * u * u) * SKUS as f64) as usize % SKUS
    }

    fn push(
        &mut self,
        source: &'static str,
        partitions: u32,
        ts_us: i64,
        mut body: serde_json::Value,
    ) {
        if ts_us < self.start || ts_us >= self.end {
            return;
        }
        let id = self.id(&source[..3]);
        let obj = body.as_object_mut();
        if let Some(o) = obj {
            o.insert("event_id".into(), json!(id));
            // Mix the two accepted timestamp forms.
            if self.rng.gen_bool(0.1) {
                o.insert("event_ts".into(), json!(ts_us / 1000));
            } else {
                o.insert("event_ts".into(), json!(rfc3339(ts_us)));
            }
        }
        let partition = self.rng.gen_range(0..partitions);
        self.events.push(Ev {
            source,
            partition,
            ts_us,
            body,
        });
    }

    fn exp(&mut self, mean_s: f64) -> i64 {
        let u: f64 = self.rng.gen_range(f64::EPSILON..1.0);
        (-u.ln() * mean_s * 1e6) as i64
    }

    fn clickstream(&mut self, rate: f64) {
        let mut t = self.start;
        let pages = ["/", "/search", "/cart", "/checkout", "/account"];
        while t < self.end {
            t += self.exp(1.0 / rate);
            let anon = self.id("anon");
            let mut et = t;
            let n = self.rng.gen_range(1..16);
            for _ in 0..n {
                let r: f64 = self.rng.gen();
                let sku = self.sku();
                let (kind, sku, page) = if r < 0.6 {
                    (
                        "page_view",
                        Some(format!("SKU-{sku:04}")),
                        format!("/p/SKU-{sku:04}"),
                    )
                } else if r < 0.7 {
                    (
                        "page_view",
                        None,
                        pages[self.rng.gen_range(0..pages.len())].to_string(),
                    )
                } else if r < 0.8 {
                    ("search", None, "/search".to_string())
                } else if r < 0.95 {
                    (
                        "add_to_cart",
                        Some(format!("SKU-{sku:04}")),
                        format!("/p/SKU-{sku:04}"),
                    )
                } else {
                    ("checkout", None, "/checkout".to_string())
                };
                let mut body = json!({"anonymous_id": anon, "event_type": kind, "page": page});
                if let Some(s) = sku {
                    body["sku"] = json!(s);
                }
                self.push("clickstream", 4, et, body);
                // mostly short gaps; sometimes a pause long enough to start a new session
                et += if self.rng.gen_bool(0.03) {
                    self.exp(2400.0)
                } else {
                    self.exp(40.0)
                };
            }
        }
    }

    fn commerce(&mut self, order_rate: f64) {
        // initial stock counts
        let mut on_hand = vec![0i64; SKUS];
        for (s, oh) in on_hand.iter_mut().enumerate() {
            *oh = if s % 17 == 0 {
                3
            } else {
                self.rng.gen_range(20..200)
            };
            let wh = format!("WH-{}", s % 3 + 1);
            let start = self.start;
            self.push("inventory", 2, start, json!({"sku": format!("SKU-{s:04}"), "warehouse_id": wh, "kind": "count", "quantity": *oh}));
        }
        let mut t = self.start;
        while t < self.end {
            t += self.exp(1.0 / order_rate);
            let order_id = self.id("ord");
            let lines = self.rng.gen_range(1..4);
            let mut total = 0;
            for l in 0..lines {
                let s = self.sku();
                let qty = self.rng.gen_range(1..4i64);
                let amount = qty * self.prices[s];
                total += amount;
                let ts = t + l as i64 * self.rng.gen_range(0..3 * US);
                self.push("orders", 2, ts, json!({"order_id": order_id, "sku": format!("SKU-{s:04}"), "quantity": qty, "amount_cents": amount}));
                let sale_ts = ts + self.rng.gen_range(0..5 * US);
                on_hand[s] -= qty;
                self.push("inventory", 2, sale_ts, json!({"sku": format!("SKU-{s:04}"), "warehouse_id": format!("WH-{}", s % 3 + 1), "kind": "sale", "quantity": -qty}));
                if on_hand[s] <= 0 && self.rng.gen_bool(0.5) {
                    // restock a while later
                    let rts = sale_ts + self.exp(600.0);
                    let q = self.rng.gen_range(20..100);
                    on_hand[s] += q;
                    self.push("inventory", 2, rts, json!({"sku": format!("SKU-{s:04}"), "warehouse_id": format!("WH-{}", s % 3 + 1), "kind": "receipt", "quantity": q}));
                }
            }
            self.payments(&order_id, t, total);
            if self.rng.gen_bool(0.02) {
                let s = self.sku();
                let adj = -self.rng.gen_range(1..3);
                on_hand[s] += adj;
                let ts = t + self.exp(30.0);
                self.push("inventory", 2, ts, json!({"sku": format!("SKU-{s:04}"), "warehouse_id": format!("WH-{}", s % 3 + 1), "kind": "adjustment", "quantity": adj}));
            }
        }
    }

    fn payments(&mut self, order_id: &str, order_ts: i64, total: i64) {
        let r: f64 = self.rng.gen();
        let pay = |g: &mut Gen, ts: i64, amount: i64, status: &str| {
            let pid = g.id("pay");
            g.push("payments", 2, ts, json!({"payment_id": pid, "order_id": order_id, "amount_cents": amount, "status": status}));
        };
        let auth = order_ts + self.rng.gen_range(US..20 * US);
        if r < 0.02 {
            // never paid
            return;
        }
        pay(self, auth, total, "authorized");
        if r < 0.05 {
            // failed, retried later
            pay(self, auth + 5 * US, total, "failed");
            let retry = auth + self.exp(900.0);
            pay(self, retry, total, "captured");
        } else if r < 0.06 {
            // captured amount differs (mismatch)
            let cap = auth + self.exp(60.0);
            pay(self, cap, total - 100, "captured");
        } else {
            let cap = auth + self.exp(60.0);
            pay(self, cap, total, "captured");
            if r > 0.98 {
                let refund = cap + self.exp(1200.0);
                pay(self, refund, total, "refunded");
            }
        }
        if self.rng.gen_bool(0.005) {
            // orphan payment for an order that never shows up
            let ghost = self.id("ord");
            let pid = self.id("pay");
            self.push("payments", 2, order_ts, json!({"payment_id": pid, "order_id": ghost, "amount_cents": 999, "status": "captured"}));
        }
    }
}

/// The `customers` change stream over `[start, end)`: a snapshot of 30 rows, then
/// about `rate` changes a second (inserts, updates, deletes, re-inserts), each with the
/// next log position; a few are held back minutes before their usual arrival delay, so
/// they land after later changes.
fn customer_changes(rng: &mut StdRng, start: i64, end: i64, rate: f64) -> Vec<Ev> {
    #[derive(Clone)]
    struct Row {
        id: String,
        email: String,
        name: String,
        tier: Option<&'static str>,
        credit: i64,
        alive: bool,
    }
    let tiers = [None, Some("silver"), Some("gold"), Some("platinum")];
    let names = [
        "Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken",
    ];
    let mut rows: Vec<Row> = Vec::new();
    let mut out = Vec::new();
    let mut lsn: i64 = 10_000;
    let row_json = |r: &Row, ts: i64| {
        json!({"customer_id": r.id, "email": r.email, "name": r.name, "tier": r.tier,
               "credit_cents": r.credit, "updated_at": rfc3339(ts)})
    };
    let mut emit =
        |rng: &mut StdRng, op: &str, before: Option<&Row>, after: Option<&Row>, ts: i64| {
            lsn += rng.gen_range(1..40);
            let body = json!({
                "op": op,
                "ts_ms": ts / 1000,
                "before": before.map(|r| row_json(r, ts)),
                "after": after.map(|r| row_json(r, ts)),
                "source": {"lsn": lsn, "db": "shop", "table": "customers"},
            });
            // A few changes are held back by the connector and land minutes later.
            let held = if rng.gen_bool(0.03) {
                rng.gen_range(120 * US..600 * US)
            } else {
                0
            };
            out.push((ts, held, body));
        };
    let new_row = |rng: &mut StdRng, n: usize| Row {
        id: format!("C-{n:05}"),
        email: format!("c{n}@example.com"),
        name: names[rng.gen_range(0..names.len())].to_string(),
        tier: tiers[rng.gen_range(0..tiers.len())],
        credit: rng.gen_range(0..50_000),
        alive: true,
    };
    for i in 0..30 {
        let r = new_row(rng, i);
        emit(rng, "r", None, Some(&r), start + i as i64 * 1000);
        rows.push(r);
    }
    let mut t = start + 60 * US;
    while rate > 0.0 && t < end {
        let u: f64 = rng.gen_range(f64::EPSILON..1.0);
        t += (-u.ln() / rate * 1e6) as i64;
        if t >= end {
            break;
        }
        let r: f64 = rng.gen();
        let alive: Vec<usize> = (0..rows.len()).filter(|i| rows[*i].alive).collect();
        let dead: Vec<usize> = (0..rows.len()).filter(|i| !rows[*i].alive).collect();
        if r < 0.15 || alive.is_empty() {
            let n = rows.len();
            let row = new_row(rng, n);
            emit(rng, "c", None, Some(&row), t);
            rows.push(row);
        } else if r < 0.85 {
            let i = alive[rng.gen_range(0..alive.len())];
            let before = rows[i].clone();
            let row = &mut rows[i];
            match rng.gen_range(0..3) {
                0 => row.tier = tiers[rng.gen_range(0..tiers.len())],
                1 => row.credit = (row.credit + rng.gen_range(-5_000..5_000)).max(0),
                _ => {
                    row.email = format!(
                        "{}+{}@example.com",
                        row.id.to_lowercase(),
                        rng.gen_range(1..100)
                    )
                }
            }
            let after = rows[i].clone();
            emit(rng, "u", Some(&before), Some(&after), t);
        } else if r < 0.95 || dead.is_empty() {
            let i = alive[rng.gen_range(0..alive.len())];
            rows[i].alive = false;
            let before = rows[i].clone();
            emit(rng, "d", Some(&before), None, t);
        } else {
            let i = dead[rng.gen_range(0..dead.len())];
            rows[i].alive = true;
            rows[i].credit = 0;
            let after = rows[i].clone();
            emit(rng, "c", None, Some(&after), t);
        }
    }
    out.into_iter()
        .filter(|(ts, _, _)| *ts >= start && *ts < end)
        .map(|(ts, held, body)| Ev {
            source: "customers",
            partition: 0,
            ts_us: ts + held,
            body,
        })
        .collect()
}

/// Generate the demo landing zone under `landing` (a local directory).
pub fn generate(landing: &Path, opts: &DemoOptions) -> Result<DemoReport> {
    let end_dt = opts.end.unwrap_or_else(Utc::now);
    // Files arrive per whole minute; nothing arrives after the last whole minute.
    let end = end_dt.timestamp_micros() / (60 * US) * (60 * US);
    let start = end - (opts.hours * 3600.0 * 1e6) as i64;
    let mut g = Gen {
        rng: StdRng::seed_from_u64(opts.seed),
        start,
        end,
        events: Vec::new(),
        prices: Vec::new(),
        next_id: 0,
    };
    g.prices = (0..SKUS).map(|_| g.rng.gen_range(199..20_000)).collect();
    g.clickstream(2.0 * opts.scale);
    g.commerce(0.3 * opts.scale);
    let mut crng = StdRng::seed_from_u64(opts.seed ^ 0xC0DE_C0DE);
    g.events
        .extend(customer_changes(&mut crng, start, end, 0.05 * opts.scale));

    // arrival times, duplicates, malformed lines
    let mut report = DemoReport::default();
    // (source, partition, minute) -> lines with arrival
    let mut files: BTreeMap<FileKey, Vec<(i64, String)>> = BTreeMap::new();
    let events = std::mem::take(&mut g.events);
    for ev in &events {
        let arrival = ev.ts_us + sample_lateness_us(&mut g.rng);
        let line = ev.body.to_string();
        let mut deliveries = vec![arrival];
        let redelivery = if ev.source == "customers" {
            0.03
        } else {
            0.003
        };
        if g.rng.gen_bool(redelivery) {
            deliveries.push(arrival + g.rng.gen_range(0..120 * US));
            report.duplicates += 1;
        }
        for a in deliveries {
            if a >= end {
                continue;
            }
            let minute = a / (60 * US);
            files
                .entry((ev.source, ev.partition, minute))
                .or_default()
                .push((a, line.clone()));
        }
    }
    let bad_lines = [
        r#"{"event_id": "broken", "event_ts": "2026-"#.to_string(),
        r#"{"event_id":"bad-type","event_ts":"2026-01-01T00:00:00Z","quantity":"3"}"#.to_string(),
        r#"{"event_id":"bad-enum","event_ts":"2026-01-01T00:00:00Z","status":"pending","kind":"theft"}"#.to_string(),
    ];
    let bad_change = r#"{"op":"x","ts_ms":1764000000000,"before":null,"after":{"customer_id":"C-bad"},"source":{"lsn":"7"}}"#;
    let keys: Vec<_> = files.keys().copied().collect();
    if let Some(k) = keys.iter().find(|k| k.0 == "customers") {
        if let Some(v) = files.get_mut(k) {
            let a = v.first().map(|x| x.0).unwrap_or(k.2 * 60 * US);
            v.push((a, bad_change.to_string()));
            report.malformed += 1;
        }
    }
    for (i, bad) in bad_lines.iter().enumerate() {
        for src in ["clickstream", "orders", "payments", "inventory"] {
            let candidates: Vec<_> = keys.iter().filter(|k| k.0 == src).collect();
            if candidates.is_empty() {
                continue;
            }
            let k = candidates[(i * 7919 + src.len() * 104_729) % candidates.len()];
            if let Some(v) = files.get_mut(k) {
                let a = v.first().map(|x| x.0).unwrap_or(k.2 * 60 * US);
                v.push((a, bad.clone()));
                report.malformed += 1;
            }
        }
    }

    for ((source, partition, minute), mut lines) in files {
        lines.sort_by_key(|l| l.0);
        let landed = (minute + 1) * 60 * US;
        let stamp = DateTime::from_timestamp_micros(minute * 60 * US)
            .unwrap_or_default()
            .format("%Y%m%dT%H%M%SZ");
        let gz = if source == "customers" {
            crng.gen_bool(opts.gzip_fraction)
        } else {
            g.rng.gen_bool(opts.gzip_fraction)
        };
        let dir = landing.join(source).join(format!("partition={partition}"));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(dir.display().to_string(), e))?;
        let name = format!(
            "{stamp}-{source}.{}",
            if gz { "ndjson.gz" } else { "ndjson" }
        );
        let tmp = dir.join(format!("_{name}.tmp"));
        let mut text = String::new();
        for (_, l) in &lines {
            text.push_str(l);
            text.push('\n');
        }
        let bytes = if gz {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            enc.write_all(text.as_bytes())
                .map_err(|e| Error::io(tmp.display().to_string(), e))?;
            enc.finish()
                .map_err(|e| Error::io(tmp.display().to_string(), e))?
        } else {
            text.into_bytes()
        };
        std::fs::write(&tmp, bytes).map_err(|e| Error::io(tmp.display().to_string(), e))?;
        let ft = filetime::FileTime::from_unix_time(landed / US, ((landed % US) * 1000) as u32);
        filetime::set_file_mtime(&tmp, ft).map_err(|e| Error::io(tmp.display().to_string(), e))?;
        let dest: PathBuf = dir.join(&name);
        std::fs::rename(&tmp, &dest).map_err(|e| Error::io(dest.display().to_string(), e))?;
        let e = report.per_source.entry(source.to_string()).or_default();
        e.0 += 1;
        e.1 += lines.len();
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lateness_distribution_has_the_documented_shape() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut v: Vec<i64> = (0..200_000).map(|_| sample_lateness_us(&mut rng)).collect();
        v.sort();
        let q = |p: f64| v[((v.len() as f64 - 1.0) * p) as usize] as f64 / 1e6;
        assert!((0.35..0.45).contains(&q(0.5)), "p50 {}", q(0.5));
        assert!((3.5..4.5).contains(&q(0.99)), "p99 {}", q(0.99));
        assert!((20.0..36.0).contains(&q(0.999)), "p99.9 {}", q(0.999));
        assert!(q(1.0) <= 960.0 && q(1.0) > 300.0, "max {}", q(1.0));
    }
}
