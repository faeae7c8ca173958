//! Which of a set of values a table's key column already holds, reading only the row
//! groups that can hold one: the exact dedup probe of bronze (`event_id`), and the
//! ledger's "seen this path before?" of a full listing (`path`).
//!
//! Bronze files carry a bloom filter on `event_id` in every row group (see
//! [`crate::sink::delta::bronze_writer_properties`]). A probe lists the active files of
//! the touched event dates, skips row groups whose `event_id` range misses every
//! incoming id (time-ordered ids: ULIDs, snowflakes, counters), asks each remaining row
//! group's bloom filter about every incoming id, and reads `event_id` and `_batch_id` of
//! the row groups that said "maybe", keeping the ids whose 64-bit hash is an incoming
//! one's; [`existing`] then compares them exactly (the ingestion's dedup does so in its
//! own pass over the batch, [`existing_ids`]). With random UUIDs the cost is
//! one filter check per incoming id and row group plus the filters' bytes, instead of
//! every id of the touched dates; row groups without a filter (files written before
//! filters existed) are read whole, as before, until compaction rewrites them, and so are
//! row groups small against the incoming ids (a backlog's batch of a million ids against
//! 16k-row groups), where asking the filter costs more than reading ([`CHECKS_PER_ROW`]). The
//! ledger's files carry a filter on `path` the same way (see
//! [`crate::ledger::writer_properties`]).

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{Array, AsArray};
use arrow::datatypes::Int64Type;
use deltalake::logstore::object_store::path::Path as ObjPath;
use deltalake::logstore::object_store::ObjectStore;
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::parquet::arrow::arrow_reader::ArrowReaderOptions;
use deltalake::parquet::arrow::async_reader::{AsyncFileReader, ParquetRecordBatchStreamBuilder};
use deltalake::parquet::arrow::ProjectionMask;
use deltalake::parquet::errors::ParquetError;
use deltalake::parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use deltalake::parquet::file::statistics::Statistics;
use deltalake::DeltaTable;
use futures::future::BoxFuture;
use futures::FutureExt;
use futures::{StreamExt, TryStreamExt};

use crate::error::{Error, Result};
use crate::sink::bloom;
use crate::sink::known::Known;

/// What can go wrong probing one file; `what` names the file and the column probed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{what}: {source}")]
    Parquet {
        what: String,
        #[source]
        source: ParquetError,
    },
    #[error("{what}: {source}")]
    Store {
        what: String,
        #[source]
        source: deltalake::logstore::object_store::Error,
    },
    #[error("{what}: file lacks {column}")]
    FileLacks { what: String, column: String },
    #[error("{what}: no {column}")]
    BatchLacks { what: String, column: String },
    #[error("{what}: filter check: {source}")]
    Check {
        what: String,
        #[source]
        source: tokio::task::JoinError,
    },
    #[error("{what}: {source}")]
    Task {
        what: String,
        #[source]
        source: tokio::task::JoinError,
    },
}

/// Ids held (for [`existing`], exactly the values asked about that the table holds; for
/// [`existing_ids`], see there), with the work it took (for the log).
#[derive(Debug, Default)]
pub struct Found {
    pub ids: HashSet<String, foldhash::fast::RandomState>,
    pub files: usize,
    pub row_groups: usize,
    /// Row groups read because a filter (or a missing filter) said "maybe", or because
    /// a file this run wrote holds a row of an incoming hash there.
    pub row_groups_read: usize,
    /// Files this run wrote, ruled in or out by the hashes it kept of them
    /// ([`crate::sink::known`]), not by their filters.
    pub known_files: usize,
}

type Ids<'a> = HashSet<&'a str, foldhash::fast::RandomState>;

/// What to probe: a key column, the partitions to look in and rows to ignore.
pub struct Probe<'a> {
    /// The string column compared with the incoming values (a bloom filter on it lets
    /// row groups be skipped).
    pub column: &'a str,
    /// Only files whose partition column has one of these values.
    pub partition: (&'a str, &'a [String]),
    /// Rows whose Int64 column equals this value are ignored (a batch's own rows).
    pub exclude: Option<(&'a str, i64)>,
}

/// The values a probe asks about, prepared once: each value's filter hash and the range
/// of the values. A probe finds the table's values whose hash is one of these hashes —
/// the asked values it holds, and (by a 64-bit hash collision: a million ids against a
/// day of ten million meet one about once in a million batches) a value that merely
/// shares one; the caller settles candidates against its own values. Cloned into each
/// file's probe task (its parts are shared).
#[derive(Clone)]
pub struct Incoming {
    /// [`bloom::hash`] of each value, in hash order, which is block order in every filter
    /// (a block is picked by the hash's upper bits), so a check of all values walks each
    /// filter front to back instead of jumping around it.
    hashes: Arc<Vec<u64>>,
    /// A bit per slice of the hash space, set for the slices the values' hashes fall in:
    /// a held value whose bit is clear is none of them, told without the hashes.
    bits: Arc<HashBits>,
    /// Where each slice of the hash space begins in `hashes`.
    index: Arc<HashIndex>,
    lo: String,
    hi: String,
}

