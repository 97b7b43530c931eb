"""The SQL store's tables (``DIR/merged.sqlite``), documented in docs/store-schema.md."""

from __future__ import annotations

import sqlite3

STORE_NAME = "merged.sqlite"
STORE_VERSION = 15

SCHEMA_SQL = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE processes(
    proc INTEGER PRIMARY KEY, file TEXT, run_id TEXT, host TEXT, pid INTEGER, rank INTEGER,
    world_size INTEGER, local_rank INTEGER, tp_rank INTEGER, tp_size INTEGER, tp_ranks TEXT,
    device TEXT, mono_anchor_ns INTEGER, wall_anchor_ns INTEGER, clock_offset_ns INTEGER,
    clock_residual_ns INTEGER, clock_matches INTEGER, records INTEGER, corrupt_chunks INTEGER,
    skipped_bytes INTEGER, truncated INTEGER, end_reason TEXT, identity TEXT);
CREATE TABLE modules(module_id INTEGER PRIMARY KEY, path TEXT UNIQUE, class TEXT);
CREATE TABLE layouts(layout_id INTEGER PRIMARY KEY, slots TEXT UNIQUE, signature TEXT);
CREATE TABLE groups(group_id INTEGER PRIMARY KEY, name TEXT, ranks TEXT, backend TEXT, pg_name TEXT,
    UNIQUE(pg_name, ranks));
CREATE TABLE steps(proc INTEGER, step INTEGER, root TEXT, t_begin INTEGER, t_end INTEGER,
    n_spans INTEGER, n_collectives INTEGER, attrs TEXT, span_first INTEGER, span_last INTEGER,
    interrupted INTEGER, device_ns INTEGER, fingerprinted INTEGER, PRIMARY KEY(proc, step));
CREATE TABLE spans(proc INTEGER, step INTEGER, idx INTEGER, parent INTEGER, module_id INTEGER,
    call INTEGER, t0 INTEGER, dur INTEGER, layout_id INTEGER, fp_pre INTEGER, fp_post INTEGER,
    n_pre INTEGER, flags INTEGER);
CREATE TABLE collective_summary(module_id INTEGER, op TEXT, reduce_op TEXT, group_id INTEGER,
    proc INTEGER, count INTEGER, bytes INTEGER, dur_ns INTEGER, per_step TEXT, first INTEGER,
    device_ns INTEGER, device_count INTEGER);
CREATE TABLE collectives(proc INTEGER, step INTEGER, idx INTEGER, parent INTEGER, op TEXT,
    reduce_op TEXT, group_id INTEGER, seq INTEGER, t0 INTEGER, dur INTEGER, layout_id INTEGER,
    fp_pre INTEGER, fp_post INTEGER, n_pre INTEGER, flags INTEGER, bytes INTEGER, module_id INTEGER,
    device_ns INTEGER, attrs TEXT, PRIMARY KEY(proc, step, idx)) WITHOUT ROWID;
CREATE TABLE fingerprints(proc INTEGER, step INTEGER, first INTEGER, data BLOB, indices BLOB);
CREATE TABLE wide_fingerprints(proc INTEGER, step INTEGER, idx INTEGER, sum REAL, sumsq REAL);
CREATE TABLE nonfinite_fingerprints(proc INTEGER, step INTEGER, idx INTEGER, sum REAL, sumsq REAL,
    posinf INTEGER, neginf INTEGER, nan INTEGER);
CREATE TABLE params(proc INTEGER, module_id INTEGER, name TEXT, shape TEXT, dtype TEXT, fp_index INTEGER,
    meta TEXT);
CREATE TABLE captures(point TEXT PRIMARY KEY, info TEXT);
CREATE TABLE lineage(proc INTEGER, step INTEGER, node INTEGER, op TEXT, attrs TEXT, inputs TEXT, shape TEXT,
    PRIMARY KEY(proc, step, node)) WITHOUT ROWID;
CREATE TABLE slot_sources(proc INTEGER, step INTEGER, span INTEGER, slot INTEGER, ref TEXT,
    PRIMARY KEY(proc, step, span, slot)) WITHOUT ROWID;
