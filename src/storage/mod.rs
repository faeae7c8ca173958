//! Locations (landing zone, warehouse) as object stores: a local path (the embedded
//! default) or `s3://bucket/prefix` with `AWS_*` environment variables and `[storage]`
//! options.

pub mod retry;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use url::Url;

use crate::error::{Error, Result};

/// A resolved location: an object store plus the prefix inside it.
#[derive(Clone)]
pub struct Location {
    /// Canonical URL (directory URLs end with `/`).
    pub url: Url,
    /// The store.
    pub store: Arc<dyn ObjectStore>,
    /// Prefix inside the store (empty for a local directory, which is the store's root).
    pub prefix: ObjPath,
    /// For local locations: the directory (used for pruned listing).
    pub local_dir: Option<PathBuf>,
    /// Storage options, passed on to delta-rs for tables under this location.
    pub options: HashMap<String, String>,
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Location")
            .field("url", &self.url.as_str())
            .finish()
    }
}

/// Turn a config value (path or URL) into a directory URL. `create`: make a local dir.
pub fn to_url(s: &str, create: bool) -> Result<Url> {
    let bad = |reason: String| Error::Location {
        url: s.to_string(),
        reason,
    };
    let mut url = if s.contains("://") {
        Url::parse(s).map_err(|e| bad(e.to_string()))?
    } else {
        let p = PathBuf::from(s);
        if create {
            std::fs::create_dir_all(&p)
                .map_err(|e| bad(format!("cannot create directory: {e}")))?;
        }
        let abs = if p.is_absolute() {
            p
        } else {
            std::env::current_dir()
                .map_err(|e| bad(e.to_string()))?
                .join(p)
        };
        let abs = normalize(&abs);
        Url::from_directory_path(&abs).map_err(|_| bad("not an absolute path".into()))?
    };
    if !url.path().ends_with('/') {
        let p = format!("{}/", url.path());
        url.set_path(&p);
    }
    Ok(url)
}

