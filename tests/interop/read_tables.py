"""Read kestrel's Delta tables with three independent readers and print what they see.

usage: read_tables.py WAREHOUSE TABLE [TABLE ...]
Prints JSON: {table: {reader: {rows, distinct_event_ids?, min_event_ts?, dates?,
final?, int_sums?}}}: gold tables (they have is_final) also report how many rows are
final and the sum of every integer result column.
"""
import json
import os
import sys
import tempfile

import deltalake
import duckdb
import duckdb_extensions
import polars as pl


def main():
    wh = sys.argv[1]
    tables = sys.argv[2:]
    ext_dir = os.environ.get("KESTREL_DUCKDB_EXT_DIR") or tempfile.mkdtemp(prefix="duckdb-ext-")
    con = duckdb.connect(config={"extension_directory": ext_dir})
    duckdb_extensions.import_extension("delta", con=con)
    con.execute("LOAD delta")
    out = {}
    for t in tables:
        path = os.path.join(wh, t)
        res = {}
        # delta-rs (Python)
        at = deltalake.DeltaTable(path).to_pyarrow_table()
        dl = pl.from_arrow(at)
        res["deltalake"] = summarize_polars(dl)
        # polars' own Delta reader
        res["polars"] = summarize_polars(pl.read_delta(path))
        # DuckDB delta extension (delta-kernel)
        rows = con.execute(f"SELECT count(*) FROM delta_scan('{path}')").fetchone()[0]
        d = {"rows": rows}
        cols = [r[0] for r in con.execute(f"DESCRIBE SELECT * FROM delta_scan('{path}')").fetchall()]
        if "event_id" in cols:
            n, m, dates = con.execute(
                f"SELECT count(DISTINCT event_id), strftime(min(event_ts) AT TIME ZONE 'UTC', '%Y-%m-%dT%H:%M:%S.%f'), "
                f"count(DISTINCT event_date) FROM delta_scan('{path}')"
            ).fetchone()
            d.update({"distinct_event_ids": n, "min_event_ts": m, "dates": dates})
        if "is_final" in cols:
            d["final"] = con.execute(
                f"SELECT count(*) FILTER (WHERE is_final) FROM delta_scan('{path}')"
            ).fetchone()[0]
            types = dict(
                (r[0], r[1]) for r in con.execute(f"DESCRIBE SELECT * FROM delta_scan('{path}')").fetchall()
            )
            ints = [c for c in cols if types[c] == "BIGINT" and not c.startswith("_")]
            d["int_sums"] = {
                c: int(con.execute(f"SELECT coalesce(sum({c}), 0) FROM delta_scan('{path}')").fetchone()[0])
                for c in ints
            }
        res["duckdb"] = d
        out[t] = res
    print(json.dumps(out), flush=True)
    con.close()
    # Skip interpreter teardown: native reader threads can abort it after the work is done.
    os._exit(0)


def summarize_polars(df):
    d = {"rows": df.height}
    if "event_id" in df.columns:
        d["distinct_event_ids"] = df["event_id"].n_unique()
        m = df["event_ts"].dt.convert_time_zone("UTC").min()
        d["min_event_ts"] = m.strftime("%Y-%m-%dT%H:%M:%S.%f")
        d["dates"] = df["event_date"].n_unique()
    if "is_final" in df.columns:
        d["final"] = int(df["is_final"].sum())
        d["int_sums"] = {
            c: int(df[c].sum())
            for c, t in df.schema.items()
            if t == pl.Int64 and not c.startswith("_")
        }
    return d


if __name__ == "__main__":
    main()
