//! Jobs: their definitions (`jobs/*.toml`). The operators that run them come with the
//! jobs issues; `spec` parses and validates definitions at load.

pub mod spec;
