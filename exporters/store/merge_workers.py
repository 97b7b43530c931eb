"""Parallel loading for ``merge_ranks``: worker processes read groups of rank files into part stores.

Decoding a rank file and inserting its rows is CPU-bound Python, so on a machine with more than
one core the rank files are split into contiguous groups: the merging process loads the first
group straight into the store while one worker process per other group loads its group, one
part store per rank file (the same schema, ``merged.sqlite.tmp.partK.I`` for the I-th file of
worker K), and says on its stdout when each part is complete. The merging process copies each
part into the store as soon as it is complete and its turn has come, in file order, by
``INSERT ... SELECT`` (SQLite does that in C), with the part's module, layout and group ids
mapped to the store's and its span rowids shifted to follow the rows already there: copying
overlaps the worker's loading of its next files, so after the last worker ends only its last
file's part is left to copy. Whole files would leave one process idle for up to a file's
loading at the end, so the cut between the merging process and the first worker falls inside a
file where both finish together (``plan``'s split): the worker loads that file's first chunks
into its first part and hands over its loader as it stopped (the open step's rows, the file's
intern tables, counts and digests); the merging process copies the part and goes on loading the
file from there (``loader.FileLoader.resume``). Ids are given in first-seen order across files in sorted order
and rows are copied in that order, so the store is the one a single process would build, row
for row. Once a worker has loaded its first file it guesses the store's ids of its layouts
(``_guess_layout_ids``): where ranks are alike, as in a TP run on GPUs, no id of its parts needs
mapping and SQLite copies their rows as they are stored.

A worker never outlives the merge: the merging process kills and reaps every worker when it
leaves (error, Ctrl-C included), and a worker exits on its own once the merging process is gone
(it watches a pipe that only that process holds open). If a worker fails, the merging process
loads the files of its group that it had not completed itself, so the store is complete either
way.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
import threading
import time

from tensor_trace import schema
from tensor_trace.exporters.store.loader import FileLoader, SharedIds, load_file
from tensor_trace.exporters.store.tables import open_new_store

ENV_WORKERS = "TENSOR_TRACE_MERGE_WORKERS"  # worker processes besides the merging one; 0 = none
PARALLEL_MIN_BYTES = 8 << 20  # below this (about 150,000 span records) starting a worker does not pay
MAX_WORKERS = 3  # the copying of parts is serial: more workers help less and hold more memory
# Copying a worker's part into the store, in bytes of rank files the merging process could have
# loaded in the same time (per byte of the part's rank file; measured on the 61-layer synthetic
# trace with parts copied as stored, bench/merge_path.py's CPU times: 0.43-0.47 s a part against
# 3.4-3.8 s to load its file at 20M span records, 0.05 against 0.37 at 2M; was 0.15 when parts
# were mapped, ~0.3 us a span record against ~2 us to load it).
COPY_RATIO = 0.13
# A file's share below which a cut inside it (plan's ``split``) is not worth a part of its own.
MIN_SPLIT = 0.05

# Columns holding ids that each process gives out on its own, by name wherever they occur, and
# the SharedIds table each maps through.
ID_COLUMNS = {"module_id": "modules", "layout_id": "layouts", "group_id": "groups"}
SPAN_ROWID_COLUMNS = ("span_first", "span_last")  # steps: rowids of the step's spans
REPLACED_TABLES = ("module_attrs", "captures")  # keyed by name: a later file's row wins

# Run in the worker: put the merging process's import path first, so the worker imports the
# same tensor_trace, wherever it came from.
_BOOT = ("import json, sys; spec = json.loads(sys.argv[1]); "
         "sys.path[:0] = [p for p in spec['path'] if p not in sys.path]; "
         "from tensor_trace.exporters.store.merge_workers import worker_main; worker_main(spec)")


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def plan(files: list, workers: int | None, split: bool = False) -> list:
    """Split the rank files into contiguous groups of ``(proc, path)``: the first for the merging
    process (it also copies the workers' parts in as they complete), one per worker after it.
    ``workers`` None: as many as the usable cores allow (at most MAX_WORKERS), and none for a
    small trace or when ``TENSOR_TRACE_MERGE_WORKERS`` says 0.

    ``split``: the cut between the merging process and the first worker may fall inside a file
    (``_split``): that worker's group then begins with ``(proc, path, stop)``, the file's first
    chunks up to byte ``stop``, and the merging process loads the rest of that file after
    copying them in."""
    procs = list(enumerate(files))
    if workers is None:
        env = os.environ.get(ENV_WORKERS, "").strip()
        if env:
            try:
                workers = max(0, int(env))
            except ValueError:
                workers = None
    sizes = []
    for f in files:
        try:
            sizes.append(os.path.getsize(f))
        except OSError:
            sizes.append(0)
    if workers is None:
        if sum(sizes) < PARALLEL_MIN_BYTES:
            return [procs]
        workers = min(_usable_cpus() - 1, MAX_WORKERS)
    if not sys.executable or getattr(sys, "frozen", False):  # no interpreter to start workers with
        return [procs]
    n = min(workers + 1, len(files))
    if n < 2:
        return [procs]
    weights = sizes if sum(sizes) else [1] * len(files)
    cum = [0]
    for w in weights:
        cum.append(cum[-1] + w)
    total = cum[-1]

    def slowest(j):
        """When the last part is in, in bytes of loading: the merging process loads files
        [0, j) and copies the workers' parts as they complete; the workers load an even share
        of the rest each, and the last part to copy is a worker's last file's. What follows
        (indexes, clocks, verdicts) is the same for every cut."""
        rest = total - cum[j]
        return max(cum[j] + COPY_RATIO * rest, rest / (n - 1) + COPY_RATIO * weights[-1])

    # The merging process's files: the cut that finishes soonest; every group keeps at least
    # one file. The workers' groups: cut where the running byte count comes nearest to even shares.
    cuts = [0, min(range(1, len(files) - n + 2), key=slowest)]
    for k in range(1, n - 1):
        target = cum[cuts[1]] + (total - cum[cuts[1]]) * k / (n - 1)
        lo, hi = cuts[-1] + 1, len(files) - (n - 1 - k)
        cuts.append(min(range(lo, hi + 1), key=lambda j: abs(cum[j] - target)))
    cuts.append(len(files))
    groups = [procs[cuts[k]:cuts[k + 1]] for k in range(n)]
    return _split(groups, weights, cum, n, cuts[2]) if split else groups


def _split(groups: list, weights: list, cum: list, n: int, end: int) -> list:
    """Move the cut between the merging process and the first worker to where both finish
    together, inside a file: whole files leave one of them idle for up to a file's loading at
    the end (of 8 equal files, the merging process finishes ~0.6 of a file after its worker,
    copying the worker's parts; ``slowest`` in ``plan``). The merging process loads bytes
    [0, x) of the trace and copies the rest: x + COPY_RATIO * (total - x); the workers load the
    rest evenly, and the last part is copied after them. The file holding x: its first
    ``cum[j + 1] - x`` bytes go to the first worker (its first part), the merging process loads
    the rest. ``end``: the files before it are the first worker's; the first file stays whole
    with the merging process (its spans are counted per call as they go in: merge.CALLS_TABLE)."""
    total, r = cum[-1], COPY_RATIO
    x = (total / (n - 1) + r * weights[-1] - r * total) / (1 - r + 1 / (n - 1))
    j = next((k for k in range(len(weights)) if cum[k] <= x < cum[k + 1]), None)
    if j is None or j < 1 or j >= end or not weights[j]:
        return groups
    head = cum[j + 1] - x  # bytes of file j for the worker
    if not MIN_SPLIT <= head / weights[j] <= 1 - MIN_SPLIT:
        return groups
    procs = [pp for g in groups for pp in g]
    proc, path = procs[j]
    return [procs[:j], [(proc, path, int(head))] + procs[j + 1:end]] + groups[2:]


def part_paths(store_tmp: str) -> list:
    """Part stores (and their logs) a killed merge may have left next to the store."""
    return glob.glob(glob.escape(store_tmp) + ".part*")


def part_path(prefix: str, index: int) -> str:
    """The part store of a worker's ``index``-th file (``prefix``: the worker's, ``STORE.tmp.partK``)."""
    return f"{prefix}.{index}"


class Pool:
    """Worker processes, one per group, started at once; a context manager that stops and reaps
    every worker still running and removes the part stores when it exits."""

    def __init__(self, groups: list, store_tmp: str, files_before: int = 0):
        self.workers = []  # (group, part prefix, Popen, log path)
        try:
            for k, group in enumerate(groups, 1):
                prefix = f"{store_tmp}.part{k}"
                log = prefix + ".log"
                for p in [log, *glob.glob(glob.escape(prefix) + ".*")]:
                    if os.path.exists(p):
                        os.remove(p)
                spec = dict(part=prefix, files=group, path=[p for p in sys.path if isinstance(p, str)],
                            files_before=files_before + sum(len(g) for g in groups[:k - 1]))
                env = dict(os.environ)
                env.pop(schema.ENV_DIR, None)  # a merge run inside a traced program: never traced itself
                with open(log, "wb") as err:
                    proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(spec)], env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                            close_fds=True)
                self.workers.append((group, prefix, proc, log))
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        for _group, prefix, proc, log in self.workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe:
                    pipe.close()
            for p in [log, *glob.glob(glob.escape(prefix) + ".*")]:
                try:
                    os.remove(p)
                except OSError:
                    pass
        self.workers = []

    def parts(self):
        """Yield ``(group, index, part path, failure)`` for every file of every worker's group, in
        file order, as soon as its part is complete (the worker goes on with its next file
        meanwhile). failure is None; or why the worker stopped before completing that file's
        part (part is None): the caller loads ``group[index:]`` itself, and this goes on with
        the next worker."""
        for group, prefix, proc, log in self.workers:
            for i in range(len(group)):
                if _part_done(proc.stdout, i):
                    yield group, i, part_path(prefix, i), None
                    continue
                status = proc.wait()
                failure = f"exit status {status}"
                try:
                    with open(log, "rb") as f:
                        tail = f.read()[-600:].decode("utf-8", "replace").strip()
                    if tail:
                        failure += f": {tail.splitlines()[-1]}"
                except OSError:
                    pass
                yield group, i, None, failure
                break


def _part_done(stdout, index: int) -> bool:
    """Wait for the worker to say that its ``index``-th part is complete (True), or to end
    without saying so (False). Lines of other output are passed over."""
    want = b"part %d\n" % index
    while True:
        line = stdout.readline() if stdout else b""
        if not line:
            return False
        if line == want:
            return True


def _map_expr(column: str, mapping: list, con, name: str, start: int = 0) -> str:
    """SQL for the store's id of a part's id in ``column`` (mapping[part id] = store id; the
    part holds no id below ``start``)."""
    if all(g == i for i, g in enumerate(mapping[start:], start)):
        return column
    shift = {g - i for i, g in enumerate(mapping[start:], start)}
    if len(shift) == 1:
        return f"({column} + {shift.pop()})"
    con.execute(f"CREATE TEMP TABLE IF NOT EXISTS {name}(l INTEGER PRIMARY KEY, g INTEGER)")
    con.execute(f"DELETE FROM temp.{name}")
    con.executemany(f"INSERT INTO temp.{name} VALUES (?, ?)", enumerate(mapping))
    return f"(SELECT g FROM temp.{name} WHERE l = {column})"


def read_part(part: str) -> dict:
    """What a worker saved with its part store: its files' load results and the ids it gave."""
    con = sqlite3.connect(f"file:{part}?mode=ro", uri=True)
    try:
        return pickle.loads(con.execute("SELECT data FROM part_result").fetchone()[0])
    finally:
        con.close()


def copy_part(con, part: str, data: dict, g, tables) -> dict:
    """Copy a worker's part store into the store (``con``, whose ids ``g`` gives out), the
    tables in the order given, rows in rowid order; return the maps of the part's ids to the
    store's (kind -> list: ``loader.FileLoader.resume``)."""
    con.commit()  # ATTACH is refused inside a transaction
    con.execute("ATTACH DATABASE ? AS part", (part,))
    try:
        base = data.get("layout_base", 0)  # the worker's layout ids start there (SharedIds.shift_layouts)
        maps = {"modules": [g.module(path, cls) for path, cls in data["modules"]],
                "layouts": list(range(base)) + [g.layout_key(key) for key in data["layouts"]],
                "groups": [g.group(*args) for args in data["groups"]]}
        exprs = {col: _map_expr(col, maps[kind], con, f"part_{kind}", base if kind == "layouts" else 0)
                 for col, kind in ID_COLUMNS.items()}
        for res in data["results"]:
            if res.digest is not None:
                res.digest = res.digest.remapped(maps["groups"])
        # Spans keep their order: a part's rowids shifted by the store's last rowid. They run
        # 1, 2, ... without gaps (a skipped file's rows are the part's last ones, and the next
        # file reuses their rowids): the last is the number of spans its files left. Then,
        # appended in order, they get exactly those (the faster insert); otherwise each row is
        # given its rowid.
        offset = con.execute("SELECT COALESCE(MAX(rowid), 0) FROM main.spans").fetchone()[0]
        last = con.execute("SELECT COALESCE(MAX(rowid), 0) FROM part.spans").fetchone()[0]
        partial = data.get("partial")  # a file's first chunks: the merging process loads the rest
        dense = last == sum(r.span_rows for r in data["results"]) + (partial.span_rows if partial else 0)
        for table in tables:
            cols = [r[1] for r in con.execute(f"PRAGMA main.table_info({table})")]
            sel = []
            for c in cols:
                if c in exprs:
                    sel.append(exprs[c])
                elif table == "steps" and c in SPAN_ROWID_COLUMNS:
                    sel.append(f"{c} + {offset}")
                else:
                    sel.append(c)
            if table == "spans" and not dense:
                con.execute(f"INSERT INTO main.spans(rowid, {', '.join(cols)}) SELECT rowid + {offset}, "
                            f"{', '.join(sel)} FROM part.spans ORDER BY rowid")
                continue
            verb = "INSERT OR REPLACE" if table in REPLACED_TABLES else "INSERT"
            if sel == cols:
                # Nothing to map: in this form SQLite copies the records as they are stored, in
                # rowid order, appended (its "transfer optimisation"; ~0.1 us a span row against
                # ~0.27 column by column), where it can; else it does the same column by column.
                con.execute(f"{verb} INTO main.{table} SELECT * FROM part.{table}")
                continue
            order = "" if _without_rowid(con, table) else " ORDER BY rowid"
            con.execute(f"{verb} INTO main.{table}({', '.join(cols)}) SELECT {', '.join(sel)} "
                        f"FROM part.{table}{order}")
        con.commit()
    finally:
        con.execute("DETACH DATABASE part")
    return maps


def _without_rowid(con, table: str) -> bool:
    sql = con.execute("SELECT sql FROM main.sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
    return bool(sql) and "WITHOUT ROWID" in sql[0].upper()


def _exit_with_parent() -> None:
    """End this worker once the merging process is gone: it holds the only writer of our stdin."""
    try:
        sys.stdin.buffer.read()
    except Exception:
        pass
    os._exit(3)


def _status_kb(key: str) -> int | None:
    """A /proc/self/status figure (VmHWM: peak RSS, VmRSS: now) in kB, where there is one."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _guess_layout_ids(con, g, k: int, partial=None) -> None:
    """Give the layouts of a worker's first part, and those it meets next, the ids the store will
    give them if each file before the worker's gave as many new layouts as its first (ranks
    alike, each tensor on its own device, as in a TP run on GPUs). Right, no part of this worker
    needs its layout ids mapped, and copy_part copies them as stored (~0.1 us a span row against
    ~0.3 mapped, in the merging process); renumbering this first part costs the worker ~0.3 us
    a span record, while the merging process is still loading its own files. Wrong, the parts
    are mapped as before (the store is the same either way). ``k``: files before the worker's
    times the layouts of its first part (``worker_main``). ``partial``: the stopped loader of
    a file's first part, whose layout ids move with its rows."""
    if k <= 0:
        return
    for table in ("spans", "collectives"):
        con.execute(f"UPDATE {table} SET layout_id = layout_id + {k} WHERE layout_id IS NOT NULL")
    g.shift_layouts(k)
    if partial is not None:
        partial.shift_layouts(k)


def worker_main(spec: dict) -> None:
    """A worker: load ``spec['files']`` one by one, each into a part store of its own (``part_path``
    of ``spec['part']``) saved with the file's load result and the ids given out so far (for
    ``copy_part``), and say on stdout when each part is complete."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the merging process, which stops us
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    c0, rss0 = time.process_time(), _status_kb("VmRSS")
    g = SharedIds(None)  # its ids go back with each part (copy_part maps them): never written here
    out = sys.stdout.buffer
    before = spec.get("files_before", 0)
    head_layouts = None  # after a file's first part (plan's split): the layouts it met
    for i, (proc, path, *stop) in enumerate(spec["files"]):
        con = open_new_store(part_path(spec["part"], i))
        # A file's first chunks only (plan's split): the loader stopped part way, which the
        # merging process goes on with (``partial``); else the file's result.
        result = load_file(con, proc, path, g, stop=stop[0] if stop else None)
        partial = result if isinstance(result, FileLoader) else None
        if i == 0:
            _guess_layout_ids(con, g, before * len(g.layouts), partial)
        elif i == 1 and head_layouts is not None and len(g.layouts) > head_layouts:
            # The first part met fewer layouts than this whole file gave (shapes that appear as
            # the run goes): the store gives each file before this one as many more.
            _guess_layout_ids(con, g, (before + 1) * (len(g.layouts) - head_layouts))
        data = dict(results=[] if partial else [result], partial=partial,
                    modules=[(p, cls) for p, (_mid, cls) in sorted(g.modules.items(), key=lambda e: e[1][0])],
                    layouts=[key for key, _lid in sorted(g.layouts.items(), key=lambda e: e[1])],
                    layout_base=g.layout_base,
                    groups=[(name, json.loads(ranks), backend, pg_name)
                            for _gid, name, ranks, backend, pg_name in sorted(g.groups.values())],
                    stats=dict(files=i + 1, peak_rss_kb=_status_kb("VmHWM"), rss_start_kb=rss0,
                               cpu_s=time.process_time() - c0))
        con.execute("CREATE TABLE part_result(data BLOB)")
        con.execute("INSERT INTO part_result VALUES (?)", (pickle.dumps(data),))
        con.commit()
        con.close()
        out.write(b"part %d\n" % i)
        out.flush()
        if partial is not None:
            # The rest of that file is the merging process's: the next files' ids come from a
            # SharedIds of their own, whose layouts are numbered, before any is loaded, where the
            # store gives them if the first part met all of its file's (as in the synthetic trace:
            # no part renumbered); else corrected after the next file (above).
            head_layouts = len(g.layouts)
            g = SharedIds(None)
            g.shift_layouts((before + 1) * head_layouts)
    os._exit(0)