/// Where each of about as many slices of the 64-bit hash space as there are hashes
/// begins in the sorted hashes, so a hash is found with two memory reads (the slice's
/// start, then a slice of one hash or two). A binary search of a million sorted hashes
/// is twenty dependent reads, most of them cache misses: the ids that passed the bitset
/// (one in 16 of a large probe's reads) took 0.5 s of CPU over the throughput
/// benchmark's run that way.
#[derive(Debug)]
struct HashIndex {
    /// `starts[s]..starts[s + 1]` holds the hashes of slice `s`.
    starts: Vec<u32>,
    /// 64 − log2(slices): a hash's slice is `hash >> shift`.
    shift: u32,
}

impl HashIndex {
    /// At most 2^26 slices (256 MiB of starts, for a batch of 64M ids or more).
    const MAX_LOG2: u32 = 26;

    /// The index of `sorted` (ascending).
    fn of(sorted: &[u64]) -> Self {
        let log2 = sorted
            .len()
            .max(1)
            .next_power_of_two()
            .trailing_zeros()
            .clamp(1, Self::MAX_LOG2);
        let shift = 64 - log2;
        let slices = 1usize << log2;
        let mut starts = Vec::with_capacity(slices + 1);
        let mut at = 0usize;
        for s in 0..slices {
            while at < sorted.len() && ((sorted[at] >> shift) as usize) < s {
                at += 1;
            }
            starts.push(at as u32);
        }
        starts.push(sorted.len() as u32);
        HashIndex { starts, shift }
    }

    /// Whether `h` is one of `sorted` (the hashes this index was built of).
    fn contains(&self, sorted: &[u64], h: u64) -> bool {
        let s = (h >> self.shift) as usize;
        let (from, to) = (self.starts[s] as usize, self.starts[s + 1] as usize);
        sorted[from..to].contains(&h)
    }
}

/// Which slices of the 64-bit hash space a set of hashes falls in, one bit a slice, with
/// about [`HashBits::BITS_PER_VALUE`] slices a value. The probe compares every id a row
/// group holds with the incoming set; for a batch of a million ids that set is tens of
/// megabytes, and each lookup of an id that is not in it (nearly all) costs a cache miss
/// or two and often a string comparison. A clear bit settles such an id from a bitset of
/// a few megabytes instead; a set bit (the value's own, or one of about 1 in 16 others)
/// goes on to the sorted hashes ([`HashIndex`]), and an equal hash to the caller's exact
/// comparison.
#[derive(Debug)]
struct HashBits {
    words: Vec<u64>,
    /// 64 − log2(bits): a hash's slice is `hash >> shift`.
    shift: u32,
}

impl HashBits {
    const BITS_PER_VALUE: usize = 16;
    /// At most 2^28 bits (32 MiB), for a set of 16M values or more.
    const MAX_LOG2: u32 = 28;

    fn of(hashes: &[u64]) -> Self {
        let want = (hashes.len().max(1) * Self::BITS_PER_VALUE).next_power_of_two();
        let log2 = want.trailing_zeros().clamp(6, Self::MAX_LOG2);
        let mut words = vec![0u64; 1 << (log2 - 6)];
        let shift = 64 - log2;
        for h in hashes {
            let slice = (h >> shift) as usize;
            words[slice >> 6] |= 1 << (slice & 63);
        }
        HashBits { words, shift }
    }

    /// Whether a value of hash `h` can be in the set.
    fn maybe(&self, h: u64) -> bool {
        let slice = (h >> self.shift) as usize;
        self.words[slice >> 6] & (1 << (slice & 63)) != 0
    }
}

impl Incoming {
    /// Prepared from the set alone (`None` when it is empty). Walking a large set touches
    /// its values in memory order of the set, not of their buffers: the caller that
    /// builds the set from Arrow arrays should use [`Incoming::with`] instead.
    pub fn of(ids: &Ids<'_>) -> Option<Self> {
        let mut hashes = Vec::with_capacity(ids.len());
        let mut range: Option<(&str, &str)> = None;
        for id in ids.iter() {
            hashes.push(bloom::hash(id.as_bytes()));
            range = Some(widen(range, id));
        }
        let (lo, hi) = range?;
        Some(Self::with(hashes, lo, hi))
    }

    /// How many values.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// No values (never, as built).
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Prepared by the caller while it gathered the values: `hashes` holds [`bloom::hash`]
    /// of every distinct value (any order), `lo` and `hi` their least and greatest.
    pub fn with(mut hashes: Vec<u64>, lo: &str, hi: &str) -> Self {
        hashes.sort_unstable();
        Incoming {
            bits: Arc::new(HashBits::of(&hashes)),
            index: Arc::new(HashIndex::of(&hashes)),
            hashes: Arc::new(hashes),
            lo: lo.to_string(),
            hi: hi.to_string(),
        }
    }
}

