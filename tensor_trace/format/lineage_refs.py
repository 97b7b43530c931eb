"""Refs of LINEAGE and SLOT_SRC records: where an input of a lineage node came from.

A ref is a list whose first item says what it is (``tracer/lineage.py`` writes them):

- ``[REF_SLOT, step, span, slot]``: that module call's recorded tensor itself;
- ``[REF_NODE, step, node]``: the result of a lineage node;
- ``[REF_VALUES, fingerprint index, shape]`` (``[..., step]`` once a reader added the step the
  index belongs to): a tensor the tracer had not seen, known by its fingerprint;
- ``[REF_UNKNOWN, shape]``: unknown (fingerprints were off).
"""

from __future__ import annotations

from typing import NamedTuple

REF_SLOT = 0
REF_NODE = 1
REF_VALUES = 2
REF_UNKNOWN = 3


class SlotRef(NamedTuple):
    step: int
    span: int
    slot: int


class NodeRef(NamedTuple):
    step: int
    node: int


class ValuesRef(NamedTuple):
    fp_index: int
    shape: list
    step: int | None  # the step the fingerprint index belongs to, when known


class UnknownRef(NamedTuple):
    shape: list


def decode_ref(ref):
    """A ref list as SlotRef, NodeRef, ValuesRef or UnknownRef."""
    kind = ref[0]
    if kind == REF_SLOT:
        return SlotRef(ref[1], ref[2], ref[3])
    if kind == REF_NODE:
        return NodeRef(ref[1], ref[2])
    if kind == REF_VALUES:
        return ValuesRef(ref[1], ref[2], ref[3] if len(ref) > 3 else None)
    return UnknownRef(ref[1])


def with_step(ref: list, step: int) -> list:
    """``ref`` with the step of its fingerprint index added where it is a REF_VALUES ref without
    one (a node's input refs are of the node's step)."""
    return ref + [step] if ref[0] == REF_VALUES and len(ref) == 3 else ref
