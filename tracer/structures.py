"""Find the tensors inside a module's inputs and outputs, each with its slot name.

Slot names follow the capture-point grammar of the contract: ``output``, ``output.0``,
``output.0.key``, ``input.0``, ``input.NAME``. Tuples, lists, dicts, dataclasses, named tuples
and msgspec structs are walked (a field is addressed by its name). Walking is bounded (depth and count) because
a server's forward passes can carry large batch objects; what is cut is counted, never an error.
"""

from __future__ import annotations

import dataclasses

import torch

MAX_DEPTH = 4
MAX_TENSORS = 64

_Tensor = torch.Tensor


def flatten(obj, prefix: str, out: list, depth: int = 0) -> None:
    """Append ``(slot, tensor)`` for every tensor in ``obj`` to ``out``."""
    if isinstance(obj, _Tensor):
        if len(out) < MAX_TENSORS:
            out.append((prefix, obj))
        return
    if depth >= MAX_DEPTH or obj is None or isinstance(obj, (int, float, str, bool)):
        return
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            if isinstance(item, _Tensor):
                if len(out) < MAX_TENSORS:
                    out.append((f"{prefix}.{i}", item))
            elif item is not None:
                flatten(item, f"{prefix}.{i}", out, depth + 1)
        return
    if isinstance(obj, dict):
        for key, item in obj.items():
            if isinstance(key, (str, int)):
                flatten(item, f"{prefix}.{key}", out, depth + 1)
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
    else:
        # msgspec.Struct (SGLang's layer-boundary handles, e.g. an OwedOutput carrying a
        # partial sum): walked like a dataclass, read only, never completed or copied.
        names = getattr(type(obj), "__struct_fields__", None)
        if not names:
            return
    for name in names:
        try:
            item = getattr(obj, name)
        except Exception:
            continue
        flatten(item, f"{prefix}.{name}", out, depth + 1)


def flatten_args(args: tuple, out: list) -> None:
    for i, item in enumerate(args):
        if isinstance(item, _Tensor):
            if len(out) < MAX_TENSORS:
                out.append((f"input.{i}", item))
        elif item is not None:
            flatten(item, f"input.{i}", out, 1)


def flatten_kwargs(kwargs: dict, out: list) -> None:
    for key, item in kwargs.items():
        flatten(item, f"input.{key}", out, 1)


def flatten_output(result, out: list) -> None:
    if isinstance(result, _Tensor):
        out.append(("output", result))
    elif result is not None:
        flatten(result, "output", out, 0)
