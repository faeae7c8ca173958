//! The threads that decode landed files: one per core, started on first use and kept
//! for the life of the process.
//!
//! Each decoder of a batch is one job here that takes file after file until none is
//! left (`runner::ingest::Ingestor::decode_all`), so a core goes from one file to the
//! next without waiting. A file at a time handed from the async runtime to tokio's
//! blocking pool and back (the store's open on one thread, the decode on another, the
//! next file started by the task) left a core idle for about a third of the decode on
//! this machine (virtual, two cores), where a thread woken on an idle core often
//! started milliseconds later, a file taking ≈ 4 ms: the decode phase kept 1.4–1.6
//! cores busy (`decode_cpu_ms` ÷ `decode_ms` in the batch log). The same loops on
//! blocking-pool threads kept ≈ 1.9 busy but landed on other threads from batch to
//! batch, each with its own malloc arena holding what its last batch freed: the
//! throughput benchmark's peak rose from 725 to 958 MiB. Threads of their own keep
//! the decode's memory in the same arenas, batch after batch.
//!
//! A job that panics is reported as the caller's error ([`run`]) and the thread goes on
//! with the next job. If no thread can be started, jobs run on tokio's blocking pool.

use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex, OnceLock};

use crate::error::{Error, Result};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The decoding threads' queue; `None` when none could be started.
struct Pool {
    jobs: Option<mpsc::Sender<Job>>,
}

/// Decoding threads: one per core.
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..threads() {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("kestrel-decode-{i}"))
                .spawn(move || loop {
                    // One thread waits for the next job while holding the lock; the
                    // others wait for the lock.
                    let job = match rx.lock() {
                        Ok(queue) => queue.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "could not start a decoding thread"),
            }
        }
        Pool {
            jobs: (started > 0).then_some(tx),
        }
    })
}

/// Run `work` on a decoding thread and return its result; `what` names it in the error
/// when it panics.
pub async fn run<T: Send + 'static>(
    what: impl FnOnce() -> String,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let Some(jobs) = &pool().jobs else {
        return on_blocking_thread(what, work).await;
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        let result = std::panic::catch_unwind(AssertUnwindSafe(work))
            .map_err(|panic| crate::error::panic_message(panic.as_ref()));
        let _ = tx.send(result);
    });
    if jobs.send(job).is_err() {
        return Err(Error::Panicked {
            what: what(),
            message: "the decoding threads are gone".into(),
        });
    }
    match rx.await {
        Ok(Ok(result)) => result,
        Ok(Err(message)) => Err(Error::Panicked {
            what: what(),
            message,
        }),
        Err(_) => Err(Error::Panicked {
            what: what(),
            message: "its decoding thread dropped it".into(),
        }),
    }
}

/// Run CPU-bound work (decoding a file) on tokio's blocking pool; `what` names it in
/// the error when it panics.
pub async fn on_blocking_thread<T: Send + 'static>(
    what: impl FnOnce() -> String,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|source| Error::Task {
            what: what(),
            source,
        })?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jobs run and return their results, more at once than there are threads; one that
    /// panics is its caller's error and the threads go on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_return_their_results_and_a_panic_is_an_error() {
        let jobs = (0..4 * threads()).map(|i| {
            run(
                move || format!("job {i}"),
                move || Ok(std::thread::current().name().map(|n| (i, n.to_string()))),
            )
        });
        let done = futures::future::try_join_all(jobs).await.unwrap();
        for (i, d) in done.into_iter().enumerate() {
            let (j, name) = d.unwrap();
            assert_eq!(j, i);
            assert!(name.starts_with("kestrel-decode-"), "{name}");
        }
        let err = run(
            || "a failing job".into(),
            || -> Result<()> { panic!("boom") },
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, Error::Panicked { what, message } if what == "a failing job" && message == "boom"),
            "{err}"
        );
        assert_eq!(run(|| "after".into(), || Ok(7)).await.unwrap(), 7);
    }
}
