//! A job that follows its source's ingestion within one `kestrel run`.
//!
//! A job batch consumes one completed ingestion batch per source, so a job that reads a
//! single source may run batch k as soon as that source's ingestion batch k is complete
//! (bronze, quarantine, ledger and run log committed) — while the ingestion decodes,
//! deduplicates and encodes batch k+1. Its batches, watermarks and outputs are those of a
//! run that ingested everything first: each batch is still planned from exactly one
//! completed ingestion batch, and nothing a batch computes depends on when it ran. On a
//! backlog of several ingestion batches the job's mostly single-core work fills the core
//! the ingestion's stages leave idle; on a five-minute drop (one batch per source) the
//! job starts while the ingestion compacts its open partitions.
//!
//! [`Progress`] is where an ingestion says which batch it completed and that it ended
//! (with or without an error); a [`Follower`] waits for the next one. A follower holds a
//! slot of the run's `parallel_jobs` only while it works: waiting for its source, it
//! gives the slot back, so a run never has more sources and jobs at work than it allows.
//! A job that reads several sources does not follow (its batch k takes batch k of each
//! source, which may complete in any order): it starts once they are all done.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// Where one source's ingestion stands in this run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ingesting {
    /// The last ingestion batch this run completed (None: none yet).
    pub completed: Option<i64>,
    /// The ingestion ended (done, failed or stopped): nothing more will complete.
    pub ended: bool,
}

/// The ingestion progress of a run's sources, for the jobs that follow them.
#[derive(Debug, Default)]
pub struct Progress {
    sources: Mutex<BTreeMap<String, watch::Sender<Ingesting>>>,
}

impl Progress {
    /// The channel of `source` (created on first use).
    fn sender(&self, source: &str) -> Option<watch::Sender<Ingesting>> {
        let mut sources = self.sources.lock().ok()?;
        Some(
            sources
                .entry(source.to_string())
                .or_insert_with(|| watch::Sender::new(Ingesting::default()))
                .clone(),
        )
    }

    /// `source`'s ingestion starts in this run: nothing completed, not ended.
    pub fn start(&self, source: &str) {
        if let Some(tx) = self.sender(source) {
            tx.send_replace(Ingesting::default());
        }
    }

    /// `source` completed ingestion batch `batch`.
    pub fn completed(&self, source: &str, batch: i64) {
        if let Some(tx) = self.sender(source) {
            tx.send_modify(|s| s.completed = Some(s.completed.map_or(batch, |c| c.max(batch))));
        }
    }

    /// `source`'s ingestion in this run ended.
    pub fn ended(&self, source: &str) {
        if let Some(tx) = self.sender(source) {
            tx.send_modify(|s| s.ended = true);
        }
    }

    /// A guard that reports `source`'s ingestion ended when dropped: on every way out of
    /// it, an early error included.
    pub fn ending<'a>(&'a self, source: &'a str) -> Ending<'a> {
        Ending {
            progress: self,
            source,
        }
    }

    /// A follower of `source`'s ingestion that holds one of `slots` while it works.
    pub fn follow(&self, source: &str, slots: Arc<Semaphore>) -> Option<Follower> {
        Some(Follower {
            source: source.to_string(),
            rx: self.sender(source)?.subscribe(),
            slots,
            slot: None,
        })
    }
}

/// Reports its source's ingestion ended when dropped ([`Progress::ending`]).
pub struct Ending<'a> {
    progress: &'a Progress,
    source: &'a str,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.progress.ended(self.source);
    }
}

/// One job's view of its source's ingestion (see the module docs).
#[derive(Debug)]
pub struct Follower {
    source: String,
    rx: watch::Receiver<Ingesting>,
    slots: Arc<Semaphore>,
    slot: Option<OwnedSemaphorePermit>,
}

impl Follower {
    /// The source followed.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Wait for a completed ingestion batch after `after` or the ingestion's end, holding
    /// no slot meanwhile; then take a slot (unless the ingestion ended with nothing new).
    /// The last completed batch when it is after `after`, None when no more will come.
    pub async fn next_after(&mut self, after: i64) -> Option<i64> {
        let newer = |s: &Ingesting| s.ended || s.completed.is_some_and(|c| c > after);
        if !newer(&self.rx.borrow()) {
            self.slot = None;
        }
        // An error means the progress is gone: nothing more will be reported.
        let waited = self.rx.wait_for(newer).await.map(|s| *s);
        let state = waited.unwrap_or_else(|_| Ingesting {
            ended: true,
            ..*self.rx.borrow()
        });
        let Some(next) = state.completed.filter(|&c| c > after) else {
            self.slot = None;
            return None;
        };
        self.hold_slot().await;
        Some(next)
    }

    /// Hold a slot of the run (waiting for one if none is free).
    pub async fn hold_slot(&mut self) {
        if self.slot.is_none() {
            // The run's semaphore is never closed; without a slot, work anyway.
            self.slot = self.slots.clone().acquire_owned().await.ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_follower_sees_each_completed_batch_and_the_end_and_waits_without_a_slot() {
        let progress = Arc::new(Progress::default());
        let slots = Arc::new(Semaphore::new(1));
        let mut f = progress.follow("orders", slots.clone()).unwrap();
        assert_eq!(f.source(), "orders");
        // Nothing completed yet: it waits, and holds no slot while it does.
        let waiting = {
            let progress = progress.clone();
            let slots = slots.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                assert_eq!(slots.available_permits(), 1);
                progress.completed("orders", 1);
            })
        };
        assert_eq!(f.next_after(0).await, Some(1));
        waiting.await.unwrap();
        // Working, it holds the run's one slot.
        assert_eq!(slots.available_permits(), 0);
        // Batches completed while it worked are all there; it skips to the latest.
        progress.completed("orders", 2);
        progress.completed("orders", 3);
        assert_eq!(f.next_after(1).await, Some(3));
        assert_eq!(slots.available_permits(), 0);
        // Another source's progress is not this one's.
        progress.completed("payments", 9);
        progress.ended("payments");
        let mut p = progress.follow("payments", slots.clone()).unwrap();
        assert_eq!(p.next_after(9).await, None);
        // The end, with nothing newer: None, and the slot is given back.
        progress.ended("orders");
        assert_eq!(f.next_after(3).await, None);
        assert_eq!(slots.available_permits(), 1);
        // The end with a batch not yet taken: that batch first.
        let progress = Progress::default();
        let mut g = progress.follow("orders", slots.clone()).unwrap();
        progress.completed("orders", 4);
        progress.ended("orders");
        assert_eq!(g.next_after(3).await, Some(4));
        assert_eq!(g.next_after(4).await, None);
    }

    #[tokio::test]
    async fn an_ending_guard_ends_the_ingestion_when_dropped() {
        let progress = Progress::default();
        let mut f = progress
            .follow("orders", Arc::new(Semaphore::new(1)))
            .unwrap();
        let ending = progress.ending("orders");
        progress.completed("orders", 1);
        assert_eq!(f.next_after(0).await, Some(1));
        drop(ending);
        assert_eq!(f.next_after(1).await, None);
    }

    #[tokio::test]
    async fn a_follower_of_a_progress_that_is_dropped_ends() {
        let progress = Progress::default();
        let mut f = progress
            .follow("orders", Arc::new(Semaphore::new(1)))
            .unwrap();
        progress.completed("orders", 2);
        drop(progress);
        assert_eq!(f.next_after(0).await, Some(2));
        assert_eq!(f.next_after(2).await, None);
    }
}
