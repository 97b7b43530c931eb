"""Refs of LINEAGE and SLOT_SRC records: where an input of a lineage node came from.

A ref is a list whose first item says what it is (``tracer/lineage.py`` writes them):

- ``[REF_SLOT, step, span, slot]``: that module call's recorded tensor itself;
- ``[REF_NODE, step, node]``: the result of a lineage node;
- ``[REF_VALUES, fingerprint index, shape]`` (``[..., step]`` once a reader added the step the
  index belongs to): a tensor the tracer had not seen, known by its fingerprint;
- ``[REF_UNKNOWN, shape]``: unknown (fingerprints were off);
- ``[REF_PARAM, module path, parameter name]``: a module's parameter (an MoE's stacked expert
  weights indexed inside its call). A rank file holds the path and name as string ids
  (``param_ref``); the store holds the strings (``resolve_strings``). Files written before this
  kind existed hold none, and read as before.
"""

from __future__ import annotations

from typing import NamedTuple

REF_SLOT = 0
REF_NODE = 1
REF_VALUES = 2
REF_UNKNOWN = 3
REF_PARAM = 4


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


class ParamRef(NamedTuple):
    module: str  # a module path (a string id in a rank file)
    name: str


def param_ref(path_id: int, name_id: int) -> list:
    """A parameter's ref as a rank file holds it: its module path and name as string ids."""
    return [REF_PARAM, path_id, name_id]


def resolve_strings(ref: list, strings: dict) -> list:
    """``ref`` as the store holds it: a parameter ref's string ids replaced by their strings
    (``strings``: the rank file's string table); any other ref unchanged."""
    if ref and ref[0] == REF_PARAM:
        return [REF_PARAM, strings.get(ref[1], "?"), strings.get(ref[2], "?")]
    return ref


def decode_ref(ref):
    """A ref list as SlotRef, NodeRef, ValuesRef, ParamRef or UnknownRef."""
    kind = ref[0]
    if kind == REF_SLOT:
        return SlotRef(ref[1], ref[2], ref[3])
    if kind == REF_NODE:
        return NodeRef(ref[1], ref[2])
    if kind == REF_VALUES:
        return ValuesRef(ref[1], ref[2], ref[3] if len(ref) > 3 else None)
    if kind == REF_PARAM:
        return ParamRef(ref[1], ref[2])
    return UnknownRef(ref[1])


def with_step(ref: list, step: int) -> list:
    """``ref`` with the step of its fingerprint index added where it is a REF_VALUES ref without
    one (a node's input refs are of the node's step)."""
    return ref + [step] if ref[0] == REF_VALUES and len(ref) == 3 else ref
