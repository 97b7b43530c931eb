"""Wrapping a class's own method once, so that a later install (a second tracer, a re-import)
neither wraps a wrapper nor loses the original that uninstalling puts back."""

from __future__ import annotations

import functools

ORIGINAL = "__tensor_trace_original__"  # set on every wrapper: the function it replaced


def is_wrapped(fn) -> bool:
    return getattr(fn, ORIGINAL, None) is not None


def wrap_method(cls, name: str, make):
    """Replace ``cls.<name>`` (defined on ``cls`` itself, not inherited) by ``make(original)``,
    given the original's name and docstring and marked with it. Returns the original, or None
    when there is nothing to wrap or it is wrapped already."""
    orig = cls.__dict__.get(name)
    if orig is None or is_wrapped(orig):
        return None
    wrapper = functools.wraps(orig)(make(orig))
    setattr(wrapper, ORIGINAL, orig)
    setattr(cls, name, wrapper)
    return orig
