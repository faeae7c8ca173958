//! Runners decide when work happens: ingestion of landed files ([`ingest`]) and job
//! micro-batches ([`batch`]: the job protocol — plan, compute, commits), one batch at a
//! time; each operator's I/O steps (a batch's compute, a backfill day's restatement) sit
//! in its own module (`windowed`, `payments`, `stockout`); [`read`] holds the bronze reads
//! jobs use; [`schedule`] is the daemon, [`stream`] the always-on mode, [`backfill`]
//! replays date ranges; [`follow`] lets a run's job take its source's batches as the
//! ingestion completes them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub mod backfill;
pub mod batch;
pub mod checkpoint;
pub mod deferred;
pub mod follow;
pub mod ingest;
pub mod schedule;
pub mod stream;

/// Shared flag: set it (on SIGTERM / Ctrl-C) to stop between batches or polls; work in
/// progress completes its commits first.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}
