"""How a step's held values are reduced: the flush of its deferred tensors into blocks of
values, the immediate values of one tensor, and the AsyncCollectiveTensors whose values come
later. tracer/fingerprint.py's ``StepFingerprints`` holds what its hooks add; what is here is
handed those holdings when they are reduced.

A block is ``(indices, values, squared)``: values a ``[k, 2]`` tensor of (sum, l2 norm), or of
(sum, sum of squares) when ``squared``; or a flat list of (sum, sum of squares) computed on the
host.
"""

from __future__ import annotations

import torch

from tensor_trace.tracer import host_values, kinds, multi_tensor

_F32 = torch.float32
_sum = torch.sum
_norm = torch.linalg.vector_norm
_NAN = float("nan")


def reduce_held(indices, versions, ts, capturing: bool) -> tuple:
    """(blocks, dups, fills, stale) of the deferred tensors ``ts`` (None: materialised since),
    held as fingerprints ``indices`` at ``versions`` (None: an inference tensor): their blocks
    of values, the repeats found among them under capture, the kernel tables a capture fills
    once it has ended, and how many were updated in place since they were held (no value)."""
    # One pass over the held tensors: stale ones (updated in place since they were seen) are
    # dropped, the rest sorted by how they are reduced. (Eagerly, a tensor seen again, not
    # right after it was added, is held twice and reduced twice: cheaper than finding it in
    # every hook. Under capture it becomes a repeat: replays are what must stay cheap.)
    # Where Triton is available (tracer/multi_tensor.py), tensors it can read where they are
    # (contiguous, or rows of a fused projection's split) go into one table per dtype and
    # device: one kernel launch each, eagerly. Otherwise tensors of one shape and dtype are
    # stacked (one copy) and reduced along the stacked dimension (two kernels): a decode
    # step has a handful of distinct shapes.
    blocks: list = []
    dups: list = []
    fills: list = []
    stale = 0
    tables: dict = {}  # eager: (dtype, device index) -> (indices, flat table, device)
    in_place: dict = {}  # capturing: (dtype, device) -> (indices, tensors, row layouts)
    groups: dict = {}  # stacked: (shape, dtype, device) -> (indices, tensors)
    first: dict = {}  # capturing: id(tensor) -> (index, version) of its first row
    usable = None
    kernel_dtypes = multi_tensor.DTYPES
    row_layout = multi_tensor.row_layout
    max_numel = multi_tensor.MAX_NUMEL
    # The eager table being filled, for the (dtype, device) of the tensor before: a step's
    # tensors are mostly of one dtype on one device, so this is one test per tensor.
    cur_dtype = cur_dev = cur_idx = cur_table = None
    for index, version, t in zip(indices, versions, ts):
        if t is None:
            continue
        if version is not None and t._version != version:
            stale += 1  # updated in place since it was seen: no honest value left
            continue
        dtype = t.dtype
        if not capturing:
            dev = t.get_device()
            if dtype is not cur_dtype or dev != cur_dev:
                if usable is None:
                    usable = multi_tensor.usable(t)
                entry = tables.get((dtype, dev)) if usable and dtype in kernel_dtypes else None
                if entry is None and usable and dtype in kernel_dtypes:
                    tables[(dtype, dev)] = entry = ([], [], t.device)
                if entry is None:
                    cur_dtype = cur_dev = None
                else:
                    cur_dtype, cur_dev, cur_idx, cur_table = dtype, dev, entry[0], entry[1]
            if cur_dtype is not None:
                n = t.numel()
                if t.is_contiguous():
                    cur_table += (t.data_ptr(), n, n, n)
                    cur_idx.append(index)
                    continue
                layout = row_layout(t)
                if layout is not None:
                    cur_table += (t.data_ptr(), n, layout[0], layout[1])
                    cur_idx.append(index)
                    continue
        else:
            # Under capture every row is kernel work at every replay: a tensor seen again
            # later in the step (held twice) is a repeat of its first row instead.
            seen = first.get(id(t))
            if seen is not None and seen[1] == version:
                dups.append((index, seen[0]))
                continue
            first[id(t)] = (index, version)
            if usable is None:
                usable = multi_tensor.usable(t)
            if usable and dtype in kernel_dtypes and t.numel() < max_numel:
                layout = None if t.is_contiguous() else row_layout(t)
                if layout is not None or t.is_contiguous():
                    gkey = (dtype, t.device)
                    entry = in_place.get(gkey)
                    if entry is None:
                        in_place[gkey] = entry = ([], [], [])
                    entry[0].append(index)
                    entry[1].append(t)
                    entry[2].append(layout)
                    continue
        gkey = (t.shape, dtype, t.device)
        entry = groups.get(gkey)
        if entry is None:
            groups[gkey] = entry = ([], [])
        entry[0].append(index)
        entry[1].append(t)
    for (dtype, _), (idx, table, device) in tables.items():
        if idx:
            values = multi_tensor.sum_sumsq_table(table, len(idx), max(table[1::4]), dtype, device)
            blocks.append((idx, values, True))
    for idx, group, layouts in in_place.values():
        res = multi_tensor.sum_l2(group, capturing=capturing, layouts=layouts)
        if res is None:  # no room for its table in this capture: stack these
            for index, t in zip(idx, group):
                entry = groups.setdefault((t.shape, t.dtype, t.device), ([], []))
                entry[0].append(index)
                entry[1].append(t)
            continue
        order, values, fill = res
        if fill is not None:
            fills.append(fill)
        blocks.append((idx if type(order) is range else [idx[i] for i in order], values, False))
    for idx, group in groups.values():
        # (explicit sizes: a view of zero-size tensors cannot infer a -1)
        flat = torch.stack(group).view(len(group), group[0].numel())
        sums = torch.sum(flat, dim=1, dtype=_F32)
        l2 = _norm(flat, dim=1, dtype=_F32)
        blocks.append((idx, torch.stack((sums, l2), dim=1), False))
    return blocks, dups, fills, stale


