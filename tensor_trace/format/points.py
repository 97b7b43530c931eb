"""Point names: where a tensor was seen, as users write them.

A point is a slot of a module call: ``MODULE:SLOT`` when the module ran once per step,
``MODULE#CALL:SLOT`` when it ran more than once (``CALL`` counts from 0). A named capture point
(``capture:NAME``) is its own name (``capture:NAME#CALL`` when called more than once). Slots are
``input.0``, ``input.NAME``, ``output``, ``output.0``, ``output.0.key``, ...
"""

from __future__ import annotations

import fnmatch
import re
from typing import NamedTuple

CAPTURE_PREFIX = "capture:"
OUTPUT = "output"
INPUT = "input"
OUTPUTS_SQL = "slot LIKE 'output%'"  # is_output in SQL
_CALL = re.compile(r"(.*)#(\d+)")


class PointName(NamedTuple):
    module: str
    call: int | None  # None: not given (any call)
    slot: str | None  # None: not given (the module's outputs)


def point_name(module: str, call: int, slot: str, multi_call: bool) -> str:
    """The name of a point, with ``#CALL`` when its module ran more than once per step."""
    if module.startswith(CAPTURE_PREFIX):  # a named capture point is its own name
        return f"{module}#{call}" if multi_call else module
    return f"{module}#{call}:{slot}" if multi_call else f"{module}:{slot}"


def full_name(module: str, call: int, slot: str) -> str:
    """A point's name with its call always given (``MODULE#CALL:SLOT``)."""
    return f"{module}#{call}:{slot}"


def module_call(module: str, call: int) -> str:
    return f"{module}#{call}"


def is_output(slot: str) -> bool:
    return slot.startswith(OUTPUT)


def is_input(slot: str) -> bool:
    return slot.startswith(INPUT)


def parse_point(name: str) -> PointName:
    """``MODULE[#CALL][:SLOT]`` as its parts. The module part ends at the first ``:`` (a module
    path has none)."""
    if ":" in name:
        module, slot = name.split(":", 1)
    else:
        module, slot = name, None
    m = _CALL.fullmatch(module)
    if m:
        return PointName(m.group(1), int(m.group(2)), slot)
    return PointName(module, None, slot)


class PointGlob:
    """A glob over points. Without ``:`` it is over module paths (or ``MODULE#CALL``) and
    selects their outputs; with ``:`` it is over whole point names, and a pattern whose module
    part has no ``#`` also matches every call (``MODULE#*:SLOT``)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.whole_names = ":" in pattern
        self._rx = re.compile(fnmatch.translate(pattern))
        self._any_call = None
        if self.whole_names:
            module, slot = pattern.split(":", 1)
            if "#" not in module:
                self._any_call = re.compile(fnmatch.translate(f"{module}#*:{slot}"))

    def matches(self, name: str, module: str, call: int, slot: str) -> bool:
        if self.whole_names:
            return bool(self._rx.match(name) or (self._any_call and self._any_call.match(name)))
        return is_output(slot) and bool(self._rx.match(module) or self._rx.match(module_call(module, call)))


def module_matches(pattern: str, module: str) -> bool:
    """A glob over one module path (``query collectives MODULE_GLOB``)."""
    return fnmatch.fnmatch(module, pattern)
