//! kestrel: a micro-batch incremental pipeline on Delta Lake.
//!
//! Data flows one way: landing → [`source`] → bronze → jobs → [`sink`] → gold. The
//! [`runner`] decides when; `main.rs` only parses the command line and calls in here.

pub mod alloc;
pub mod app;
pub mod columns;
pub mod config;
pub mod demo;
pub mod engine;
pub mod error;
pub mod fault;
pub mod job;
pub mod lease;
pub mod ledger;
pub mod names;
pub mod operator;
pub mod ops;
pub mod runlog;
pub mod runner;
pub mod schema;
pub mod sink;
pub mod source;
pub mod storage;
pub mod time;

pub use error::{Error, Result};
