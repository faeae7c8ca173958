//! How many rows the operators of one process recompute at once.
//!
//! A windowed batch recomputes its touched windows from bronze: at Kestrel's scale a
//! five-minute drop of 48k clickstream events, whose late tail touches the last two
//! hours, reads back ~1.1M rows for `clickstream_5m` and ~1.4M for `sessions`, and the
//! read holds ~250–300 MB at its peak. The two jobs read the same source, so a `run`
//! starts them together once it is ingested, and their peaks added up: a run's peak
//! RSS reached 1,080 MB. The budget lets computes overlap until their new rows pass it:
//! a batch holds `min(new rows, budget)` rows of it while it reads and aggregates, so
//! two batches of more than half the budget run one after the other, while small ones
//! (the revenue jobs' 2k orders, every job of a small drop) still run side by side.
//! A batch larger than the budget runs alone. See the README ("Cost over time", "What a
//! run holds at its peak").

use tokio::sync::{Semaphore, SemaphorePermit};

/// New rows that may be recomputed at once by default (`compute_budget_rows`).
pub const DEFAULT_ROWS: usize = 65_536;

/// Rows of recompute work admitted at once; shared by the jobs of a process.
#[derive(Debug)]
pub struct RowBudget {
    rows: usize,
    permits: Semaphore,
}

/// Rows held from a [`RowBudget`]; returned when dropped.
#[derive(Debug)]
pub struct Held<'a> {
    _permit: Option<SemaphorePermit<'a>>,
}

impl RowBudget {
    /// A budget of `rows` rows (at least one).
    pub fn new(rows: usize) -> Self {
        let rows = rows.clamp(1, u32::MAX as usize);
        RowBudget {
            rows,
            permits: Semaphore::new(rows),
        }
    }

    /// Wait until `rows` (capped at the budget, at least one) are free and hold them.
    /// Waiters are served in order, so a large batch is not overtaken for good.
    pub async fn hold(&self, rows: usize) -> Held<'_> {
        // The budget fits a u32 (see `new`), so the count does.
        let n = u32::try_from(rows.clamp(1, self.rows)).unwrap_or(u32::MAX);
        // Never closed, so acquiring cannot fail; if it did, do not wait.
        Held {
            _permit: self.permits.acquire_many(n).await.ok(),
        }
    }

    /// Rows free now (for tests and diagnostics).
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

impl Default for RowBudget {
    fn default() -> Self {
        RowBudget::new(DEFAULT_ROWS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn small_holds_share_the_budget_and_large_ones_take_turns() {
        let b = RowBudget::new(100);
        let a = b.hold(30).await;
        let c = b.hold(30).await;
        assert_eq!(b.available(), 40);
        drop((a, c));
        assert_eq!(b.available(), 100);
        // Beyond the budget: capped, so it runs alone rather than never.
        let big = b.hold(1_000).await;
        assert_eq!(b.available(), 0);
        drop(big);
        // Nothing to hold still takes a row, so an empty batch is admitted in turn.
        let empty = b.hold(0).await;
        assert_eq!(b.available(), 99);
        drop(empty);

        // Two holders of more than half the budget never overlap.
        let b = Arc::new(RowBudget::new(100));
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (b, inside, most) = (b.clone(), inside.clone(), most.clone());
                tokio::spawn(async move {
                    let _held = b.hold(60).await;
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1);
        assert_eq!(b.available(), 100);
    }
}
