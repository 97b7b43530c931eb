"""The merge's loader: one rank file streamed into the store, and the ids all files share.

Streaming: each file is read chunk by chunk and inserted in batches; a loader holds only one
file's intern tables (``format.records.RecordResolver``) and one batch in memory.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter

import msgpack

from tensor_trace import progress, schema
from tensor_trace.errors import BadInput
from tensor_trace.exporters.store.merge_align import SequenceDigest
from tensor_trace.exporters.store.reader import ReadReport, iter_chunks, step_fingerprinted
from tensor_trace.exporters.store.shared_ids import SharedIds  # noqa: F401  (merge and its workers import it here)
from tensor_trace.exporters.store.tables import insert_rows
from tensor_trace.format.fingerprints import decode_nonfinite
from tensor_trace.format.lineage_refs import resolve_strings
from tensor_trace.format.records import RecordResolver

BATCH = 20_000


def _attrs_json(attrs):
    """A collective's attributes (a dict in the rank file) as the store's JSON text; 0 for none
    (NULL in the store: COLLECTIVE_ROW)."""
    return json.dumps(attrs, sort_keys=True) if isinstance(attrs, dict) and attrs else 0


class FileLoader:
    """Streams one rank file into the store."""

    def __init__(self, con, proc, path, shared_ids, count_calls=False):
        self.con = con
        self.proc = proc
        self.path = path
        self.g = shared_ids
        self.resolver = RecordResolver()
        self.strings = self.resolver.strings  # the hot loop reads it directly
        self.layouts: dict = {}  # file layout id -> global layout id
        self.groups: dict = {}  # file group id -> global group id
        self.modules: dict = {}  # file string id -> module id
        self.spans: list = []  # rows to insert, flat: SPAN_COLUMNS values per row
        self.colls: list = []  # the same, COLLECTIVE_VALUES values per row (COLLECTIVE_ROW)
        self.fps: list = []
        self.wide_fps: list = []  # (proc, step, idx, sum, sumsq): WIDE_FINGERPRINTS
        self.nonfinite_fps: list = []  # (proc, step, idx, sum, sumsq, +inf, -inf, NaN): NONFINITE_FINGERPRINTS
        self.steps: dict = {}
        self.header: dict = {}
        self.identity: dict = {}
        self.end = None
        self.errors: list = []
        self.params: list = []
        self.coll_device: list = []  # (device ns, proc, step, idx)
        self.lineage: list = []  # LINEAGE rows
        self.slot_sources: list = []  # SLOT_SRC rows
        self.step_device: list = []  # (device ns, proc, step) of CUDA-graph replays
        self.replays: list = []  # REPLAY records: (step, captured step, span base, coll base, fp base, t0, dur)
        self.step_colls: list = []  # this step's collectives, until their modules are known
        self.span_module: dict = {}  # this step's span index -> module id
        self.interrupted: set = set()  # steps whose root call raised (e.g. Ctrl-C mid-forward)
        self.summary: dict = {}  # (module, op, reduce op, group) -> count, bytes, time, per step, first
        # Spans are stored in file order, so a step's spans are a run of consecutive rowids:
        # (first, last) per step lets a query read one step without an index on spans.
        self.span_ranges: dict = {}
        self.span_rows = 0  # spans stored so far
        self.report = ReadReport(path)
        self.digest = SequenceDigest()  # what align_collectives compares across processes
        # Spans per (module id, call) of this file, counted as they are inserted when asked
        # (the merge's first file: the verdicts' steps seen per point, ``merge.CALLS_TABLE``).
        self.calls = Counter() if count_calls else None
        self.offset = 0  # where in the file loading goes on (a load stopped at ``stop``: load())

    def __getstate__(self):
        # A load stopped part way (a merge worker's share of a file) goes to the merging process,
        # which goes on with it on its own connection and ids (resume()).
        state = dict(self.__dict__)
        state["con"] = state["g"] = None
        return state

    def resume(self, con, g, maps: dict, offset: int) -> None:
        """Go on here with a load that a merge worker stopped (``load(stop=...)``) and whose rows
        are now in ``con``'s store: the worker's ids of modules, layouts and groups in what the
        loader holds become the store's (``maps[kind][worker id]``, as ``copy_part`` mapped its
        rows), and its span rowids move up by ``offset`` (the store's spans before them)."""
        mod, lay, grp = maps["modules"], maps["layouts"], maps["groups"]

        def m(x, table):
            return None if x is None else table[x]

        self.con, self.g = con, g
        self.modules = {sid: mod[mid] for sid, mid in self.modules.items()}
        self.layouts = {k: m(lid, lay) for k, lid in self.layouts.items()}
        self.groups = {k: m(gid, grp) for k, gid in self.groups.items()}
        self.span_module = {i: m(mid, mod) for i, mid in self.span_module.items()}
        for c in self.step_colls:  # the open step's collectives: group at 6, layout at 10
            c[6], c[10] = m(c[6], grp), m(c[10], lay)
        self.summary = {(m(mid, mod), op, redop, m(gid, grp)): a
                        for (mid, op, redop, gid), a in self.summary.items()}
        self.digest = self.digest.remapped(grp)
        self.params = [(p[0], m(p[1], mod), *p[2:]) for p in self.params]
        if self.calls is not None:
            self.calls = Counter({(m(mid, mod), call): n for (mid, call), n in self.calls.items()})
        self.span_ranges = {k: (a + offset, b + offset) for k, (a, b) in self.span_ranges.items()}

    def shift_layouts(self, k: int) -> None:
        """The worker renumbered its layouts ``k`` higher (merge_workers._guess_layout_ids)."""
        self.layouts = {key: lid + k for key, lid in self.layouts.items()}
        for c in self.step_colls:
            if c[10] is not None:
                c[10] += k

    def module_id(self, sid):
        mid = self.modules.get(sid)
        if mid is None:
            mid = self.g.module(self.strings.get(sid, "?"), None)
            self.modules[sid] = mid
        return mid

    def flush(self, last=True):
        """Insert the rows gathered so far; unless ``last``, spans and collectives that would not
        fill a whole statement wait for the next flush."""
        con = self.con
        # Emptied in place: load() holds these lists in local variables.
        if self.spans:
            n = insert_rows(con, "INSERT INTO spans", SPAN_COLUMNS, self.spans, last)
            self.span_rows += n
            if self.calls is not None and n:
                # C-level counting of the rows just inserted (module id at 4, call at 5): ~0.03
                # us a span here, against a GROUP BY over the process's spans after loading
                # (0.73 s of the verdicts at 20M span records, on the merge's serial path).
                end = n * SPAN_COLUMNS
                self.calls.update(zip(self.spans[4:end:SPAN_COLUMNS], self.spans[5:end:SPAN_COLUMNS]))
            del self.spans[:n * SPAN_COLUMNS]
        if self.colls:
            n = insert_rows(con, "INSERT OR IGNORE INTO collectives", COLLECTIVE_VALUES, self.colls, last,
                            COLLECTIVE_ROW)
            del self.colls[:n * COLLECTIVE_VALUES]
        if self.fps:
            con.executemany("INSERT INTO fingerprints VALUES (?,?,?,?,?)", self.fps)
            self.fps.clear()
        if self.wide_fps:
            con.executemany("INSERT INTO wide_fingerprints VALUES (?,?,?,?,?)", self.wide_fps)
            self.wide_fps.clear()
        if self.nonfinite_fps:
            con.executemany("INSERT INTO nonfinite_fingerprints VALUES (?,?,?,?,?,?,?,?)", self.nonfinite_fps)
            self.nonfinite_fps.clear()
        if self.lineage:
            con.executemany("INSERT OR REPLACE INTO lineage VALUES (?,?,?,?,?,?,?)", self.lineage)
            self.lineage.clear()
        if self.slot_sources:
            con.executemany("INSERT OR REPLACE INTO slot_sources VALUES (?,?,?,?,?)", self.slot_sources)
            self.slot_sources.clear()

    def _close_step(self):
        span_module = self.span_module
        summary = self.summary
        colls_extend = self.colls.extend
        for c in self.step_colls:
            mid = c[16] = span_module.get(c[3])
            colls_extend(c)
            key = (mid, c[4], None if c[5] == 0 else c[5], c[6])  # 0: no reduce op (COLLECTIVE_ROW)
            a = summary.get(key)
            if a is None:
                summary[key] = a = [0, 0, 0, array("q"), c[1] * 1000000 + c[2]]
            a[0] += 1
            a[1] += c[15] or 0
            a[2] += c[9] or 0
            per_step = a[3]  # step, count, step, count, ...: 16 bytes a step (a dict took ~70)
            if per_step and per_step[-2] == c[1]:
                per_step[-1] += 1
            elif c[1].__class__ is int:
                per_step.append(c[1])
                per_step.append(1)
        self.digest.add_rows(self.step_colls, self.g.signature_codes)
        self.step_colls.clear()
        span_module.clear()

    def _expand_replays(self, rowid: int) -> None:
        """Give every CUDA-graph replay step the spans and collectives of the step it replays,
        shifted by the replay's bases and flagged REPLAYED, with the replay's fingerprints (the
        FINGERPRINTS records of the replay step, from its fingerprint base)."""
        con, proc = self.con, self.proc
        keep_flags = ~(schema.FLAG_CAPTURED | schema.FLAG_ERROR)
        for step, cap, sb, cb, fb, _t0, _dur in self.replays:
            rng = self.span_ranges.get(cap)
            if rng is None:
                self.report.bad_records += 1  # the captured step is not in this file
                continue
            fp = (f"CASE WHEN fp_pre >= 0 AND ? >= 0 THEN fp_pre + ? ELSE -1 END, "
                  f"CASE WHEN fp_post >= 0 AND ? >= 0 THEN fp_post + ? ELSE -1 END")
            cur = con.execute(
                f"INSERT INTO spans SELECT proc, ?, idx + ?, CASE WHEN parent >= 0 THEN parent + ? ELSE -1 END, "
                f"module_id, call, t0, dur, layout_id, {fp}, n_pre, (flags & ?) | ? FROM spans "
                f"WHERE rowid BETWEEN ? AND ? AND proc = ? AND step = ? ORDER BY rowid",
                (step, sb, sb, fb, fb, fb, fb, keep_flags, schema.FLAG_REPLAYED, rng[0], rng[1], proc, cap))
            if cur.rowcount > 0:
                self._add_range(step, rowid + 1, rowid + cur.rowcount)
                rowid += cur.rowcount
                self.span_rows += cur.rowcount
            con.execute(
                f"INSERT OR IGNORE INTO collectives SELECT proc, ?, idx + ?, "
                f"CASE WHEN parent >= 0 THEN parent + ? ELSE -1 END, op, reduce_op, group_id, "
                f"seq, t0, dur, layout_id, {fp}, n_pre, (flags & ?) | ?, bytes, module_id, NULL, attrs "
                f"FROM collectives WHERE proc = ? AND step = ?",
                (step, cb, sb, fb, fb, fb, fb, keep_flags, schema.FLAG_REPLAYED, proc, cap))
        # Replayed collectives count in the per-module summary (their host time is not measured).
        summary = self.summary
        for mid, op, redop, gid, step, n, nbytes in con.execute(
                "SELECT module_id, op, reduce_op, group_id, step, COUNT(*), SUM(bytes) FROM collectives "
                "WHERE proc = ? AND (flags & ?) != 0 GROUP BY module_id, op, reduce_op, group_id, step",
                (proc, schema.FLAG_REPLAYED)):
            a = summary.get((mid, op, redop, gid))
            if a is None:
                summary[(mid, op, redop, gid)] = a = [0, 0, 0, array("q"), step * 1000000]
            a[0] += n
            a[1] += nbytes or 0
            a[3].append(step)
            a[3].append(n)

    def _add_range(self, step, first, last):
        old = self.span_ranges.get(step)
        self.span_ranges[step] = (first, last) if old is None else (min(old[0], first), max(old[1], last))

    def _defined(self, rec, kind):
        """Map a definition the resolver took in to the store's shared ids."""
        resolver = self.resolver
        if kind == schema.STRING:
            self.modules.pop(rec[1], None)
        elif kind == schema.LAYOUT:
            slots = [[slot, shape, dtype, device, *([tensor_kind] if tensor_kind else [])]
                     for slot, (shape, dtype, device, tensor_kind) in resolver.tensors(rec[1])]
            self.layouts[rec[1]] = self.g.layout(slots)
        elif kind == schema.MODULE:
            path = resolver.string(rec[1])
            self.modules[rec[1]] = self.g.module(path, resolver.modules[path])
        elif kind == schema.GROUP:
            group = resolver.groups[rec[1]]
            self.groups[rec[1]] = self.g.group(group.name, group.ranks, group.backend, group.pg_name)

    def _record(self, rec, kind):
        """Any record but a span or a collective (definitions, steps, fingerprints, ...)."""
        proc = self.proc
        strings = self.strings
        if kind == schema.COLL_DEVICE:
            # Written once the CUDA events completed: after the collective, often after
            # its step ended, so applied to the stored rows at the end. Index -1 is the
            # step's CUDA-graph replay.
            if rec[2] < 0:
                self.step_device.append((int(rec[3]), proc, rec[1]))
            else:
                self.coll_device.append((int(rec[3]), proc, rec[1], rec[2]))
        elif kind == schema.REPLAY:
            self.replays.append(tuple(rec[1:8]))
        elif kind == schema.LINEAGE:
            self.lineage.append((proc, rec[1], rec[2], strings.get(rec[3], "?"),
                                 json.dumps(rec[4]) if rec[4] else None,
                                 json.dumps([resolve_strings(r, strings) for r in rec[5]]),
                                 json.dumps(rec[6])))
        elif kind == schema.SLOT_SRC:
            self.slot_sources.append((proc, rec[1], rec[2], rec[3], json.dumps(resolve_strings(rec[4], strings))))
        elif self.resolver.define(rec):
            self._defined(rec, kind)
        elif kind == schema.PARAMS:
            mid = self.module_id(rec[1])
            for name, (shape, dtype, _device, tensor_kind), fp_index in self.resolver.params(rec):
                self.params.append((proc, mid, name, json.dumps(shape), dtype, fp_index,
                                    json.dumps(tensor_kind, sort_keys=True) if tensor_kind is not None else None))
        elif kind == schema.FINGERPRINTS:
            self.fps.append((proc, rec[1], rec[2], rec[3], rec[4]))
        elif kind == schema.WIDE_FINGERPRINTS:
            vals = rec[2]
            self.wide_fps += [(proc, rec[1], vals[k], vals[k + 1], vals[k + 2]) for k in range(0, len(vals) - 2, 3)]
        elif kind == schema.NONFINITE_FINGERPRINTS:
            self.nonfinite_fps += [(proc, rec[1], *e) for e in decode_nonfinite(rec[2])]
        elif kind == schema.MODULE_ATTRS:
            self.con.execute("INSERT OR REPLACE INTO module_attrs VALUES (?, ?)",
                             (strings.get(rec[1], "?"), json.dumps(rec[2], sort_keys=True)))
        elif kind == schema.CAPTURE_INFO:
            self.con.execute("INSERT OR REPLACE INTO captures VALUES (?, ?)",
                             (strings.get(rec[1], "?"), json.dumps(rec[2], sort_keys=True)))
        elif kind == schema.STEP_BEGIN:
            self.steps[rec[1]] = [strings.get(rec[2], ""), rec[3], None, 0, 0,
                                  json.dumps(rec[4] or {}, sort_keys=True), rec[5] if len(rec) > 5 else None]
        elif kind == schema.STEP_END:
            st = self.steps.get(rec[1])
            if st is not None:
                st[2], st[3], st[4] = rec[2], rec[3], rec[4]
                if len(rec) > 5 and rec[5]:  # attributes learnt during the step, over its begin's
                    st[5] = json.dumps({**json.loads(st[5]), **rec[5]}, sort_keys=True)
            self._close_step()
        elif kind == schema.GROUP:
            self.groups[rec[1]] = self.g.group(rec[2], rec[3], rec[4], rec[5] if len(rec) > 5 else "")
        elif kind == schema.IDENTITY:
            self.identity = dict(rec[1])
        elif kind == schema.HEADER:
            self.header = dict(rec[1])
        elif kind == schema.ERROR:
            self.errors.append((proc, rec[1], rec[2], rec[3]))
        elif kind == schema.END:
            self.end = dict(rec[1])

    def load(self, stop: int | None = None) -> bool:
        """Load the file from ``self.offset`` on; True once its end is reached. ``stop``: end
        after the chunk that reaches that byte offset: rows of the steps closed so far are in the
        store, the open step is kept (its collectives wait for their modules' spans), and False
        is returned; ``resume`` and ``load`` again go on from there."""
        # The hot loop: spans and collectives are nearly every record, handled inline with
        # everything they touch in local variables; other kinds go to _record.
        proc = self.proc
        strings = self.strings
        spans = self.spans
        spans_extend = spans.extend
        colls = self.colls
        layouts = self.layouts
        groups = self.groups
        module_id = self.module_id
        span_module = self.span_module
        step_colls = self.step_colls
        modules = self.modules
        interrupted = self.interrupted
        add_range = self._add_range
        other = self._record
        report = self.report
        S_SPAN, S_COLL, FLAG_ERROR = schema.SPAN, schema.COLLECTIVE, schema.FLAG_ERROR
        # The k-th row of spans will be stored at rowid base + k + 1 (rowids count up from the
        # table's end, which holds this file's spans so far, where the load goes on).
        start = self.con.execute("SELECT COALESCE(MAX(rowid), 0) FROM spans").fetchone()[0] - self.span_rows
        base = start + self.span_rows
        cur_step, cur_first = None, base + 1
        where = [self.offset, False]
        for records in _chunks(self.path, report, self.offset, stop, where):
            for rec in records:
                try:
                    kind = rec[0]
                    if kind == S_SPAN:
                        mid = modules.get(rec[4])
                        if mid is None:
                            mid = module_id(rec[4])
                        if len(rec) != 13:
                            raise IndexError("span record of another length")
                        # The record becomes the row: its type slot takes the process id and the
                        # file's ids become the store's (no new object per span).
                        rec[0] = proc
                        rec[4] = mid
                        rec[8] = layouts.get(rec[8])
                        spans_extend(rec)
                        if rec[1] != cur_step:
                            row = base + len(spans) // SPAN_COLUMNS
                            if cur_step is not None:
                                add_range(cur_step, cur_first, row - 1)
                            cur_step, cur_first = rec[1], row
                        if rec[3] == -1 and rec[12] & FLAG_ERROR:
                            interrupted.add(rec[1])  # the step's root call raised
                        span_module[rec[2]] = mid
                    elif kind == S_COLL:
                        # The issuing module's span ends after its collectives: resolved at STEP_END.
                        gid = groups.get(rec[6])
                        lid = layouts.get(rec[10])
                        # COLLECTIVE_ROW's values (0 stands for a NULL reduce op or attrs).
                        step_colls.append([proc, rec[1], rec[2], rec[3], strings.get(rec[4]),
                                           strings.get(rec[5]) if rec[5] >= 0 else 0,
                                           gid, rec[7], rec[8], rec[9], lid,
                                           rec[11], rec[12], rec[13], rec[14], rec[15], None,
                                           _attrs_json(rec[16]) if len(rec) > 16 else 0])
                    else:
                        other(rec, kind)
                except (IndexError, TypeError, ValueError, AttributeError):
                    report.bad_records += 1
            # Batches end at chunk ends: a chunk's records are in memory anyway.
            if len(spans) // SPAN_COLUMNS + len(colls) // COLLECTIVE_VALUES + len(step_colls) >= BATCH:
                self.flush(last=False)
                base = start + self.span_rows
        if where[1]:  # stopped before the file's end
            if cur_step is not None:
                self._add_range(cur_step, cur_first, base + len(spans) // SPAN_COLUMNS)
            self.flush()
            self.offset = where[0]
            return False
        self._close_step()
        if cur_step is not None:
            self._add_range(cur_step, cur_first, base + len(spans) // SPAN_COLUMNS)
        self.flush()
        if self.replays:
            self._expand_replays(start + self.span_rows)
        self._finish()
        return True

    def _finish(self):
        """The file's per-step and per-file rows, once all its records are read."""
        proc = self.proc
        ranges = self.span_ranges
        if not self.header:
            raise BadInput(f"{self.path}: no header (damaged at its start)")
        steps = self.steps
        begun = set(steps)  # the steps whose STEP_BEGIN was read
        for step in ranges:
            steps.setdefault(step, ["", None, None, 0, 0, "{}", None])
        self.con.executemany("INSERT INTO steps VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                             [(proc, k, *v[:6], *ranges.get(k, (None, None)),
                               int(k in self.interrupted or v[2] is None), None,
                               _int_or_none(step_fingerprinted(self.header, k in begun, v[6])))
                              for k, v in sorted(steps.items())])
        if self.step_device:
            self.con.executemany("UPDATE steps SET device_ns=? WHERE proc=? AND step=?", self.step_device)
        self.con.executemany("INSERT INTO collective_summary VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", [
            (mid, op, redop, gid, proc, a[0], a[1], a[2], _per_step_json(a[3]), a[4], None, 0)
            for (mid, op, redop, gid), a in self.summary.items()])
        if self.coll_device:
            self.con.executemany("UPDATE collectives SET device_ns=? WHERE proc=? AND step=? AND idx=?",
                                 self.coll_device)
            self.con.execute(
                "UPDATE collective_summary SET (device_ns, device_count) = ("
                "SELECT SUM(c.device_ns), COUNT(c.device_ns) FROM collectives c "
                "WHERE c.proc = collective_summary.proc AND c.module_id IS collective_summary.module_id "
                "AND c.op = collective_summary.op AND c.reduce_op IS collective_summary.reduce_op "
                "AND c.group_id = collective_summary.group_id) WHERE proc = ?", (proc,))
        if self.errors:
            self.con.executemany("INSERT INTO errors VALUES (?,?,?,?)", self.errors)
        if self.params:
            self.con.executemany("INSERT INTO params VALUES (?,?,?,?,?,?,?)", self.params)


SPAN_COLUMNS = 13
COLLECTIVE_COLUMNS = 19
# A collective's row as inserted: device_ns is NULL until _finish, and a NULL reduce op or
# attrs is bound as 0 (never a value of those text columns) and made NULL by SQLite: binding
# None costs CPython's sqlite3 an adapter look-up, ~0.27 us a value against ~0.03 for an int
# (2 a row on the synthetic trace: a quarter of a collective's insert).
COLLECTIVE_ROW = "(?,?,?,?,?,NULLIF(?,0),?,?,?,?,?,?,?,?,?,?,?,NULL,NULLIF(?,0))"
COLLECTIVE_VALUES = COLLECTIVE_ROW.count("?")
def _chunks(path, report, start=0, stop=None, where=None):
    """The records of every intact chunk of a rank file, one decoded chunk (a list) at a time
    (iter_records without its per-record checks: a malformed record is caught by the loader);
    ``start``, ``stop``, ``where``: a range of the file (``reader.iter_chunks``)."""
    unpackb = msgpack.unpackb
    for payload in iter_chunks(path, report, start, stop, where):
        try:
            records = unpackb(payload, raw=False, strict_map_key=False)
        except Exception:
            report.corrupt_chunks += 1
            continue
        if isinstance(records, list):
            report.records += len(records)
            yield records
        else:
            report.corrupt_chunks += 1


def _per_step_json(per_step) -> str:
    """collective_summary.per_step: [[step, count], ...] in step order, from the loader's flat
    (step, count) pairs (in the order steps closed; replays' after them)."""
    pairs = list(zip(per_step[::2], per_step[1::2]))
    if any(a >= b for (a, _), (b, _) in zip(pairs, pairs[1:])):  # out of order, or a step twice
        counts: dict = {}
        for step, n in pairs:
            counts[step] = counts.get(step, 0) + n
        pairs = sorted(counts.items())
    return json.dumps(pairs)


# Tables a rank file's rows go to (the loader's), in the order a worker's part is copied.
FILE_TABLES = ("spans", "collectives", "fingerprints", "wide_fingerprints", "nonfinite_fingerprints", "steps", "errors",
               "params", "lineage", "slot_sources", "collective_summary", "module_attrs", "captures")


class FileResult:
    """What loading one rank file gave (picklable: a worker sends it back): its header, identity
    and END record, the read report and the spans it left in the store, or ``skipped``, why the
    file was left out (it left no rows)."""

    def __init__(self, proc, path, loader=None, skipped=None):
        self.proc, self.path, self.skipped = proc, path, skipped
        self.header = loader.header if loader else {}
        self.identity = loader.identity if loader else {}
        self.end = loader.end if loader else None
        self.report = loader.report if loader else None
        self.span_rows = loader.span_rows if loader else 0
        self.digest = loader.digest if loader else None
        # Spans per (module id, call), where counted; None where not, or where CUDA-graph
        # replays added spans in SQL that the count did not see.
        self.calls = loader.calls if loader and not loader.replays else None


def load_file(con, proc: int, path: str, g, count_calls: bool = False, stop: int | None = None,
              resume: tuple | None = None):
    """Load one rank file into ``con``; a file that cannot be read leaves no rows.
    ``count_calls``: the result's ``calls`` counts the file's spans per (module id, call).
    ``stop`` (a byte offset): a merge worker's first part of the file, up to the chunk that
    reaches it; where the file goes on after it, the FileLoader that stopped is returned (the
    merging process goes on with it: ``resume`` = (that loader, the ids' maps, the store's spans
    before its rows): ``FileLoader.resume``)."""
    if resume is not None:
        loader, maps, offset = resume
        loader.resume(con, g, maps, offset)
    else:
        loader = FileLoader(con, proc, path, g, count_calls)
    try:
        if not loader.load(stop):
            return loader
    except BadInput as exc:
        for table in ("spans", "collectives", "fingerprints", "wide_fingerprints", "nonfinite_fingerprints", "steps",
                      "errors", "params", "lineage", "slot_sources"):
            con.execute(f"DELETE FROM {table} WHERE proc=?", (proc,))
        return FileResult(proc, path, skipped=str(exc))
    return FileResult(proc, path, loader)


def _int_or_none(x):
    return None if x is None else int(x)
