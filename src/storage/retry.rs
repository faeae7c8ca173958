//! Object-store calls retried: every store kestrel opens (landing, warehouse, the Delta
//! tables' stores) is wrapped in [`RetryStore`]. A transient failure (object_store's
//! `Generic` error: a timeout, a reset connection, a 5xx the client's own retries gave up
//! on, an I/O error) is retried with jittered backoff, a few times, then returned.
//! Definite answers (not found, already exists, precondition failed, invalid path, not
//! supported) are returned at once.
//!
//! A put-if-absent is the delicate case (arrow-rs object_store #852): the write may land
//! while the answer is lost, and the retry — or the client's own retry — then finds the
//! object there. An "already exists" whose object holds exactly the bytes this call
//! wrote is therefore this call's own write and reported as success. Every create kestrel
//! and delta-rs make writes content unique to its writer (a lease names its pid and
//! time, a plan its creation time, a Delta commit its files' UUIDs), so equal bytes are
//! never another writer's.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
    Result,
};

/// Attempts per call (the first included).
pub const ATTEMPTS: u32 = 5;

/// A store whose transient failures are retried (see the module docs).
#[derive(Debug)]
pub struct RetryStore {
    inner: Arc<dyn ObjectStore>,
}

impl RetryStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        RetryStore { inner }
    }
}

/// Whether `e` may go away on its own.
fn transient(e: &object_store::Error) -> bool {
    matches!(
        e,
        object_store::Error::Generic { .. } | object_store::Error::JoinError { .. }
    )
}

/// Wait before attempt `attempt + 1`: 20 ms doubling, ±50 % jitter.
fn backoff(attempt: u32) -> Duration {
    use rand::Rng;
    let base = 20u64 << attempt.min(6);
    Duration::from_millis(rand::thread_rng().gen_range(base / 2..=base + base / 2))
}

/// Run `op` until it succeeds, fails for good, or has failed [`ATTEMPTS`] times.
async fn retried<T, F, Fut>(what: &str, location: &Path, mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if transient(&e) && attempt + 1 < ATTEMPTS => {
                tracing::debug!(what, %location, attempt, error = %e, "store call failed; retrying");
                let wait = backoff(attempt);
                // delta-rs calls some stores outside a Tokio runtime (see `sink::loglist`).
                if tokio::runtime::Handle::try_current().is_ok() {
                    tokio::time::sleep(wait).await;
                } else {
                    std::thread::sleep(wait);
                }
                attempt += 1;
            }
            r => return r,
        }
    }
}

/// The bytes of `payload`, whole.
fn bytes_of(payload: &PutPayload) -> Bytes {
    let mut out = Vec::with_capacity(payload.content_length());
    for chunk in payload.iter() {
        out.extend_from_slice(chunk);
    }
    out.into()
}

