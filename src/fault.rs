//! Fault injection for crash tests: `KESTREL_FAULT=<point>[,<point>…]` makes the process
//! SIGKILL itself when it reaches a named point — a real kill -9, no unwinding, no flush.
//!
//! Points of ingestion, in order: `after_plan`, `after_decode`, `after_bronze`,
//! `after_quarantine`, `after_ledger`, `after_runlog`. Of a job batch: `job_after_plan`,
//! `job_after_compute`, `job_after_late`, `job_between_merges`, `job_after_gold`,
//! `job_after_runlog`. Of a backfill: `backfill_after_day`. Inside a delta-rs commit:
//! `compaction_commit` (an open-partition compaction's files are written, its commit is
//! not; see [`FaultStore`]).
//!
//! Pause points (`KESTREL_DELAY`): `job_after_compute`, and `job_before_gold_commit`
//! (a gold table is opened for a batch's commit; a test commits to it meanwhile).

/// Environment variable naming the fault points.
pub const ENV: &str = "KESTREL_FAULT";

/// Environment variable naming points to pause at: `KESTREL_DELAY=<point>:<ms>[,…]`
/// (tests of overlapping runs and of shutdown in the middle of a batch).
pub const DELAY_ENV: &str = "KESTREL_DELAY";

/// Pause (without blocking the thread) if `point` is named in `KESTREL_DELAY`.
pub async fn pause(point: &str) {
    let Ok(v) = std::env::var(DELAY_ENV) else {
        return;
    };
    for d in v.split(',') {
        if let Some((p, ms)) = d.split_once(':') {
            if p.trim() == point {
                let ms = ms.trim().parse::<u64>().unwrap_or(0);
                tracing::info!(point, ms, "fault injection: pausing");
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
        }
    }
}

/// Kill the process with SIGKILL if `point` is named in `KESTREL_FAULT`.
pub fn point(point: &str) {
    let Ok(v) = std::env::var(ENV) else { return };
    if v.split(',').any(|p| p.trim() == point) {
        eprintln!("kestrel: fault injection: SIGKILL at {point}");
        // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        // SIGKILL cannot be caught; if kill failed, abort is the next best crash.
        std::process::abort();
    }
}

/// Fault point inside an open-partition compaction: its new files are written, its
/// Delta commit is about to be put (`KESTREL_FAULT=compaction_commit`).
pub const COMPACTION_COMMIT: &str = "compaction_commit";

static COMPACTING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Marks a compaction in progress while alive (see [`COMPACTION_COMMIT`]).
pub struct Compacting(());

impl Drop for Compacting {
    fn drop(&mut self) {
        COMPACTING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Mark the current work as a compaction until the returned guard is dropped.
pub fn compacting() -> Compacting {
    COMPACTING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Compacting(())
}

fn named(point: &str) -> bool {
    std::env::var(ENV).is_ok_and(|v| v.split(',').any(|p| p.trim() == point))
}

/// Whether Delta tables must be opened through [`FaultStore`] (a fault point sits inside
/// a delta-rs commit). Never true unless the environment asks for it.
pub fn wraps_store() -> bool {
    named(COMPACTION_COMMIT)
}

/// An object store that reaches fault points where delta-rs, not kestrel, does the I/O:
/// the put of a commit file while a compaction runs. Used only when [`wraps_store`].
#[derive(Debug)]
pub struct FaultStore {
    inner: std::sync::Arc<dyn object_store::ObjectStore>,
}

impl FaultStore {
    /// Wrap `inner` (rooted where delta-rs expects its table stores to be rooted).
    pub fn new(inner: std::sync::Arc<dyn object_store::ObjectStore>) -> Self {
        FaultStore { inner }
    }

    fn check(&self, location: &object_store::path::Path) {
        let p = location.as_ref();
        let is_commit = p.contains("_delta_log/")
            && p.rsplit('/')
                .next()
                .and_then(|n| n.strip_suffix(".json"))
                .is_some_and(|v| v.len() == 20 && v.bytes().all(|b| b.is_ascii_digit()));
        if is_commit && COMPACTING.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            point(COMPACTION_COMMIT);
        }
    }
}

impl std::fmt::Display for FaultStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FaultStore({})", self.inner)
    }
}

#[async_trait::async_trait]
impl object_store::ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &object_store::path::Path,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.check(location);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &object_store::path::Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &object_store::path::Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<
            'static,
            object_store::Result<object_store::path::Path>,
        >,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&object_store::path::Path>,
        offset: &object_store::path::Path,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.check(to);
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::RenameOptions,
    ) -> object_store::Result<()> {
        self.check(to);
        self.inner.rename_opts(from, to, options).await
    }
}
