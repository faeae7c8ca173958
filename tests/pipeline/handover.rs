//! The jobs of a `kestrel run` take the ingestion batch the run has just committed from
//! memory instead of reading it back from bronze (`operator::fresh`); earlier batches of
//! a backlog, and everything after a restart, come from bronze — each read while the job
//! batch before it computes (`operator::prefetch`). The paths give the same tables: a
//! replay with the handover and the read-ahead and one with `KESTREL_NEW_ROWS=bronze`
//! (every batch reads bronze when it runs) end equal.

use crate::common::*;
use crate::compaction::{assert_same_tables, buckets, demo_files, land_all, late_order};

/// The debug line of a job batch that took its new rows from memory.
const TAKEN: &str = "new rows taken in memory";

/// The debug line of a job batch whose new rows were read while the batch before it
/// computed (`operator::prefetch`).
const AHEAD: &str = "new rows read ahead";

/// The line of a windowed job batch that folded its rows into gold (`job::fold`).
const FOLDED: &str = "windows folded";

/// A replay of an hour of demo drops (duplicates, malformed lines, orders too late for
/// the revenue jobs, a backlog of several ingestion batches per source in every run),
/// once with the handover, the read-ahead and the revenue jobs folding into gold, and once
/// reading bronze and recomputing (`KESTREL_WINDOWS=recompute`): every bronze,
/// quarantine, gold and late table and the run log are the same, and both were used.
#[test]
fn new_rows_from_memory_give_the_same_tables_as_from_bronze() {
    let files = demo_files();
    // Several ingestion batches per source and run, a slot for every source and job,
    // and a pause after each ingestion batch, so that the jobs following a source
    // usually take its first batch (held whole, unless every job that reads the source
    // declared its columns up front, as the two clickstream jobs do), and so say which
    // columns they read, before its next ones are written, which are then held with
    // those columns only
    // (how soon a job starts is the machine's; that path is checked deterministically
    // by `operator::read`'s tests). The jobs of two sources run after both ingestions
    // and read all but the last batch from bronze, ahead.
    let cfg = "parallel_jobs = 8\n[ingest]\nmax_files_per_batch = 8\n";
    let (memory, bronze) = (Env::with_config(cfg), Env::with_config(cfg));
    let bs = buckets(&files);
    assert!(bs.len() >= 4, "{} buckets", bs.len());
    let (mut taken, mut ahead, mut folded) = ([0usize; 2], [0usize; 2], [0usize; 2]);
    for (i, b) in bs.iter().enumerate() {
        for (k, env) in [&memory, &bronze].into_iter().enumerate() {
            land_all(env, b);
            let bad = format!("orders/partition=0/x-{i:03}-bad.ndjson");
            env.land(&bad, b"{\"event_id\": \"not closed\n", b[0].0);
            if i > 0 {
                let late = format!("orders/partition=0/x-{i:03}-late.ndjson");
                env.land(&late, late_order(b, i).as_bytes(), b[0].0);
                // One more in the run's last ingestion batch, which is held with the
                // jobs' columns only: its too-late rows come from bronze.
                let last = format!("orders/partition=0/x-{i:03}-late-last.ndjson");
                let order = late_order(b, i).replace("late-order-", "late-order-last-");
                env.land(&last, order.as_bytes(), b[b.len() - 1].0);
            }
            let mut vars = vec![
                (
                    "RUST_LOG",
                    "kestrel::operator::read=debug,kestrel::operator::windowed=info",
                ),
                ("KESTREL_DELAY", "ingest_after_batch:200"),
            ];
            if k == 1 {
                vars.push(("KESTREL_NEW_ROWS", "bronze"));
                vars.push(("KESTREL_WINDOWS", "recompute"));
            }
            let out = env.kestrel_env(&["run"], &vars);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(0), "bucket {i}: {err}");
            taken[k] += err.lines().filter(|l| l.contains(TAKEN)).count();
            ahead[k] += err.lines().filter(|l| l.contains(AHEAD)).count();
            folded[k] += err.lines().filter(|l| l.contains(FOLDED)).count();
        }
    }
    assert_same_tables(&memory, &bronze);
    // Seven jobs over four sources: at least one batch of each job per run.
    assert!(
        taken[0] >= 7 * bs.len(),
        "{} batches took rows from memory",
        taken[0]
    );
    assert_eq!(taken[1], 0, "KESTREL_NEW_ROWS=bronze reads bronze");
    // A backlog's batches before the last are read ahead.
    assert!(
        ahead[0] > 0,
        "{} batches had their rows read ahead",
        ahead[0]
    );
    assert_eq!(
        ahead[1], 0,
        "KESTREL_NEW_ROWS=bronze reads bronze when a batch runs"
    );
    // revenue_5m (tumbling) and revenue_1h (sliding) fold every batch after their first.
    assert!(
        folded[0] >= 2 * (bs.len() - 1),
        "{} batches folded",
        folded[0]
    );
    assert_eq!(folded[1], 0, "KESTREL_WINDOWS=recompute recomputes");
}
