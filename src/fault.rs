//! Fault injection for crash tests: `KESTREL_FAULT=<point>[,<point>…]` makes the process
//! SIGKILL itself when it reaches a named point — a real kill -9, no unwinding, no flush.
//!
//! Points of ingestion, in order: `after_plan`, `after_decode`, `after_bronze`,
//! `after_quarantine`, `after_ledger`, `after_runlog`. Of a job batch: `job_after_plan`,
//! `job_after_compute`, `job_after_late`, `job_between_merges` (before every gold commit
//! after the first), `job_before_completing_merge` (before the last of two or more),
//! `job_after_gold`,
//! `job_after_runlog`. Of a stream: `stream_after_state_commit` (a poll committed a
//! partition of its deferred state), `stream_before_finish` (the loop ended; pending
//! state not committed). Of a backfill: `backfill_after_day`. Inside a delta-rs commit:
//! `compaction_commit` (an open-partition compaction's files are written, its commit is
//! not; see [`FaultStore`]). The process dies at the first commit put while any of its
//! compactions runs — when jobs run side by side, that can be another job's gold or
//! run-log commit, an ordinary kill point of that job's batch.
//!
//! Pause points (`KESTREL_DELAY`): `job_after_compute`, and `job_before_gold_commit`
//! (a gold table is opened for a batch's commit; a test commits to it meanwhile).
//!
//! A failing store (`KESTREL_STORE_FAULTS=rate=0.05[,ambiguous=0.02][,seed=N][,path=P]`):
//! every object-store call of the process (landing, warehouse, Delta tables) fails with a
//! transient error at `rate`, before it reaches the store; and a put-if-absent that
//! *did* write reports an error anyway at `ambiguous` (S3's answer lost on the way back).
//! With `path`, only calls on locations that start with `P` inside their store (a
//! source's landed files: `path=<source>/`) fail. Unset, nothing is wrapped.

use futures::StreamExt;

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

/// Environment variable of the failing store.
pub const STORE_FAULTS_ENV: &str = "KESTREL_STORE_FAULTS";

/// Injected object-store faults (see the module docs).
#[derive(Debug)]
pub struct StoreFaults {
    rate: f64,
    ambiguous: f64,
    /// Only locations starting with this fail (all when None).
    path: Option<String>,
    rng: std::sync::Mutex<rand::rngs::StdRng>,
}

impl StoreFaults {
    fn parse(spec: &str) -> Option<Self> {
        use rand::SeedableRng;
        let (mut rate, mut ambiguous, mut seed, mut path) = (0.0, 0.0, None, None);
        for kv in spec.split(',').filter(|s| !s.trim().is_empty()) {
            let (k, v) = kv.split_once('=')?;
            match k.trim() {
                "rate" => rate = v.trim().parse().ok()?,
                "ambiguous" => ambiguous = v.trim().parse().ok()?,
                "seed" => seed = Some(v.trim().parse().ok()?),
                "path" => path = Some(v.trim().to_string()),
                _ => return None,
            }
        }
        let rng = match seed {
            Some(s) => rand::rngs::StdRng::seed_from_u64(s),
            None => rand::rngs::StdRng::from_entropy(),
        };
        Some(StoreFaults {
            rate,
            ambiguous,
            path,
            rng: std::sync::Mutex::new(rng),
        })
    }

    /// Whether a call on `location` fails, at probability `p`.
    fn roll(&self, p: f64, location: &str) -> bool {
        use rand::Rng;
        p > 0.0
            && self.path.as_ref().is_none_or(|s| location.starts_with(s))
            && self.rng.lock().is_ok_and(|mut r| r.gen_bool(p.min(1.0)))
    }
}

/// The failing store's settings, if `KESTREL_STORE_FAULTS` asks for one (a malformed
/// value is reported once and ignored).
pub fn store_faults() -> Option<&'static StoreFaults> {
    static FAULTS: std::sync::OnceLock<Option<StoreFaults>> = std::sync::OnceLock::new();
    FAULTS
        .get_or_init(|| {
            let spec = std::env::var(STORE_FAULTS_ENV).ok()?;
            let f = StoreFaults::parse(&spec);
            if f.is_none() {
                tracing::warn!(%spec, "{STORE_FAULTS_ENV}: expected rate=P[,ambiguous=P][,seed=N][,path=P]; ignored");
            }
            f
        })
        .as_ref()
}

/// Whether object stores must be opened through [`FaultStore`] (a fault point sits inside
/// a delta-rs commit, or the store is to fail). Never true unless the environment asks.
pub fn wraps_store() -> bool {
    named(COMPACTION_COMMIT) || store_faults().is_some()
}

/// The error an injected fault returns (a transient one: what a timeout looks like).
fn injected(op: &str, location: &object_store::path::Path) -> object_store::Error {
    object_store::Error::Generic {
        store: "kestrel-fault",
        source: format!("injected transient fault: {op} {location}").into(),
    }
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

    /// Fail this call at the configured rate.
    fn fail(&self, op: &str, location: &object_store::path::Path) -> object_store::Result<()> {
        match store_faults() {
            Some(f) if f.roll(f.rate, location.as_ref()) => {
                tracing::debug!(op, %location, "injected store fault");
                Err(injected(op, location))
            }
            _ => Ok(()),
        }
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
        self.fail("put", location)?;
        let create = matches!(opts.mode, object_store::PutMode::Create);
        let r = self.inner.put_opts(location, payload, opts).await?;
        if create && store_faults().is_some_and(|f| f.roll(f.ambiguous, location.as_ref())) {
            tracing::debug!(%location, "injected ambiguous create: written, reported failed");
            return Err(injected("put (written)", location));
        }
        Ok(r)
    }

    async fn put_multipart_opts(
        &self,
        location: &object_store::path::Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.fail("put multipart", location)?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &object_store::path::Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        self.fail("get", location)?;
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<
            'static,
            object_store::Result<object_store::path::Path>,
        >,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
        if store_faults().is_none() {
            return self.inner.delete_stream(locations);
        }
        // A failed delete leaves the object; the stream reports it and goes on.
        let inner = self.inner.clone();
        locations
            .then(move |l| {
                let inner = inner.clone();
                async move {
                    let l = l?;
                    match store_faults() {
                        Some(f) if f.roll(f.rate, l.as_ref()) => Err(injected("delete", &l)),
                        _ => object_store::ObjectStoreExt::delete(&inner, &l)
                            .await
                            .map(|()| l),
                    }
                }
            })
            .boxed()
    }

    fn list(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        let root = object_store::path::Path::default();
        if let Err(e) = self.fail("list", prefix.unwrap_or(&root)) {
            return futures::stream::once(async move { Err(e) }).boxed();
        }
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&object_store::path::Path>,
        offset: &object_store::path::Path,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        let root = object_store::path::Path::default();
        if let Err(e) = self.fail("list", prefix.unwrap_or(&root)) {
            return futures::stream::once(async move { Err(e) }).boxed();
        }
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> object_store::Result<object_store::ListResult> {
        let root = object_store::path::Path::default();
        self.fail("list", prefix.unwrap_or(&root))?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.check(to);
        self.fail("copy", to)?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::RenameOptions,
    ) -> object_store::Result<()> {
        self.check(to);
        self.fail("rename", to)?;
        self.inner.rename_opts(from, to, options).await
    }
}
