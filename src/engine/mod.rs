//! Where kestrel's reads and aggregates execute: in this process (the embedded default)
//! or on an Apache DataFusion Ballista cluster (`[engine] kind = "ballista"`).
//!
//! The coordinator — the `kestrel run` / `schedule` / `backfill` process — stays the
//! only writer: plans, leases, MERGEs, the run log and every commit happen here, with the
//! same exactly-once protocol. What moves to the cluster are the operators' reads: a
//! [`port::ClusterPort`] registers each Delta table as the Parquet files of its current
//! snapshot, so the scans, filters, joins and aggregates of a job batch (and of a
//! backfill day) run on the executors, and only their results come back.
//!
//! - [`config`]: `[engine]` in `kestrel.toml`.
//! - [`connect`]: checking the scheduler before a run (unreachable, wrong version,
//!   `fallback = "local"`).
//! - [`port`]: the read port whose sessions execute remotely.
//! - [`codec`]: kestrel's plan codec (in-memory tables such as a keyed read's keys, and
//!   the version check), registered on the client, the scheduler and the executors.
//! - [`deadline`]: `[engine] job_timeout`, a bound on every cluster job.
//! - [`cluster`]: `kestrel cluster scheduler|executor`, Ballista's processes embedded.
//! - [`stores`]: the object stores a cluster process reads the warehouse with.
//! - [`ingest`]: a batch's decode, dedup and bronze write as a distributed stage.

pub mod cluster;
pub mod codec;
pub mod config;
pub mod connect;
pub mod deadline;
pub mod ingest;
pub mod port;
pub mod stores;

pub use config::{EngineConfig, EngineKind, Fallback};

/// What can go wrong reaching or running on a cluster.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The scheduler did not answer (down, wrong address, firewall).
    #[error("ballista scheduler {url} is unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    /// The scheduler runs another Ballista than this kestrel was built with: plans
    /// would not decode, or decode differently.
    #[error("ballista scheduler {url} runs ballista {theirs}; this kestrel is built with ballista {ours}: run the same kestrel version on the coordinator, scheduler and executors")]
    VersionMismatch {
        url: String,
        theirs: String,
        ours: String,
    },
    /// A plan from another kestrel version reached this process.
    #[error("a plan encoded by kestrel {theirs} reached kestrel {ours}: run the same kestrel version on the coordinator, scheduler and executors")]
    PlanVersion { theirs: String, ours: String },
    /// A distributed stage returned what kestrel cannot use, or lacks what it needs.
    #[error("{what}: {reason}")]
    Stage { what: String, reason: String },
    /// The scheduler refused this process's plans: another kestrel version.
    #[error("ballista scheduler {url} refused kestrel {ours}'s plans: {reason}")]
    Refused {
        url: String,
        ours: String,
        reason: String,
    },
    /// A cluster job gave no result within `[engine] job_timeout`.
    #[error("the cluster job gave no result within [engine] job_timeout ({timeout}){earlier}; the scheduler may have lost it (Ballista's adaptive planner after a lost executor: see its log for \"is not in running\"); nothing of the batch is committed and the next run resumes it")]
    JobTimeout {
        timeout: String,
        earlier: &'static str,
    },
    /// A cluster process could not start.
    #[error("{what}: {reason}")]
    Process { what: String, reason: String },
}

/// The version every cluster process and every encoded plan carries.
pub const KESTREL_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The kestrel version this process encodes plans with and accepts: [`KESTREL_VERSION`],
/// unless `KESTREL_TEST_VERSION` is set — a test hook that makes one process act as
/// another release, to check that mismatched processes refuse each other.
pub fn kestrel_version() -> &'static str {
    static V: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        std::env::var("KESTREL_TEST_VERSION")
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| KESTREL_VERSION.to_string())
    })
}

/// The Ballista version this kestrel is built with.
pub const BALLISTA_VERSION: &str = ballista_core::BALLISTA_VERSION;
