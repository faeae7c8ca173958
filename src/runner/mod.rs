//! Runners decide when work happens: ingestion of landed files (one micro-batch at a time).

pub mod ingest;
