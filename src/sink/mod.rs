//! Writing Delta tables: generic open/create/append/MERGE with application
//! transactions, the late-data ledger and the quarantine table.

pub mod bloom;
pub mod cluster;
pub mod compact;
pub mod delta;
pub mod known;
pub mod late;
pub mod logcache;
pub mod loglist;
pub mod merge;
pub mod probe;
pub mod quarantine;
pub mod scan;
pub mod tables;
pub mod timings;
pub mod txn;
