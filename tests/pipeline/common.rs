//! Test harness: a temp landing zone + warehouse, the kestrel binary, landed files with
//! chosen arrival times, and table snapshots read back through delta-rs + DataFusion.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use arrow::util::display::{ArrayFormatter, FormatOptions};
use kestrel::sink::delta::{self, Warehouse};
use kestrel::storage::Location;

pub const BIN: &str = env!("CARGO_BIN_EXE_kestrel");

/// 2025-11-20T12:00:00Z in seconds: the base arrival time of fixtures.
pub const T0: i64 = 1_763_640_000;

pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Self {
        Self::with_config("")
    }

    /// A fresh env; `extra` is appended to kestrel.toml (e.g. an [ingest] table).
    pub fn with_config(extra: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("landing")).unwrap();
        std::fs::write(
            dir.path().join("kestrel.toml"),
            format!("landing = \"landing\"\nwarehouse = \"warehouse\"\n{extra}\n"),
        )
        .unwrap();
        Env { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
    pub fn landing(&self) -> PathBuf {
        self.path().join("landing")
    }
    pub fn warehouse(&self) -> PathBuf {
        self.path().join("warehouse")
    }

    /// Run kestrel with this env's config.
    pub fn kestrel(&self, args: &[&str]) -> Output {
        self.kestrel_env(args, &[])
    }

    pub fn kestrel_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        self.command(args, env).output().expect("run kestrel")
    }

    /// The `kestrel` command on this env's config, with `env` set and the fault and
    /// location variables of the test process removed (to spawn it yourself).
    pub fn command(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--config")
            .arg(self.path().join("kestrel.toml"))
            .args(args);
        c.env_remove("KESTREL_FAULT")
            .env_remove("KESTREL_STORE_FAULTS")
            .env_remove("KESTREL_LANDING")
            .env_remove("KESTREL_WAREHOUSE")
            .env_remove("KESTREL_WINDOWS");
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    /// Run and require exit code `code`.
    pub fn run_ok(&self, args: &[&str], code: i32) -> String {
        let out = self.kestrel(args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(
            out.status.code(),
            Some(code),
            "kestrel {args:?}\nstdout:\n{stdout}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    /// Run, require exit code 1 and a one-line reason on stderr; returns that line.
    pub fn fails_one_line(&self, args: &[&str]) -> String {
        self.fails_with(args, 1)
    }

    /// Run with `KESTREL_FAULT=point` and require the run to be killed there (SIGKILL).
    pub fn killed_at(&self, args: &[&str], point: &str) {
        use std::os::unix::process::ExitStatusExt;
        let out = self.kestrel_env(args, &[("KESTREL_FAULT", point)]);
        assert_eq!(
            out.status.signal(),
            Some(9),
            "kestrel {args:?} at {point}: expected SIGKILL, got {:?}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Run, require exit code `code` and a one-line reason on stderr; returns that line.
    pub fn fails_with(&self, args: &[&str], code: i32) -> String {
        let out = self.kestrel(args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(code), "kestrel {args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    }

    /// Land a file the way the contract asks: temporary `_` name, mtime = arrival, rename.
    pub fn land(&self, rel: &str, content: &[u8], landed_at_s: i64) {
        let dest = self.landing().join(rel);
        let dir = dest.parent().unwrap();
        std::fs::create_dir_all(dir).unwrap();
        let tmp = dir.join(format!("_{}", dest.file_name().unwrap().to_string_lossy()));
        std::fs::write(&tmp, content).unwrap();
        set_mtime(&tmp, landed_at_s);
        std::fs::rename(&tmp, &dest).unwrap();
    }

    pub fn wh(&self) -> Warehouse {
        Warehouse::new(
            Location::open(self.warehouse().to_str().unwrap(), &BTreeMap::new(), true).unwrap(),
        )
    }

    /// Rows of a table as sorted strings, without the named columns; empty if no table.
    pub fn snapshot(&self, table: &str, exclude: &[&str]) -> Vec<String> {
        snapshot_of(&self.wh(), table, exclude)
    }

    /// Each of `tables` holds rows, and the same rows as in `other`'s warehouse, the
    /// `skip` columns aside (processing times, batch ids).
    pub fn assert_same_tables(&self, other: &Env, tables: &[&str], skip: &[&str]) {
        for t in tables {
            let got = self.snapshot(t, skip);
            assert!(!got.is_empty(), "{t}");
            assert_eq!(got, other.snapshot(t, skip), "{t}");
        }
    }

    /// One SQL query against one table (registered as `t`), results as strings.
    pub fn query(&self, table: &str, sql: &str) -> Vec<Vec<String>> {
        rt().block_on(async {
            let t = self.wh().open(table).await.unwrap().expect("table exists");
            let ctx = delta::session_with(&t, "t").await.unwrap();
            let batches = delta::sql(&ctx, sql).await.unwrap();
            let opts = FormatOptions::default().with_null("∅");
            let mut out = Vec::new();
            for b in &batches {
                let fs: Vec<ArrayFormatter> = b
                    .columns()
                    .iter()
                    .map(|c| ArrayFormatter::try_new(c.as_ref(), &opts).unwrap())
                    .collect();
                for i in 0..b.num_rows() {
                    out.push(fs.iter().map(|f| f.value(i).to_string()).collect());
                }
            }
            out
        })
    }

    /// A single integer from a query.
    pub fn count(&self, table: &str, sql: &str) -> i64 {
        self.query(table, sql)[0][0].parse().unwrap()
    }

    /// Current Delta version of a table (None when absent).
    pub fn version(&self, table: &str) -> Option<u64> {
        rt().block_on(async {
            self.wh()
                .open(table)
                .await
                .unwrap()
                .and_then(|t| t.version())
        })
    }
}

/// Rows of a table of `wh` (local or S3) as sorted strings, without the named columns;
/// empty if no table.
pub fn snapshot_of(wh: &Warehouse, table: &str, exclude: &[&str]) -> Vec<String> {
    rt().block_on(async {
        let Some(t) = wh.open(table).await.unwrap() else {
            return Vec::new();
        };
        let ctx = delta::session_with(&t, "t").await.unwrap();
        let batches = delta::sql(&ctx, "SELECT * FROM t").await.unwrap();
        let mut rows = Vec::new();
        let opts = FormatOptions::default().with_null("∅");
        for b in &batches {
            let schema = b.schema();
            let cols: Vec<(String, ArrayFormatter)> = schema
                .fields()
                .iter()
                .zip(b.columns())
                .filter(|(f, _)| !exclude.contains(&f.name().as_str()))
                .map(|(f, c)| {
                    (
                        f.name().clone(),
                        ArrayFormatter::try_new(c.as_ref(), &opts).unwrap(),
                    )
                })
                .collect();
            for i in 0..b.num_rows() {
                let mut s = String::new();
                for (name, f) in &cols {
                    s.push_str(&format!("{name}={}|", f.value(i)));
                }
                rows.push(s);
            }
        }
        rows.sort();
        rows
    })
}

/// Write the shipped job definition `file` (e.g. `revenue_5m.toml`) into `dir` with its
/// `schedule` replaced by `cron`.
pub fn shipped_job_on(dir: &Path, file: &str, cron: &str) {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("jobs")
        .join(file);
    let text: String = std::fs::read_to_string(shipped)
        .unwrap()
        .lines()
        .map(|l| {
            if l.starts_with("schedule") {
                format!("schedule = \"{cron}\"")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(file), text).unwrap();
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

pub fn set_mtime(p: &Path, s: i64) {
    filetime::set_file_mtime(p, filetime::FileTime::from_unix_time(s, 0)).unwrap();
}

pub fn ts(s: i64) -> String {
    chrono::DateTime::from_timestamp(s, 0)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// An order event line.
pub fn order(id: &str, event_s: i64, order_id: &str, sku: &str, qty: i64, amount: i64) -> String {
    format!(
        r#"{{"event_id":"{id}","event_ts":"{}","order_id":"{order_id}","sku":"{sku}","quantity":{qty},"amount_cents":{amount}}}"#,
        ts(event_s)
    )
}

pub fn lines(ls: &[String]) -> Vec<u8> {
    let mut s = ls.join("\n");
    s.push('\n');
    s.into_bytes()
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// The Python with deltalake, polars and duckdb that `.ci/run` installs. In CI it must
/// exist; elsewhere the interop half of the test is skipped with a message.
pub fn python_for_interop() -> Option<String> {
    match std::env::var("KESTREL_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must set KESTREL_PYTHON (see .ci/run)"
            );
            eprintln!("KESTREL_PYTHON not set: skipping the independent-reader half of this test");
            None
        }
    }
}
