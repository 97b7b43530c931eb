"""What the tracer reads from a CPU tensor's memory through numpy: its fingerprint pair (sum,
sum of squares) and the rows a collective's input holds nonzero values in.

numpy views a CPU tensor's memory without a copy and answers in one C call per reduction, where
torch spends several microseconds of dispatch per op (bench/RESULTS.md). numpy is imported on
first use; without it (or for a tensor numpy cannot view: bf16, conjugate or negative views,
tensors that require grad) each function returns None and the caller uses torch.

Once tracer/native.py's extension is built (``use_native``), its C functions
(tracer/native_host.py) are asked first: one C call on the tensor's memory, where numpy's views
and reductions cost several microseconds inside a model's step; what they do not read comes
here.
"""

from __future__ import annotations

_numpy: list = []  # [numpy module] once imported, [None] when unavailable
_NP_F32: list = []  # [numpy's float32 dtype] once numpy is imported
_ONES_F32: dict = {}  # numel -> float32 ones vector, for tensors below ROWS_FROM
_ONES: dict = {}  # (numel, numpy dtype char) -> ones vector of another dtype, below ROWS_FROM
_ONES_ROW: dict = {}  # numpy dtype char -> ones vector of ROW elements
# tracer/native_host.py's host_pair, nonzero_rows and add_host once built (use_native), else None
native_pair = None
native_rows = None
native_add = None

# From this many elements the sum is a matrix-vector product of the tensor, as rows of ROW
# elements, with one ROW-long ones vector: one read of the tensor (a dot with a ones vector of
# the tensor's own length reads two, and that vector had to be made: 128 MiB for a 32M-element
# embedding), about half the time from 2**17 elements up, each row's float32 partial sum
# combined in float64. Measured on the VM (one thread): 1M fp32 elements 322 -> 149 us, 32M
# 16.9 -> 8.9 ms. Below it one dot with a cached ones vector is cheaper than the reshape.
ROWS_FROM = 1 << 16
ROW = 1024
# The sum of squares is a dot of the tensor with itself, in pieces of this many elements whose
# float32 results are added in float64: BLAS accumulates in float32, 1.6e-4 off for a 32M-element
# tensor in one dot, 2e-8 in pieces, at about the same time.
SQ_PIECE = 1 << 18


def numpy_module():
    """numpy, imported on first use; None when it is not installed."""
    if _numpy:
        return _numpy[0]
    try:
        import numpy
    except Exception:
        numpy = None
    else:
        _NP_F32.append(numpy.dtype(numpy.float32))
        # Uninitialised memory (a receive buffer before its broadcast) overflows a sum of
        # squares: an inf the analysis reads as "no values", not a warning for the host's stderr
        # (nor an exception under -W error). Only warnings raised from this module are muted.
        import re
        import warnings
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=re.escape(__name__) + "$")
    _numpy.append(numpy)
    return numpy


def use_native(host_pair, nonzero_rows, add_host=None) -> None:
    """Ask tracer/native_host.py's ``host_pair`` and ``nonzero_rows`` first (None: numpy only),
    and ``StepFingerprints.add`` its ``add_host`` (None: Python only)."""
    global native_pair, native_rows, native_add
    native_pair, native_rows, native_add = host_pair, nonzero_rows, add_host


def pair(t):
    """(sum, sum of squares) of a CPU tensor as Python floats; None when neither the extension
    nor numpy can read it.

    Through numpy, sums accumulate in the tensor's dtype within a row or piece, as torch's do
    (integers in float64), and the partial sums of a large tensor in float64."""
    if native_pair is not None:
        values = native_pair(t)
        if values is not None:
            return values
    np = _numpy[0] if _numpy else numpy_module()
    if np is None:
        return None
    try:
        a = t.numpy().ravel()  # a view of a contiguous tensor (a 1-D dot skips vdot's ravels)
        n = a.size
        if a.dtype is _NP_F32[0]:  # the common case first: one lookup, by size
            if n < ROWS_FROM:
                ones = _ONES_F32.get(n)
                if ones is None:  # sum as a dot with ones: one BLAS call, a third of a ufunc reduce
                    if len(_ONES_F32) >= 128:
                        _ONES_F32.clear()
                    ones = _ONES_F32[n] = np.ones(n, dtype=np.float32)
                s, q = float(a.dot(ones)), float(a.dot(a))
                if s - s == 0.0 and q - q == 0.0:  # both finite
                    return (s, q)
                return _in_float64(np, a, n)
        elif not t.is_floating_point():  # token ids, positions: exact in float64
            a = a.astype(np.float64)
        s, q = _numpy_pair(np, a, n)
        if (s - s != 0.0 or q - q != 0.0) and a.dtype is _NP_F32[0]:
            return _in_float64(np, a, n)
        return (s, q)
    except Exception:  # conjugate or negative views, and whatever else numpy cannot view
        return None


def _numpy_pair(np, a, n: int) -> tuple:
    if n < ROWS_FROM:
        key = (n, a.dtype.char)
        ones = _ONES.get(key)
        if ones is None:
            if len(_ONES) >= 128:
                _ONES.clear()
            ones = _ONES[key] = np.ones(n, dtype=a.dtype)
        return (float(a.dot(ones)), float(a.dot(a)))
    return (_rows_sum(np, a, n), _pieces_sumsq(a, n))


def _in_float64(np, a, n: int) -> tuple:
    """The pair of float32 values whose float32 sums overflowed (values near float32's limit,
    an attention mask of finfo.min), added in float64: finite there unless a value is not."""
    return _numpy_pair(np, a.astype(np.float64), n)


def _rows_sum(np, a, n: int) -> float:
    ones = _ONES_ROW.get(a.dtype.char)
    if ones is None:
        ones = _ONES_ROW[a.dtype.char] = np.ones(ROW, dtype=a.dtype)
    whole = n - n % ROW
    total = float((a[:whole].reshape(-1, ROW) @ ones).sum(dtype=np.float64))
    if whole < n:
        total += float(a[whole:].dot(ones[:n - whole]))
    return total


def _pieces_sumsq(a, n: int) -> float:
    if n <= SQ_PIECE:
        return float(a.dot(a))
    total = 0.0
    for i in range(0, n, SQ_PIECE):
        piece = a[i:i + SQ_PIECE]
        total += float(piece.dot(piece))
    return total


def nonzero_rows(t):
    """``[first, last, count]`` of the dim-0 rows of a CPU tensor holding a nonzero value
    (``[0, 0, 0]`` when none; NaN counts as nonzero, -0.0 does not, as ``ne(0)``); None when
    numpy cannot view it."""
    np = _numpy[0] if _numpy else numpy_module()
    if np is None:
        return None
    try:
        rows = np.flatnonzero(t.numpy().reshape(t.shape[0], -1).any(axis=1))
    except Exception:
        return None
    n = int(rows.size)
    return [int(rows[0]), int(rows[-1]), n] if n else [0, 0, 0]
