"""FINGERPRINTS records: one blob of values per step (``schema.FINGERPRINTS``).

``data`` is packed little-endian float32 pairs (sum, sum of squares) per tensor; ``indices`` is
None when the pairs' indices run ``first``, ``first + 1``, ..., else packed little-endian u32
indices, one per pair. A NaN sum of squares means the tensor has only a sum.

A step's values come from several sources (the deferred table, host values, repeats of an
earlier tensor), each with its own indices: a writer puts them in index order (``dense_values``)
so that one record without indices holds them all, 8 bytes a tensor instead of 12 (format 2).
"""

from __future__ import annotations

import array
import math
import struct

FP_PAIR = struct.Struct("<ff")
F32_MAX = 3.4028234663852886e38  # the largest finite float32


def pack_host_values(sums_and_squares) -> tuple:
    """(data blob, wide) of a flat ``sum0, sumsq0, sum1, ...`` that holds values past float32's
    range: those stand as +-inf in the blob (what float32 makes of them), and ``wide`` lists
    (k, sum, sumsq) for each k-th pair with such a value that is finite in float64: its
    WIDE_FINGERPRINTS entry (``encode_values`` raises OverflowError for them)."""
    vals = list(sums_and_squares)
    wide = []
    for k in range(0, len(vals) - 1, 2):
        s, q = vals[k], vals[k + 1]
        if abs(s) > F32_MAX or abs(q) > F32_MAX:  # NaN compares false: stays as it is
            if math.isfinite(s) and (math.isfinite(q) or math.isnan(q)):
                wide.append((k // 2, s, q))
            vals[k] = math.copysign(math.inf, s) if abs(s) > F32_MAX else s
            vals[k + 1] = math.inf if abs(q) > F32_MAX else q
    return struct.pack(f"<{len(vals)}f", *vals), wide


def wide_record_values(wide) -> list:
    """A WIDE_FINGERPRINTS record's flat list from (index, sum, sumsq) triples (a NaN sum of
    squares, for a tensor with only a sum, is kept as NaN)."""
    return [v for triple in wide for v in (int(triple[0]), float(triple[1]), float(triple[2]))]


def decode_wide(values, into: dict, key=None) -> dict:
    """Put a WIDE_FINGERPRINTS record's values in ``into`` as ``decode_fingerprints`` does,
    over the +-inf that its FINGERPRINTS record holds for them; return ``into``."""
    isnan = math.isnan
    for k in range(0, len(values) - 2, 3):
        i, s, q = values[k:k + 3]
        into[i if key is None else key(i)] = (s, None if isnan(q) else q)
    return into


def nonfinite_record_values(entries) -> list:
    """A NONFINITE_FINGERPRINTS record's flat list from (index, sum, sumsq, +inf count, -inf
    count, NaN count) entries: the sums over the tensor's finite values."""
    return [v for e in entries for v in (int(e[0]), float(e[1]), float(e[2]), int(e[3]), int(e[4]), int(e[5]))]


def decode_nonfinite(values):
    """The (index, sum, sumsq, +inf count, -inf count, NaN count) entries of a
    NONFINITE_FINGERPRINTS record's flat list."""
    return [tuple(values[k:k + 6]) for k in range(0, len(values) - 5, 6)]


def encode_values(sums_and_squares) -> bytes:
    """The ``data`` blob of a flat sequence ``sum0, sumsq0, sum1, sumsq1, ...``."""
    return struct.pack(f"<{len(sums_and_squares)}f", *sums_and_squares)


def dense_order(indices):
    """(first, positions) where ``indices`` are ``first, first + 1, ..., first + n - 1`` each
    once, in any order: ``positions[k]`` is where ``first + k`` is in ``indices``; else None."""
    n = len(indices)
    if not n:
        return None
    first = min(indices)
    if max(indices) - first + 1 != n:
        return None
    positions = [-1] * n
    for k, i in enumerate(indices):
        positions[i - first] = k
    if -1 in positions:  # an index twice, so another missing
        return None
    return first, positions


def dense_values(indices, data: bytes):
    """(first, data in index order) of a ``data`` blob whose k-th pair is of ``indices[k]``,
    where the indices are dense as ``dense_order`` says; else None. Pairs are moved as they are
    (8 bytes), in one pass (a writer calls this at every step's end)."""
    n = len(indices)
    if not n or len(data) < 8 * n:
        return None
    first = min(indices)
    if max(indices) - first + 1 != n:
        return None
    dense = [None] * n
    for i, row in zip(indices, memoryview(data)[:8 * n].cast("Q")):
        dense[i - first] = row
    if None in dense:  # an index twice, so another missing
        return None
    return first, array.array("Q", dense).tobytes()


def encode_indices(indices) -> bytes:
    """The ``indices`` blob of a sequence of fingerprint indices."""
    return struct.pack(f"<{len(indices)}I", *indices)


def fingerprint_pairs(first: int, data: bytes, indices):
    """The (index, sum, sum of squares) of a FINGERPRINTS record's values, raw (a NaN sum of
    squares stays NaN). Bytes past the last whole pair are ignored."""
    n = len(data) // FP_PAIR.size
    idx = range(first, first + n) if indices is None else struct.unpack(f"<{n}I", indices[:4 * n])
    return ((i, s, q) for i, (s, q) in zip(idx, FP_PAIR.iter_unpack(data[:n * FP_PAIR.size])))


def decode_fingerprints(first: int, data: bytes, indices, into: dict, key=None) -> dict:
    """Add a FINGERPRINTS record's values to ``into``: index (or ``key(index)``) -> (sum, sum of
    squares or None); return ``into``."""
    isnan = math.isnan
    for i, s, q in fingerprint_pairs(first, data, indices):
        into[i if key is None else key(i)] = (s, None if isnan(q) else q)
    return into


def fingerprint_refs(n: int, n_pre: int, fp_pre: int, fp_post: int) -> list:
    """The fingerprint index of each of a span's ``n`` tensors (-1: none): the first ``n_pre``
    count from ``fp_pre``, the others from ``fp_post``; a base of -1 means none."""
    return [(fp_pre + i if fp_pre >= 0 else -1) if i < n_pre else (fp_post + i - n_pre if fp_post >= 0 else -1)
            for i in range(n)]
