//! Application-transaction versions (`txn` actions) of Delta tables, looked up once and
//! then followed incrementally.
//!
//! delta-rs answers "the last version of app X" by replaying the table's log segment (its
//! last checkpoint and the commits after it) for every question. kestrel asks it before
//! every commit and for every position it plans from, a dozen times per table and run, so
//! the answers are kept per table and brought forward by reading only the commits made
//! since: O(new commits) per lookup instead of O(checkpoint).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use deltalake::DeltaTable;

use crate::error::{Error, Result};

/// Commits read forward at most before starting over from a fresh lookup.
const MAX_FORWARD: u64 = 64;

/// What is known of one table's application transactions, as of `version`.
#[derive(Debug, Default)]
struct Index {
    version: u64,
    apps: HashMap<String, Option<i64>>,
}

/// Per table URL.
static INDEX: LazyLock<Mutex<HashMap<String, Index>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn lock() -> std::sync::MutexGuard<'static, HashMap<String, Index>> {
    match INDEX.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The `txn` actions (app id, version) of one commit file's text.
fn txn_actions(commit: &[u8]) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for line in commit.split(|b| *b == b'\n') {
        // Cheap test first: most actions are adds.
        if !line.windows(6).any(|w| w == b"\"txn\":") {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(t) = v.get("txn") {
            if let (Some(app), Some(version)) = (
                t.get("appId").and_then(|a| a.as_str()),
                t.get("version").and_then(|v| v.as_i64()),
            ) {
                out.push((app.to_string(), version));
            }
        }
    }
    out
}

/// The last application-transaction version recorded for `app_id` in `table` (as loaded).
pub async fn version(table: &DeltaTable, app_id: &str) -> Result<Option<i64>> {
    let Some(at) = table.version() else {
        return Ok(None);
    };
    // The table's id (fixed at creation) too: a table deleted and created again at the
    // same URL is another table.
    let snap = table
        .snapshot()
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    let url = format!("{} {}", table.table_url(), snap.metadata().id());
    // What is known, and which commits must be read to bring it to `at`.
    let (known, from) = {
        let g = lock();
        match g.get(&url) {
            Some(ix) if ix.version == at => (ix.apps.get(app_id).copied(), None),
            Some(ix) if ix.version < at && at - ix.version <= MAX_FORWARD => {
                (None, Some(ix.version))
            }
            _ => (None, None),
        }
    };
    if let Some(v) = known {
        return Ok(v);
    }
    if let Some(from) = from {
        let mut found: Vec<(String, i64)> = Vec::new();
        let mut complete = true;
        for v in from + 1..=at {
            match table.log_store().read_commit_entry(v).await {
                Ok(Some(bytes)) => found.extend(txn_actions(&bytes)),
                // Cleaned up or unreadable: start over from a full lookup.
                _ => {
                    complete = false;
                    break;
                }
            }
        }
        let mut g = lock();
        if let Some(ix) = g.get_mut(&url).filter(|ix| ix.version == from) {
            if complete {
                // Commits in order: the latest action of an app is its version.
                for (app, v) in found {
                    if let Some(slot) = ix.apps.get_mut(&app) {
                        *slot = Some(v);
                    }
                }
                ix.version = at;
            } else {
                g.remove(&url);
            }
        }
        if let Some(v) = g.get(&url).filter(|ix| ix.version == at) {
            if let Some(known) = v.apps.get(app_id) {
                return Ok(*known);
            }
        }
    }
    // A full lookup, remembered at this version.
    let v = snap
        .transaction_version(table.log_store().as_ref(), app_id)
        .await
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    let mut g = lock();
    let ix = g.entry(url).or_default();
    if ix.version != at {
        if ix.version > at {
            // An older snapshot than the one indexed: answer, do not remember.
            return Ok(v);
        }
        *ix = Index {
            version: at,
            apps: HashMap::new(),
        };
    }
    ix.apps.insert(app_id.to_string(), v);
    Ok(v)
}

/// Forget every table's transaction versions (see [`super::tables::clear`]).
pub fn clear() {
    lock().clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_txn_actions_in_a_commit() {
        let commit = br#"{"commitInfo":{"timestamp":1,"operation":"WRITE"}}
{"txn":{"appId":"kestrel-job-x","version":7,"lastUpdated":null}}
{"add":{"path":"a.parquet","size":1,"txn":"not an action"}}
{"txn":{"appId":"kestrel-late-x","version":3}}
"#;
        assert_eq!(
            txn_actions(commit),
            vec![
                ("kestrel-job-x".to_string(), 7),
                ("kestrel-late-x".to_string(), 3)
            ]
        );
    }
}
