"""Attrs of lineage nodes that move dimensions around (indexing, transpose, squeeze...) and the
inputs of matrix products: what the placement rules (exporters/analysis/dataflow_ops.py) need to
carry a shard through them, read off the call's arguments and shapes alone (no values).

``dims``: for each input dimension, the output dimension it became, or -1 where it is gone
(indexed by an integer or a tensor, squeezed); ``part``: the input dimensions that were cut
(a partial slice, rows picked by an index, repeated elements): the output holds a selection of
them, not the whole. A call whose mapping is not worked out here (several tensor indices, a
boolean mask among others) gets no ``dims``: the rules then give no answer for a shard.
"""

from __future__ import annotations

import torch

# ops whose node records ``dims`` (and ``part``)
DIMS_OPS = frozenset(("getitem", "index_select", "transpose", "t", "permute", "movedim", "unsqueeze",
                      "squeeze", "repeat_interleave"))
# ops whose result is the same elements under another shape: the node keeps the result's shape
RESHAPES = frozenset(("view", "reshape", "flatten", "unflatten"))


def tracked() -> dict:
    """The ops that carry a parameter's split to what a module receives (an MoE's experts index
    their stacked weights, multiply and split the product inside one call), as lineage.py's
    ``_TRACKED`` entries: op -> (name, kind); kind "index" (one tensor in, ``dims``), "one"
    (dimension moves, ``dims``), "mm" (products, the operands' ``ndims``)."""
    T = torch.Tensor
    ops = [
        (T.__getitem__, "getitem", "index"), (torch.index_select, "index_select", "index"),
        (T.index_select, "index_select", "index"),
        (torch.transpose, "transpose", "one"), (T.transpose, "transpose", "one"), (torch.t, "t", "one"),
        (torch.swapaxes, "transpose", "one"), (T.swapaxes, "transpose", "one"),
        (torch.swapdims, "transpose", "one"), (T.swapdims, "transpose", "one"),
        (torch.movedim, "movedim", "one"), (T.movedim, "movedim", "one"),
        (torch.moveaxis, "movedim", "one"), (T.moveaxis, "movedim", "one"),
        (T.t, "t", "one"), (torch.permute, "permute", "one"), (T.permute, "permute", "one"),
        (torch.unsqueeze, "unsqueeze", "one"), (T.unsqueeze, "unsqueeze", "one"),
        (torch.squeeze, "squeeze", "one"), (T.squeeze, "squeeze", "one"),
        (torch.repeat_interleave, "repeat_interleave", "one"), (T.repeat_interleave, "repeat_interleave", "one"),
        (torch.nn.functional.linear, "linear", "mm"), (torch.matmul, "matmul", "mm"), (T.matmul, "matmul", "mm"),
        (T.__matmul__, "matmul", "mm"), (torch.bmm, "bmm", "mm"), (T.bmm, "bmm", "mm"), (torch.mm, "mm", "mm"),
        (T.mm, "mm", "mm"),
        # Megatron's core attention: baddbmm(buffer, q [b*np, sq, hn], k^T, beta=0, alpha=1/norm)
        (torch.baddbmm, "baddbmm", "mm"), (T.baddbmm, "baddbmm", "mm"),
    ]
    if hasattr(torch, "_grouped_mm"):  # what F.grouped_mm calls (transformers' grouped experts)
        ops.append((torch._grouped_mm, "grouped_mm", "mm"))
    return {f: (name, kind) for f, name, kind in ops}


def _norm(d, n):
    d = int(d)
    return d + n if d < 0 else d


class LazyDims:
    """A dimension move's attrs, worked out only for a node that is written (most lead nowhere
    recorded): what ``dims_attrs`` needs, no tensor (the index's, if any, is kept to the step's
    end). ``"into" in`` it is False, as for any attrs but a write's."""

    __slots__ = ("args",)

    def __init__(self, name, rest, kwargs, shape, out_ndim):
        self.args = (name, rest, kwargs, shape, out_ndim)

    def __contains__(self, key) -> bool:
        return False

    def resolve(self) -> dict | None:
        return dims_attrs(*self.args)


def dims_attrs(name, rest, kwargs, shape, out_ndim) -> dict | None:
    """``{"dims": [...], "part": [...]}`` of a call of ``name`` on a tensor of ``shape`` with
    the further arguments ``rest`` and ``kwargs``, whose result has ``out_ndim`` dims, or None
    where it cannot be told (the rules then keep only whole placements)."""
    n = len(shape)
    try:
        if name == "getitem":
            got = _index_dims(shape, rest[0] if rest else None)
            if got is not None and got[2] != out_ndim:
                return None  # an index form read wrongly: no dims rather than wrong ones
            got = got and got[:2]
        elif name == "index_select":
            d = _norm(rest[0] if rest else kwargs["dim"], n)
            got = list(range(n)), [d]
        elif name == "transpose":
            d0 = _norm(rest[0] if rest else kwargs["dim0"], n)
            d1 = _norm(rest[1] if len(rest) > 1 else kwargs["dim1"], n)
            dims = list(range(n))
            dims[d0], dims[d1] = d1, d0
            got = dims, []
        elif name == "t":
            got = (list(range(n))[::-1], [])
        elif name == "permute":
            perm = rest if rest else kwargs["dims"]
            if len(perm) == 1 and isinstance(perm[0], (tuple, list, torch.Size)):
                perm = perm[0]
            dims = [-1] * n
            for j, d in enumerate(perm):
                dims[_norm(d, n)] = j
            got = dims, []
        elif name == "movedim":
            src = rest[0] if rest else kwargs["source"]
            dst = rest[1] if len(rest) > 1 else kwargs["destination"]
            src = [_norm(x, n) for x in (src if isinstance(src, (tuple, list)) else [src])]
            dst = [_norm(x, n) for x in (dst if isinstance(dst, (tuple, list)) else [dst])]
            if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
                return None
            dims = [-1] * n
            for a, b in zip(src, dst):
                dims[a] = b
            taken = set(dst)
            free = iter(j for j in range(n) if j not in taken)  # the others keep their order
            for i in range(n):
                if dims[i] < 0:
                    dims[i] = next(free)
            got = dims, []
        elif name == "unsqueeze":
            d = _norm(rest[0] if rest else kwargs["dim"], n + 1)
            got = [i if i < d else i + 1 for i in range(n)], []
        elif name == "squeeze":
            spec = rest[0] if rest else kwargs.get("dim")
            if spec is None:
                which = set(range(n))
            elif isinstance(spec, (tuple, list)):
                which = {_norm(d, n) for d in spec}
            else:
                which = {_norm(spec, n)}
            gone = {d for d in which if shape[d] == 1}
            dims, k = [], 0
            for i in range(n):
                if i in gone:
                    dims.append(-1)
                else:
                    dims.append(k)
                    k += 1
            got = dims, []
        elif name == "repeat_interleave":
            d = rest[1] if len(rest) > 1 else kwargs.get("dim")
            if d is None:
                return None  # flattened first
            got = list(range(n)), [_norm(d, n)]
        else:
            return None
    except Exception:
        return None  # an argument form not read here: no dims, never wrong ones
    if got is None:
        return None
    dims, part = got
    if any(d >= out_ndim for d in dims):
        return None
    return {"dims": dims, "part": sorted(set(part))} if part else {"dims": dims}


