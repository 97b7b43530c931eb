"""Find the tensors inside a module's inputs and outputs, each with its slot name.

Slot names follow the capture-point grammar of the contract: ``output``, ``output.0``,
``output.0.key``, ``input.0``, ``input.NAME``. Tuples, lists, dicts, dataclasses, named tuples
and msgspec structs are walked (a field is addressed by its name). Walking is bounded (depth and
count) because a server's forward passes can carry large batch objects; what is cut is counted,
never an error. A framework's per-batch context object (``add_context_type``: SGLang's
ForwardBatch) is walked only among the step root's inputs.
"""

from __future__ import annotations

import dataclasses

import torch

MAX_DEPTH = 4
MAX_TENSORS = 64

_Tensor = torch.Tensor


_LEAVES = (int, float, str, bool)
_FIELDS: dict = {}  # type -> field names to walk (() for a type that has none)


def _field_names(cls) -> tuple:
    """The fields of a dataclass or msgspec.Struct type (() for anything else), looked up once
    per type: a server's batch object is passed to many modules of every step."""
    names = _FIELDS.get(cls)
    if names is None:
        if dataclasses.is_dataclass(cls):
            names = tuple(f.name for f in dataclasses.fields(cls))
        else:
            # msgspec.Struct (SGLang's layer-boundary handles, e.g. an OwedOutput carrying a
            # partial sum): walked like a dataclass, read only, never completed or copied.
            names = tuple(getattr(cls, "__struct_fields__", None) or ())
        if len(_FIELDS) >= 4096:
            _FIELDS.clear()
        _FIELDS[cls] = names
    return names


CONTEXT_TYPES: set = set()  # types of a framework's per-batch context (SGLang's ForwardBatch)


def add_context_type(cls) -> None:
    """Register ``cls`` as a per-batch context type: an object of it is walked only where
    ``context`` is asked for (the step root's inputs), not in every module that receives it.

    SGLang passes its ForwardBatch (a dataclass of some 40 fields, a dozen of them tensors) to
    every decoder layer, attention block and attention kernel module: walked in each, it made
    every such call cost tens of microseconds more and repeated the same dozen tensors in a
    hundred spans per step."""
    CONTEXT_TYPES.add(cls)


def flatten(obj, prefix: str, out: list, depth: int = 0, context: bool = False) -> None:
    """Append ``(slot, tensor)`` for every tensor in ``obj`` to ``out``. A context object
    (``add_context_type``) is walked only when ``context`` is true."""
    if isinstance(obj, _Tensor):
        if len(out) < MAX_TENSORS:
            out.append((prefix, obj))
        return
    if depth >= MAX_DEPTH or obj is None or isinstance(obj, _LEAVES):
        return
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            if isinstance(item, _Tensor):
                if len(out) < MAX_TENSORS:
                    out.append((f"{prefix}.{i}", item))
            elif item is not None:
                flatten(item, f"{prefix}.{i}", out, depth + 1, context)
        return
    if isinstance(obj, dict):
        for key, item in obj.items():
            if isinstance(key, (str, int)):
                flatten(item, f"{prefix}.{key}", out, depth + 1, context)
        return
    cls = type(obj)
    if cls is type or (not context and cls in CONTEXT_TYPES):
        return
    names = _field_names(cls)
    depth += 1
    for name in names:
        try:
            item = getattr(obj, name)
        except Exception:
            continue
        # the common fields, inline: None, numbers, flags, tensors
        if item is None or isinstance(item, _LEAVES):
            continue
        if isinstance(item, _Tensor):
            if len(out) < MAX_TENSORS:
                out.append((f"{prefix}.{name}", item))
            continue
        flatten(item, f"{prefix}.{name}", out, depth, context)


def flatten_args(args: tuple, out: list, context: bool = False) -> None:
    for i, item in enumerate(args):
        if isinstance(item, _Tensor):
            if len(out) < MAX_TENSORS:
                out.append((f"input.{i}", item))
        elif item is not None:
            flatten(item, f"input.{i}", out, 1, context)


def flatten_kwargs(kwargs: dict, out: list, context: bool = False) -> None:
    for key, item in kwargs.items():
        flatten(item, f"input.{key}", out, 1, context)


def flatten_output(result, out: list) -> None:
    if isinstance(result, _Tensor):
        out.append(("output", result))
    elif result is not None:
        flatten(result, "output", out, 0)
