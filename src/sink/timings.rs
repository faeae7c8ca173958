//! Wall time of the storage operations a process has done, by operation and table
//! (`open bronze/orders`, `merge gold/revenue_1h`, `read bronze`…): where a run's time
//! goes. The cost benchmark prints it per run (`KESTREL_AGE_PROFILE=1`); recording is a
//! map update per Delta operation, nothing next to the operation itself.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

static TIMES: Mutex<BTreeMap<String, (u64, Duration)>> = Mutex::new(BTreeMap::new());

/// Add one `what` operation that took `took`.
pub fn record(what: String, took: Duration) {
    if let Ok(mut g) = TIMES.lock() {
        let e = g.entry(what).or_default();
        e.0 += 1;
        e.1 += took;
    }
}

/// Everything recorded since the last call: operation → (count, total time).
pub fn take() -> BTreeMap<String, (u64, Duration)> {
    TIMES
        .lock()
        .map(|mut g| std::mem::take(&mut *g))
        .unwrap_or_default()
}

/// `bronze/orders` of a table URL (the last two path segments).
pub fn table_name(url: &str) -> String {
    let u = url.trim_end_matches('/');
    let parts: Vec<&str> = u.rsplitn(3, '/').collect();
    if parts.len() >= 2 {
        format!("{}/{}", parts[1], parts[0])
    } else {
        u.to_string()
    }
}
