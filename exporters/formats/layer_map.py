"""Layers and point kinds from module paths, for any model's naming.

The layer of a module is the first numbered component of its path (a ModuleList entry):
``model.layers.3.self_attn.qkv_proj`` (SGLang, HF) and ``layers.3.attention.wq`` (torchtitan) are
in layer 3 of the stack ``model.layers`` / ``layers``. A point's kind (its column on the
placement map) is the rest of its name below the layer: ``self_attn.qkv_proj:output.0``,
``mlp.down_proj:output``, ``:output`` for the layer's own output. Points outside every layer
(embedding, final norm, head, named captures) have no layer.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_NUMBERED = re.compile(r"^(?P<stack>(?:[^.:#]+\.)*?[^.:#]+)\.(?P<index>\d+)(?=[.:#]|$)")


class LayerKey(NamedTuple):
    stack: str  # the path of the list of layers, e.g. "model.layers"
    index: int


def layer_of(name: str) -> tuple[LayerKey | None, str]:
    """(layer, the rest of the name below it) of a module path or point name; (None, name) for
    a name outside every layer (or a ``capture:`` point)."""
    if name.startswith("capture:"):
        return None, name
    m = _NUMBERED.match(name)
    if m is None:
        return None, name
    rest = name[m.end():]
    return LayerKey(m.group("stack"), int(m.group("index"))), rest.lstrip(".")


def column_label(kind: str) -> str:
    """A column's label: ``:output`` is the layer's own output."""
    return "layer" + kind if kind.startswith((":", "#")) else kind


class Stack(NamedTuple):
    """One list of layers: its path, its layer indices in order, and its point kinds (columns)
    in order of first execution."""
    path: str
    indices: list
    columns: list


def stacks(names: list[str]) -> tuple[list, dict, list]:
    """Group point names (in execution order) into stacks of layers.

    Returns (stacks in order of first execution, ``{name: (stack, index, column)}`` for every
    name in a layer, the names outside every layer in their order)."""
    order: dict = {}  # stack path -> {"indices": set, "columns": list}
    where: dict = {}
    outside: list = []
    per_layer: dict = {}  # (stack, index) -> kinds in execution order
    for name in names:
        key, kind = layer_of(name)
        if key is None:
            outside.append(name)
            continue
        order.setdefault(key.stack, set()).add(key.index)
        per_layer.setdefault(key, []).append(kind)
        where[name] = (key.stack, key.index, kind)
    out = []
    for path, indices in order.items():
        layers = sorted(indices)
        out.append(Stack(path, layers, merge_orders([per_layer[LayerKey(path, i)] for i in layers])))
    return out, where, outside


def merge_orders(sequences: list[list]) -> list:
    """One order of every item of ``sequences`` that keeps each sequence's order where they
    agree: an item not placed yet goes right after the item that precedes it in its sequence
    (layers of a stack mostly run the same kinds; a MoE layer adds some, a dense one others)."""
    merged: list = []
    placed: set = set()
    for seq in sequences:
        prev = None
        for item in seq:
            if item not in placed:
                merged.insert(merged.index(prev) + 1 if prev is not None else 0, item)
                placed.add(item)
            prev = item
    return merged
