//! Jobs: their definitions (`jobs/*.toml`, [`spec`]), durable batch plans ([`plan`]) and
//! the operators that compute them — pure functions over Arrow record batches with no I/O
//! of their own ([`aggregate`]), so micro-batch runs and backfills share them.

pub mod aggregate;
pub mod fold;
pub mod keys;
pub mod plan;
pub mod sessions_open;
pub mod spec;