/// `range` widened to hold `v`. Called for every id of a batch: the first bytes decide
/// nearly every comparison of random ids, so they are compared before the strings.
pub fn widen<'a>(range: Option<(&'a str, &'a str)>, v: &'a str) -> (&'a str, &'a str) {
    fn less(a: &str, b: &str) -> bool {
        match (a.as_bytes().first(), b.as_bytes().first()) {
            (Some(x), Some(y)) if x != y => x < y,
            _ => a < b,
        }
    }
    match range {
        None => (v, v),
        Some((lo, hi)) => (
            if less(v, lo) { v } else { lo },
            if less(hi, v) { v } else { hi },
        ),
    }
}

/// The ids bronze (`table`) holds in partitions `event_date` ∈ `dates` (`YYYY-MM-DD`),
/// outside the rows of ingestion batch `exclude_batch`, whose hash is one of
/// `incoming`'s: every incoming id bronze holds, and possibly (by a hash collision) an
/// id that was not asked about, which the caller's exact comparison leaves out. The
/// files `known` names (this run wrote them) are read only in the row groups where it
/// says a row's hash is an incoming one's.
pub async fn existing_ids(
    table: &DeltaTable,
    dates: &[String],
    exclude_batch: i64,
    incoming: &Incoming,
    known: Option<&Known>,
) -> Result<Found> {
    let probe = Probe {
        column: "event_id",
        partition: (crate::schema::EVENT_DATE, dates),
        exclude: Some((crate::schema::BATCH_ID, exclude_batch)),
    };
    existing_prepared(table, &probe, incoming, known).await
}

/// The values of `incoming` that `table` holds in `probe.column`, in the partitions and
/// outside the rows `probe` names.
pub async fn existing(table: &DeltaTable, probe: &Probe<'_>, incoming: &Ids<'_>) -> Result<Found> {
    let Some(prepared) = Incoming::of(incoming) else {
        return Ok(Found::default());
    };
    let mut found = existing_prepared(table, probe, &prepared, None).await?;
    found.ids.retain(|v| incoming.contains(v.as_str()));
    Ok(found)
}

/// The values of `probe.column` whose hash is one of `incoming`'s (see [`Incoming`]).
async fn existing_prepared(
    table: &DeltaTable,
    probe: &Probe<'_>,
    incoming: &Incoming,
    known: Option<&Known>,
) -> Result<Found> {
    let mut found = Found::default();
    let started = std::time::Instant::now();
    let snap = table
        .snapshot()
        .map_err(|e| Error::delta(table.table_url().as_str(), e))?;
    let (part_col, part_values) = probe.partition;
    let files: Vec<(ObjPath, u64)> = snap
        .log_data()
        .iter()
        .filter(|f| {
            f.partition_values_map()
                .get(part_col)
                .is_some_and(|v| v.as_ref().is_some_and(|d| part_values.contains(d)))
        })
        .map(|f| (f.object_store_path(), f.size() as u64))
        .collect();
    found.files = files.len();
    let store = table.log_store().object_store(None);
    let asked = Arc::new(Asked {
        column: probe.column.to_string(),
        exclude: probe.exclude.map(|(c, v)| (c.to_string(), v)),
        incoming: incoming.clone(),
        url: table.table_url().to_string(),
        known: known.filter(|k| !k.is_empty()).cloned(),
    });
    // One task a file, so the files' Parquet decoding runs on every worker thread (the
    // futures of one task are polled on one thread: a backlog's probe of a million ids
    // read its row groups on one core). The tasks own what they need; they hand back
    // the ids whose hash is an incoming one's.
    let per_file = files.into_iter().map(|(path, size)| {
        let (store, asked) = (store.clone(), asked.clone());
        async move {
            let what = asked.what(&path);
            tokio::spawn(probe_file(store, path, size, asked))
                .await
                .map_err(|source| ProbeError::Task { what, source })?
        }
    });
    let results: Vec<FileFound> = futures::stream::iter(per_file)
        .buffer_unordered(4)
        .try_collect()
        .await?;
    for r in results {
        found.row_groups += r.row_groups;
        found.row_groups_read += r.read;
        found.known_files += usize::from(r.known);
        found.ids.extend(r.ids);
    }
    crate::sink::timings::record(
        format!("probe {}", crate::sink::timings::table_name(&asked.url)),
        started.elapsed(),
    );
    Ok(found)
}

/// How many incoming values a row group's bloom filter is asked about at most, per row
/// of the group: beyond it the row group is read without asking. A row group whose filter
/// holds none of K values costs K checks (a few nanoseconds each) to rule out, and one
/// that holds one costs a read of its id column (about 150 ns a row: decompression,
/// decoding and a set lookup per row) either way; so when K exceeds this many times the
/// rows, reading is the cheaper way to the same exact answer. A read also has a fixed
/// cost (a request and a page to set up), counted as [`READ_FIXED_ROWS`] rows, so a small
/// row group of a five-minute append keeps being asked. With 1.1–1.4M random UUIDs
/// a batch (`cargo bench --bench jobs -- throughput`) against 16k-row groups, every
/// filter asked took 1.83–1.93 s of probing over the run's four batches, reading those
/// row groups instead 1.63–1.73 s. A five-minute drop (hundreds to tens of thousands of
/// ids) still asks every filter of every row group it meets.
pub const CHECKS_PER_ROW: usize = 40;

