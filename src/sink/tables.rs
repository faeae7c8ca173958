//! Delta tables kept open for the life of the process, by URL.
//!
//! Opening a Delta table replays its log: the last checkpoint (every active file, every
//! remove still retained) and the commits after it. kestrel opens the same handful of
//! tables for every batch, so the first open of a table loads it and later opens bring
//! the kept copy forward: one read of the next commit file tells whether anything was
//! committed since (nothing: no listing at all), and only then the new commits are read.
//! Every commit kestrel makes keeps the table it returns, so a process's own commits
//! never need reading back.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use deltalake::DeltaTable;

static KEPT: LazyLock<Mutex<HashMap<String, DeltaTable>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn lock() -> std::sync::MutexGuard<'static, HashMap<String, DeltaTable>> {
    match KEPT.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn key(table: &DeltaTable) -> String {
    table.table_url().as_str().trim_end_matches('/').to_string()
}

/// The kept copy of the table at `url`, if any.
pub fn kept(url: &url::Url) -> Option<DeltaTable> {
    lock().get(url.as_str().trim_end_matches('/')).cloned()
}

/// Keep `table` unless a newer version of it is kept already.
pub fn keep(table: &DeltaTable) {
    let mut g = lock();
    let k = key(table);
    if g.get(&k).is_none_or(|t| t.version() < table.version()) {
        g.insert(k, table.clone());
    }
}

/// Forget the table at `url` (deleted or replaced underneath).
pub fn forget(url: &url::Url) {
    lock().remove(url.as_str().trim_end_matches('/'));
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

/// Forget every kept table and cached footer (what a new process starts with;
/// benchmarks of cron-driven runs call it between runs).
pub fn clear() {
    lock().clear();
    super::txn::clear();
    super::delta::clear_file_metadata();
}
