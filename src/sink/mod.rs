//! Writing Delta tables: generic open/create/append with application transactions,
//! and the quarantine table.

pub mod delta;
pub mod quarantine;
