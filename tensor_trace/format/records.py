"""Each record kind's fields by name, and the resolver of a file's interned ids.

A record is a list whose first item is its type (``tensor_trace.schema``). The writer fills
records positionally, in the field order of the tuples below (no call per span on the tracer's
hot path); readers off the hot path decode them by name with ``decode``. The merge's hot loop
indexes span and collective records directly: ``SPAN_FIELDS`` / ``COLLECTIVE_FIELDS`` are the
positions it relies on (tests/unit/test_format.py checks them against the writer).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from tensor_trace import schema


# What a module call and a collective both carry after their own fields: when (t0: ns from the
# step's start, dur), their tensors (layout id) and those tensors' fingerprints (the first n_pre
# count from fp_pre, the others from fp_post; -1: none; format/fingerprints.py), and flags.
_CALL_FIELDS = ("t0", "dur", "layout", "fp_pre", "fp_post", "n_pre", "flags")

# A module call: parent is the enclosing call's index (-1: none), path a string id.
SpanRecord = collections.namedtuple("SpanRecord", ("kind", "step", "index", "parent", "path", "call") + _CALL_FIELDS)

# A collective: parent is the issuing module's span index; op and reduce_op string ids (-1: none);
# bytes its input payload; attrs (optional) what the Python layer that issued it knew.
CollectiveRecord = collections.namedtuple(
    "CollectiveRecord", ("kind", "step", "index", "parent", "op", "reduce_op", "group", "seq") + _CALL_FIELDS
    + ("bytes", "attrs"), defaults=(None,))


class StepBegin(NamedTuple):
    kind: int
    step: int
    root: int  # string id
    mono_ns: int
    attrs: dict | None
    fingerprinted: bool | None = None  # None: not said (an older tracer's file)


class StepEnd(NamedTuple):
    kind: int
    step: int
    mono_ns: int
    n_spans: int
    n_collectives: int
    attrs: dict | None = None  # learnt during the step, over StepBegin's (None: none)


class FingerprintsRecord(NamedTuple):
    kind: int
    step: int
    first: int
    data: bytes
    indices: bytes | None


class MetaRecord(NamedTuple):
    kind: int
    id: int
    shape: list
    dtype: int  # string id
    device: int  # string id
    tensor_kind: dict | None = None


class GroupRecord(NamedTuple):
    kind: int
    id: int
    name: str
    ranks: list
    backend: str
    pg_name: str = ""


class ReplayRecord(NamedTuple):
    kind: int
    step: int
    captured_step: int
    span_base: int
    collective_base: int
    fp_base: int  # -1: none
    t0: int
    dur: int


class LineageRecord(NamedTuple):
    kind: int
    step: int
    node: int
    op: int  # string id
    attrs: dict | None
    inputs: list  # refs (format/lineage_refs.py)
    shape: list


class SlotSourceRecord(NamedTuple):
    kind: int
    step: int
    span: int
    slot: int  # position in the span's layout
    ref: list


class CollDeviceRecord(NamedTuple):
    kind: int
    step: int
    index: int  # -1: the step's CUDA-graph replay
    device_ns: int


class ErrorRecord(NamedTuple):
    kind: int
    mono_ns: int
    where: str
    message: str
    count: int = 0


_TYPES = {
    schema.SPAN: SpanRecord, schema.COLLECTIVE: CollectiveRecord, schema.STEP_BEGIN: StepBegin,
    schema.STEP_END: StepEnd, schema.FINGERPRINTS: FingerprintsRecord, schema.META: MetaRecord,
    schema.GROUP: GroupRecord, schema.REPLAY: ReplayRecord, schema.LINEAGE: LineageRecord,
    schema.SLOT_SRC: SlotSourceRecord, schema.COLL_DEVICE: CollDeviceRecord, schema.ERROR: ErrorRecord,
}

SPAN_FIELDS = {name: i for i, name in enumerate(SpanRecord._fields)}
COLLECTIVE_FIELDS = {name: i for i, name in enumerate(CollectiveRecord._fields)}


def decode(rec):
    """A record as its named tuple (items past its fields are ignored; a missing optional
    field takes its default). Raises TypeError for a record too short for its kind."""
    cls = _TYPES[rec[0]]
    return cls(*rec[:len(cls._fields)])


class TensorMeta(NamedTuple):
    shape: list
    dtype: str
    device: str
    kind: dict | None  # what kind of tensor, when not a plain dense one (docs/store-schema.md)


class Param(NamedTuple):
    name: str
    meta: TensorMeta
    fp_index: int  # in the FINGERPRINTS of step schema.PARAMS_STEP


LOST_META = TensorMeta([], "?", "?", None)  # a META record that was lost
_DEFINITIONS = frozenset((schema.STRING, schema.META, schema.LAYOUT, schema.MODULE, schema.GROUP))


class RecordResolver:
    """The interned ids of one rank file (STRING, META, LAYOUT, MODULE, GROUP records), as the
    reader, the merge loader and live OTLP all resolve them. Ids are per file: one resolver
    per file (or per live stream)."""

    def __init__(self):
        self.strings: dict = {}  # string id -> text
        self.metas: dict = {}  # meta id -> TensorMeta
        self.layouts: dict = {}  # layout id -> [(slot, TensorMeta), ...]
        self.modules: dict = {}  # module path -> class (None: not said)
        self.groups: dict = {}  # group id -> GroupRecord

    def define(self, rec) -> bool:
        """Take in ``rec`` if it is a definition (True), else leave it (False)."""
        kind = rec[0]
        if kind not in _DEFINITIONS:
            return False
        strings = self.strings
        if kind == schema.STRING:
            strings[rec[1]] = rec[2]
        elif kind == schema.META:
            self.metas[rec[1]] = TensorMeta(rec[2], strings.get(rec[3], "?"), strings.get(rec[4], "?"),
                                            rec[5] if len(rec) > 5 else None)
        elif kind == schema.LAYOUT:
            metas = self.metas
            self.layouts[rec[1]] = [(strings.get(slot, "?"), metas.get(meta, LOST_META)) for slot, meta in rec[2]]
        elif kind == schema.MODULE:
            self.modules[strings.get(rec[1], "?")] = strings.get(rec[2])
        else:
            self.groups[rec[1]] = decode(rec)
        return True

    def string(self, sid, default: str = "?"):
        return self.strings.get(sid, default)

    def tensors(self, layout_id) -> list:
        """[(slot, TensorMeta), ...] of a layout id (empty for an unknown one)."""
        return self.layouts.get(layout_id, [])

    def params(self, rec) -> list:
        """A PARAMS record's entries as Params: [name id, meta id, fingerprint index(, kind)];
        an entry's kind (a dict) stands instead of its META's."""
        strings, metas = self.strings, self.metas
        out = []
        for entry in rec[2]:
            name_id, meta_id, fp_index = entry[:3]
            meta = metas.get(meta_id, LOST_META)
            if len(entry) > 3 and isinstance(entry[3], dict):
                meta = meta._replace(kind=entry[3])
            out.append(Param(strings.get(name_id, "?"), meta, fp_index))
        return out
