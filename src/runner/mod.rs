//! Runners decide when work happens: ingestion of landed files ([`ingest`]) and job
//! micro-batches ([`batch`]), one batch at a time; [`read`] holds the bronze reads jobs use.

pub mod batch;
pub mod checkpoint;
pub mod ingest;
mod payments;
pub mod read;
mod stockout;
pub mod stream;