def _index_dims(shape, index):
    """(dims, part, output ndim) of ``t[index]``: integers, slices, None and Ellipsis, with at most one
    tensor (or list) index and no integer beside it (where PyTorch's placement of the indexed
    dimensions is plain: in place of the one it indexes); None otherwise."""
    items = index if isinstance(index, tuple) else (index,)
    n = len(shape)
    adv = [it for it in items if isinstance(it, (torch.Tensor, list))]
    ints = [it for it in items if isinstance(it, int) and not isinstance(it, bool)]
    if len(adv) > 1 or (adv and ints):
        return None
    used = 0
    for it in items:
        if it is None or it is Ellipsis:
            continue
        if isinstance(it, torch.Tensor) and it.dtype == torch.bool:
            if it.dim() != 1:
                return None
            used += 1
        elif isinstance(it, (int, slice, torch.Tensor, list)) and not isinstance(it, bool):
            used += 1
        else:
            return None
    if sum(1 for it in items if it is Ellipsis) > 1 or used > n:
        return None
    dims, part = [-1] * n, []
    i = o = 0  # input dimension, output dimension
    for it in items:
        if it is None:
            o += 1
        elif it is Ellipsis:
            for _ in range(n - used):
                dims[i] = o
                i += 1
                o += 1
        elif isinstance(it, slice):
            if not _whole(it, shape[i]):
                part.append(i)
            dims[i] = o
            i += 1
            o += 1
        elif isinstance(it, int):
            i += 1  # gone
        else:  # the one tensor index: its dimensions take the indexed one's place
            k = 1 if isinstance(it, list) or it.dtype == torch.bool else it.dim()
            if k == 1:
                dims[i] = o
                part.append(i)
            i += 1
            o += k
    while i < n:
        dims[i] = o
        i += 1
        o += 1
    return dims, part, o


def _whole(s: slice, size: int) -> bool:
    start, stop, step = s.start, s.stop, s.step
    return (start is None or start == 0) and (stop is None or (isinstance(stop, int) and stop >= size)) \
        and (step is None or step == 1)


def mm_inputs(name, args, kwargs) -> list:
    """The tensor operands of a matrix product, in order: ``linear``'s input, weight and bias;
    ``baddbmm``'s two batches, then what it adds unless ``beta`` is 0 (a buffer whose values
    do not count); the two matrices of the others (``_grouped_mm``'s offsets are not data)."""
    if name == "baddbmm":
        added = args[0] if args else kwargs.get("input")
        b1 = args[1] if len(args) > 1 else kwargs.get("batch1")
        b2 = args[2] if len(args) > 2 else kwargs.get("batch2")
        beta = args[3] if len(args) > 3 else kwargs.get("beta", 1)
        return [b1, b2] + ([] if isinstance(beta, (int, float)) and beta == 0 else [added])
    if name == "linear":
        x = args[0] if args else kwargs.get("input")
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        return [x, w] + ([b] if b is not None else [])
    a = args[0] if args else kwargs.get("input", kwargs.get("mat_a", kwargs.get("self")))
    b = args[1] if len(args) > 1 else kwargs.get("mat2", kwargs.get("mat_b", kwargs.get("other")))
    return [a, b]


def asked_shape(name, args, kwargs):
    """The sizes a ``view`` / ``reshape`` was asked for, where one of them is -1 (the dim the
    rest of the elements go to: across ranks, the one that holds the ranks' parts), else None."""
    if name == "flatten":
        return None
    if name == "unflatten":  # unflatten(x, dim, sizes): the asked sizes in place of dim
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        part = args[2] if len(args) > 2 else kwargs.get("sizes")
        if not isinstance(dim, int) or not isinstance(part, (tuple, list, torch.Size)):
            return None
        dim = _norm(dim, x.dim())
        sizes = list(x.shape[:dim]) + list(part) + list(x.shape[dim + 1:])
    else:
        sizes = args[1:] if len(args) > 1 else kwargs.get("shape") or kwargs.get("size") or ()
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = sizes[0]
    if not sizes or not all(isinstance(n, int) for n in sizes) or -1 not in sizes:
        return None
    return [int(n) for n in sizes]
