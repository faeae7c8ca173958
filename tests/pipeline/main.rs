//! Integration tests: one test binary (every test binary links all of DataFusion).
//! They drive the real `kestrel` binary against real Delta tables in temp directories.

mod backfill;
mod cdc;
mod cluster;
mod common;
mod compaction;
mod faults;
mod handover;
mod ingest;
mod jobs;
mod ops;
mod payments;
mod s3;
mod select;
mod stockout;
mod writers;
