//! Delta tables kept open for the life of the process, by URL.
//!
//! Opening a Delta table replays its log: the last checkpoint (every active file, every
//! remove still retained) and the commits after it. kestrel opens the same handful of
//! tables for every batch, so the first open of a table loads it and later opens bring
//! the kept copy forward: one read of the next commit file tells whether anything was
//! committed since (nothing: no listing at all), and only then the new commits are read.
//! Every commit kestrel makes keeps the table it returns, so a process's own commits
//! never need reading back.
//!
//! A kept table is loaded afresh once it is [`RELOAD_AFTER_COMMITS`] versions past its
//! last load. Each commit brings delta-rs's snapshot forward by re-running the kernel's
//! log replay over the files the snapshot holds, and a snapshot brought forward commit
//! after commit costs more with every commit (a fixed cost per commit it went through,
//! not per file): 300 one-row appends in one process to a table of 30 files, each opening
//! it through the warehouse as a daemon's batches do, took 8.2 ms at the start and
//! 70.4 ms at the end; with the reload 8.2 and 8.6 ms (`cargo bench --bench jobs --
//! readcost`, opt-level 1). A table loaded from its checkpoint does not carry that cost:
//! an append to a freshly loaded table of 300 files took 7.6 ms. Without the reload a
//! daemon's (or an always-on stream's) commits slowed down with every commit it had made
//! since it started, until something — a compaction's lease, the daily maintenance —
//! happened to make it load the table again.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use deltalake::DeltaTable;

/// A kept table loaded afresh once it is this many versions past its last load: the
/// tables kestrel creates are checkpointed every 10 commits
/// ([`super::delta::CHECKPOINT_INTERVAL`]), so the load reads a recent checkpoint and
/// a few commits. One load costs about what a commit on a snapshot brought forward
/// through ten commits loses, measured as above.
pub const RELOAD_AFTER_COMMITS: u64 = 10;

/// A kept table and the version it was last loaded at (0 when it was kept without a
/// load of its own, e.g. the table a creation returned: its snapshot may have been
/// brought forward from the start).
struct Kept {
    table: DeltaTable,
    loaded: u64,
}

static KEPT: LazyLock<Mutex<HashMap<String, Kept>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn lock() -> std::sync::MutexGuard<'static, HashMap<String, Kept>> {
    match KEPT.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The map key of the table at `url` (with or without its trailing slash).
fn url_key(url: &url::Url) -> &str {
    url.as_str().trim_end_matches('/')
}

fn key(table: &DeltaTable) -> String {
    url_key(table.table_url()).to_string()
}

/// The kept copy of the table at `url`, if any and not yet due for a reload (see
/// [`RELOAD_AFTER_COMMITS`]).
pub fn kept(url: &url::Url) -> Option<DeltaTable> {
    let g = lock();
    let k = g.get(url_key(url))?;
    let worn = k
        .table
        .version()
        .is_some_and(|v| v.saturating_sub(k.loaded) >= RELOAD_AFTER_COMMITS);
    (!worn).then(|| k.table.clone())
}

/// Keep `table` unless a newer version of it is kept already.
pub fn keep(table: &DeltaTable) {
    let mut g = lock();
    let k = key(table);
    match g.get_mut(&k) {
        Some(kept) if kept.table.version() >= table.version() => {}
        Some(kept) => kept.table = table.clone(),
        None => {
            g.insert(
                k,
                Kept {
                    table: table.clone(),
                    loaded: 0,
                },
            );
        }
    }
}

/// Keep `table`, just loaded from storage (its snapshot holds the files as the
/// checkpoint and the commits after it have them, not as many small batches).
pub fn keep_loaded(table: &DeltaTable) {
    lock().insert(
        key(table),
        Kept {
            table: table.clone(),
            loaded: table.version().unwrap_or(0),
        },
    );
}

/// Forget the table at `url` (deleted or replaced underneath).
pub fn forget(url: &url::Url) {
    lock().remove(url_key(url));
}

/// Bring a kept table up to the newest version: nothing to do unless the commit after
/// its version exists.
pub async fn refresh(table: &mut DeltaTable) -> deltalake::DeltaResult<()> {
    let Some(v) = table.version() else {
        return table.update_incremental(None).await;
    };
    if table.log_store().read_commit_entry(v + 1).await?.is_none() {
        return Ok(());
    }
    table.update_incremental(None).await?;
    keep(table);
    Ok(())
}

/// Forget every kept table, cached footer and kept log file (what a new process starts with;
/// benchmarks of cron-driven runs call it between runs).
pub fn clear() {
    lock().clear();
    super::txn::clear();
    super::delta::clear_file_metadata();
    super::logcache::clear();
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    /// A table committed to through the warehouse is kept between opens until it is
    /// `RELOAD_AFTER_COMMITS` versions past its last load; the next open loads it afresh,
    /// at the same version, and keeps that.
    #[tokio::test]
    async fn a_kept_table_is_loaded_afresh_every_few_versions() {
        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, true)]));
        let row = |v: i64| {
            RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![v]))]).unwrap()
        };
        let t = wh.open_or_create("t", &schema, &[]).await.unwrap();
        let url = t.table_url().clone();
        clear();
        let t = wh.open("t").await.unwrap().unwrap();
        assert_eq!(t.version(), Some(0));
        for v in 1..RELOAD_AFTER_COMMITS as i64 {
            let t = wh.open("t").await.unwrap().unwrap();
            crate::sink::delta::append(t, vec![row(v)], &[], "w", v)
                .await
                .unwrap();
            assert_eq!(kept(&url).and_then(|t| t.version()), Some(v as u64));
        }
        let t = wh.open("t").await.unwrap().unwrap();
        let v = RELOAD_AFTER_COMMITS as i64;
        crate::sink::delta::append(t, vec![row(v)], &[], "w", v)
            .await
            .unwrap();
        // Ten versions past its load: not handed out again…
        assert!(kept(&url).is_none());
        // …but loaded afresh, at the newest version, with every row.
        let t = wh.open("t").await.unwrap().unwrap();
        assert_eq!(t.version(), Some(RELOAD_AFTER_COMMITS));
        assert_eq!(
            kept(&url).and_then(|t| t.version()),
            Some(RELOAD_AFTER_COMMITS)
        );
        let ctx = crate::sink::delta::session_with(&t, "t").await.unwrap();
        let n = crate::sink::delta::sql(&ctx, "SELECT count(*) FROM t")
            .await
            .unwrap();
        assert_eq!(
            crate::columns::int64_at(&n[0], 0).unwrap().value(0),
            RELOAD_AFTER_COMMITS as i64
        );
    }
}
