//! Every name kestrel gives things in a warehouse, in one place: table paths, object
//! keys under `_kestrel/`, Delta application ids (the `txn` every commit carries) and
//! lease names. A name written twice drifts; these are part of the on-disk contract
//! (DESIGN: layout, exactly-once protocol), so a change here is a migration.

/// Table paths, relative to the warehouse root.
pub mod table {
    /// The run log (`_kestrel/runs`).
    pub const RUNS: &str = "_kestrel/runs";
    /// The file ledger (`_kestrel/ledger`).
    pub const LEDGER: &str = "_kestrel/ledger";
    /// Where gold tables live: every job's `sink.table` is under it.
    pub const GOLD_PREFIX: &str = "gold/";
    /// Default table of the stock-out job's availability (`params.availability_table`).
    pub const SKU_AVAILABILITY: &str = "gold/sku_availability";

    /// A source's bronze table.
    pub fn bronze(source: &str) -> String {
        format!("bronze/{source}")
    }

    /// A source's quarantine (rejected lines, with reasons).
    pub fn quarantine(source: &str) -> String {
        format!("quarantine/{source}")
    }

    /// A job's late ledger (events too late for the job).
    pub fn late(job: &str) -> String {
        format!("late/{job}")
    }

    /// A job's gold table when its TOML names none.
    pub fn gold(job: &str) -> String {
        format!("{GOLD_PREFIX}{job}")
    }

    /// The open sessions of a session job whose gold table is `table`.
    pub fn open_sessions(table: &str) -> String {
        format!("{table}_open")
    }

    /// A mirror job's record of the deletes it applied.
    pub fn mirror_deletes(job: &str) -> String {
        format!("_kestrel/mirror/{job}/deletes")
    }

    /// Whether `path` names a table under `gold/` (not `gold/` itself).
    pub fn is_gold(path: &str) -> bool {
        path.starts_with(GOLD_PREFIX) && path.len() > GOLD_PREFIX.len()
    }
}

/// Object keys of kestrel's bookkeeping files (plans, progress, state, leases).
pub mod key {
    use crate::time::Micros;

    /// Prefix of a source's ingestion plans.
    pub fn ingest_plans(source: &str) -> String {
        format!("_kestrel/plans/ingest/{source}/")
    }

    /// A source's ingestion plan of `batch_id`.
    pub fn ingest_plan(source: &str, batch_id: i64) -> String {
        format!("{}{batch_id:020}.json", ingest_plans(source))
    }

    /// Prefix of what the tasks of one distributed ingestion of `batch_id` leave for
    /// each other (`stage` names the attempt; see [`crate::engine::ingest`]).
    pub fn ingest_stage(source: &str, batch_id: i64, stage: &str) -> String {
        format!("_kestrel/stage/ingest/{source}/{batch_id:020}-{stage}/")
    }

    /// Prefix of a job's batch plans and results.
    pub fn job_plans(job: &str) -> String {
        format!("_kestrel/plans/job/{job}/")
    }

    /// A job's `what` file (`plan`, `result`) of `batch_id`.
    pub fn job_plan(job: &str, batch_id: i64, what: &str) -> String {
        format!("{}{batch_id:020}.{what}.json", job_plans(job))
    }

    /// A job's deferred state rows of `batch_id` (always-on mode; see
    /// [`crate::runner::deferred`]), expired with its plans.
    pub fn job_deferred(job: &str, batch_id: i64) -> String {
        format!("{}{batch_id:020}.deferred.parquet", job_plans(job))
    }

    /// The marker of a stream deferring a job's state output.
    pub fn job_deferred_marker(job: &str) -> String {
        format!("{}deferred.json", job_plans(job))
    }

    /// The batch id in a plan file's name (`…/<batch:020>.json`, also `.plan.json` and
    /// `.result.json`).
    pub fn plan_batch(key: &str) -> Option<i64> {
        let name = key.rsplit('/').next()?;
        name.split('.').next()?.parse().ok()
    }

    /// A job's backfill progress.
    pub fn backfill_progress(job: &str) -> String {
        format!("_kestrel/backfill/{job}.json")
    }

    /// A stream's state manifest for `source`.
    pub fn checkpoint(job: &str, source: &str) -> String {
        format!("_kestrel/state/{job}/{source}.ckpt")
    }

