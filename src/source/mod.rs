//! Reading the landing zone: discover new files, decode them, validate records.

mod cdc;
pub mod decode;
pub mod dedup;
pub mod discover;
mod flat;
pub mod pool;
pub mod read;
pub mod validate;

#[cfg(test)]
mod fuzz;
