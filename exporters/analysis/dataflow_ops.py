"""Placement through the ops that carry a module parameter's split into what a module receives
(tracer/lineage_attrs.py records them): a parameter's own placement, dimension moves (indexing,
transpose, squeeze...) and matrix products, each mapping its inputs' placements to the output's
as DTensor's sharding propagation does. All placements are of local tensors (``shard(D)``: each
rank holds its slice along local dim D). A combination not listed gives no answer (None), never
a guess. An index tensor is taken to be the same on every rank (DTensor's assumption for an
index: a replicated one); a rank that indexed other rows would hold other values, which the
value rules judge before these.
"""

from __future__ import annotations

from tensor_trace.exporters.analysis import declared
from tensor_trace.exporters.analysis.tolerance import Observed, fp_equal

PRODUCTS = frozenset(("linear", "matmul", "bmm", "baddbmm", "mm", "grouped_mm"))


def _shard_dim(p):
    return int(p[6:-1]) if isinstance(p, str) and p.startswith("shard(") else None


def param_placement(per_rank: list):
    """(placement, how) of a parameter from its records on every rank of the group
    (``[(shape, fingerprint, meta)]``): the split a DTensor declares (``Shard(d)`` and
    ``_StridedShard(dim=d)``: shard(d) of the local tensor; ``Replicate``: replicate), else
    replicate where every rank's fingerprint is equal; None otherwise."""
    if not per_rank:
        return None
    shape, fp, meta = per_rank[0]
    says = declared.dtensor_placement(meta, len(shape))
    if says in ("replicate",) or _shard_dim(says) is not None:
        placements = (meta or {}).get("placements") or []
        return says, f"a DTensor {', '.join(map(str, placements))}"
    if says is not None or fp is None:
        return None  # a partial parameter, or no values to compare
    ref = Observed(tuple(shape), "float32", fp)
    for other_shape, other_fp, _ in per_rank[1:]:
        if other_fp is None or tuple(other_shape) != tuple(shape) \
                or not fp_equal(ref, Observed(tuple(shape), "float32", other_fp)):
            return None
    return "replicate", "equal values on every rank"


def dims_placement(placement, attrs: dict):
    """A dimension move (``attrs["dims"]``: each input dim's output dim, -1 where gone;
    ``attrs["part"]``: input dims of which a selection is kept): a whole or partial tensor stays
    so (these ops are linear); a shard follows its dim, unless that dim is gone or cut."""
    if placement in ("replicate", "partial"):
        return placement
    d = _shard_dim(placement)
    dims = attrs.get("dims")
    if d is None or not dims or d >= len(dims):
        return None
    k = dims[d]
    if k < 0 or d in (attrs.get("part") or ()):
        return None  # the sharded dim indexed, sliced or repeated: not a slice of the whole
    return f"shard({k})"


def batch_shard(op: str, placements: list, ndims: list):
    """The output's shard where a batched product's ``a`` is sharded along a batch dim (its rows
    stay where they are, whatever ``b`` is), else None. Such a shard's positions in its dim
    (contiguous, or an interleaved slice: heads merged with the batch, as Megatron's core
    attention's ``[b * np, sq, hn]``) are ``a``'s."""
    if op == "baddbmm" and len(placements) == 2:
        op = "bmm"
    if op in ("bmm", "matmul") and len(placements) == 2 and len(ndims) == 2 and min(ndims) >= 3:
        da = _shard_dim(placements[0] or "")
        if da is not None and da < ndims[0] - 2:
            return f"shard({da + max(ndims) - ndims[0]})"
    return None


def product_placement(op: str, placements: list, ndims: list):
    """The output of a matrix product from its operands' placements and ranks:

    - ``linear(x, W[, b])`` (W is [out, in]): x replicate and W shard(0) give shard(last), b
      (if any) shard(0) too; x shard(last) and W shard(1) give partial (no bias); x shard along
      a leading dim and W replicate keep it;
    - ``matmul``/``bmm``/``mm`` (``a @ b``, both at least 2-D): a replicate and b shard(last)
      give shard(last); a shard(rows) and b replicate give shard(rows); a and b sharded along
      the contracted dim give partial; a partial times a whole operand stays partial;
    - ``grouped_mm(a [S, K], b [E, K, N])``: a replicate and b shard(2) give shard(1); a
      shard(1) and b shard(1) give partial;
    - ``bmm``/``matmul`` with ``a`` sharded along a batch dim: that dim of the output, whatever
      ``b`` is (not placed: a weight made after loading, as DeepSeek's absorbed ``w_kc``): a
      batched product keeps each batch's rows where they are;
    - ``baddbmm`` with ``beta`` 0 (its operands the two batches only): as ``bmm``; with
      something added, replicate where all three are, else None;
    - every operand replicate: replicate. Anything else: None."""
    if op == "baddbmm":  # beta * added + batch1 @ batch2: a bmm where nothing is added (beta 0)
        if len(placements) != 2:
            return "replicate" if placements and all(p == "replicate" for p in placements) else None
        op = "bmm"
    batched = batch_shard(op, placements, ndims)
    if batched is not None:
        return batched
    if op not in PRODUCTS or len(placements) < 2 or len(ndims) != len(placements) or None in placements:
        return None
    if all(p == "replicate" for p in placements):
        return "replicate"
    if op == "linear":
        (x, w), bias = placements[:2], placements[2] if len(placements) > 2 else None
        nx = ndims[0]
        if ndims[1] != 2 or nx < 1:
            return None
        dx, dw = _shard_dim(x), _shard_dim(w)
        if x == "replicate" and dw == 0 and bias in (None, "shard(0)"):
            return f"shard({nx - 1})"
        if dx == nx - 1 and dw == 1 and bias is None:
            return "partial"
        if dx is not None and dx < nx - 1 and w == "replicate" and bias in (None, "replicate"):
            return f"shard({dx})"
        if bias is None and {x, w} == {"partial", "replicate"}:
            return "partial"
        return None
    if len(placements) != 2:
        return None
    a, b = placements
    na, nb = ndims
    da, db = _shard_dim(a), _shard_dim(b)
    if op == "grouped_mm":
        if na != 2 or nb != 3:
            return None
        if a == "replicate" and db == 2:
            return "shard(1)"
        if da == 1 and db == 1:
            return "partial"
        return None
    if na < 2 or nb < 2:
        return None
    nout = max(na, nb)
    if a == "replicate" and db == nb - 1:
        return f"shard({nout - 1})"
    if da == na - 2 and b == "replicate":
        return f"shard({nout - 2})"
    if da == na - 1 and db == nb - 2:
        return "partial"
    if {a, b} == {"partial", "replicate"}:
        return "partial"
    return None
