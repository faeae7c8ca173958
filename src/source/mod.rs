//! Reading the landing zone: discover new files, decode them, validate records.

pub mod decode;
pub mod discover;
pub mod validate;
