//! Writing Delta tables: generic open/create/append/MERGE with application
//! transactions, the late-data ledger and the quarantine table.

pub mod delta;
pub mod late;
pub mod quarantine;