CREATE TABLE module_attrs(module TEXT PRIMARY KEY, attrs TEXT);
CREATE TABLE errors(proc INTEGER, t INTEGER, location TEXT, message TEXT);
CREATE TABLE collective_issues(group_id INTEGER, seq INTEGER, kind TEXT, ranks TEXT, detail TEXT);
CREATE TABLE points(point TEXT, module TEXT, call INTEGER, slot TEXT, placement TEXT,
    reduction TEXT, shapes TEXT, dtype TEXT, dtypes TEXT, steps INTEGER, evidence TEXT,
    collective TEXT, fingerprint TEXT, semantics TEXT, sort_key INTEGER, rule TEXT, evidence_items TEXT,
    grouping TEXT);
"""

# Built by a second connection while the verdicts are computed (merge._index_beside): none of
# the merge's own reads needs it, and it costs as much as the verdicts on a large trace.
INDEX_BESIDE_SQL = "CREATE INDEX collectives_by_module ON collectives(module_id, proc, step);"

INDEX_SQL = """
CREATE INDEX collectives_by_seq ON collectives(group_id, seq);
CREATE INDEX fingerprints_by_step ON fingerprints(step, proc);
CREATE INDEX points_by_module ON points(module, call);
CREATE INDEX points_by_point ON points(point);
CREATE VIEW span_view AS
    SELECT s.proc, p.rank, s.step, s.idx, s.parent, m.path AS module, m.class, s.call,
           st.t_begin + s.t0 + COALESCE(p.clock_offset_ns, 0) AS start_ns, s.dur AS dur_ns,
           l.slots AS tensors, s.flags
    FROM spans s JOIN modules m USING(module_id) JOIN processes p USING(proc)
    JOIN steps st ON st.proc = s.proc AND st.step = s.step
    LEFT JOIN layouts l USING(layout_id);
CREATE VIEW collective_view AS
    SELECT c.proc, p.rank, c.step, c.idx, m.path AS module, c.op, c.reduce_op, g.name AS grp,
           g.ranks AS group_ranks, c.seq, st.t_begin + c.t0 + COALESCE(p.clock_offset_ns, 0) AS start_ns,
           c.dur AS dur_ns, c.device_ns, c.bytes, l.slots AS tensors, c.flags, c.attrs
    FROM collectives c JOIN processes p USING(proc) JOIN groups g USING(group_id)
    JOIN steps st ON st.proc = c.proc AND st.step = c.step
    LEFT JOIN modules m ON m.module_id = c.module_id
    LEFT JOIN layouts l ON l.layout_id = c.layout_id;
"""


def open_new_store(path: str) -> sqlite3.Connection:
    """A new store with the schema and no rows (built in one go: no journal, no syncs)."""
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    con.executescript(SCHEMA_SQL)
    return con


ROWS_PER_STATEMENT = 250  # about the fastest in a multi-row INSERT (fewer: more statements; more: no gain)
_MIN_VARIABLES = 999  # bound parameters per statement in SQLite builds before 3.32


def _variables_limit(con) -> int:
    """Bound parameters this SQLite takes in one statement."""
    try:
        return con.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    except (AttributeError, sqlite3.Error):  # Python before 3.11
        return _MIN_VARIABLES


def insert_rows(con, insert: str, ncols: int, flat: list, last: bool = True, row: str | None = None) -> int:
    """``insert`` (``INSERT ... INTO table``) the rows of ``flat``, ``ncols`` values each, one
    after the other, many rows per statement (about half the cost of executemany's statement
    per row); return the number of rows inserted: all, or unless ``last`` only those that fill
    whole statements (a statement of another length is compiled anew). ``row``: one row's
    values in SQL, with ``ncols`` parameters (default ``(?,?,...)``)."""
    one = row or "(" + ",".join("?" * ncols) + ")"
    per = max(1, min(ROWS_PER_STATEMENT, _variables_limit(con) // ncols))
    step = per * ncols
    full = len(flat) - len(flat) % step
    if full:
        sql = f"{insert} VALUES " + ",".join([one] * per)
        for i in range(0, full, step):
            con.execute(sql, flat[i:i + step])
    if last and full < len(flat):
        con.execute(f"{insert} VALUES " + ",".join([one] * ((len(flat) - full) // ncols)), flat[full:])
        full = len(flat)
    return full // ncols
