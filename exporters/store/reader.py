"""Read rank files: everything before a torn or corrupt part, and a report of what was skipped.

``iter_records`` streams raw records (the arrays of ``tensor_trace.schema``); ``load_rank_file``
resolves interned ids and fingerprints into plain objects for one file.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zlib

import msgpack

from tensor_trace import schema
from tensor_trace.errors import BadInput
from tensor_trace.format.fingerprints import decode_fingerprints, decode_wide, fingerprint_refs
from tensor_trace.format.records import RecordResolver, decode


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
    if version not in schema.READABLE_VERSIONS:
        raise BadInput(f"{path}: format version {version}, this tensor-trace reads "
                       + " and ".join(map(str, schema.READABLE_VERSIONS)))


READ_BLOCK = 4 << 20


def iter_chunks(path: str, report: ReadReport, start: int = 0, stop: int | None = None,
                where: list | None = None):
    """Yield the payload of every intact chunk (inflated where it was stored compressed);
    resynchronise on the sync marker after damage.

    Streams: memory holds one read block plus the chunk being decoded (chunks are at most
    ``schema.MAX_CHUNK_BYTES``), whatever the size of the file.

    A range of the file (a merge worker loads a file's first chunks, the merging process the
    rest: ``merge_workers``): ``start``, a byte offset where a chunk begins (one that an earlier
    read stopped at; 0: the file's beginning); ``stop``, end once a chunk ending at or after
    this offset has been taken. ``where`` (a list), if given, holds the offset after the last
    chunk taken (``where[0]``) and whether the read stopped there before the file's end
    (``where[1]``). Reading on from ``where[0]`` meets what one read from the beginning meets."""
    head = schema.CHUNK_HEAD
    with open(path, "rb") as f:
        if start:
            f.seek(start)
            buf = f.read(READ_BLOCK)
            pos = 0
        else:
            buf = f.read(max(READ_BLOCK, len(schema.FILE_PREFIX)))
            _check_prefix(path, buf)
            pos = len(schema.FILE_PREFIX)
        base = start  # the file offset of buf[0]
        eof = len(buf) < READ_BLOCK
        if where is not None:
            where[:] = [base + pos, False]

        def need(n):
            """Make buf[pos:pos+n] available if the file has it; False at end of file."""
            nonlocal buf, pos, eof, base
            while len(buf) - pos < n and not eof:
                more = f.read(max(READ_BLOCK, n))
                if not more:
                    eof = True
                    break
                base += pos
                buf = buf[pos:] + more
                pos = 0
            return len(buf) - pos >= n

        while need(1):
            if not need(head.size):
                report.truncated_tail = True
                report.skipped_bytes += len(buf) - pos
                return
            sync, length, crc = head.unpack_from(buf, pos)
            if (sync == schema.SYNC or sync == schema.SYNC_ZLIB) and length <= schema.MAX_CHUNK_BYTES:
                if need(head.size + length):
                    body = pos + head.size
                    stored = buf[body:body + length]
                    if zlib.crc32(stored) == crc:
                        try:
                            payload = schema.chunk_payload(sync, stored)
                        except ValueError:
                            payload = None
                        if payload is not None:
                            report.chunks += 1
                            pos = body + length
                            if where is not None:
                                where[0] = base + pos
                            yield payload
                            if stop is not None and base + pos >= stop:
                                if where is not None:
                                    where[1] = need(1)  # stopped before the file's end
                                return
                            continue
                elif buf.find(schema.SYNC_STEM, pos + 1) == -1:
                    # The last chunk was cut short: the process died while writing it.
                    report.truncated_tail = True
                    report.skipped_bytes += len(buf) - pos
                    return
            # Damage: skip to the next sync marker.
            report.corrupt_chunks += 1
            while True:
                nxt = buf.find(schema.SYNC_STEM, pos + 1)
                if nxt != -1:
                    report.skipped_bytes += nxt - pos
                    pos = nxt
                    break
                keep = len(schema.SYNC_STEM) - 1  # a marker may straddle two blocks
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
    fingerprinted: bool | None = None  # the step took fingerprints (schema.STEP_BEGIN); None: no record of it


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


def load_rank_file(path: str) -> RankTrace:
    """Read and resolve a whole rank file (for summaries and tests; the merge streams)."""
    report = ReadReport(path)
    resolver = RecordResolver()
    strings = resolver.strings
    steps: dict = {}
    begun: set = set()  # the steps whose STEP_BEGIN was read
    errors: list = []
    header: dict = {}
    identity: dict = {}
    end = None
    params: dict = {}
    device_ns: dict = {}  # (step, collective index) -> device time

    def tensors_of(layout_id):
        return [TensorInfo(slot, meta.shape, meta.dtype, meta.device, meta=meta.kind)
                for slot, meta in resolver.tensors(layout_id)]

    def step_of(step):
        st = steps.get(step)
        if st is None:
            st = steps[step] = Step(step)
        return st

    for rec in iter_records(path, report):
        kind = rec[0]
        try:
            # Spans and collectives are nearly every record: unpacked in their fields' order
            # (format.records.SpanRecord / CollectiveRecord) rather than decoded into tuples.
            if kind == schema.SPAN:
                _, step, index, parent, path_id, call, t0, dur, layout, fp_pre, fp_post, n_pre, flags = rec[:13]
                tensors = tensors_of(layout)
                module = strings.get(path_id, "?")
                cls = resolver.modules.get(module, "?")
                step_of(step).spans.append(Span(step, index, parent, module, "?" if cls is None else cls, call, t0,
                                                dur, tensors, flags, fingerprint_refs(len(tensors), n_pre, fp_pre,
                                                                                      fp_post)))
            elif kind == schema.COLLECTIVE:
                (_, step, index, parent, op, reduce_op, group, seq, t0, dur, layout, fp_pre, fp_post, n_pre,
                 flags, nbytes) = rec[:16]
                attrs = rec[16] if len(rec) > 16 and isinstance(rec[16], dict) else None
                tensors = tensors_of(layout)
                step_of(step).collectives.append(Collective(
                    step, index, parent, strings.get(op, "?"), strings.get(reduce_op) if reduce_op >= 0 else None,
                    group, seq, t0, dur, tensors, flags, nbytes,
                    fingerprint_refs(len(tensors), n_pre, fp_pre, fp_post), attrs=attrs))
            elif resolver.define(rec):
                pass
            elif kind == schema.COLL_DEVICE:
                dev = decode(rec)
                device_ns[(dev.step, dev.index)] = int(dev.device_ns)
            elif kind == schema.STEP_BEGIN:
                begin = decode(rec)
                st = step_of(begin.step)
                st.root, st.t_begin, st.attrs = strings.get(begin.root, ""), begin.mono_ns, begin.attrs or {}
                st.fingerprinted = begin.fingerprinted
                begun.add(begin.step)
            elif kind == schema.STEP_END:
                ended = decode(rec)
                st = step_of(ended.step)
                st.t_end = ended.mono_ns
                if ended.attrs:  # attributes learnt during the step, over its begin's
                    st.attrs = {**(st.attrs or {}), **ended.attrs}
            elif kind == schema.FINGERPRINTS:
                fps = decode(rec)
                decode_fingerprints(fps.first, fps.data, fps.indices, step_of(fps.step).fingerprints)
            elif kind == schema.WIDE_FINGERPRINTS:  # values past float32's range, over their +-inf
                decode_wide(rec[2], step_of(rec[1]).fingerprints)
            elif kind == schema.PARAMS:
                plist = params.setdefault(strings.get(rec[1], "?"), [])
                for name, meta, fp_index in resolver.params(rec):
                    plist.append((TensorInfo(name, meta.shape, meta.dtype, meta.device, meta=meta.kind), fp_index))
            elif kind == schema.IDENTITY:
                identity = dict(rec[1])
            elif kind == schema.HEADER:
                header = dict(rec[1])
            elif kind == schema.ERROR:
                err = decode(rec)
                errors.append(dict(t=err.mono_ns, where=err.where, message=err.message))
            elif kind == schema.END:
                end = dict(rec[1])
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, struct.error):
            report.bad_records += 1
    if not header:
        raise BadInput(f"{path}: no header record (the file was damaged at its start)")
    static = steps.pop(schema.PARAMS_STEP, Step(schema.PARAMS_STEP)).fingerprints
    for path_, plist in params.items():
        for t, ref in plist:
            t.fp = static.get(ref)
        params[path_] = [t for t, _ in plist]
    for st in steps.values():
        st.fingerprinted = step_fingerprinted(header, st.step in begun, st.fingerprinted)
        # In issue order: a functional collective's record is written once it was waited.
        st.collectives.sort(key=lambda c: c.index)
        if device_ns:
            for c in st.collectives:
                c.device_ns = device_ns.get((c.step, c.index))
        for item in (*st.spans, *st.collectives):
            for t, ref in zip(item.tensors, item.fp_refs):
                if ref >= 0:
                    t.fp = st.fingerprints.get(ref)
    groups = {gid: dict(name=g.name, ranks=g.ranks, backend=g.backend, pg_name=g.pg_name)
              for gid, g in resolver.groups.items()}
    modules = {p: "?" if cls is None else cls for p, cls in resolver.modules.items()}
    return RankTrace(path, header, identity, steps, modules, groups, errors, end, report, params)


def step_fingerprinted(header: dict, begun: bool, flag) -> bool | None:
    """Whether a step took fingerprints, as loader and reader both store it: its STEP_BEGIN's
    flag; the header's default where that record carries none (an older tracer); None
    (unknown) where no STEP_BEGIN of the step was read (lost in a damaged chunk). Analysis
    treats None as not known to be fingerprinted: such a step's values are not sampled first
    nor compared."""
    if not begun:
        return None
    return fingerprinted_by_default(header) if flag is None else bool(flag)


def fingerprinted_by_default(header: dict) -> bool:
    """Whether a step whose STEP_BEGIN does not say took fingerprints: the tracers that wrote no
    such flag took them on every step unless the recording had them off."""
    return bool((header.get("config") or {}).get("fingerprint", True))


def rank_files(trace_dir: str) -> list[str]:
    """The rank files of a trace folder, sorted."""
    d = os.path.join(trace_dir, "ranks")
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(schema.RANK_FILE_SUFFIX))
