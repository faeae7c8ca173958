//! Leases under `<warehouse>/_kestrel/leases/<name>.json`: a writer takes one before it
//! touches a source or job, so two processes never run the same work at once.
//!
//! A lease expires (`ttl`), and on the same host a lease whose process is gone is taken
//! over at once, so a kill -9 never blocks the next run. Creation uses put-if-absent;
//! Delta's optimistic concurrency and put-if-absent plans stay the last guard.

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sink::delta::Warehouse;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseBody {
    owner: String,
    host: String,
    pid: u32,
    acquired_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

/// A held lease; call [`Lease::release`] when done (a dropped lease simply expires).
#[derive(Debug)]
pub struct Lease {
    wh: Warehouse,
    key: String,
    body: LeaseBody,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

impl Lease {
    /// Try to take lease `name` for `ttl`.
    pub async fn acquire(wh: &Warehouse, name: &str, ttl: std::time::Duration) -> Result<Lease> {
        let key = format!("_kestrel/leases/{name}.json");
        let path = wh.loc.path(&key);
        let now = Utc::now();
        let body = LeaseBody {
            owner: format!("{}:{}", hostname(), std::process::id()),
            host: hostname(),
            pid: std::process::id(),
            acquired_at: now,
            expires_at: now + ChronoDuration::from_std(ttl).unwrap_or(ChronoDuration::minutes(10)),
        };
        let bytes = serde_json::to_vec(&body).map_err(|e| Error::Other(e.to_string()))?;
        for attempt in 0..3 {
            let opts = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            match wh
                .loc
                .store
                .put_opts(&path, PutPayload::from(bytes.clone()), opts)
                .await
            {
                Ok(_) => {
                    return Ok(Lease {
                        wh: wh.clone(),
                        key,
                        body,
                    })
                }
                Err(object_store::Error::AlreadyExists { .. }) => {
                    let current = match wh.loc.store.get(&path).await {
                        Ok(r) => r
                            .bytes()
                            .await
                            .ok()
                            .and_then(|b| serde_json::from_slice::<LeaseBody>(&b).ok()),
                        Err(object_store::Error::NotFound { .. }) => continue,
                        Err(e) => return Err(Error::storage(wh.loc.display(&key), e)),
                    };
                    let stale = match &current {
                        None => true, // unreadable or half-written: treat as stale
                        Some(c) => {
                            c.expires_at < Utc::now()
                                || (c.host == body.host && c.pid != body.pid && !pid_alive(c.pid))
                        }
                    };
                    if stale && attempt < 2 {
                        tracing::warn!(lease = name, "taking over a stale lease");
                        match wh.loc.store.delete(&path).await {
                            Ok(()) | Err(object_store::Error::NotFound { .. }) => continue,
                            Err(e) => return Err(Error::storage(wh.loc.display(&key), e)),
                        }
                    }
                    let (owner, until) = current
                        .map(|c| (c.owner, c.expires_at.to_rfc3339()))
                        .unwrap_or_else(|| ("unknown".into(), "unknown".into()));
                    return Err(Error::LeaseHeld {
                        name: name.to_string(),
                        owner,
                        until,
                        path: wh.loc.display(&key),
                    });
                }
                Err(e) => return Err(Error::storage(wh.loc.display(&key), e)),
            }
        }
        Err(Error::Other(format!(
            "could not take lease {name}: contended"
        )))
    }

    /// Give the lease up.
    pub async fn release(self) -> Result<()> {
        let path = self.wh.loc.path(&self.key);
        // Only delete it if it is still ours.
        if let Ok(r) = self.wh.loc.store.get(&path).await {
            if let Ok(b) = r.bytes().await {
                if let Ok(c) = serde_json::from_slice::<LeaseBody>(&b) {
                    if c.owner != self.body.owner || c.acquired_at != self.body.acquired_at {
                        return Ok(());
                    }
                }
            }
        }
        match self.wh.loc.store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Error::storage(self.wh.loc.display(&self.key), e)),
        }
    }
}