    /// One hour's chunk of a stream's seen event ids for `source`.
    pub fn checkpoint_ids(job: &str, source: &str, hour: Micros) -> String {
        format!("_kestrel/state/{job}/{source}/{hour}.ids")
    }

    /// A lease's object.
    pub fn lease(name: &str) -> String {
        format!("_kestrel/leases/{name}.json")
    }
}

/// Delta application ids (`txn.appId`): one per writer and table, so a commit's version
/// says which batch it completes.
pub mod app {
    /// A source's bronze and quarantine appends.
    pub fn ingest(source: &str) -> String {
        format!("kestrel-ingest-{source}")
    }

    /// A source's ledger commits.
    pub fn ledger(source: &str) -> String {
        format!("kestrel-ledger-{source}")
    }

    /// A job's gold commits.
    pub fn job(job: &str) -> String {
        format!("kestrel-job-{job}")
    }

    /// The stock-out job's availability commits (its second gold table).
    pub fn availability(job: &str) -> String {
        format!("{}-availability", self::job(job))
    }

    /// A session job's open-sessions commits.
    pub fn open_sessions(job: &str) -> String {
        format!("{}-open", self::job(job))
    }

    /// A mirror job's history commits.
    pub fn mirror_history(job: &str) -> String {
        format!("{}-history", self::job(job))
    }

    /// A mirror job's deletes-record commits.
    pub fn mirror_deletes(job: &str) -> String {
        format!("{}-deletes", self::job(job))
    }

    /// A job's late-ledger commits.
    pub fn late(job: &str) -> String {
        format!("kestrel-late-{job}")
    }

    /// A job's backfill commits.
    pub fn backfill(job: &str) -> String {
        format!("kestrel-backfill-{job}")
    }

    /// A run-log entry stream (`kind` + `name`, e.g. ingest/orders).
    pub fn runlog(kind: &str, name: &str) -> String {
        format!("kestrel-runlog-{kind}-{name}")
    }
}

/// Lease names: who may write a job's tables right now.
pub mod lease {
    /// Held by a micro-batch, a backfill or maintenance of a job's tables.
    pub fn job(job: &str) -> String {
        format!("job-{job}")
    }

    /// Held by `kestrel stream` for as long as it runs a job.
    pub fn stream(job: &str) -> String {
        format!("stream-{job}")
    }

    /// Held while a table (warehouse path) is compacted: `compact-gold.revenue_5m`.
    pub fn compaction(table: &str) -> String {
        format!("compact-{}", table.trim_end_matches('/').replace('/', "."))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names on disk are a contract with existing warehouses: pinned here.
    #[test]
    fn names_are_stable() {
        assert_eq!(table::bronze("orders"), "bronze/orders");
        assert_eq!(table::quarantine("orders"), "quarantine/orders");
        assert_eq!(table::late("revenue_5m"), "late/revenue_5m");
        assert_eq!(lease::compaction("_kestrel/runs"), "compact-_kestrel.runs");
        assert_eq!(table::gold("revenue_5m"), "gold/revenue_5m");
        assert!(table::is_gold("gold/x") && !table::is_gold("gold/") && !table::is_gold("x"));
        assert_eq!(
            key::ingest_plan("orders", 7),
            "_kestrel/plans/ingest/orders/00000000000000000007.json"
        );
        assert_eq!(
            key::job_plan("j", 7, "result"),
            "_kestrel/plans/job/j/00000000000000000007.result.json"
        );
        assert_eq!(key::plan_batch(&key::job_plan("j", 42, "plan")), Some(42));
        assert_eq!(key::plan_batch(&key::ingest_plan("s", 3)), Some(3));
        assert_eq!(key::lease("job-x"), "_kestrel/leases/job-x.json");
        assert_eq!(
            app::availability("stockout"),
            "kestrel-job-stockout-availability"
        );
        assert_eq!(
            app::runlog("ingest", "orders"),
            "kestrel-runlog-ingest-orders"
        );
        assert_eq!(lease::job("x"), "job-x");
        assert_eq!(table::mirror_deletes("c"), "_kestrel/mirror/c/deletes");
        assert_eq!(table::open_sessions("gold/sessions"), "gold/sessions_open");
        assert_eq!(app::open_sessions("sessions"), "kestrel-job-sessions-open");
        assert_eq!(app::mirror_history("c"), "kestrel-job-c-history");
        assert_eq!(app::mirror_deletes("c"), "kestrel-job-c-deletes");
        assert_eq!(lease::stream("x"), "stream-x");
    }
}
