"""Where a write into a tensor lands, read off storage offsets, sizes and strides (no values):
the regions tracer/lineage.py records for copies into slices of a buffer. A geometry is
``(storage offset, sizes, strides)``; a region of a tensor is ``(at, len)``, start and extent
per dim of that tensor."""

from __future__ import annotations

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose storage offsets mean what they say


def _basic_key(key) -> bool:
    """An index made of ints, plain slices, ``...`` and ``None`` only: it selects a view."""
    for k in key if type(key) is tuple else (key,):
        if k is None or k is Ellipsis or type(k) is int:
            continue
        if type(k) is slice and all(v is None or type(v) is int for v in (k.start, k.stop, k.step)):
            continue
        return False
    return True


def _geom(t) -> tuple:
    return t.storage_offset(), tuple(t.shape), t.stride()


def written(name, dst, args, kwargs):
    """Where a write into ``dst`` lands in its storage: (offset, sizes, strides), or None where
    it is not a view's box or would need reading a device tensor (an index on the GPU: a sync,
    and not possible inside a CUDA graph capture)."""
    if name == "copy_":
        return _geom(dst)
    if name == "setitem":
        key = args[1]
        return _geom(dst[key]) if _basic_key(key) else None
    # index_copy_: a short, consecutive index on the CPU only
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    index = args[2] if len(args) > 2 else kwargs.get("index")
    if (type(dim) is not int or not isinstance(index, torch.Tensor) or index.device.type != "cpu"
            or index.dim() > 1 or not 0 < index.numel() <= 1 << 20 or index.is_floating_point()):
        return None
    index = index.reshape(-1)
    if index.numel() > 1 and not bool((index.diff() == 1).all()):
        return None  # not one consecutive run: no box
    return _geom(dst.narrow(dim, int(index[0]), index.numel()))


def scatter_region(name, base, args, kwargs, src):
    """(at, len) of what ``slice_scatter`` / ``select_scatter`` / ``index_copy`` replace in
    ``base``, or None."""
    nd = base.dim()
    if name == "index_copy":
        geom = written(name, base, args, kwargs)
        return None if geom is None else box(geom, _geom(base))
    a = list(args[2:])
    dim = a[0] if a else kwargs.get("dim", 0)
    if type(dim) is not int or not -nd <= dim < nd:
        return None
    dim %= nd
    size = base.shape[dim]
    at, ln = [0] * nd, list(base.shape)
    if name == "select_scatter":
        i = a[1] if len(a) > 1 else kwargs.get("index")
        if type(i) is not int:
            return None
        at[dim], ln[dim] = i % size, 1
        return at, ln
    start = a[1] if len(a) > 1 else kwargs.get("start")
    step = a[3] if len(a) > 3 else kwargs.get("step", 1)
    start = 0 if start is None else start
    if type(start) is not int or step not in (None, 1) or src.dim() != nd:
        return None
    at[dim], ln[dim] = (start + size if start < 0 else start), src.shape[dim]
    return at, ln


def _span(geom) -> tuple:
    """First and last storage element a (offset, sizes, strides) view covers."""
    off, shape, stride = geom
    lo = hi = off
    for n, st in zip(shape, stride):
        if n == 0:
            return off, off - 1
        if st >= 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return lo, hi


def disjoint(a, b) -> bool:
    (alo, ahi), (blo, bhi) = _span(a), _span(b)
    return ahi < blo or bhi < alo or ahi < alo


def box(view, base):
    """Where ``view`` lies in ``base`` (both (offset, sizes, strides) in one storage): start
    and extent per dim of ``base``, from offsets and strides (no values read), cut to ``base``
    where it reaches past its end (a write over all rows of a buffer that ``base`` takes the
    first rows of); None if it is not a box starting inside it (a stepped slice, a transposed
    view)."""
    voff, vshape, vstride = view
    boff, bshape, bstride = base
    nd = len(bshape)
    free = {}
    for d in range(nd):
        if bshape[d] > 1:
            if bstride[d] <= 0 or bstride[d] in free:
                return None
            free[bstride[d]] = d
    ln = [1] * nd
    for n, st in zip(vshape, vstride):
        if n == 1:
            continue
        d = free.get(st)
        if d is None or ln[d] != 1:
            return None
        ln[d] = n
    off = voff - boff
    if off < 0:
        return None
    at = [0] * nd
    for st in sorted(free, reverse=True):
        d = free[st]
        at[d], off = divmod(off, st)
    if off or any(at[d] >= max(bshape[d], 1) for d in range(nd)):
        return None
    return at, [min(ln[d], bshape[d] - at[d]) for d in range(nd)]
