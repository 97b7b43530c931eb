"""Local shapes of every module call's inputs and outputs, seen without tensor-trace.

The truth corpus (tests/integration/test_truth_corpus.py) states each point's local shape from
the TP plan; this probe measures them in an untraced run, so that a mistake in the truth shows
up as a truth error rather than as a tensor-trace mismatch. Points are named as tensor-trace
names them (README, "Points"): ``PATH:input.N``, ``PATH:input.NAME``, ``PATH:output``,
``PATH:output.K`` / ``PATH:output.FIELD`` for tuples and mappings, the root's path empty. A
DTensor is measured by its local tensor.
"""

import json
from collections.abc import Mapping

import torch
import torch.nn as nn

_state = {"depth": 0, "names": None, "seen": {}}


def _local(t):
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _flatten(prefix, value, out):
    if isinstance(value, torch.Tensor):
        t = _local(value)
        out.append((prefix, list(t.shape), str(t.dtype).replace("torch.", "")))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _flatten(f"{prefix}.{i}", v, out)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)


def _note(path, args, kwargs, result):
    found = []
    for i, a in enumerate(args):
        _flatten(f"input.{i}", a, found)
    for k, v in kwargs.items():
        _flatten(f"input.{k}", v, found)
    _flatten("output", result, found)
    for slot, shape, dtype in found:
        _state["seen"].setdefault(f"{path}:{slot}", {"shape": shape, "dtype": dtype})


def install():
    """Wrap ``nn.Module.__call__`` (outside the modules' own hooks, as tensor-trace's default
    interception does) for the rest of the process."""
    original = nn.Module.__call__

    def call(self, *args, **kwargs):
        if _state["depth"] == 0:
            _state["names"] = {id(m): n for n, m in self.named_modules()}
        _state["depth"] += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _state["depth"] -= 1
        path = _state["names"].get(id(self))
        if path is not None:
            _note(path, args, kwargs, result)
        return result

    nn.Module.__call__ = call


def reset():
    """Forget what was seen (between two models run in one process)."""
    _state["seen"] = {}


def dump(path):
    """Write ``{point: {"shape": [...], "dtype": ...}}`` (first call of each point) to ``path``."""
    with open(path, "w") as f:
        json.dump(_state["seen"], f, sort_keys=True)