def device_blocks(imm_idx, imm_vals) -> list:
    """Blocks of immediate values reduced on their devices (``imm_vals``: (sum, l2 norm) 0-d
    tensors, or (sum, None)), one per device: stacked there, not copied one by one."""
    by_device: dict = {}
    for index, (s, q) in zip(imm_idx, imm_vals):
        idx, items = by_device.setdefault(s.device, ([], []))
        idx.append(index)
        items.append(s)
        items.append(q if q is not None else s.new_full((), _NAN))
    return [(idx, torch.stack(items).view(-1, 2), False) for idx, items in by_device.values()]


class AwaitedValues:
    """The step's AsyncCollectiveTensors (tracer/kinds.py) whose collective had not completed
    when they were seen: each is read at a flush once the program has waited on it, if it was
    not updated in place since."""

    __slots__ = ("_acts",)

    def __init__(self):
        self._acts: list = []  # (index, AsyncCollectiveTensor, its elem's version then)

    def hold(self, idx: int, act) -> None:
        """Fingerprint ``idx`` is ``act``'s value, read once the program has waited on it."""
        elem = getattr(act, "elem", None)
        version = None if elem is None or elem.is_inference() else elem._version
        self._acts.append((idx, act, version))

    def take(self, final: bool) -> tuple:
        """(ready, stale): ``ready`` lists (index, kind, data) of those the program has waited
        on (``kinds.FULL``: reduce ``data``; else ``data``'s sum only); ``stale`` counts those
        updated in place since they were seen. The others are kept for the next flush, or, at
        the step's end (``final``), get none. Nothing waits here."""
        acts, self._acts = self._acts, []
        ready = []
        stale = 0
        pending = not kinds.no_work_pending()
        for idx, act, version in acts:
            kind, data = kinds.waited(act, not pending)
            if kind == kinds.NONE:
                if not final:
                    self._acts.append((idx, act, version))
                continue
            if version is not None and act.elem._version != version:
                stale += 1
                continue
            ready.append((idx, kind, data))
        return ready, stale


class HeldIndex:
    """Where each held deferred tensor is among the step's held ones, by id: built only when a
    collective asks to reduce some at once (``StepFingerprints.materialize``), and then only for
    the tensors held since it last asked."""

    __slots__ = ("_pos", "_indexed")

    def __init__(self):
        self._pos: dict = {}  # id(tensor) -> its positions in the held tensors
        self._indexed = 0  # positions already in _pos

    def update(self, ts) -> None:
        """Index the tensors of ``ts`` (the held ones, None where materialised) added since."""
        k = self._indexed
        if k < len(ts):
            pos = self._pos
            for j in range(k, len(ts)):
                t = ts[j]
                if t is not None:
                    pos.setdefault(id(t), []).append(j)
            self._indexed = len(ts)

    def pop(self, t):
        """The positions of ``t`` among the held tensors (forgotten here)."""
        return self._pos.pop(id(t), ())


def pair(t, host: bool = True):
    """(sum, l2 norm) of ``t`` as 0-d fp32 tensors on its device (l2 None for bool tensors), or
    (sum, sum of squares) as Python floats when computed on the host (``host_pair``)."""
    if host and t.is_cpu and t.dtype in HOST_DTYPES and not t.requires_grad:
        vals = host_pair(t)
        if vals is not None:
            return vals
    if t.is_floating_point():  # (complex ones come as their real view: tracer/kinds.py)
        return (_sum(t, dtype=_F32), _norm(t, dtype=_F32))
    if t.dtype is torch.bool:
        return (_sum(t, dtype=_F32), None)
    # Integer tensors (token ids, positions) sum exactly in fp32 only up to 2**24: good enough
    # to tell ranks apart.
    f = t.to(_F32)
    return (f.sum(), _norm(f))


HOST_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)
# (sum, sum of squares) of a CPU tensor as Python floats, through numpy on its memory, or None
# (tracer/host_values.py). Two torch reductions from Python cost about 7 us on a CPU
# (``vector_norm`` alone about 4); two BLAS calls over the same flat buffer cost about 1 us, and
# give floats at once, so the step end has no 0-d tensors to stack.
host_pair = host_values.pair