/// The fixed cost of reading a row group, in rows (≈ 150 µs).
pub const READ_FIXED_ROWS: usize = 1024;

/// Whether asking a row group of `rows` rows' filter about `incoming` values is worth it
/// (see [`CHECKS_PER_ROW`]).
fn worth_checking(incoming: usize, rows: usize) -> bool {
    incoming <= (rows + READ_FIXED_ROWS).saturating_mul(CHECKS_PER_ROW)
}

/// What a file's probe asks, owned by its task: the column, the rows to ignore, the
/// incoming values.
struct Asked {
    column: String,
    exclude: Option<(String, i64)>,
    incoming: Incoming,
    url: String,
    /// The files this run wrote, with their rows' hashes.
    known: Option<Known>,
}

impl Asked {
    fn what(&self, path: &ObjPath) -> String {
        format!("probe of {}{path} by {}", self.url, self.column)
    }

    /// Whether `v`'s filter hash is one of the incoming values' (the bitset settles
    /// nearly every value that is not; the index of the sorted hashes the rest): every
    /// incoming value passes, and another only when its 64-bit hash equals one of theirs.
    fn may_hold(&self, v: &str) -> bool {
        self.incoming.holds_hash(bloom::hash(v.as_bytes()))
    }
}

impl Incoming {
    /// Whether `h` is one of the values' hashes.
    fn holds_hash(&self, h: u64) -> bool {
        self.bits.maybe(h) && self.index.contains(&self.hashes, h)
    }
}

struct FileFound {
    ids: Vec<String>,
    row_groups: usize,
    read: usize,
    /// Its row groups were picked by the hashes this run kept of it.
    known: bool,
}

/// The values of one file's `asked.column` whose hash is an incoming value's (see
/// [`Asked::may_hold`]), outside the excluded rows.
async fn probe_file(
    store: Arc<dyn ObjectStore>,
    path: ObjPath,
    size: u64,
    asked: Arc<Asked>,
) -> Result<FileFound> {
    let what = || asked.what(&path);
    let reader = Reader {
        store: store.clone(),
        path: path.clone(),
        size,
    };
    let mut builder = ParquetRecordBatchStreamBuilder::new(reader)
        .await
        .map_err(|source| ProbeError::Parquet {
            what: what(),
            source,
        })?;
    let meta = builder.metadata().clone();
    let schema = meta.file_metadata().schema_descr();
    let column = |name: &str| (0..schema.num_columns()).find(|i| schema.column(*i).name() == name);
    let lacks = |column: &str| ProbeError::FileLacks {
        what: what(),
        column: column.to_string(),
    };
    let id_col = column(&asked.column).ok_or_else(|| lacks(&asked.column))?;
    let exclude = match &asked.exclude {
        Some((name, value)) => Some((column(name).ok_or_else(|| lacks(name))?, name, *value)),
        None => None,
    };
    let mut out = FileFound {
        ids: Vec::new(),
        row_groups: meta.num_row_groups(),
        read: 0,
        known: false,
    };
    // A file this run wrote: the row groups holding a row of an incoming hash, by the
    // hashes it kept of the file's rows (no filter asked, no id decoded elsewhere).
    let name = path.filename().unwrap_or_default();
    let known = asked.known.as_ref().and_then(|k| k.get(name, size));
    let read = match known {
        Some(file) => {
            let rows: Vec<usize> = (0..meta.num_row_groups())
                .map(|rg| meta.row_group(rg).num_rows().max(0) as usize)
                .collect();
            let incoming = asked.incoming.clone();
            tokio::task::spawn_blocking(move || {
                file.row_groups_where(&rows, |h| incoming.holds_hash(h))
            })
            .await
            .map_err(|source| ProbeError::Check {
                what: what(),
                source,
            })?
        }
        None => None,
    };
    out.known = read.is_some();
    let read = match read {
        Some(read) => read,
        None => filtered_row_groups(&mut builder, &meta, &store, &path, id_col, &asked).await?,
    };
    out.read = read.len();
    if read.is_empty() {
        return Ok(out);
    }
    read_ids(builder, &path, read, (id_col, exclude), &asked, &mut out).await?;
    Ok(out)
}

