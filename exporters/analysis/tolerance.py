"""When two fingerprints (fp32 sum, sum of squares) describe the same values.

Two sums of the same n values agree when
``|a - b| <= eps(dtype) * sqrt(sumsq) + 2**-20 * sqrt(n * sumsq)``: the first term covers
rounding each value once to the tensor's dtype (eps 2**-7 for bfloat16, 2**-10 for float16,
2**-20 for float32: several standard deviations of that rounding, whose errors add like a random
walk), the second covers fp32 accumulation in another order (1e-6 of the sum of absolute values
at most). Sums of squares agree within ``(4 * eps / sqrt(n) + 2**-18) * sumsq``. So a bf16
partial sum on GPU still matches its reduced output, while two shards whose statistics differ by
1% do not look replicate.
"""

from __future__ import annotations

import math

_finite = math.isfinite
# A dtype whose name starts with one of these holds floating-point values.
FLOAT_DTYPES = ("float", "bfloat", "complex")
EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -20, "float64": 2.0 ** -40}


class Observed:
    """One tensor seen on one rank: its local shape, dtype, fingerprint and, for a tensor
    subclass such as a DTensor, what the tracer recorded about it (``meta``).

    A fingerprint with a NaN or infinite sum (or sum of squares) says nothing about the values:
    it is dropped (``fp`` None) and ``nonfinite`` set. Such sums are what uninitialised memory
    gives, e.g. the padding rows of a gathered buffer that SGLang allocates with ``torch.empty``
    under DP attention: compared as numbers they would read as values that differ."""

    __slots__ = ("shape", "dtype", "fp", "numel", "meta", "nonfinite", "nf")

    def __init__(self, shape, dtype, fp, meta=None):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.nonfinite = fp is not None and not (_finite(fp[0]) and (fp[1] is None or _finite(fp[1])))
        self.fp = None if self.nonfinite else fp
        self.numel = math.prod(self.shape) if self.shape else 1
        self.meta = meta
        # of a non-finite tensor where recorded (NONFINITE_FINGERPRINTS): (its finite values'
        # sum and sum of squares, +inf count, -inf count, NaN count)
        self.nf = None


def eps(dtype) -> float:
    return EPS.get(dtype, 2.0 ** -7)


def sum_tol(n: int, sq: float, dtype) -> float:
    sq = max(sq, 0.0)
    return eps(dtype) * math.sqrt(sq) + 2.0 ** -20 * math.sqrt(max(n, 1) * sq) + 1e-30


def close(a: float, b: float, n: int, sq: float, dtype) -> bool:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return False
    return abs(a - b) <= sum_tol(n, sq, dtype) + 1e-7 * (abs(a) + abs(b))


def sumsq_close(qa: float, qb: float, n: int, dtype) -> bool:
    q = max(qa, qb)
    return abs(qa - qb) <= (4 * eps(dtype) / math.sqrt(max(n, 1)) + 2.0 ** -18) * q + 1e-30


def fp_equal(x: Observed, y: Observed, scale: float = 1.0) -> bool:
    """``y`` holds ``scale`` times the values of ``x`` (same numel, same fingerprint)."""
    if x.fp is None or y.fp is None or x.numel != y.numel:
        return False
    (sx, qx), (sy, qy) = x.fp, y.fp
    if qx is None or qy is None:
        # booleans and other kinds fingerprinted by their sum alone: exact sums of counts
        return qx is None and qy is None and scale == 1.0 and sx == sy
    dtype = x.dtype if eps(x.dtype) > eps(y.dtype) else y.dtype
    qx2 = qx * scale * scale
    return sumsq_close(qx2, qy, x.numel, dtype) and close(sx * scale, sy, x.numel, max(qx2, qy), dtype)


def linked(xs: dict, ys: dict) -> float | None:
    """The common scale c with ys[r] == c * xs[r] on every rank of ``xs``, or None."""
    procs = [p for p in xs if p in ys]
    if not procs or len(procs) < len(xs):
        return None
    ref = procs[0]
    x, y = xs[ref], ys[ref]
    if x.fp is None or y.fp is None or x.numel != y.numel or not x.fp[1] or y.fp[1] is None:
        return None
    if fp_equal(x, y):
        scale = 1.0
    else:
        # A common scale factor is believable only when the sums carry it: both far from zero
        # (the sum of squares alone fits any scale).
        # Each sum is measured against its own sum of squares, so the test does not depend
        # on the scale itself.
        if (abs(x.fp[0]) < 64 * sum_tol(x.numel, x.fp[1], x.dtype)
                or abs(y.fp[0] or 0.0) < 64 * sum_tol(y.numel, y.fp[1], y.dtype)):
            return None
        scale = math.sqrt(y.fp[1] / x.fp[1])
        if x.fp[0] * y.fp[0] < 0:
            scale = -scale
        if abs(scale) < 1e-6 or not fp_equal(x, y, scale):
            return None
    for p in procs[1:]:
        if not fp_equal(xs[p], ys[p], scale):
            return None
    return scale


def unconfirmed_scale(xs: dict, ys: dict) -> float | None:
    """The common scale c with ys[r] == c * xs[r] on every rank, found as ``linked`` finds it
    but where a sum is too near zero to confirm it (the sums of squares fit it, the sums do not
    contradict it), or None: evidence too weak to link, enough for a step not to say the
    contrary (verdicts.vote)."""
    procs = [p for p in xs if p in ys]
    if not procs or len(procs) < len(xs):
        return None
    x, y = xs[procs[0]], ys[procs[0]]
    if x.fp is None or y.fp is None or x.numel != y.numel or not x.fp[1] or not y.fp[1]:
        return None
    scale = math.sqrt(y.fp[1] / x.fp[1])
    if x.fp[0] * y.fp[0] < 0:
        scale = -scale
    if abs(scale) < 1e-6 or abs(scale - 1.0) < 1e-6:
        return None
    if all(fp_equal(xs[p], ys[p], scale) for p in procs):
        return scale
    return None


def all_equal(ts: list) -> bool:
    return all(fp_equal(ts[0], t) for t in ts[1:])


def disjoint_sum(ins: list, out: Observed, known_distinct: bool = False) -> bool:
    """A sum of the ``ins`` whose sum of squares is the sum of theirs: the inputs are nonzero
    on disjoint elements (each zero outside its own slice), so the sum only puts the slices
    together (one rank's tensor sent to all is the extreme case). Partial sums of a real
    computation have cross terms far above the tolerance. Equal fingerprints on every rank
    refute it, unless the caller knows the inputs differ (``known_distinct``: they are nonzero
    in different rows, e.g. the same values in two ranks' slices of a zero-filled buffer)."""
    if out.fp is None or out.fp[1] is None or any(t.fp is None or t.fp[1] is None for t in ins):
        return False
    if sum(1 for t in ins if t.fp[1] > 0) < 1 or (all_equal(ins) and not known_distinct):
        return False
    total = sum(t.fp[1] for t in ins)
    return sumsq_close(total, out.fp[1], out.numel, out.dtype)