fn normalize(p: &std::path::Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// `store` as kestrel uses it: transient failures retried ([`retry`]); below the
/// retries, the test fault points and the failing store when the environment asks for
/// them ([`crate::fault::FaultStore`]).
pub fn layered(store: Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> {
    let store = if crate::fault::wraps_store() {
        Arc::new(crate::fault::FaultStore::new(store))
    } else {
        store
    };
    Arc::new(retry::RetryStore::new(store))
}

impl Location {
    /// Open a location. `create`: create a local directory if missing (warehouse).
    pub fn open(s: &str, options: &BTreeMap<String, String>, create: bool) -> Result<Self> {
        let url = to_url(s, create)?;
        let options: HashMap<String, String> = options
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let bad = |reason: String| Error::Location {
            url: url.to_string(),
            reason,
        };
        match url.scheme() {
            "file" => {
                let dir = url
                    .to_file_path()
                    .map_err(|_| bad("not a local path".into()))?;
                if !dir.is_dir() {
                    return Err(bad("directory does not exist or is not readable".into()));
                }
                let store =
                    LocalFileSystem::new_with_prefix(&dir).map_err(|e| bad(e.to_string()))?;
                Ok(Location {
                    url,
                    store: layered(Arc::new(store)),
                    prefix: ObjPath::default(),
                    local_dir: Some(dir),
                    options,
                })
            }
            "s3" | "s3a" => {
                let bucket = url
                    .host_str()
                    .ok_or_else(|| bad("missing bucket name".into()))?
                    .to_string();
                let mut b = AmazonS3Builder::from_env().with_bucket_name(&bucket);
                for (k, v) in &options {
                    let key = k
                        .to_ascii_lowercase()
                        .parse()
                        .map_err(|e| bad(format!("unknown storage option `{k}`: {e}")))?;
                    b = b.with_config(key, v);
                }
                let store = b.build().map_err(|e| bad(e.to_string()))?;
                let prefix = ObjPath::from(url.path().trim_matches('/'));
                Ok(Location {
                    url,
                    store: layered(Arc::new(store)),
                    prefix,
                    local_dir: None,
                    options,
                })
            }
            "memory" => Ok(Location {
                url,
                store: Arc::new(InMemory::new()),
                prefix: ObjPath::default(),
                local_dir: None,
                options,
            }),
            other => Err(bad(format!("unsupported scheme `{other}`"))),
        }
    }

    /// Object path of a key relative to this location. The key is taken as it is (the
    /// name a listing returned, or one of kestrel's own): `ObjPath::from` would
    /// percent-encode `#`, `%`, `[`, `]` and every non-ASCII character, which names
    /// another object — a landed `w1 #7.ndjson` listed on S3, or walked on local disk,
    /// would then be "gone" when read. A key that is no valid path (empty segments,
    /// `.`/`..`, control characters) falls back to the encoded form.
    pub fn path(&self, rel: &str) -> ObjPath {
        let rel = rel.trim_matches('/');
        let full = if self.prefix.as_ref().is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix.as_ref())
        };
        ObjPath::parse(&full).unwrap_or_else(|_| ObjPath::from(full))
    }

    /// Key relative to this location of an object path (inverse of [`Location::path`]).
    pub fn relative(&self, p: &ObjPath) -> String {
        let s = p.as_ref();
        let pre = self.prefix.as_ref();
        if pre.is_empty() {
            s.to_string()
        } else {
            s.strip_prefix(pre)
                .map(|r| r.trim_start_matches('/').to_string())
                .unwrap_or_else(|| s.to_string())
        }
    }

    /// URL of a sub-directory (e.g. a Delta table under the warehouse).
    pub fn child_url(&self, rel: &str) -> Result<Url> {
        let rel = format!("{}/", rel.trim_matches('/'));
        self.url.join(&rel).map_err(|e| Error::Location {
            url: format!("{}{rel}", self.url),
            reason: e.to_string(),
        })
    }

    /// Write `bytes` at `rel` only if nothing is there (put-if-absent). Returns false when
    /// an object already exists.
    pub async fn put_if_absent(&self, rel: &str, bytes: Vec<u8>) -> Result<bool> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .store
            .put_opts(&self.path(rel), PutPayload::from(bytes), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(Error::storage(self.display(rel), e)),
        }
    }

    /// Write `bytes` at `rel`, replacing what is there.
    pub async fn put(&self, rel: &str, bytes: Vec<u8>) -> Result<()> {
        self.store
            .put(&self.path(rel), PutPayload::from(bytes))
            .await
            .map(|_| ())
            .map_err(|e| Error::storage(self.display(rel), e))
    }

    /// Read the object at `rel`; None when it does not exist.
    pub async fn get_opt(&self, rel: &str) -> Result<Option<bytes::Bytes>> {
        let t = std::time::Instant::now();
        let r = self.get_opt_inner(rel).await;
        crate::sink::timings::record("get".into(), t.elapsed());
        r
    }

    async fn get_opt_inner(&self, rel: &str) -> Result<Option<bytes::Bytes>> {
        match self.store.get(&self.path(rel)).await {
            Ok(r) => Ok(Some(
                r.bytes()
                    .await
                    .map_err(|e| Error::storage(self.display(rel), e))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Error::storage(self.display(rel), e)),
        }
    }

    /// Delete the object at `rel`; absent is fine.
    pub async fn delete_if_exists(&self, rel: &str) -> Result<()> {
        match self.store.delete(&self.path(rel)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Error::storage(self.display(rel), e)),
        }
    }

    /// Delete the objects under `prefix` that were last modified more than `older_than`
    /// ago and whose key (relative to this location) `expired` accepts. Returns how many
    /// were deleted.
    pub async fn expire(
        &self,
        prefix: &str,
        older_than: std::time::Duration,
        expired: impl Fn(&str) -> bool,
    ) -> Result<usize> {
        use futures::TryStreamExt;
        let cutoff = chrono::Utc::now()
            - chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::days(7));
        let listed: Vec<object_store::ObjectMeta> = self
            .store
            .list(Some(&self.path(prefix)))
            .try_collect()
            .await
            .map_err(|e| Error::storage(self.display(prefix), e))?;
        let mut n = 0;
        for meta in listed {
            let rel = self.relative(&meta.location);
            if meta.last_modified < cutoff && expired(&rel) {
                self.delete_if_exists(&rel).await?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// A display string for a relative key.
    pub fn display(&self, rel: &str) -> String {
        format!("{}{}", self.url, rel.trim_start_matches('/'))
    }
}
