"""merge_ranks: every rank file of a run into one indexed SQLite store (``DIR/merged.sqlite``).

Streaming: each file is read chunk by chunk and inserted in batches (``loader``); the merge holds
only one file's intern tables and one batch in memory, whatever the size of the trace. With more than one
core, worker processes load groups of files at the same time (``merge_workers``), one part store
per file (the first worker's first: the first chunks of a file whose rest this process loads),
and each part is copied in as soon as it is complete; the store is the same row for row. The store is built in a temporary file and
renamed, so a reader never sees half a store, and merging twice gives the same store (files are
taken in sorted order; nothing depends on the time of the merge or on the number of workers).

After loading, the merge (1) matches collectives across ranks by (group, sequence number) and
records ranks that skipped one or issued a different one, (2) estimates clock offsets between
processes from matched blocking collectives (both ``merge_align``), and (3) runs the caller's
analysis on the store (``tensor_trace.exporters.pipeline`` computes the placement and reduction
verdicts of every capture point there; an index that none of this reads is built beside it, on
a second connection: ``_index_beside``). The tables (``tables``) are documented in
``docs/store-schema.md``; ``tensor-trace query sql`` exposes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sqlite3
import sys
import threading
import time

from tensor_trace import progress, schema
from tensor_trace.errors import BadInput
from tensor_trace.exporters.store import merge_workers
from tensor_trace.exporters.store.loader import FILE_TABLES, SharedIds, load_file
from tensor_trace.exporters.store.merge_align import align_collectives, check_missing_ranks, estimate_clock_offsets
from tensor_trace.exporters.store.reader import rank_files
from tensor_trace.exporters.store.tables import (INDEX_BESIDE_SQL, INDEX_SQL, STORE_NAME, STORE_VERSION,
                                                 open_new_store)

WAIT_FOR_INDEX_MS = 24 * 3600 * 1000  # the store's connection waits for the index beside it, however long
# A table of the merge's connection only (TEMP: never in the store): the spans of the first
# process with spans per (module_id, call), counted while its file was loaded (``n``), where they
# were. The verdicts read it instead of grouping that process's spans again (0.7 s at 20M span
# records, on the merge's serial path); without it they group (``verdicts.calls_seen``).
CALLS_TABLE = "first_proc_calls"


def store_path(trace_dir: str) -> str:
    return os.path.join(trace_dir, STORE_NAME)


def is_stale(trace_dir: str, meta: dict | None = None) -> bool:
    """True when the store is missing, of another version, older than a rank file, or when its
    ``meta`` rows differ from ``meta`` (key -> value; the analysis' version: pipeline.py)."""
    path = store_path(trace_dir)
    if not os.path.exists(path):
        return True
    mtime = os.path.getmtime(path)
    if any(os.path.getmtime(f) > mtime for f in rank_files(trace_dir)):
        return True
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        rows = dict(con.execute("SELECT key, value FROM meta"))
        con.close()
        if rows.get("store_version") != str(STORE_VERSION):
            return True
        return any(rows.get(k) != v for k, v in (meta or {}).items())
    except sqlite3.Error:
        return True

def _side_files(tmp: str) -> list:
    """The WAL files SQLite keeps beside the store while ``_index_beside`` runs."""
    return [tmp + "-wal", tmp + "-shm"]


@contextlib.contextmanager
def _index_beside(con, path: str, sql: str, report: dict):
    """Run ``sql`` (CREATE INDEX) on a second connection in a thread while the body reads
    ``con``. SQLite builds an index without holding the GIL, so with a core to spare (the
    workers have ended by now) it leaves the merge's path. The store is in WAL mode meanwhile, so
    that ``con`` can read; a write of the body waits for the index's commit (the index takes the
    write lock before the body starts, so the store's pages come in the same order every time),
    and the body's writes are committed before the index is waited for. Then back to a plain file
    (no WAL beside it). Without WAL (a file system without shared memory) the index is built
    first, here."""
    con.commit()
    try:
        wal = con.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() == "wal"
        con.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # WAL's shared memory works
    except sqlite3.Error:
        wal = False
    if not wal:
        with contextlib.suppress(sqlite3.Error):
            con.execute("PRAGMA journal_mode=DELETE")
        con.executescript(sql)
        yield
        return
    con.execute(f"PRAGMA busy_timeout={WAIT_FOR_INDEX_MS}")
    side = sqlite3.connect(path, timeout=WAIT_FOR_INDEX_MS / 1000, check_same_thread=False)
    started, failure, figures = threading.Event(), [], {}

    def build():
        try:
            c0 = time.thread_time()
            side.execute("PRAGMA synchronous=OFF")
            side.execute("BEGIN IMMEDIATE")
            started.set()
            side.execute(sql)
            side.commit()
            figures["index_cpu_s"] = time.thread_time() - c0
        except BaseException as exc:  # raised again in the merging thread
            failure.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=build, name="tensor-trace-merge-index", daemon=True)
    thread.start()
    try:
        started.wait()
        c0 = time.thread_time()
        yield
        con.commit()
        figures["beside_cpu_s"] = time.thread_time() - c0
    except BaseException:
        side.interrupt()  # a failed merge does not wait for the whole index
        raise
    finally:
        thread.join()
        side.close()
    if failure:
        raise failure[0]
    con.execute("PRAGMA journal_mode=DELETE")
    report["index_beside"] = figures


