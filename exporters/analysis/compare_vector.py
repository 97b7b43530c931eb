"""The fast path of ``compare`` by columns: a step's fingerprints as one list of sums and one of
sums of squares per process, every point of a step pair unsharded and measured a column at a
time by ``map`` (the loops run in C; no tensor library, so no import and no memory for one).

It computes what the scalar fast path of ``compare.py`` computes (``_fast_whole`` then
``_fast_err``), with the same Python float operations in the same order, so each relative error
is the same number. It settles the plain case only: both sides replicated or sharded, every
value present, a sum of squares on both sides, nonzero tensors, within the tolerance (a NaN
error, which no tolerance admits, marks the points of the other cases). Every other point of the step (missing values, partial sums, integer tensors, points compared rank by
rank, errors beyond the tolerance) goes back to the scalar code, which decides it with all its
details.
"""

from __future__ import annotations

import math
import struct
import sys
from operator import add, le, mul, sub, truediv

from tensor_trace.format.fingerprints import FP_PAIR

FP_BYTES = FP_PAIR.size  # two little-endian float32
_PLAIN = ("rep", "shard")  # compare.py's fast-path kinds this path unshards
_LITTLE = sys.byteorder == "little"  # a memoryview of float32 reads native order; FP_PAIR is "<ff"


class StepColumns:
    """One step's fingerprints on every process of a side, in its plans' slot order: per
    process a list of sums and one of sums of squares, None where the scalar reader has None."""

    __slots__ = ("sums", "squares")

    def __init__(self, sums: list, squares: list):
        self.sums, self.squares = sums, squares

    def columns(self) -> list:
        """The scalar reader's columns: per process, per slot (sum, sumsq) or None."""
        return [[None if s is None else (s, q) for s, q in zip(ss, qs)] for ss, qs in zip(self.sums, self.squares)]


def read_columns(rows, refs: list, largest: int, known: dict | None = None) -> tuple | None:
    """One process's (sums, sums of squares) of a step in slot order, as ``compare_steps._column``
    reads them (a later value of an index replaces an earlier one); None for rows only the
    scalar reader handles. ``known``: where each slot's value lies in rows laid out alike (the
    same starts, lengths and indices: every step of one structure), kept for the next step."""
    layout = tuple((first, len(data) // FP_BYTES, indices) for first, data, indices in rows)
    got = known.get(layout, False) if known is not None else False
    if got is False:
        got = _sources(layout, refs, largest)
        if known is not None:
            if len(known) >= 64:  # rows laid out anew in every step: keep a few
                known.clear()
            known[layout] = got
    if got is None:
        return None
    at_sums, at_squares, complete = got
    blob = b"".join(data[:count * FP_BYTES] for (_, count, _), (_, data, _) in zip(layout, rows))
    if complete and _LITTLE:  # every slot has a value: read only those, as floats, in place
        flat = memoryview(blob).cast("f")
    else:
        flat = struct.unpack(f"<{len(blob) // 4}f", blob) + (None,)
    return list(map(flat.__getitem__, at_sums)), list(map(flat.__getitem__, at_squares))


def _sources(layout: tuple, refs: list, largest: int) -> tuple | None:
    """Per slot, the positions of its sum and its sum of squares among the rows' values laid
    end to end (-1: none), by the scalar reader's list assignments, and whether every slot has
    one; None: rows only the scalar reader handles."""
    src: list = [None] * (largest + 2)
    top = len(src) - 1  # the last entry stays None: where a slot without values points
    start = 0
    for first, n, indices in layout:
        if indices is None:
            if first < 0:
                return None  # the scalar reader's slice counts from the end
            if first + n > top:
                src[top:] = [None] * (first + n - top + 1)
                top = len(src) - 1
            src[first:first + n] = range(start, start + n)
        else:
            at = struct.unpack(f"<{n}I", indices[:4 * n])
            if n and max(at) >= top:
                return None  # indices past the end, which the scalar reader skips
            list(map(src.__setitem__, at, range(start, start + n)))
        start += n
    src[-1] = None
    by_slot = [src[r] for r in refs]
    return ([-1 if k is None else 2 * k for k in by_slot], [-1 if k is None else 2 * k + 1 for k in by_slot],
            None not in by_slot)


class PairColumns:
    """The common points of two step structures, grouped by how each side unshards them:
    per group their positions in ``common``, in each side's plan, sqrt(numel), tolerance and
    result."""

    def __init__(self, common: list, results: dict):
        groups: dict = {}
        self.scalar = []  # positions left to the scalar code in every step
        for pos, (key, ia, ib, cat_a, cat_b, numel, t) in enumerate(common):
            if cat_a not in _PLAIN or cat_b not in _PLAIN or numel <= 0:
                self.scalar.append(pos)
                continue
            g = groups.setdefault((cat_a, cat_b), ([], [], [], [], [], []))
            for column, value in zip(g, (pos, ia, ib, math.sqrt(numel), t, results[key])):
                column.append(value)
        self.groups = [(kinds, g) for kinds, g in groups.items()]

    def settle(self, ca: StepColumns, cb: StepColumns) -> list:
        """Tally every point plainly within its tolerance into its result; the positions in
        ``common`` of the others, in order."""
        todo = list(self.scalar)
        for (kind_a, kind_b), (where, ia, ib, root_n, tol, rs) in self.groups:
            wa, wb = _whole(ca, ia, kind_a), _whole(cb, ib, kind_b)
            if wa is None or wb is None:
                todo += where
                continue
            errs = _errors(wa, wb, root_n)
            for pos, r, err, t, ok in zip(where, rs, errs, tol, map(le, errs, tol)):
                if ok:
                    r["steps"] += 1
                    if r["rel_error"] is None or err > r["rel_error"]:
                        r["rel_error"], r["tol"] = err, t
                else:
                    todo.append(pos)
        return sorted(todo)


def _whole(side: StepColumns, at: list, kind: str) -> tuple | None:
    """``compare._fast_whole`` of a group's points: (sums, sums of squares); None where a value
    is missing (the scalar code looks further)."""
    if kind == "rep":  # the first process, when it has every value
        s = list(map(side.sums[0].__getitem__, at))
        q = list(map(side.squares[0].__getitem__, at))
        return None if None in s else (s, q)
    s = q = [0.0] * len(at)
    for sums, squares in zip(side.sums, side.squares):  # in rank order, as the scalar sums
        rank_s = list(map(sums.__getitem__, at))
        if None in rank_s:
            return None
        s = list(map(add, s, rank_s))
        q = list(map(add, q, map(squares.__getitem__, at)))
    return s, q


def _errors(wa: tuple, wb: tuple, root_n: list) -> list:
    """``compare._fast_err`` of a group's points, NaN for a point the scalar code's other
    branches decide: no sum of squares on a side (its NaN makes the error NaN), a zero tensor."""
    (sa, qa), (sb, qb) = wa, wb
    zeros = [0.0] * len(qa)
    pos_a, pos_b = list(map(max, qa, zeros)), list(map(max, qb, zeros))
    top = list(map(math.sqrt, map(max, pos_a, pos_b)))
    if not all(map((0.0).__lt__, top)):
        top = [t if t > 0.0 else math.nan for t in top]
    sum_err = map(truediv, map(abs, map(sub, sa, sb)), map(mul, root_n, top))
    norm_err = map(truediv, map(abs, map(sub, map(math.sqrt, pos_a), map(math.sqrt, pos_b))), top)
    return list(map(max, norm_err, sum_err))
