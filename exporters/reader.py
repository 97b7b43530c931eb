"""Read rank files: everything before a torn or corrupt part, and a report of what was skipped.

``iter_records`` streams raw records (the arrays of ``tensor_trace.schema``); ``load_rank_file``
resolves interned ids and fingerprints into plain objects for one file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import zlib

import msgpack

from tensor_trace import schema
from tensor_trace.errors import BadInput


@dataclasses.dataclass
class ReadReport:
    """What reading one rank file met besides good chunks."""

    path: str
    chunks: int = 0
    records: int = 0
    skipped_bytes: int = 0
    corrupt_chunks: int = 0
    truncated_tail: bool = False
    bad_records: int = 0  # intact chunks holding a record that does not fit the schema

    def problems(self) -> list[str]:
        out = []
        if self.corrupt_chunks:
            out.append(f"{self.corrupt_chunks} corrupt chunk(s), {self.skipped_bytes} bytes skipped")
        if self.truncated_tail:
            out.append("a truncated tail (the process was killed mid-write)")
        if self.bad_records:
            out.append(f"{self.bad_records} malformed record(s) skipped")
        return out


def _check_prefix(path: str, data: bytes) -> None:
    if len(data) < len(schema.MAGIC) or not data.startswith(schema.MAGIC):
        raise BadInput(f"{path}: not a tensor-trace rank file")
    if len(data) < len(schema.FILE_PREFIX):
        raise BadInput(f"{path}: truncated before its format version")
    (version,) = struct.unpack_from("<I", data, len(schema.MAGIC))
    if version != schema.FORMAT_VERSION:
        raise BadInput(f"{path}: format version {version}, this tensor-trace reads {schema.FORMAT_VERSION}")


READ_BLOCK = 4 << 20


def iter_chunks(path: str, report: ReadReport):
    """Yield the payload of every intact chunk; resynchronise on the sync marker after damage.

    Streams: memory holds one read block plus the chunk being decoded (chunks are at most
    ``schema.MAX_CHUNK_BYTES``), whatever the size of the file."""
    head = schema.CHUNK_HEAD
    with open(path, "rb") as f:
        buf = f.read(max(READ_BLOCK, len(schema.FILE_PREFIX)))
        _check_prefix(path, buf)
        pos = len(schema.FILE_PREFIX)
        eof = len(buf) < READ_BLOCK

        def need(n):
            """Make buf[pos:pos+n] available if the file has it; False at end of file."""
            nonlocal buf, pos, eof
            while len(buf) - pos < n and not eof:
                more = f.read(max(READ_BLOCK, n))
                if not more:
                    eof = True
                    break
                buf = buf[pos:] + more
                pos = 0
            return len(buf) - pos >= n

        while need(1):
            if not need(head.size):
                report.truncated_tail = True
                report.skipped_bytes += len(buf) - pos
                return
            sync, length, crc = head.unpack_from(buf, pos)
            if sync == schema.SYNC and length <= schema.MAX_CHUNK_BYTES:
                if need(head.size + length):
                    start = pos + head.size
                    payload = buf[start:start + length]
                    if zlib.crc32(payload) == crc:
                        report.chunks += 1
                        pos = start + length
                        yield payload
                        continue
                elif buf.find(schema.SYNC, pos + 1) == -1:
                    # The last chunk was cut short: the process died while writing it.
                    report.truncated_tail = True
                    report.skipped_bytes += len(buf) - pos
                    return
            # Damage: skip to the next sync marker.
            report.corrupt_chunks += 1
            while True:
                nxt = buf.find(schema.SYNC, pos + 1)
                if nxt != -1:
                    report.skipped_bytes += nxt - pos
                    pos = nxt
                    break
                keep = len(schema.SYNC) - 1  # a marker may straddle two blocks
                report.skipped_bytes += max(0, len(buf) - pos - keep)
                pos = max(pos, len(buf) - keep)
                if not need(len(buf) - pos + 1):
                    report.skipped_bytes += len(buf) - pos
                    return


def iter_records(path: str, report: ReadReport | None = None):
    """Yield every record (a list whose first item is its type) of a rank file."""
    report = report or ReadReport(path)
    for payload in iter_chunks(path, report):
        try:
            records = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
        except Exception:
            report.corrupt_chunks += 1
            continue
        if not isinstance(records, list):
            report.corrupt_chunks += 1
            continue
        for rec in records:
            if isinstance(rec, list) and rec and isinstance(rec[0], int):
                report.records += 1
                yield rec


@dataclasses.dataclass
class TensorInfo:
    slot: str
    shape: list
    dtype: str
    device: str
    fp: tuple | None = None  # (sum, sum of squares)
    meta: dict | None = None  # what kind of tensor, when not a plain one (docs/store-schema.md)


@dataclasses.dataclass
class Span:
    step: int
    index: int
    parent: int
    path: str
    cls: str
    call: int
    t0: int  # ns from the step's start
    dur: int
    tensors: list
    flags: int
    fp_refs: list  # fingerprint index per tensor (-1 none)


@dataclasses.dataclass
class Collective:
    step: int
    index: int
    parent: int
    op: str
    reduce_op: str | None
    group: int
    seq: int
    t0: int
    dur: int
    tensors: list
    flags: int
    bytes: int
    fp_refs: list
    device_ns: int | None = None  # device time from CUDA events (COLL_DEVICE), when recorded
    attrs: dict | None = None  # what the issuing Python layer knew (gather_dim, ...), when it said


@dataclasses.dataclass
class Step:
    step: int
    root: str = ""
    t_begin: int = 0
    t_end: int | None = None
    attrs: dict = dataclasses.field(default_factory=dict)
    spans: list = dataclasses.field(default_factory=list)
    collectives: list = dataclasses.field(default_factory=list)
    fingerprints: dict = dataclasses.field(default_factory=dict)  # index -> (sum, sumsq)


@dataclasses.dataclass
class RankTrace:
    """One rank file, resolved."""

    path: str
    header: dict
    identity: dict
    steps: dict
    modules: dict  # path -> class
    groups: dict  # group id -> dict(name, ranks, backend, pg_name)
    errors: list
    end: dict | None
    report: ReadReport
    params: dict = dataclasses.field(default_factory=dict)  # module path -> [TensorInfo(slot=name)]

    @property
    def rank(self):
        return self.identity.get("rank")


def _fp_refs(n: int, n_pre: int, fp_pre: int, fp_post: int) -> list:
    refs = []
    for i in range(n):
        if i < n_pre:
            refs.append(fp_pre + i if fp_pre >= 0 else -1)
        else:
            refs.append(fp_post + i - n_pre if fp_post >= 0 else -1)
    return refs


_NO_META = ([], "?", "?", None)  # a META record that was lost


def load_rank_file(path: str) -> RankTrace:
    """Read and resolve a whole rank file (for summaries and tests; the merge streams)."""
    report = ReadReport(path)
    strings: dict = {}
    metas: dict = {}
    layouts: dict = {}
    modules: dict = {}
    groups: dict = {}
    steps: dict = {}
    errors: list = []
    header: dict = {}
    identity: dict = {}
    end = None
    params: dict = {}
    device_ns: dict = {}  # (step, collective index) -> device time

    def tensors_of(layout_id):
        out = []
        for slot_id, meta_id in layouts.get(layout_id, ()):
            shape, dtype, device, kind = metas.get(meta_id, _NO_META)
            out.append(TensorInfo(strings.get(slot_id, "?"), shape, dtype, device, meta=kind))
        return out

    for rec in iter_records(path, report):
        kind = rec[0]
        try:
            if kind == schema.SPAN:
                _, step, index, parent, path_id, call, t0, dur, lay, fp_pre, fp_post, n_pre, flags = rec[:13]
                tensors = tensors_of(lay)
                p = strings.get(path_id, "?")
                st = steps.setdefault(step, Step(step))
                st.spans.append(Span(step, index, parent, p, modules.get(p, "?"), call, t0, dur, tensors,
                                     flags, _fp_refs(len(tensors), n_pre, fp_pre, fp_post)))
            elif kind == schema.COLLECTIVE:
                (_, step, index, parent, op, redop, gid, seq, t0, dur, lay, fp_pre, fp_post, n_pre,
                 flags, nbytes) = rec[:16]
                tensors = tensors_of(lay)
                st = steps.setdefault(step, Step(step))
                attrs = rec[16] if len(rec) > 16 and isinstance(rec[16], dict) else None
                st.collectives.append(Collective(step, index, parent, strings.get(op, "?"),
                                                 strings.get(redop) if redop >= 0 else None, gid, seq,
                                                 t0, dur, tensors, flags, nbytes,
                                                 _fp_refs(len(tensors), n_pre, fp_pre, fp_post),
                                                 attrs=attrs))
            elif kind == schema.STRING:
                strings[rec[1]] = rec[2]
            elif kind == schema.META:
                metas[rec[1]] = (rec[2], strings.get(rec[3], "?"), strings.get(rec[4], "?"),
                                 rec[5] if len(rec) > 5 else None)
            elif kind == schema.LAYOUT:
                layouts[rec[1]] = rec[2]
            elif kind == schema.COLL_DEVICE:
                device_ns[(rec[1], rec[2])] = int(rec[3])
            elif kind == schema.MODULE:
                modules[strings.get(rec[1], "?")] = strings.get(rec[2], "?")
            elif kind == schema.STEP_BEGIN:
                st = steps.setdefault(rec[1], Step(rec[1]))
                st.root, st.t_begin, st.attrs = strings.get(rec[2], ""), rec[3], rec[4] or {}
            elif kind == schema.STEP_END:
                steps.setdefault(rec[1], Step(rec[1])).t_end = rec[2]
            elif kind == schema.FINGERPRINTS:
                _, step, first, data, indices = rec[:5]
                st = steps.setdefault(step, Step(step))
                for i, s, q in schema.fingerprint_pairs(first, data, indices):
                    st.fingerprints[i] = (s, None if math.isnan(q) else q)
            elif kind == schema.PARAMS:
                plist = params.setdefault(strings.get(rec[1], "?"), [])
                for entry in rec[2]:
                    name_id, meta_id, ref = entry[:3]
                    shape, dtype, device, kind = metas.get(meta_id, _NO_META)
                    if len(entry) > 3 and isinstance(entry[3], dict):  # (schema.PARAMS)
                        kind = entry[3]
                    plist.append((TensorInfo(strings.get(name_id, "?"), shape, dtype, device, meta=kind), ref))
            elif kind == schema.GROUP:
                groups[rec[1]] = dict(name=rec[2], ranks=rec[3], backend=rec[4],
                                      pg_name=rec[5] if len(rec) > 5 else "")
            elif kind == schema.IDENTITY:
                identity = dict(rec[1])
            elif kind == schema.HEADER:
                header = dict(rec[1])
            elif kind == schema.ERROR:
                errors.append(dict(t=rec[1], where=rec[2], message=rec[3]))
            elif kind == schema.END:
                end = dict(rec[1])
        except (ValueError, TypeError, IndexError, KeyError, struct.error):
            report.bad_records += 1
    if not header:
        raise BadInput(f"{path}: no header record (the file was damaged at its start)")
    static = steps.pop(schema.PARAMS_STEP, Step(schema.PARAMS_STEP)).fingerprints
    for path_, plist in params.items():
        for t, ref in plist:
            t.fp = static.get(ref)
        params[path_] = [t for t, _ in plist]
    for st in steps.values():
        # In issue order: a functional collective's record is written once it was waited.
        st.collectives.sort(key=lambda c: c.index)
        if device_ns:
            for c in st.collectives:
                c.device_ns = device_ns.get((c.step, c.index))
        for item in (*st.spans, *st.collectives):
            for t, ref in zip(item.tensors, item.fp_refs):
                if ref >= 0:
                    t.fp = st.fingerprints.get(ref)
    return RankTrace(path, header, identity, steps, modules, groups, errors, end, report, params)


def rank_files(trace_dir: str) -> list[str]:
    """The rank files of a trace folder, sorted."""
    d = os.path.join(trace_dir, "ranks")
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(schema.RANK_FILE_SUFFIX))