#[async_trait::async_trait]
impl ObjectStore for RetryStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let create = matches!(opts.mode, PutMode::Create);
        let r = retried("put", location, || {
            self.inner.put_opts(location, payload.clone(), opts.clone())
        })
        .await;
        match r {
            Err(object_store::Error::AlreadyExists { path, source }) if create => {
                // Ours, if it holds what we wrote (the answer to our write was lost).
                let there = retried("get", location, || async {
                    self.inner.get(location).await?.bytes().await
                })
                .await;
                match there {
                    Ok(b) if b == bytes_of(&payload) => {
                        tracing::info!(%location, "create answered 'already exists' but holds our bytes: it was ours");
                        let meta = self.inner.head(location).await.ok();
                        Ok(PutResult {
                            e_tag: meta.as_ref().and_then(|m| m.e_tag.clone()),
                            version: meta.and_then(|m| m.version),
                        })
                    }
                    _ => Err(object_store::Error::AlreadyExists { path, source }),
                }
            }
            r => r,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        retried("put multipart", location, || {
            self.inner.put_multipart_opts(location, opts.clone())
        })
        .await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        retried("get", location, || {
            self.inner.get_opts(location, options.clone())
        })
        .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        // Deletes run 16 at a time (a vacuum deletes thousands), each retried alone.
        let inner = self.inner.clone();
        locations
            .map(move |l| {
                let inner = inner.clone();
                async move {
                    let l = l?;
                    let r = retried("delete", &l, || inner.delete(&l)).await;
                    r.map(|()| l)
                }
            })
            .buffered(16)
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        let (inner, prefix) = (self.inner.clone(), prefix.cloned());
        // A listing is retried whole (a retry in the middle would repeat entries).
        futures::stream::once(async move {
            let at = prefix.clone().unwrap_or_default();
            retried("list", &at, || {
                inner.list(prefix.as_ref()).try_collect::<Vec<_>>()
            })
            .await
        })
        .map_ok(|v| futures::stream::iter(v.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        let (inner, prefix, offset) = (self.inner.clone(), prefix.cloned(), offset.clone());
        futures::stream::once(async move {
            let at = prefix.clone().unwrap_or_default();
            retried("list", &at, || {
                inner
                    .list_with_offset(prefix.as_ref(), &offset)
                    .try_collect::<Vec<_>>()
            })
            .await
        })
        .map_ok(|v| futures::stream::iter(v.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        let at = prefix.cloned().unwrap_or_default();
        retried("list", &at, || self.inner.list_with_delimiter(prefix)).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        retried("copy", to, || {
            self.inner.copy_opts(from, to, options.clone())
        })
        .await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        retried("rename", to, || {
            self.inner.rename_opts(from, to, options.clone())
        })
        .await
    }
}

impl std::fmt::Display for RetryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RetryStore({})", self.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;

    /// A store whose first `fail` calls fail transiently, and whose creates land but
    /// answer with an error while `lose_answer` is set.
    #[derive(Debug)]
    struct Flaky {
        inner: InMemory,
        fail: std::sync::atomic::AtomicU32,
        lose_answer: std::sync::atomic::AtomicBool,
    }

    impl std::fmt::Display for Flaky {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Flaky")
        }
    }

    fn generic() -> object_store::Error {
        object_store::Error::Generic {
            store: "flaky",
            source: "timeout".into(),
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Flaky {
        async fn put_opts(&self, l: &Path, p: PutPayload, o: PutOptions) -> Result<PutResult> {
            use std::sync::atomic::Ordering::SeqCst;
            if self.fail.load(SeqCst) > 0 {
                self.fail.fetch_sub(1, SeqCst);
                return Err(generic());
            }
            let r = self.inner.put_opts(l, p, o).await?;
            if self.lose_answer.swap(false, SeqCst) {
                return Err(generic());
            }
            Ok(r)
        }
        async fn put_multipart_opts(
            &self,
            l: &Path,
            o: PutMultipartOptions,
        ) -> Result<Box<dyn MultipartUpload>> {
            self.inner.put_multipart_opts(l, o).await
        }
        async fn get_opts(&self, l: &Path, o: GetOptions) -> Result<GetResult> {
            self.inner.get_opts(l, o).await
        }
        fn delete_stream(
            &self,
            l: BoxStream<'static, Result<Path>>,
        ) -> BoxStream<'static, Result<Path>> {
            self.inner.delete_stream(l)
        }
        fn list(&self, p: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
            self.inner.list(p)
        }
        async fn list_with_delimiter(&self, p: Option<&Path>) -> Result<ListResult> {
            self.inner.list_with_delimiter(p).await
        }
        async fn copy_opts(&self, f: &Path, t: &Path, o: CopyOptions) -> Result<()> {
            self.inner.copy_opts(f, t, o).await
        }
    }

    fn create() -> PutOptions {
        PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        }
    }

    /// Transient failures are retried; a create whose answer was lost is found to be
    /// ours by its bytes; another writer's object is still "already exists".
    #[tokio::test]
    async fn transient_failures_and_lost_create_answers_are_resolved() {
        let flaky = Arc::new(Flaky {
            inner: InMemory::new(),
            fail: 3.into(),
            lose_answer: false.into(),
        });
        let store = RetryStore::new(flaky.clone());
        let a = Path::from("a");
        store.put_opts(&a, "one".into(), create()).await.unwrap();
        assert_eq!(store.get(&a).await.unwrap().bytes().await.unwrap(), "one");
        // Too many failures in a row: the error comes back.
        flaky
            .fail
            .store(ATTEMPTS, std::sync::atomic::Ordering::SeqCst);
        let e = store.put(&Path::from("b"), "x".into()).await.unwrap_err();
        assert!(transient(&e), "{e}");
        flaky.fail.store(0, std::sync::atomic::Ordering::SeqCst);
        // The write lands, its answer is lost, the retry finds the object: ours.
        flaky
            .lose_answer
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let c = Path::from("c");
        store.put_opts(&c, "mine".into(), create()).await.unwrap();
        // Someone else's object at the key: already exists, as it should.
        let e = store
            .put_opts(&c, "theirs".into(), create())
            .await
            .unwrap_err();
        assert!(
            matches!(e, object_store::Error::AlreadyExists { .. }),
            "{e}"
        );
    }
}
