//! The object stores of a cluster process: local files as DataFusion has them, and every
//! `s3://bucket` opened on first use the way kestrel opens its own locations
//! ([`crate::storage::Location`]: the `AWS_*` environment, then the `[storage]` options of
//! the `--config` the process was started with), so executors read the warehouse with
//! the coordinator's credentials and endpoint.

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
use object_store::ObjectStore;
use url::Url;

use crate::storage::Location;

static PROCESS_OPTIONS: std::sync::OnceLock<BTreeMap<String, String>> = std::sync::OnceLock::new();

/// Remember the `[storage]` options this cluster process was started with (its
/// `--config`): the stores its tasks open themselves (landing files, Delta tables) use
/// them, since credentials never travel in plans. Set once, at start.
pub fn set_process_options(options: BTreeMap<String, String>) {
    let _ = PROCESS_OPTIONS.set(options);
}

/// The options [`set_process_options`] remembered (none in a process that did not set
/// them: local files and `AWS_*` only).
pub fn process_options() -> BTreeMap<String, String> {
    PROCESS_OPTIONS.get().cloned().unwrap_or_default()
}

/// Object stores by bucket, S3 ones created on demand.
#[derive(Debug)]
pub struct WarehouseStores {
    known: DefaultObjectStoreRegistry,
    options: BTreeMap<String, String>,
}

impl WarehouseStores {
    /// Stores opened with `options` (`[storage]`).
    pub fn new(options: BTreeMap<String, String>) -> Self {
        WarehouseStores {
            known: DefaultObjectStoreRegistry::new(),
            options,
        }
    }
}

impl ObjectStoreRegistry for WarehouseStores {
    fn register_store(
        &self,
        url: &Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        self.known.register_store(url, store)
    }

    fn deregister_store(&self, url: &Url) -> Result<Arc<dyn ObjectStore>> {
        self.known.deregister_store(url)
    }

    fn get_store(&self, url: &Url) -> Result<Arc<dyn ObjectStore>> {
        if let Ok(store) = self.known.get_store(url) {
            return Ok(store);
        }
        match url.scheme() {
            "s3" | "s3a" => {
                let bucket = format!("{}://{}", url.scheme(), url.host_str().unwrap_or(""));
                let loc = Location::open(&bucket, &self.options, false).map_err(|e| {
                    DataFusionError::External(Box::new(super::EngineError::Process {
                        what: format!("open object store {bucket} on this cluster process"),
                        reason: e.to_string(),
                    }))
                })?;
                let parsed = Url::parse(&bucket)
                    .map_err(|e| DataFusionError::Configuration(format!("{bucket}: {e}")))?;
                self.known.register_store(&parsed, loc.store.clone());
                Ok(loc.store)
            }
            _ => self.known.get_store(url),
        }
    }
}