def _load_rank_files(con, files, g, tmp, workers, report, warn):
    """Load every rank file into ``con``; yield their results in file order. The first group of
    files is loaded here while worker processes load the others (``merge_workers``), whose
    parts are copied in as they complete; closing this generator stops them. Where the first
    worker's group begins with a file's first chunks (``plan``'s split), the rest of that file
    is loaded here once they are copied in."""
    groups = merge_workers.plan(files, workers, split=True)
    first = groups[0][0][0]  # its spans are counted per (module, call) as they go in: CALLS_TABLE
    if len(groups) == 1:
        for proc, path in groups[0]:
            yield load_file(con, proc, path, g, count_calls=proc == first)
        return
    with merge_workers.Pool(groups[1:], tmp, len(groups[0])) as pool:
        for proc, path in groups[0]:
            yield load_file(con, proc, path, g, count_calls=proc == first)
        report["workers"] = []
        stats = {}  # id(group) -> the worker's latest figures
        for group, i, part, failure in pool.parts():
            if failure is not None:
                # Nothing of these files is in the store yet: this process loads them instead.
                rest = group[i:]
                msg = (f"a merge worker failed ({failure}); loaded its {'last ' if i else ''}"
                       f"{len(rest)} rank file(s) here")
                warn(msg)
                report["problems"].append(msg)
                for proc, path, *_ in rest:
                    yield load_file(con, proc, path, g)
            else:
                try:
                    data = merge_workers.read_part(part)
                except (sqlite3.Error, OSError, TypeError, pickle.UnpicklingError) as exc:
                    msg = f"a merge worker's part store is unreadable ({exc}); loaded its rank file here"
                    warn(msg)
                    report["problems"].append(msg)
                    proc, path = group[i][:2]
                    yield load_file(con, proc, path, g)
                else:
                    offset = con.execute("SELECT COALESCE(MAX(rowid), 0) FROM spans").fetchone()[0]
                    maps = merge_workers.copy_part(con, part, data, g, FILE_TABLES)
                    os.remove(part)  # copied: its disk is not needed until the store is complete
                    stats[id(group)] = data["stats"]
                    yield from data["results"]
                    partial = data.get("partial")
                    if partial is not None:  # the file's first chunks: the rest is loaded here
                        yield load_file(con, partial.proc, partial.path, g, resume=(partial, maps, offset))
            if (i == len(group) - 1 or failure is not None) and id(group) in stats:
                report["workers"].append(stats.pop(id(group)))


