"""The batch truth of a CDC mirror, computed from the landed change files alone, and what
three independent Delta readers see in kestrel's mirror tables.

usage: cdc_truth.py LANDING_DIR WAREHOUSE SOURCE TABLE
Truth: per key, the change of the greatest lsn over every landed file (the first
delivery of a key and lsn wins); the current table holds the keys whose last change is
not a delete; the history holds one version per upsert, valid from its ts_ms until the
next change's ts_ms (None while current). Prints JSON: {"truth": {...}, reader: {"current":
bool, "history": bool, "rows": n, "versions": n}} — each bool says the reader's rows
equal the truth exactly.
"""
import glob
import gzip
import json
import os
import sys
import tempfile
from datetime import datetime, timezone

import deltalake
import duckdb
import duckdb_extensions
import polars as pl

COLS = ["customer_id", "email", "name", "tier", "credit_cents"]


def ms(v):
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return int(v)
    if isinstance(v, str):
        v = datetime.fromisoformat(v.replace("Z", "+00:00"))
    if v.tzinfo is None:
        v = v.replace(tzinfo=timezone.utc)
    return round(v.timestamp() * 1000)


def truth(landing, source):
    changes = {}
    for f in sorted(glob.glob(os.path.join(landing, source, "**", "*"), recursive=True)):
        name = os.path.basename(f)
        if name.startswith("_") or name.startswith("."):
            continue
        if f.endswith(".ndjson"):
            lines = open(f, encoding="utf-8").read().splitlines()
        elif f.endswith(".ndjson.gz"):
            lines = gzip.open(f, "rt", encoding="utf-8").read().splitlines()
        else:
            continue
        for line in lines:
            try:
                c = json.loads(line)
            except ValueError:
                continue
            c = c.get("payload", c) if isinstance(c, dict) else c
            if not isinstance(c, dict) or c.get("op") not in ("c", "u", "d", "r"):
                continue
            lsn = (c.get("source") or {}).get("lsn")
            row = c.get("before") if c["op"] == "d" else c.get("after")
            if not isinstance(lsn, int) or not isinstance(c.get("ts_ms"), int) or not row:
                continue
            changes.setdefault(row["customer_id"], {}).setdefault(lsn, c)
    current, history = set(), set()
    for key, by_lsn in changes.items():
        seq = [by_lsn[lsn] for lsn in sorted(by_lsn)]
        last = seq[-1]
        if last["op"] != "d":
            a = last["after"]
            current.add(tuple(a.get(c) for c in COLS) + (ms(a["updated_at"]), last["source"]["lsn"]))
        open_v = None
        for c in seq:
            if open_v is not None:
                history.add(tuple(open_v[:-2]) + (c["ts_ms"], False, open_v[-1]))
                open_v = None
            if c["op"] != "d":
                a = c["after"]
                open_v = [a.get(k) for k in COLS] + [ms(a["updated_at"]), c["ts_ms"], None, c["source"]["lsn"]]
        if open_v is not None:
            history.add(tuple(open_v[:-2]) + (None, True, open_v[-1]))
    return current, history


def rows_of(records):
    current = set()
    for r in records["current"]:
        current.add(tuple(r[c] for c in COLS) + (ms(r["updated_at"]), r["_lsn"]))
    history = set()
    for r in records["history"]:
        history.add(
            tuple(r[c] for c in COLS)
            + (ms(r["updated_at"]), ms(r["valid_from"]), ms(r["valid_to"]), bool(r["is_current"]), r["_lsn"])
        )
    return current, history


def main():
    landing, wh, source, table = sys.argv[1:5]
    want_current, want_history = truth(landing, source)
    paths = {"current": os.path.join(wh, table), "history": os.path.join(wh, table + "_history")}
    readers = {
        "deltalake": lambda p: deltalake.DeltaTable(p).to_pyarrow_table().to_pylist(),
        "polars": lambda p: pl.read_delta(p).to_dicts(),
    }
    ext_dir = os.environ.get("KESTREL_DUCKDB_EXT_DIR") or tempfile.mkdtemp(prefix="duckdb-ext-")
    con = duckdb.connect(config={"extension_directory": ext_dir})
    duckdb_extensions.import_extension("delta", con=con)
    con.execute("LOAD delta")

    def duck(p):
        # Timestamps as epoch milliseconds (DuckDB's own conversion, no pytz needed).
        cols = con.execute(f"DESCRIBE SELECT * FROM delta_scan('{p}')").fetchall()
        sel = ", ".join(
            f"epoch_ms({c}) AS {c}" if t.startswith("TIMESTAMP") else c for c, t, *_ in cols
        )
        cur = con.execute(f"SELECT {sel} FROM delta_scan('{p}')")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    readers["duckdb"] = duck
    out = {"truth": {"rows": len(want_current), "versions": len(want_history)}}
    for name, read in readers.items():
        got_current, got_history = rows_of({k: read(p) for k, p in paths.items()})
        out[name] = {
            "current": got_current == want_current,
            "history": got_history == want_history,
            "rows": len(got_current),
            "versions": len(got_history),
        }
        if got_current != want_current:
            out[name]["current_diff"] = [repr(x) for x in list(got_current ^ want_current)[:5]]
        if got_history != want_history:
            out[name]["history_diff"] = [repr(x) for x in list(got_history ^ want_history)[:5]]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