/// The row groups of a file (not one this run wrote) that can hold an incoming value:
/// those the values' range leaves in, whose bloom filter says "maybe" to one of them —
/// or that are read without asking, when asking would cost more than reading
/// ([`CHECKS_PER_ROW`]) or they have no filter. Ascending.
async fn filtered_row_groups(
    builder: &mut ParquetRecordBatchStreamBuilder<Reader>,
    meta: &ParquetMetaData,
    store: &Arc<dyn ObjectStore>,
    path: &ObjPath,
    id_col: usize,
    asked: &Arc<Asked>,
) -> Result<Vec<usize>> {
    let what = || asked.what(path);
    let (lo, hi) = (asked.incoming.lo.as_str(), asked.incoming.hi.as_str());
    // Row groups the id range leaves in, and where their filters lie; those whose filter
    // would cost more to ask than the row group costs to read go straight to `always`.
    let mut kept: Vec<(usize, Option<std::ops::Range<u64>>)> = Vec::new();
    let mut always: Vec<usize> = Vec::new();
    for rg in 0..meta.num_row_groups() {
        let chunk = meta.row_group(rg).column(id_col);
        if let Some(Statistics::ByteArray(s)) = chunk.statistics() {
            let min = s.min_bytes_opt();
            let max = s.max_bytes_opt();
            let below = max.is_some_and(|m| lo.as_bytes() > m);
            let above = min.is_some_and(|m| hi.as_bytes() < m);
            if below || above {
                continue;
            }
        }
        let rows = meta.row_group(rg).num_rows().max(0) as usize;
        if !worth_checking(asked.incoming.len(), rows) {
            always.push(rg);
            continue;
        }
        let at = match (chunk.bloom_filter_offset(), chunk.bloom_filter_length()) {
            (Some(off), Some(len)) => Some(off as u64..off as u64 + len as u64),
            _ => None,
        };
        kept.push((rg, at));
    }
    // The filters' bytes, all of the file's in one request (one open of a local file, or
    // parallel ranges on an object store), checked where they lie; the Parquet reader's
    // own path (which copies the bitset twice more) only for an unusual header.
    let ranges: Vec<std::ops::Range<u64>> = kept.iter().filter_map(|(_, r)| r.clone()).collect();
    let mut raws = if ranges.is_empty() {
        Vec::new()
    } else {
        store
            .get_ranges(path, &ranges)
            .await
            .map_err(|source| ProbeError::Store {
                what: what(),
                source,
            })?
    }
    .into_iter();
    let mut candidates: Vec<(usize, Option<bloom::Filter>)> = Vec::with_capacity(kept.len());
    for (rg, at) in kept {
        let mut filter = at
            .and_then(|_| raws.next())
            .and_then(bloom::Filter::from_column_chunk);
        if filter.is_none() {
            filter = match builder
                .get_row_group_column_bloom_filter(rg, id_col)
                .await
                .map_err(|source| ProbeError::Parquet {
                    what: what(),
                    source,
                })? {
                Some(sbbf) => Some(bloom::Filter::from_sbbf(&sbbf)?),
                None => None,
            };
        }
        candidates.push((rg, filter));
    }
    // Checking every id against every filter is the probe's CPU work (K ids × R row
    // groups): off the async thread, so the files of a probe check in parallel.
    let mut read: Vec<usize> = if candidates.is_empty() {
        Vec::new()
    } else {
        let hashes = asked.incoming.hashes.clone();
        tokio::task::spawn_blocking(move || {
            candidates
                .into_iter()
                .filter(|(_, f)| {
                    f.as_ref()
                        .is_none_or(|f| hashes.iter().any(|h| f.check(*h)))
                })
                .map(|(rg, _)| rg)
                .collect()
        })
        .await
        .map_err(|source| ProbeError::Check {
            what: what(),
            source,
        })?
    };
    read.extend(always);
    read.sort_unstable();
    Ok(read)
}

/// The values of row groups `read` (ascending) whose hash is an incoming value's,
/// outside the excluded rows, into `out.ids`.
async fn read_ids(
    builder: ParquetRecordBatchStreamBuilder<Reader>,
    path: &ObjPath,
    read: Vec<usize>,
    (id_col, exclude): (usize, Option<(usize, &String, i64)>),
    asked: &Arc<Asked>,
    out: &mut FileFound,
) -> Result<()> {
    let what = || asked.what(path);
    let schema = builder.metadata().file_metadata().schema_descr_ptr();
    let leaves: Vec<usize> = std::iter::once(id_col)
        .chain(exclude.map(|(c, _, _)| c))
        .collect();
    let mask = ProjectionMask::leaves(&schema, leaves);
    let mut stream = builder
        .with_row_groups(read)
        .with_projection(mask)
        .build()
        .map_err(|source| ProbeError::Parquet {
            what: what(),
            source,
        })?;
    let batch_lacks = |column: &str| ProbeError::BatchLacks {
        what: what(),
        column: column.to_string(),
    };
    while let Some(b) = stream.next().await {
        let b = b.map_err(|source| ProbeError::Parquet {
            what: what(),
            source,
        })?;
        let ids = arrow::compute::cast(
            b.column_by_name(&asked.column)
                .ok_or_else(|| batch_lacks(&asked.column))?,
            &arrow::datatypes::DataType::Utf8,
        )?;
        let ids = ids.as_string::<i32>();
        let skip = match exclude {
            Some((_, name, value)) => {
                let c = arrow::compute::cast(
                    b.column_by_name(name).ok_or_else(|| batch_lacks(name))?,
                    &arrow::datatypes::DataType::Int64,
                )?;
                Some((c, value))
            }
            None => None,
        };
        let skip = skip
            .as_ref()
            .map(|(c, value)| (c.as_primitive::<Int64Type>(), *value));
        for i in 0..b.num_rows() {
            let excluded = skip.is_some_and(|(c, v)| c.is_valid(i) && c.value(i) == v);
            if ids.is_valid(i) && !excluded && asked.may_hold(ids.value(i)) {
                out.ids.push(ids.value(i).to_string());
            }
        }
    }
    Ok(())
}