def merge_ranks(trace_dir: str, warn=None, workers: int | None = None, analyse=None) -> dict:
    """Merge every rank file of ``trace_dir`` into ``trace_dir/merged.sqlite``; return a report.

    ``workers``: processes that load rank files besides this one (``merge_workers``); None
    chooses from the cores and the trace's size (``TENSOR_TRACE_MERGE_WORKERS`` overrides), 0
    loads every file here. The store is the same either way. ``analyse(con)``, if given, runs
    on the loaded store before it is committed (the placement verdicts: ``pipeline.merge_ranks``);
    what it returns is the report's ``points``."""
    warn = warn or (lambda msg: sys.stderr.write(f"tensor-trace: warning: {msg}\n"))
    if not os.path.isdir(trace_dir):
        raise BadInput(f"{trace_dir}: no such trace folder")
    files = rank_files(trace_dir)
    if not files:
        raise BadInput(f"{trace_dir}: no rank files (expected {trace_dir}/ranks/*.ttr from tensor-trace record)")
    run_id = schema.read_run_id(trace_dir, warn)
    final = store_path(trace_dir)
    tmp = final + ".tmp"
    for old in [tmp, *_side_files(tmp), *merge_workers.part_paths(tmp)]:
        if os.path.exists(old):
            os.remove(old)
    con = open_new_store(tmp)
    g = SharedIds(con)
    report = dict(files=len(files), processes=0, problems=[])
    digests = {}  # proc -> SequenceDigest of its collectives
    calls = None  # the first process with spans: its spans per (module id, call), if counted
    spans_seen = False
    loading = _load_rank_files(con, files, g, tmp, workers, report, warn)
    bar = progress.Task.open("merge: rank files", len(files))
    try:
        for res in loading:
            bar.advance()
            path = res.path
            if res.skipped:
                warn(f"skipping {res.skipped}")
                report["problems"].append(res.skipped)
                continue
            file_run = res.header.get("run_id")
            if run_id is None:
                run_id = file_run
            elif file_run != run_id:
                raise BadInput(f"{os.path.basename(path)} belongs to run {file_run}, not to this folder's "
                               f"run {run_id}: move it out, or record again with --replace")
            ident = res.identity
            hdr = res.header
            rep = res.report
            for p in rep.problems():
                warn(f"{os.path.basename(path)}: {p}; read what came before")
                report["problems"].append(f"{os.path.basename(path)}: {p}")
            con.execute("INSERT INTO processes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", (
                res.proc, os.path.relpath(path, trace_dir), file_run, hdr.get("host"), hdr.get("pid"),
                ident.get("rank"), ident.get("world_size"), ident.get("local_rank"), ident.get("tp_rank"),
                ident.get("tp_size"), json.dumps(ident.get("tp_ranks")) if ident.get("tp_ranks") else None,
                ident.get("device"), hdr.get("mono_ns"), hdr.get("wall_ns"), hdr.get("clock_offset_ns", 0),
                None, 0, rep.records,
                rep.corrupt_chunks, rep.skipped_bytes, int(rep.truncated_tail),
                (res.end or {}).get("reason"), json.dumps(ident, sort_keys=True)))
            report["processes"] += 1
            digests[res.proc] = res.digest
            if not spans_seen and res.span_rows:
                spans_seen, calls = True, res.calls
        if not report["processes"]:
            raise BadInput(f"{trace_dir}: none of its {len(files)} rank file(s) could be read")
        report["hosts"] = [h for (h,) in con.execute("SELECT DISTINCT host FROM processes WHERE host IS NOT NULL "
                                                     "ORDER BY host")]
        bar.stage("merge: collectives, clocks and verdicts")
        g.write()
        con.executemany("INSERT INTO meta VALUES (?,?)", [
            ("store_version", str(STORE_VERSION)), ("run_id", run_id or ""),
            ("format_version", str(schema.FORMAT_VERSION))])
        con.executescript(INDEX_SQL)
        check_missing_ranks(con, warn, report)
        report["collective_issues"] = align_collectives(con, digests)
        report["clocks"] = estimate_clock_offsets(con)
        if calls is not None:
            con.execute(f"CREATE TEMP TABLE {CALLS_TABLE}(module_id INTEGER, call INTEGER, n INTEGER)")
            con.executemany(f"INSERT INTO temp.{CALLS_TABLE} VALUES (?,?,?)",
                            [(mid, call, n) for (mid, call), n in calls.items()])
        if analyse is not None:
            with _index_beside(con, tmp, INDEX_BESIDE_SQL, report):
                report["points"] = analyse(con)
        else:
            con.executescript(INDEX_BESIDE_SQL)
        con.commit()
    except BaseException:
        loading.close()
        con.close()
        for path in [tmp, *_side_files(tmp)]:
            if os.path.exists(path):
                os.remove(path)
        raise
    finally:
        bar.close()
    con.close()
    os.replace(tmp, final)
    return report
