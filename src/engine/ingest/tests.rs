use super::*;
use crate::ledger::FileAction;
use crate::schema::EVENT_DATE;
use crate::sink::delta::{self, Warehouse};
use crate::source::discover::{self, LandedFile};
use arrow::array::RecordBatch;
use datafusion::prelude::SessionContext;

fn planned(files: &[LandedFile]) -> Vec<PlannedFile> {
    files
        .iter()
        .map(|f| PlannedFile {
            file: f.clone(),
            action: FileAction::Ingest,
        })
        .collect()
}

fn plan(source: &str, n: i64, files: Vec<PlannedFile>) -> Plan {
    Plan {
        source: source.into(),
        batch_id: n,
        created_at: "2026-12-03T00:00:00Z".into(),
        full_scan: true,
        files,
        cursors_after: Default::default(),
    }
}

/// The rows of `batches` that the local ingestion's dedup keeps against `bronze` in the
/// event `dates`, as its writers copy them: the expectation of the cluster's write tasks.
async fn dedup_in_dates(
    batches: Vec<RecordBatch>,
    bronze: &deltalake::DeltaTable,
    schema: &SourceSchema,
    n: i64,
    dates: &BTreeSet<i32>,
) -> crate::error::Result<Vec<RecordBatch>> {
    let masks =
        crate::runner::ingest::dedup_masks(&batches, bronze, schema, n, dates, None).await?;
    let date_idx = Some(schema.bronze.index_of(EVENT_DATE)?);
    let mut kept = Vec::new();
    for (b, m) in batches.into_iter().zip(masks) {
        kept.extend(delta::kept_rows(b, Some(&m), date_idx)?);
    }
    Ok(kept)
}

