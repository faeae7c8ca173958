//! Operating kestrel: [`status`] (freshness, watermarks, last runs).

pub mod status;
