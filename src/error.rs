//! Library errors. The binary turns these into a one-line message on stderr.

use std::path::PathBuf;

/// Result alias used throughout the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong inside kestrel, by kind.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration or job file is invalid: names the file, the field and what was expected.
    #[error("{file}: field `{field}`: expected {expected}")]
    Config {
        file: String,
        field: String,
        expected: String,
    },

    /// A schema file (`schemas/<source>.json`) is invalid.
    #[error("schema {file}: {message}")]
    Schema { file: PathBuf, message: String },

    /// An object-store operation failed (landing zone or warehouse).
    #[error("storage {url}: {source}")]
    Storage {
        url: String,
        #[source]
        source: object_store::Error,
    },

    /// A Delta table operation failed.
    #[error("delta table {table}: {source}")]
    Delta {
        table: String,
        #[source]
        source: deltalake::DeltaTableError,
    },

    /// A DataFusion query failed.
    #[error("query {what}: {source}")]
    Query {
        what: String,
        #[source]
        source: datafusion::error::DataFusionError,
    },

    /// Building an Arrow array or batch failed.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),

    /// Local I/O (config files, schemas, the demo writer).
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    /// A URL given for landing or warehouse cannot be used.
    #[error("invalid location `{url}`: {reason}")]
    Location { url: String, reason: String },

    /// Another process holds a lease.
    #[error("{name} is busy: lease held by {owner} until {until} (remove {path} if that process is gone)")]
    LeaseHeld {
        name: String,
        owner: String,
        until: String,
        path: String,
    },

    /// A durable batch plan is unreadable or inconsistent.
    #[error("batch plan {path}: {reason}")]
    Plan { path: String, reason: String },

    /// A job named on the command line that no job file defines.
    #[error("unknown job `{name}` (known: {known})")]
    UnknownJob { name: String, known: String },

    /// A source named on the command line that no schema defines (or the config leaves out).
    #[error("unknown source `{name}` (known: {known})")]
    UnknownSource { name: String, known: String },

    /// Rows without a column their reader needs, or of another type.
    #[error(transparent)]
    Column(#[from] crate::columns::ColumnError),

    /// Rows a deferred output cannot hold.
    #[error(transparent)]
    Pending(#[from] crate::operator::pending::PendingError),

    /// Probing a table's files for values (dedup, the ledger) failed.
    #[error(transparent)]
    Probe(#[from] crate::sink::probe::ProbeError),

    /// A MERGE into a gold table could not read or fit its rows.
    #[error(transparent)]
    Merge(#[from] crate::sink::merge::MergeError),

    /// Interned keys out of step with a job's rows (an invariant).
    #[error(transparent)]
    Key(#[from] crate::job::keys::KeyError),

    /// The daemon cannot start or run a task.
    #[error(transparent)]
    Schedule(#[from] crate::runner::schedule::ScheduleError),

    /// A backfill cannot start, or stopped before its last day.
    #[error(transparent)]
    Backfill(#[from] crate::runner::backfill::BackfillError),

    /// A lease could not be taken or kept.
    #[error(transparent)]
    Lease(#[from] crate::lease::LeaseError),

    /// Reaching or running on a cluster engine.
    #[error(transparent)]
    Engine(#[from] crate::engine::EngineError),

    /// A source without a schema.
    #[error("no schema for source `{0}`")]
    NoSchema(String),

    /// A batch's commit lost every retry to other writers' commits.
    #[error("{table}: batch {batch} lost {attempts} commit races in a row with other writers; the next run retries it ({last})")]
    CommitRaces {
        table: String,
        batch: i64,
        attempts: u32,
        last: String,
    },

    /// kestrel's own bookkeeping (plans, results, manifests) failed to serialise.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),

    /// `kestrel lag` has nothing to analyse or cannot draw its chart.
    #[error(transparent)]
    Lag(#[from] crate::ops::lag::LagError),

    /// Writing or reading Parquet structures kestrel builds itself (bloom filters).
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),

    /// A run of the daemon panicked (a bug, reported as that run's failure).
    #[error("{what} panicked: {message}")]
    Panicked { what: String, message: String },

    /// A background task (a file's decoder) panicked or was cancelled.
    #[error("{what}: {source}")]
    Task {
        what: String,
        #[source]
        source: tokio::task::JoinError,
    },

    /// A lock whose holder panicked: what it guarded may be half updated.
    #[error("{0}: a thread panicked while holding its lock")]
    Poisoned(&'static str),
}

/// The text of a panic's payload (`panic!` with a message gives a `&str` or `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Whether a Delta error is a lost race with a concurrent commit (the commit can be
/// planned again against the newer table), not a failure.
pub fn is_delta_conflict(e: &deltalake::DeltaTableError) -> bool {
    use deltalake::kernel::transaction::TransactionError;
    use deltalake::DeltaTableError as E;
    match e {
        E::Transaction { source } => matches!(
            source,
            TransactionError::CommitConflict(_)
                | TransactionError::MaxCommitAttempts(_)
                | TransactionError::VersionAlreadyExists(_)
        ),
        E::CommitValidation { .. } => false,
        other => {
            let s = other.to_string();
            s.contains("ommit conflict") || s.contains("concurrent transaction")
        }
    }
}

impl Error {
    /// A Delta commit that lost a race with another writer's (see [`is_delta_conflict`]).
    pub fn is_commit_conflict(&self) -> bool {
        matches!(self, Error::Delta { source, .. } if is_delta_conflict(source))
    }

    pub(crate) fn delta(table: impl Into<String>, source: deltalake::DeltaTableError) -> Self {
        Error::Delta {
            table: crate::sink::delta::shown(table.into()),
            source,
        }
    }

    pub(crate) fn query(
        what: impl Into<String>,
        source: datafusion::error::DataFusionError,
    ) -> Self {
        Error::Query {
            what: crate::sink::delta::shown(what.into()),
            source,
        }
    }

    pub(crate) fn storage(url: impl Into<String>, source: object_store::Error) -> Self {
        Error::Storage {
            url: url.into(),
            source,
        }
    }

    pub(crate) fn io(path: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn config(
        file: impl Into<String>,
        field: impl Into<String>,
        expected: impl Into<String>,
    ) -> Self {
        Error::Config {
            file: file.into(),
            field: field.into(),
            expected: expected.into(),
        }
    }
}