/// Bronze's rows of batch `n` as `event_id file line`, sorted.
async fn ids(wh: &Warehouse, n: i64) -> Vec<String> {
    let t = wh.open("bronze/orders").await.unwrap().unwrap();
    let ctx = delta::session_with(&t, "b").await.unwrap();
    let rows = delta::sql(
        &ctx,
        &format!("SELECT concat(event_id, ' ', _source_file, ' ', _source_line) AS k FROM b WHERE _batch_id = {n} ORDER BY k"),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    for b in &rows {
        let c = crate::columns::string_at(b, 0).unwrap();
        out.extend((0..b.num_rows()).map(|i| c.value(i).to_string()));
    }
    out
}

/// The two stages, run by DataFusion in this process, ingest a batch as a local batch
/// does: the same survivors of dedup within the batch (copies in other files, so in
/// other decode tasks) and against bronze (copies of an earlier batch's files), the same
/// counts and file outcomes; their files, once committed, are bronze's rows of the
/// batch. Each planned file is decoded once however many tasks there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stages_ingest_a_batch_as_a_local_batch_does() {
    let dir = tempfile::tempdir().unwrap();
    let land = dir.path().join("landing");
    let end = chrono::DateTime::parse_from_rfc3339("2026-11-20T12:00:00Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let opts = crate::demo::DemoOptions {
        hours: 0.5,
        end: Some(end),
        gzip_fraction: 0.3,
        ..Default::default()
    };
    crate::demo::generate(&land, &opts).unwrap();
    let mut landed: Vec<PathBuf> = walk(&land.join("orders"))
        .into_iter()
        .map(PathBuf::from)
        .collect();
    landed.sort();
    assert!(landed.len() >= 6, "{landed:?}");
    // Copies: two of the first half (bronze holds them), one of the second half.
    let half = landed.len() / 2;
    for (i, src) in [&landed[0], &landed[1], &landed[half]]
        .into_iter()
        .enumerate()
    {
        let name = src.file_name().unwrap().to_string_lossy().into_owned();
        let to = src.with_file_name(format!("zz-copy{i}-{name}"));
        std::fs::copy(src, to).unwrap();
    }
    let landing = Location::open(land.to_str().unwrap(), &Default::default(), false).unwrap();
    let wh = Warehouse::new(
        Location::open(
            dir.path().join("wh").to_str().unwrap(),
            &Default::default(),
            true,
        )
        .unwrap(),
    );
    let schemas = crate::schema::load_all(Path::new("/nonexistent")).unwrap();
    let schema = schemas["orders"].clone();
    let mut all = discover::list_source(&landing, "orders", None)
        .await
        .unwrap();
    all.sort_by(|a, b| a.path.cmp(&b.path));
    let copies: Vec<LandedFile> = all
        .iter()
        .filter(|f| f.path.contains("zz-copy"))
        .cloned()
        .collect();
    let originals: Vec<LandedFile> = all
        .iter()
        .filter(|f| !f.path.contains("zz-copy"))
        .cloned()
        .collect();

    // Batch 1, locally: the first half.
    let bronze = wh
        .open_or_create("bronze/orders", &schema.bronze, &[EVENT_DATE])
        .await
        .unwrap();
    let decode = |files: Vec<PlannedFile>, n: i64| {
        let (landing, schema) = (&landing, &schema);
        async move {
            let mut rows = Vec::new();
            for f in &files {
                let d = crate::runner::ingest::decode_planned(landing, f, schema, n, 7)
                    .await
                    .unwrap();
                if let Some(Decoded::Rows { batch: Some(b), .. }) = d {
                    rows.push(b);
                }
            }
            rows
        }
    };
    let first = planned(&originals[..half]);
    let rows = decode(first.clone(), 1).await;
    let kept = dedup_in_dates(rows, &bronze, &schema, 1, &Default::default())
        .await
        .unwrap();
    let bronze = delta::append(bronze, kept, &[EVENT_DATE], "ingest", 1)
        .await
        .unwrap();

    // Batch 2: the second half and the copies, locally (the expectation) and by the
    // stages.
    let mut second = planned(&originals[half..]);
    second.extend(planned(&copies));
    second.push(PlannedFile {
        file: originals[0].clone(),
        action: FileAction::Changed {
            previous_size: 1,
            previous_e_tag: None,
        },
    });
    let rows = decode(second.clone(), 2).await;
    let valid: usize = rows.iter().map(|b| b.num_rows()).sum();
    let mut dates = BTreeSet::new();
    for b in &rows {
        crate::runner::ingest::event_dates(
            b,
            schema.bronze.index_of(EVENT_DATE).unwrap(),
            &mut dates,
        );
    }
    let expected = dedup_in_dates(rows, &bronze, &schema, 2, &dates)
        .await
        .unwrap();
    let mut expected_ids: Vec<String> = Vec::new();
    for b in &expected {
        let c = crate::columns::string_at(b, schema.event_id_index()).unwrap();
        let file =
            crate::columns::string_at(b, schema.bronze.index_of("_source_file").unwrap()).unwrap();
        let line =
            crate::columns::int64_at(b, schema.bronze.index_of("_source_line").unwrap()).unwrap();
        expected_ids.extend(
            (0..b.num_rows())
                .map(|i| format!("{} {} {}", c.value(i), file.value(i), line.value(i))),
        );
    }
    expected_ids.sort();
    assert!(
        expected_ids.len() < valid,
        "the copies are duplicates ({} of {valid} kept)",
        expected_ids.len()
    );

    let ctx = SessionContext::new_with_config(
        datafusion::prelude::SessionConfig::new().with_target_partitions(3),
    );
    let p = plan("orders", 2, second.clone());
    let version = bronze.version().unwrap();
    let got = run(
        &ctx,
        &p,
        &schema,
        &landing,
        &wh.loc,
        7,
        version,
        true,
        &Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(got.valid as usize, valid);
    assert_eq!(got.written as usize, expected_ids.len());
    assert_eq!(got.decoded.len(), second.len());
    assert!(
        got.decoded.last().unwrap().is_none(),
        "a changed file is not read"
    );
    assert!(got.decoded[..second.len() - 1]
        .iter()
        .all(|d| matches!(d, Some(Decoded::Rows { batch: None, .. }))));
    // Nothing committed yet: bronze has no rows of batch 2.
    assert!(ids(&wh, 2).await.is_empty());
    let t = delta::commit_adds(bronze, got.adds, "ingest", 2)
        .await
        .unwrap();
    assert!(delta::holds(&t, "ingest", 2).await.unwrap());
    assert_eq!(ids(&wh, 2).await, expected_ids);
    // The stage's date lists are gone.
    let stage = crate::names::key::ingest_stage("orders", 2, "");
    let prefix = stage.trim_end_matches("-/");
    let left: Vec<_> = walk(&dir.path().join("wh").join("_kestrel"))
        .into_iter()
        .filter(|p| p.contains(prefix) && p.ends_with(".json"))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // A replay of a batch bronze holds counts the same and writes nothing.
    let again = run(
        &ctx,
        &p,
        &schema,
        &landing,
        &wh.loc,
        7,
        version,
        false,
        &Default::default(),
    )
    .await
    .unwrap();
    assert_eq!((again.valid, again.written), (got.valid, got.written));
    assert!(again.adds.is_empty());
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p.to_string_lossy().into_owned());
            }
        }
    }
    out
}

use std::path::PathBuf;
