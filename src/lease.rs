//! Leases under `<warehouse>/_kestrel/leases/<name>.json`: a writer takes one before it
//! touches a source or job, so two processes never run the same work at once.
//!
//! A lease expires (`ttl`), and on the same host a lease whose process is gone is taken
//! over at once, so a kill -9 never blocks the next run. "Gone" is judged by
//! `/proc/<pid>/stat`: no such process, a zombie (killed, not yet reaped by its parent),
//! or a process whose start time differs from the one the lease recorded (the pid was
//! reused by an unrelated process). Creation uses put-if-absent;
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
    /// The holder's start time (clock ticks after boot, `/proc/<pid>/stat` field 22);
    /// absent in leases written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    started: Option<u64>,
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

/// A takeover marker this old was left by a contender that died mid-takeover.
const MARKER_TTL: ChronoDuration = ChronoDuration::seconds(30);

/// FNV-1a of `bytes` (names a takeover marker after the lease it replaces).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// State and start time of process `pid` (`/proc/<pid>/stat` fields 3 and 22), if it
/// exists.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let started = fields.get(19)?.parse().ok()?;
    Some((state, started))
}

/// Whether the process that took a lease (`pid`, started at `started`) still runs: it
/// exists, is no zombie, and is the same process (same start time, when recorded).
fn holder_alive(pid: u32, started: Option<u64>) -> bool {
    match proc_stat(pid) {
        None => false,
        Some((state, _)) if state == 'Z' || state == 'X' => false,
        Some((_, at)) => started.is_none_or(|s| s == at),
    }
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
            started: proc_stat(std::process::id()).map(|(_, at)| at),
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
                        || (c.host == body.host
                            && c.pid != body.pid
                            && !holder_alive(c.pid, c.started))
                }
            };
            if stale && attempt < 2 {
                if Self::take_over(wh, &key, &raw, &bytes).await? {
                    tracing::warn!(lease = name, "took over a stale lease");
                }
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

    /// Remove the stale lease `raw` at `key` so it can be created again — unless another
    /// contender got there first. Deleting and re-creating alone lets two processes that
    /// both saw the stale lease both win (the second deletes the first's fresh lease), so
    /// a takeover is claimed first with a put-if-absent marker named after the stale
    /// lease's bytes: one contender per stale lease wins it, re-reads the lease and
    /// deletes it only if it is still the stale one. Returns whether it removed it.
    /// The marker holds the contender's own lease body (`ours`), unique to it, so a
    /// create whose answer was lost is told apart from another contender's.
    async fn take_over(wh: &Warehouse, key: &str, raw: &[u8], ours: &[u8]) -> Result<bool> {
        let marker = format!("{key}.takeover-{:016x}", fnv1a(raw));
        if !wh.loc.put_if_absent(&marker, ours.to_vec()).await? {
            // Another contender is taking it over — or died doing so (kill -9 between
            // its marker and its delete): a marker older than a takeover takes is stale
            // too, and goes, so the next attempt can claim the lease.
            let path = wh.loc.path(&marker);
            if let Ok(meta) = object_store::ObjectStoreExt::head(&wh.loc.store, &path).await {
                if Utc::now() - meta.last_modified > MARKER_TTL {
                    tracing::warn!(%marker, "removing a stale takeover marker");
                    wh.loc.delete_if_exists(&marker).await?;
                }
            }
            return Ok(false);
        }
        let still = wh.loc.get_opt(key).await?;
        let removed = if still.as_deref() == Some(raw) {
            wh.loc.delete_if_exists(key).await?;
            true
        } else {
            false
        };
        wh.loc.delete_if_exists(&marker).await?;
        Ok(removed)
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
        let dead = c.host == hostname() && !holder_alive(c.pid, c.started);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn warehouse(dir: &std::path::Path) -> Warehouse {
        Warehouse::new(
            crate::storage::Location::open(dir.to_str().unwrap(), &Default::default(), true)
                .unwrap(),
        )
    }

    /// Write lease `name` as if process `pid` (started at `started`) held it for an hour.
    async fn held_by(wh: &Warehouse, name: &str, pid: u32, started: Option<u64>) {
        let now = Utc::now();
        let body = LeaseBody {
            owner: format!("{}:{pid}", hostname()),
            host: hostname(),
            pid,
            started,
            acquired_at: now,
            expires_at: now + ChronoDuration::hours(1),
        };
        let key = crate::names::key::lease(name);
        wh.loc
            .put(&key, serde_json::to_vec(&body).unwrap())
            .await
            .unwrap();
    }

    const TTL: std::time::Duration = std::time::Duration::from_secs(60);

    /// A lease of another host's process that expired an hour ago.
    fn expired() -> LeaseBody {
        let then = Utc::now() - ChronoDuration::hours(2);
        LeaseBody {
            owner: "elsewhere:1".into(),
            host: "elsewhere".into(),
            pid: 1,
            started: None,
            acquired_at: then,
            expires_at: then + ChronoDuration::hours(1),
        }
    }

    /// A live holder blocks; the same pid with another start time (a reused pid) and a
    /// zombie (killed, not yet reaped) count as gone, and their leases are taken over.
    #[tokio::test]
    async fn a_reused_pid_or_a_zombie_does_not_hold_a_lease() {
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        let mut live = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = live.id();
        let (_, started) = proc_stat(pid).unwrap();

        held_by(&wh, "job-a", pid, Some(started)).await;
        let e = Lease::acquire(&wh, "job-a", TTL).await.unwrap_err();
        assert!(matches!(e, Error::LeaseHeld { .. }), "{e}");
        assert!(Lease::live_holder(&wh, "job-a").await.unwrap().is_some());
        // An old lease without a start time: the pid alone decides.
        held_by(&wh, "job-b", pid, None).await;
        assert!(Lease::acquire(&wh, "job-b", TTL).await.is_err());

        // The pid now belongs to another process than the one that took the lease.
        held_by(&wh, "job-c", pid, Some(started + 1)).await;
        assert!(Lease::live_holder(&wh, "job-c").await.unwrap().is_none());
        let l = Lease::acquire(&wh, "job-c", TTL).await.unwrap();
        assert_eq!(l.body.pid, std::process::id());
        l.release().await.unwrap();

        // Killed but not reaped: a zombie.
        live.kill().unwrap();
        let t = std::time::Instant::now();
        while proc_stat(pid).is_some_and(|(s, _)| s != 'Z') {
            assert!(t.elapsed().as_secs() < 10, "no zombie");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(proc_stat(pid).map(|(s, _)| s), Some('Z'));
        held_by(&wh, "job-d", pid, Some(started)).await;
        assert!(Lease::live_holder(&wh, "job-d").await.unwrap().is_none());
        Lease::acquire(&wh, "job-d", TTL).await.unwrap();
        live.wait().unwrap();
    }

    /// Many processes finding the same expired lease: exactly one takes it over (the
    /// others find it held), in every round.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_contender_takes_over_a_stale_lease() {
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        for round in 0..20 {
            let name = format!("job-r{round}");
            let key = crate::names::key::lease(&name);
            let stale = expired();
            wh.loc
                .put(&key, serde_json::to_vec(&stale).unwrap())
                .await
                .unwrap();
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let (wh, name) = (wh.clone(), name.clone());
                    tokio::spawn(async move { Lease::acquire(&wh, &name, TTL).await })
                })
                .collect();
            let mut won = Vec::new();
            for t in tasks {
                match t.await.unwrap() {
                    Ok(l) => won.push(l),
                    Err(Error::LeaseHeld { .. }) | Err(Error::Lease(LeaseError::Contended(_))) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            assert_eq!(won.len(), 1, "round {round}: {} holders", won.len());
            // The lease on disk is the winner's.
            let raw = wh.loc.get_opt(&key).await.unwrap().unwrap();
            let on_disk: LeaseBody = serde_json::from_slice(&raw).unwrap();
            assert_eq!(on_disk.acquired_at, won[0].body.acquired_at);
        }
    }

    /// A contender killed between its takeover marker and its delete leaves the marker:
    /// once it is older than a takeover takes, the next contender removes it and takes
    /// the lease over.
    #[tokio::test]
    async fn a_dead_contenders_takeover_marker_does_not_block_forever() {
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        let stale = expired();
        let key = crate::names::key::lease("job-m");
        let raw = serde_json::to_vec(&stale).unwrap();
        wh.loc.put(&key, raw.clone()).await.unwrap();
        let marker = format!("{key}.takeover-{:016x}", fnv1a(&raw));
        wh.loc.put(&marker, b"dead".to_vec()).await.unwrap();
        // A fresh marker: someone is taking over right now.
        assert!(Lease::acquire(&wh, "job-m", TTL).await.is_err());
        // An old one (its mtime an hour back): removed, and the lease is taken.
        let file = dir.path().join(&marker);
        let old = filetime::FileTime::from_unix_time(Utc::now().timestamp() - 3600, 0);
        filetime::set_file_mtime(&file, old).unwrap();
        let l = Lease::acquire(&wh, "job-m", TTL).await.unwrap();
        assert_eq!(l.body.pid, std::process::id());
    }

    /// This process's own stat parses (a command name with spaces and parentheses is
    /// skipped whole), and its lease records its start time.
    #[tokio::test]
    async fn a_lease_records_its_holders_start_time() {
        let (state, started) = proc_stat(std::process::id()).unwrap();
        assert!(state != 'Z' && started > 0);
        let dir = tempfile::tempdir().unwrap();
        let wh = warehouse(dir.path());
        let l = Lease::acquire(&wh, "job-x", TTL).await.unwrap();
        assert_eq!(l.body.started, Some(started));
        assert!(holder_alive(std::process::id(), Some(started)));
        assert!(!holder_alive(std::process::id(), Some(started + 1)));
        l.release().await.unwrap();
    }
}