/// A Parquet file in an object store, of known size (no HEAD request).
pub(crate) struct Reader {
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) path: ObjPath,
    pub(crate) size: u64,
}

fn parquet_err(e: deltalake::logstore::object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl AsyncFileReader for Reader {
    fn get_bytes(
        &mut self,
        range: std::ops::Range<u64>,
    ) -> BoxFuture<'_, deltalake::parquet::errors::Result<bytes::Bytes>> {
        let (store, path) = (self.store.clone(), self.path.clone());
        async move { store.get_range(&path, range).await.map_err(parquet_err) }.boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<std::ops::Range<u64>>,
    ) -> BoxFuture<'_, deltalake::parquet::errors::Result<Vec<bytes::Bytes>>> {
        let (store, path) = (self.store.clone(), self.path.clone());
        async move { store.get_ranges(&path, &ranges).await.map_err(parquet_err) }.boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, deltalake::parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            let size = self.size;
            let meta = ParquetMetaDataReader::new()
                .with_arrow_reader_options(options)
                .load_and_finish(self, size)
                .await?;
            Ok(Arc::new(meta))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller's preparation (hashes in its own order, range as it went) is the set's.
    #[test]
    fn prepared_incoming_equals_the_sets_own() {
        let values = ["m", "b", "zz", "a0", "q", "b"];
        let ids: Ids<'_> = values.iter().copied().collect();
        let mut hashes = Vec::new();
        let mut range = None;
        let mut seen = HashSet::new();
        for v in values {
            if seen.insert(v) {
                hashes.push(bloom::hash(v.as_bytes()));
                range = Some(widen(range, v));
            }
        }
        let (lo, hi) = range.unwrap();
        let by_caller = Incoming::with(hashes, lo, hi);
        let by_set = Incoming::of(&ids).unwrap();
        assert_eq!((by_caller.lo.as_str(), by_caller.hi.as_str()), ("a0", "zz"));
        assert_eq!((by_set.lo.as_str(), by_set.hi.as_str()), ("a0", "zz"));
        assert_eq!(by_caller.hashes, by_set.hashes);
        assert!(by_caller.hashes.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(by_caller.len(), 5);
        let empty: Ids<'_> = Ids::default();
        assert!(Incoming::of(&empty).is_none());
    }

    /// Widening a range gives the least and greatest string, as `str`'s order has them.
    #[test]
    fn a_widened_range_is_the_least_and_greatest() {
        let values = [
            "b", "", "ab", "a", "ba", "zz", "z", "é", "e", "bb", "a\u{0}",
        ];
        for n in 1..=values.len() {
            let mut range = None;
            for v in &values[..n] {
                range = Some(widen(range, v));
            }
            let lo = *values[..n].iter().min().unwrap();
            let hi = *values[..n].iter().max().unwrap();
            assert_eq!(range, Some((lo, hi)), "{n}");
        }
    }

    /// The index finds every hash it was built of and no other, whatever the number of
    /// hashes (an empty set, one, fewer than the slices, many per slice).
    #[test]
    fn the_hash_index_finds_exactly_its_hashes() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in [0usize, 1, 2, 3, 1000, 65_536, 100_000] {
            let mut hashes: Vec<u64> = (0..n).map(|_| next()).collect();
            // Clustered values too: many hashes in one slice.
            hashes.extend((0..n as u64 / 10).map(|i| 0x7000_0000_0000_0000 + i));
            hashes.extend([0, u64::MAX]);
            hashes.sort_unstable();
            let index = HashIndex::of(&hashes);
            assert!(
                hashes.iter().all(|h| index.contains(&hashes, *h)),
                "n = {n}"
            );
            let others = (0..10_000)
                .map(|_| next())
                .filter(|h| hashes.binary_search(h).is_err());
            assert!(
                others.into_iter().all(|h| !index.contains(&hashes, h)),
                "n = {n}"
            );
            assert!(!index.contains(&hashes, 0x7000_0000_0000_0000 + n as u64));
        }
        let none = HashIndex::of(&[]);
        assert!(!none.contains(&[], 42));
    }

    /// Every hash of the set passes its bitset, and about one in 16 others does.
    #[test]
    fn hash_bits_pass_every_member_and_few_others() {
        for n in [0usize, 1, 500, 100_000] {
            let hashes: Vec<u64> = (0..n as u64)
                .map(|i| bloom::hash(&i.to_le_bytes()))
                .collect();
            let bits = HashBits::of(&hashes);
            assert!(hashes.iter().all(|h| bits.maybe(*h)), "n = {n}");
            let strangers = 100_000u64;
            let passed = (0..strangers)
                .filter(|i| bits.maybe(bloom::hash(format!("stranger-{i}").as_bytes())))
                .count();
            assert!(
                passed as f64 / (strangers as f64) < 0.08,
                "n = {n}: {passed}"
            );
        }
    }

    /// Two files of ten 100-row groups with an `event_id` filter each: a few ids ask the
    /// filters and read only the row groups that may hold them; more ids than
    /// [`CHECKS_PER_ROW`] times a row group's rows and [`READ_FIXED_ROWS`] read every row
    /// group instead — and both find exactly the ids held, outside the excluded batch.
    #[tokio::test]
    async fn few_ids_ask_the_filters_many_read_and_both_find_the_same() {
        use arrow::array::{Int64Array, RecordBatch, StringArray};
        use arrow::datatypes::{DataType, Field, Schema};
        use deltalake::parquet::file::properties::WriterProperties;
        use deltalake::parquet::schema::types::ColumnPath;

        let dir = tempfile::tempdir().unwrap();
        let wh = crate::sink::delta::local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("_batch_id", DataType::Int64, true),
            Field::new("day", DataType::Utf8, true),
        ]));
        let mut table = wh.open_or_create("t", &schema, &["day"]).await.unwrap();
        let held = |batch: i64, i: usize| format!("id-{batch}-{i:04}");
        for batch in [1i64, 2] {
            let ids: Vec<String> = (0..1000).map(|i| held(batch, i)).collect();
            let b = RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from(ids)),
                    Arc::new(Int64Array::from(vec![batch; 1000])),
                    Arc::new(StringArray::from(vec!["d1"; 1000])),
                ],
            )
            .unwrap();
            let id = ColumnPath::from("event_id");
            let props = WriterProperties::builder()
                .set_column_bloom_filter_enabled(id.clone(), true)
                .set_column_bloom_filter_fpp(id.clone(), 1e-7)
                .set_column_bloom_filter_max_ndv(id, 100)
                .set_max_row_group_row_count(Some(100))
                .build();
            table = crate::sink::delta::append_with(
                table,
                vec![b],
                &["day"],
                "app",
                batch,
                Some(props),
            )
            .await
            .unwrap();
        }
        let days = ["d1".to_string()];
        let probe = |exclude: Option<i64>| Probe {
            column: "event_id",
            partition: ("day", &days),
            exclude: exclude.map(|b| ("_batch_id", b)),
        };
        // Held: rows 250 and 999 of batch 1 and 430 of batch 2.
        let wanted = [held(1, 250), held(1, 999), held(2, 430)];
        let mut few: Vec<String> = wanted.to_vec();
        few.extend([
            "id-1-0250x".to_string(),
            "id-0".to_string(),
            "id-3".to_string(),
        ]);
        let mut many = few.clone();
        many.extend((0..45_000).map(|i| format!("id-1-{i:05}-stranger")));
        assert!(!worth_checking(many.len(), 100) && worth_checking(few.len(), 100));
        assert!(worth_checking(40_000, 1), "a tiny row group is asked");
        for (incoming, asked) in [(&few, true), (&many, false)] {
            let ids: Ids<'_> = incoming.iter().map(|s| s.as_str()).collect();
            for (exclude, expect) in [(None, &wanted[..]), (Some(2), &wanted[..2])] {
                let found = existing(&table, &probe(exclude), &ids).await.unwrap();
                let mut got: Vec<&str> = found.ids.iter().map(|s| s.as_str()).collect();
                got.sort_unstable();
                assert_eq!(got, expect, "asked filters: {asked}, exclude {exclude:?}");
                assert_eq!((found.files, found.row_groups), (2, 20));
                if asked {
                    // rows 250, 999 and 430 lie in three row groups (and no stranger's
                    // filter hit at 1e-7).
                    assert_eq!(found.row_groups_read, 3, "{found:?}");
                } else {
                    // The ids' range ("id-0" to "id-3") covers every row group.
                    assert_eq!(found.row_groups_read, 20, "{found:?}");
                }
            }
        }
    }
    /// Files written with their rows' hashes remembered (one writer, parts of two
    /// partitions interleaved, masks dropping rows): each file's remembered hashes are
    /// its rows' in order, and a probe that knows them reads only the row groups holding
    /// an incoming id's hash — and finds the same ids as one that asks the filters, also
    /// in a file it does not know and outside an excluded batch.
    #[tokio::test]
    async fn known_files_read_only_the_row_groups_of_incoming_hashes() {
        use crate::sink::delta::{self, KeptWrite};
        use arrow::array::{BooleanArray, Int64Array, RecordBatch, StringArray};
        use arrow::datatypes::{DataType, Field, Schema};
        use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
        use deltalake::parquet::file::properties::WriterProperties;

        let dir = tempfile::tempdir().unwrap();
        let wh = delta::local_warehouse(dir.path());
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("_batch_id", DataType::Int64, true),
            Field::new("day", DataType::Utf8, true),
        ]));
        let table = wh.open_or_create("t", &schema, &["day"]).await.unwrap();
        let id = |batch: i64, day: &str, i: usize| format!("id-{batch}-{day}-{i:04}");
        let part = |batch: i64, day: &'static str, from: usize, keep_every: usize| {
            let ids: Vec<String> = (from..from + 300).map(|i| id(batch, day, i)).collect();
            let b = RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from(ids)),
                    Arc::new(Int64Array::from(vec![batch; 300])),
                    Arc::new(StringArray::from(vec![day; 300])),
                ],
            )
            .unwrap();
            let keep: BooleanArray = (from..from + 300)
                .map(|i| Some(i % keep_every != 0))
                .collect();
            (b, Some(keep))
        };
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(100))
            .build();
        let how = KeptWrite {
            cut: None,
            writers: 1,
            hold: false,
            hold_columns: None,
            remember: Some(0),
        };
        // Batch 1: d1, d2, d1 again (a third of the rows dropped); remembered.
        let parts = vec![
            part(1, "d1", 0, 3),
            part(1, "d2", 0, 3),
            part(1, "d1", 300, 3),
        ];
        let written = delta::write_kept(&table, parts, props.clone(), how.clone())
            .await
            .unwrap();
        assert_eq!((written.adds.len(), written.known.len()), (2, 2));
        let table = delta::commit_adds(table, written.adds.clone(), "app", 1)
            .await
            .unwrap();
        let mut known = Known::default();
        for (name, file) in written.known {
            let add = written
                .adds
                .iter()
                .find(|a| a.path.ends_with(&name))
                .unwrap();
            let f = std::fs::File::open(dir.path().join("t").join(&add.path)).unwrap();
            let mut hashes = Vec::new();
            for b in ParquetRecordBatchReaderBuilder::try_new(f)
                .unwrap()
                .build()
                .unwrap()
            {
                let b = b.unwrap();
                let ids = b.column(0).as_string::<i32>();
                hashes.extend(ids.iter().map(|v| bloom::hash(v.unwrap().as_bytes())));
            }
            assert_eq!(file.hashes, hashes, "{name}: its rows' hashes, in order");
            assert_eq!(file.size, add.size as u64);
            known.insert(name, file);
        }
        // Batch 2: not remembered (another writer's file, as far as the probe knows).
        let parts = vec![part(2, "d1", 0, 1000)];
        let plain = KeptWrite {
            remember: None,
            ..how
        };
        let written = delta::write_kept(&table, parts, props, plain)
            .await
            .unwrap();
        let table = delta::commit_adds(table, written.adds, "app", 2)
            .await
            .unwrap();

        // d1 of batch 1 holds 400 rows (rows 1, 2, 4, 5, … of 0..600) in four groups.
        let wanted = [
            id(1, "d1", 1),
            id(1, "d1", 599),
            id(1, "d2", 2),
            id(2, "d1", 7),
        ];
        let mut asked: Vec<String> = wanted.to_vec();
        asked.extend([id(1, "d1", 3), id(1, "d2", 300), "id-x".to_string()]);
        let ids: Ids<'_> = asked.iter().map(|s| s.as_str()).collect();
        let incoming = Incoming::of(&ids).unwrap();
        let days = ["d1".to_string(), "d2".to_string()];
        for exclude in [None, Some(2)] {
            let probe = Probe {
                column: "event_id",
                partition: ("day", &days),
                exclude: exclude.map(|b| ("_batch_id", b)),
            };
            let by_filters = existing_prepared(&table, &probe, &incoming, None)
                .await
                .unwrap();
            let by_known = existing_prepared(&table, &probe, &incoming, Some(&known))
                .await
                .unwrap();
            let sorted = |f: &Found| {
                let mut v: Vec<String> = f.ids.iter().cloned().collect();
                v.sort();
                v
            };
            let expect: Vec<String> = match exclude {
                None => wanted.to_vec(),
                Some(_) => wanted[..3].to_vec(),
            };
            let mut expect = expect;
            expect.sort();
            assert_eq!(sorted(&by_known), expect, "exclude {exclude:?}");
            assert_eq!(sorted(&by_filters), expect, "exclude {exclude:?}");
            assert_eq!((by_known.files, by_known.known_files), (3, 2));
            assert_eq!(by_filters.known_files, 0);
            // Known: d1's first and last group, d2's first; the unknown file (3 groups
            // of 100) is read whole (no filter).
            assert_eq!(by_known.row_groups_read, 3 + 3, "{by_known:?}");
        }
    }
}
