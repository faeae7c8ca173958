//! Operating kestrel: [`status`] (freshness, watermarks, last runs) with [`slo`] (each
//! job's service levels against its objectives), [`maintain`]
//! (compaction, checkpoints, vacuum), [`lag`] (lateness and a suggested watermark) with its [`watermark_doc`] (the decision record), [`metrics`] and [`http`] (the daemon's
//! `/healthz` and `/metrics`).

pub mod http;
pub mod lag;
pub mod maintain;
pub mod metrics;
pub mod slo;
pub mod status;
pub mod watermark_doc;
