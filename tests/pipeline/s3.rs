//! Ingestion against a real S3-protocol server (moto, started by the test): landing and
//! warehouse both on `s3://`, exactly-once reruns, and an independent reader.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kestrel::sink::delta::{self, Warehouse};
use kestrel::storage::Location;

use crate::common::*;
use crate::ingest::fixture_files;

pub(crate) struct Moto {
    child: Child,
    pub(crate) endpoint: String,
    /// moto's request log (werkzeug writes one line per request to stderr).
    log: tempfile::NamedTempFile,
}

impl Moto {
    /// The request log so far: `… "PUT /bucket/key HTTP/1.1" 412 -` per request.
    pub(crate) fn requests(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start moto on a free loopback port; None (with a message) outside CI when the Python
/// with moto that `.ci/run` installs is not available.
pub(crate) fn start_moto() -> Option<Moto> {
    let python = match std::env::var("KESTREL_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must set KESTREL_PYTHON (see .ci/run)"
            );
            eprintln!("KESTREL_PYTHON not set: skipping the S3 test");
            return None;
        }
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = tempfile::NamedTempFile::new().unwrap();
    let child = Command::new(&python)
        .args([
            "-m",
            "moto.server",
            "-H",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("start moto (pip install 'moto[s3]' flask flask-cors)");
    let moto = Moto {
        child,
        endpoint: format!("http://127.0.0.1:{port}"),
        log,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "moto did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let script = format!(
        "import boto3\ns3 = boto3.client('s3', endpoint_url='{}', aws_access_key_id='test', aws_secret_access_key='test', region_name='us-east-1')\nfor b in ('landing', 'lake'):\n    s3.create_bucket(Bucket=b)\n",
        moto.endpoint
    );
    run_python(&python, &script);
    Some(moto)
}

/// Run a Python snippet; its stdout.
pub(crate) fn run_python(python: &str, script: &str) -> String {
    let out = Command::new(python).args(["-c", script]).output().unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

pub(crate) fn options(endpoint: &str) -> BTreeMap<String, String> {
    [
        ("aws_endpoint", endpoint),
        ("aws_access_key_id", "test"),
        ("aws_secret_access_key", "test"),
        ("aws_region", "us-east-1"),
        ("allow_http", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// The first row of an integer query against a table (registered as `t`) on S3.
async fn first_row(wh: &Warehouse, table: &str, sql: &str) -> Vec<i64> {
    let t = wh
        .open(table)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{table} on s3"));
    let ctx = delta::session_with(&t, "t").await.unwrap();
    let rows = delta::sql(&ctx, sql).await.unwrap();
    (0..rows[0].num_columns())
        .map(|i| kestrel::columns::int64_at(&rows[0], i).unwrap().value(0))
        .collect()
}

#[test]
fn ingest_from_s3_landing_into_s3_warehouse_exactly_once() {
    let Some(moto) = start_moto() else { return };
    let opts = options(&moto.endpoint);
    let mut storage = String::from("[storage]\n");
    for (k, v) in &opts {
        storage.push_str(&format!("{k} = \"{v}\"\n"));
    }
    let env = Env::with_config(&storage);
    let cfg =
        format!("landing = \"s3://landing/zone\"\nwarehouse = \"s3://lake/warehouse\"\n{storage}");
    std::fs::write(env.path().join("kestrel.toml"), cfg).unwrap();

    let rt = rt();
    rt.block_on(async {
        let landing = Location::open("s3://landing/zone", &opts, false).unwrap();
        for (name, body, _) in fixture_files() {
            landing.put(&name, body).await.unwrap();
        }
        // an upload in progress is ignored there too
        landing
            .put("orders/_partial.ndjson", b"{".to_vec())
            .await
            .unwrap();
    });
    let out = env.run_ok(&["run", "--source", "orders"], 0);
    assert!(out.contains("orders"), "{out}");
    let out = env.run_ok(&["run", "--source", "orders"], 0);
    assert!(out.contains("nothing new landed"), "{out}");

    let wh = Warehouse::new(Location::open("s3://lake/warehouse", &opts, false).unwrap());
    let (bronze, quarantined, log, gold, jobs, pending) = rt.block_on(async {
        (
            first_row(
                &wh,
                "bronze/orders",
                "SELECT count(*), count(DISTINCT event_id) FROM t",
            )
            .await,
            first_row(&wh, "quarantine/orders", "SELECT count(*) FROM t").await,
            first_row(
                &wh,
                "_kestrel/runs",
                "SELECT sum(files), sum(rows_written), sum(duplicates) FROM t WHERE kind = 'ingest'",
            )
            .await,
            first_row(&wh, "gold/revenue_5m", "SELECT sum(orders) FROM t").await,
            first_row(
                &wh,
                "_kestrel/runs",
                "SELECT count(*) FROM t WHERE kind = 'job'",
            )
            .await,
            first_row(
                &wh,
                "gold/payment_reconciliation",
                "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FROM t",
            )
            .await,
        )
    });
    assert_eq!(bronze, vec![120, 120]);
    assert_eq!(quarantined, vec![6]);
    assert_eq!(log, vec![6, 120, 11]);
    // The windowed jobs over orders ran on S3 too: gold MERGEs through object_store.
    assert_eq!(gold, vec![120], "every order in a revenue_5m window");
    assert_eq!(
        jobs,
        vec![4],
        "revenue_5m, revenue_1h and the two payment jobs, one batch each"
    );
    // Orders without any payments data: no watermark yet, so every order is pending.
    assert_eq!(pending[0], pending[1]);
    assert!(pending[0] > 0, "{pending:?}");

    // an independent reader (delta-rs Python) sees the same table on S3
    let python = std::env::var("KESTREL_PYTHON").unwrap();
    let script = format!(
        "import deltalake\nt = deltalake.DeltaTable('s3://lake/warehouse/bronze/orders', storage_options={{'AWS_ENDPOINT_URL': '{}', 'AWS_ACCESS_KEY_ID': 'test', 'AWS_SECRET_ACCESS_KEY': 'test', 'AWS_REGION': 'us-east-1', 'AWS_ALLOW_HTTP': 'true'}})\nprint(t.to_pyarrow_table().num_rows, flush=True)\n\
         # skip interpreter teardown: delta-rs' S3 client threads can abort it (\"terminate called\")\n\
         import os\nos._exit(0)\n",
        moto.endpoint
    );
    assert_eq!(run_python(&python, &script), "120");
}

/// Names real producers give files: non-ASCII, spaces, `#`, `%`, `[`, `]`. Each file
/// ingests (its valid rows to bronze, its bad line to quarantine) under its real name in
/// the ledger and the quarantine, on local disk and on S3; a rerun changes nothing.
#[test]
fn files_with_hostile_names_ingest_on_local_disk_and_s3() {
    const NAMES: [&str; 3] = [
        "orders/café ☕ 注文.ndjson",
        "orders/w1 #7 [v2] 100%.ndjson",
        "orders/partition=eu west/50%25 off?.ndjson",
    ];
    let file = |k: i64| {
        let mut ls: Vec<String> = (0..3)
            .map(|i| order(&format!("h{k}-{i}"), T0 + k * 60 + i, "ord", "A", 1, 100))
            .collect();
        ls.push("{\"event_id\": 1}".to_string());
        lines(&ls)
    };
    let check = |env: &Env, wh: &Warehouse| {
        let rt = rt();
        let (bronze, files, quarantined) = rt.block_on(async {
            let q = |table: &'static str, sql: &'static str| async move {
                let t = wh.open(table).await.unwrap().expect(table);
                let ctx = kestrel::sink::delta::session_with(&t, "t").await.unwrap();
                let b = kestrel::sink::delta::sql(&ctx, sql).await.unwrap();
                let mut out = Vec::new();
                for b in &b {
                    let c = arrow::compute::cast(b.column(0), &arrow::datatypes::DataType::Utf8)
                        .unwrap();
                    let c = c
                        .as_any()
                        .downcast_ref::<arrow::array::StringArray>()
                        .unwrap();
                    out.extend(c.iter().map(|v| v.unwrap_or("∅").to_string()));
                }
                out.sort();
                out
            };
            (
                q("bronze/orders", "SELECT _source_file FROM t").await,
                q("_kestrel/ledger", "SELECT path || ' ' || status FROM t").await,
                q("quarantine/orders", "SELECT source_file FROM t").await,
            )
        });
        let mut names: Vec<String> = NAMES.iter().map(|n| n.to_string()).collect();
        names.sort();
        let thrice: Vec<String> = names
            .iter()
            .flat_map(|n| [n.clone(), n.clone(), n.clone()])
            .collect();
        assert_eq!(
            bronze, thrice,
            "every valid row, under its file's real name"
        );
        assert_eq!(
            quarantined, names,
            "each file's bad line, under its real name"
        );
        assert_eq!(files.len(), 3, "{files:?}");
        for (f, n) in files.iter().zip(&names) {
            assert!(f.starts_with(n.as_str()) && !f.contains("rejected"), "{f}");
        }
        let out = env.run_ok(&["run", "--source", "orders"], 0);
        assert!(out.contains("nothing new landed"), "{out}");
    };

    // Local disk.
    let env = Env::new();
    for (k, n) in NAMES.iter().enumerate() {
        env.land(n, &file(k as i64), T0 + 300);
    }
    env.run_ok(&["run", "--source", "orders"], 0);
    check(&env, &env.wh());

    // S3.
    let Some(moto) = start_moto() else { return };
    let opts = options(&moto.endpoint);
    let mut storage = String::from("[storage]\n");
    for (k, v) in &opts {
        storage.push_str(&format!("{k} = \"{v}\"\n"));
    }
    let env = Env::with_config(&storage);
    let cfg =
        format!("landing = \"s3://landing/hostile\"\nwarehouse = \"s3://lake/hostile\"\n{storage}");
    std::fs::write(env.path().join("kestrel.toml"), cfg).unwrap();
    let landing = Location::open("s3://landing/hostile", &opts, false).unwrap();
    rt().block_on(async {
        for (k, n) in NAMES.iter().enumerate() {
            landing.put(n, file(k as i64)).await.unwrap();
        }
    });
    env.run_ok(&["run", "--source", "orders"], 0);
    let wh = Warehouse::new(Location::open("s3://lake/hostile", &opts, false).unwrap());
    check(&env, &wh);
}

/// A secret given in the environment appears in no output, log or table: a run at
/// `-vv` (debug logs, object_store's and the HTTP client's included) whose S3 landing
/// fails, and one that succeeds and writes its warehouse.
#[test]
fn the_secret_key_appears_in_no_output_log_or_table() {
    let Some(moto) = start_moto() else { return };
    const SECRET: &str = "kestrel-test-secret-9f2c4e7a1b";
    let env = Env::new();
    let storage = format!(
        "[storage]\naws_endpoint = \"{}\"\naws_region = \"us-east-1\"\nallow_http = \"true\"\n",
        moto.endpoint
    );
    let secrets = [
        ("AWS_ACCESS_KEY_ID", "kestrel-test-key-id"),
        ("AWS_SECRET_ACCESS_KEY", SECRET),
        ("RUST_LOG", "trace"),
    ];
    let mut seen = String::new();
    // A bucket that does not exist: the run fails on S3.
    let cfg =
        format!("landing = \"s3://no-such-bucket/zone\"\nwarehouse = \"warehouse\"\n{storage}");
    std::fs::write(env.path().join("kestrel.toml"), cfg).unwrap();
    let out = env.kestrel_env(&["-vv", "run", "--source", "orders"], &secrets);
    assert_ne!(out.status.code(), Some(0), "the run fails on S3");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(stderr.contains("no-such-bucket"), "{stderr}");
    seen.push_str(&String::from_utf8_lossy(&out.stdout));
    seen.push_str(&stderr);
    // A landing that works: files ingested into the local warehouse, the run log written.
    let opts = options(&moto.endpoint);
    let landing = Location::open("s3://landing/secret", &opts, false).unwrap();
    rt().block_on(async {
        for (name, body, _) in fixture_files() {
            landing.put(&name, body).await.unwrap();
        }
    });
    let cfg = format!("landing = \"s3://landing/secret\"\nwarehouse = \"warehouse\"\n{storage}");
    std::fs::write(env.path().join("kestrel.toml"), cfg).unwrap();
    let out = env.kestrel_env(&["-vv", "run", "--source", "orders"], &secrets);
    seen.push_str(&String::from_utf8_lossy(&out.stdout));
    seen.push_str(&String::from_utf8_lossy(&out.stderr));
    assert!(
        seen.contains("DEBUG") || seen.contains("TRACE"),
        "debug logs were on"
    );
    assert!(!seen.contains(SECRET), "the secret is in the output");
    // Nor in any file of the warehouse (tables, logs, plans, leases).
    let mut stack = vec![env.warehouse()];
    let mut files = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files += 1;
                let bytes = std::fs::read(&p).unwrap();
                let hit = bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes());
                assert!(!hit, "the secret is in {}", p.display());
            }
        }
    }
    assert!(files > 10, "the warehouse was written ({files} files)");
}
