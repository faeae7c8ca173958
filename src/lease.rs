//! Leases under `<warehouse>/_kestrel/leases/<name>.json`: a writer takes one before it
//! touches a source or job, so two processes never run the same work at once.
//!
//! A lease expires (`ttl`), and on the same host a lease whose process is gone is taken
//! over at once, so a kill -9 never blocks the next run. Creation uses put-if-absent;
//! Delta's optimistic concurrency and put-if-absent plans stay the last guard.

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sink::delta::Warehouse;

/// A lease that could not be taken or kept (a lease held by another process is
/// [`Error::LeaseHeld`], which callers wait on or report).
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("could not take lease {0}: contended")]
    Contended(String),
    #[error("lost lease {0}: it expired and was taken over; stopping before the next batch")]
    Lost(String),
    #[error("lease body: {0}")]
    Encode(#[from] serde_json::Error),
}

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
        let key = crate::names::key::lease(name);
        let now = Utc::now();
        let body = LeaseBody {
            owner: format!("{}:{}", hostname(), std::process::id()),
            host: hostname(),
            pid: std::process::id(),
            acquired_at: now,
            expires_at: now + ChronoDuration::from_std(ttl).unwrap_or(ChronoDuration::minutes(10)),
        };
        let bytes = serde_json::to_vec(&body).map_err(LeaseError::Encode)?;
        for attempt in 0..3 {
            if wh.loc.put_if_absent(&key, bytes.clone()).await? {
                return Ok(Lease {
                    wh: wh.clone(),
                    key,
                    body,
                });
            }
            let Some(raw) = wh.loc.get_opt(&key).await? else {
                continue; // released in between: try again
            };
            let current = serde_json::from_slice::<LeaseBody>(&raw).ok();
            let stale = match &current {
                None => true, // unreadable or half-written: treat as stale
                Some(c) => {
                    c.expires_at < Utc::now()
                        || (c.host == body.host && c.pid != body.pid && !pid_alive(c.pid))
                }
            };
            if stale && attempt < 2 {
                tracing::warn!(lease = name, "taking over a stale lease");
                wh.loc.delete_if_exists(&key).await?;
                continue;
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
        Err(LeaseError::Contended(name.to_string()).into())
    }

    /// Who runs `job` always-on right now (the live holder of its stream lease), if
    /// anyone but this process: `run`, `schedule`, `backfill` and `maintain` leave such a
    /// job's tables and sources to the stream.
    pub async fn stream_owner(wh: &Warehouse, job: &str) -> Result<Option<String>> {
        Self::live_holder(wh, &crate::names::lease::stream(job)).await
    }

    /// The owner of lease `name` if another live process holds it (unexpired, and not a
    /// dead process on this host); None when it is free or ours.
    pub async fn live_holder(wh: &Warehouse, name: &str) -> Result<Option<String>> {
        let key = crate::names::key::lease(name);
        let Some(raw) = wh.loc.get_opt(&key).await? else {
            return Ok(None);
        };
        let Ok(c) = serde_json::from_slice::<LeaseBody>(&raw) else {
            return Ok(None);
        };
        let dead = c.host == hostname() && !pid_alive(c.pid);
        let ours = c.host == hostname() && c.pid == std::process::id();
        Ok((c.expires_at >= Utc::now() && !dead && !ours).then_some(c.owner))
    }

    /// Who holds it: `host:pid`.
    pub fn owner(&self) -> &str {
        &self.body.owner
    }

    /// Extend the lease by `ttl` from now (between batches of a long run). Fails if the
    /// lease is no longer ours: it expired and another process took it.
    pub async fn renew(&mut self, ttl: std::time::Duration) -> Result<()> {
        let raw = self.wh.loc.get_opt(&self.key).await?;
        let ours = raw
            .and_then(|r| serde_json::from_slice::<LeaseBody>(&r).ok())
            .is_some_and(|c| c.owner == self.body.owner && c.acquired_at == self.body.acquired_at);
        if !ours {
            return Err(LeaseError::Lost(self.wh.loc.display(&self.key)).into());
        }
        self.body.expires_at =
            Utc::now() + ChronoDuration::from_std(ttl).unwrap_or(ChronoDuration::minutes(10));
        let bytes = serde_json::to_vec(&self.body).map_err(LeaseError::Encode)?;
        self.wh.loc.put(&self.key, bytes).await
    }

    /// Give the lease up.
    pub async fn release(self) -> Result<()> {
        // Only delete it if it is still ours.
        if let Some(raw) = self.wh.loc.get_opt(&self.key).await? {
            if let Ok(c) = serde_json::from_slice::<LeaseBody>(&raw) {
                if c.owner != self.body.owner || c.acquired_at != self.body.acquired_at {
                    return Ok(());
                }
            }
        }
        self.wh.loc.delete_if_exists(&self.key).await
    }
}
