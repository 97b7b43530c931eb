"""FINGERPRINTS records of finished steps: their values on the way to the host, then the bytes.

A step's blocks of values (device tensors, or host floats) are copied to pinned host memory
without waiting (``to_host``); ``PendingCopies`` keeps each step until its copies' events have
completed and then makes its records: one record per step in index order where the values and
their repeats cover a run of indices (format 2: 8 bytes a value), else the values and the repeats
apart, with their indices (``step_records``).
"""

from __future__ import annotations

import array
import ctypes
import struct
import sys

import torch

from tensor_trace import schema
from tensor_trace.format.fingerprints import (dense_values, nonfinite_record_values, pack_host_values,
                                              wide_record_values)

_F32 = torch.float32


class PendingCopies:
    """The finished steps whose values are being copied to the host (tracer/fingerprint.py's
    ``StepFingerprints`` hands each step over at its end), until ``collect`` turns them into
    records. Nothing here waits unless ``collect(wait=True)``."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending: list = []  # (step, blocks, dups) waiting for their copies to finish; public: the step end skips
        # an empty collect() by reading it (tracer/steps.py)

    def add_step(self, step: int, blocks, dups, nonfinite=None) -> None:
        """Start the copies of a step's ``blocks`` ((indices, values, squared) each); ``dups``
        are its repeats, (index, index it repeats); ``nonfinite`` its values' entries of a
        NONFINITE_FINGERPRINTS record (made now: nothing to copy)."""
        out = [to_host(idx, vals, squared) for idx, vals, squared in blocks]
        if out or dups:
            self.pending.append((step, out, dups))
        if nonfinite:
            self.pending.append((step, READY, nonfinite_record(step, nonfinite, dups)))

    def add_replay(self, step: int, base: int, captured) -> None:
        """A replay of ``captured`` (tracer/fingerprint_capture.py's ``CapturedFingerprints``):
        copy its static buffer without waiting, as fingerprints ``base + i`` of ``step``."""
        static = captured.static
        if static is None:
            return
        # A CPU buffer is rewritten by the next "replay": copy it (a CUDA one is copied anyway).
        _, host, event, _ = to_host(None, static if static.is_cuda else static.clone(), False)
        self.pending.append((step, None, (captured.plan(base), host, event)))

    def adopt(self, other: "PendingCopies") -> None:
        """Take ``other``'s steps: they are collected with this one's next ones."""
        self.pending.extend(other.pending)
        other.pending = []

    def collect(self, wait: bool = False) -> list:
        """Return FINGERPRINTS records whose copies have completed (all of them if ``wait``)."""
        records = []
        keep = []
        for step, blocks, dups in self.pending:
            if blocks is READY:
                records.append(dups)
                continue
            if blocks is None:  # a replay: (plan, host buffer, event)
                plan, host, event = dups
                if event is not None and not event.query():
                    if not wait:
                        keep.append((step, blocks, dups))
                        continue
                    event.synchronize()
                records += plan.records(step, host)
                continue
            if not wait and any(ev is not None and not ev.query() for _, _, ev, _ in blocks):
                keep.append((step, blocks, dups))
                continue
            # One record per step, whatever the blocks, and one more for the repeats: each block
            # becomes bytes at once (host values packed, tensors copied out), no Python per value.
            idx_all: list = []
            datas = []
            wide = None
            for idx, host, event, squared in blocks:
                if event is not None and wait:
                    event.synchronize()
                idx_all += idx
                if type(host) is list:  # (sum, sum of squares) already
                    try:
                        datas.append(struct.pack(f"<{len(host)}f", *host))
                    except OverflowError:  # sums past float32's range (a mask of finfo.min)
                        data, at = pack_host_values(host)
                        datas.append(data)
                        wide = (wide or []) + [(idx[k], s, q) for k, s, q in at]
                    continue
                if host.dtype != _F32:
                    host = host.to(_F32)
                if not squared:  # our own copy: the l2 norm becomes the sum of squares in place
                    if host.is_inference():  # made under inference_mode, collected outside it
                        host = host.clone()
                    host[:, 1].square_()
                datas.append(f32_bytes(host))
            if not idx_all:
                continue
            data = datas[0] if len(datas) == 1 else b"".join(datas)
            records += step_records(step, idx_all, data, dups)
            if wide:
                records.append(wide_record(step, wide, dups))
        self.pending = keep
        return records


def step_records(step, idx_all, data, dups) -> list:
    """A step's FINGERPRINTS records: its values and repeats in index order as one record
    without indices where they cover a run of indices (format 2: 8 bytes a value, not 12),
    else the values and the repeats apart, with their indices."""
    dst, repeated = repeats(idx_all, dups, data)
    if not dst and idx_all[-1] - idx_all[0] == len(idx_all) - 1 and idx_all == list(
            range(idx_all[0], idx_all[0] + len(idx_all))):
        return [(schema.FINGERPRINTS, step, idx_all[0], data, None)]  # in order already
    dense = dense_values(idx_all + dst, data + repeated)
    if dense is not None:
        return [(schema.FINGERPRINTS, step, dense[0], dense[1], None)]
    records = [record(step, idx_all, data)]
    if dst:
        records.append(record(step, dst, repeated))
    return records


READY = "ready"  # a pending entry that is a record already (PendingCopies.add_step's nonfinite)


def nonfinite_record(step, entries, dups) -> tuple:
    """The NONFINITE_FINGERPRINTS record of a step's values that are not finite, with the
    repeats of their tensors."""
    by_index = {e[0]: e[1:] for e in entries}
    for i, src in dups or ():
        if src in by_index and i not in by_index:
            by_index[i] = by_index[src]
    return (schema.NONFINITE_FINGERPRINTS, step, nonfinite_record_values((i, *rest) for i, rest in by_index.items()))


def wide_record(step, wide, dups) -> tuple:
    """The WIDE_FINGERPRINTS record of a step's values past float32's range (index, sum, sumsq),
    with the repeats of their tensors."""
    by_index = {i: (s, q) for i, s, q in wide}
    for i, src in dups or ():
        if src in by_index and i not in by_index:
            by_index[i] = by_index[src]
    return (schema.WIDE_FINGERPRINTS, step, wide_record_values((i, s, q) for i, (s, q) in by_index.items()))


def repeats(idx_all, dups, data) -> tuple:
    """(indices, values): each repeat whose source has a value, and that value's 8 bytes from
    ``data`` (rows in ``idx_all`` order); a repeat of a stale or missing value is left out."""
    dst, rows = repeat_rows(idx_all, dups)
    return dst, b"".join([data[8 * r:8 * r + 8] for r in rows])


def repeat_rows(idx_all, dups) -> tuple:
    """(indices, rows): each repeat whose source has a value, and the row of that value in
    ``idx_all`` order."""
    dst, rows = [], []
    if dups:
        get = dict(zip(idx_all, range(len(idx_all)))).get
        alias = None
        for i, src in dups:
            r = get(src)
            if r is None:
                # A repeat of a repeat: under capture, the flush turns a tensor held twice into a
                # repeat of its first row, after hooks made repeats of that second sighting.
                if alias is None:
                    alias = dict(dups)
                for _ in range(len(alias)):
                    src = alias.get(src)
                    if src is None:
                        break
                    r = get(src)
                    if r is not None:
                        break
            if r is not None:
                dst.append(i)
                rows.append(r)
    return dst, rows


def f32_bytes(values) -> bytes:
    """The little-endian float32 bytes of a contiguous fp32 CPU tensor."""
    values = values.contiguous()
    if _LITTLE:
        return ctypes.string_at(values.data_ptr(), values.numel() * 4)
    flat = values.view(-1).tolist()
    return struct.pack(f"<{len(flat)}f", *flat)


_LITTLE = sys.byteorder == "little"


def to_host(idx, vals, squared) -> tuple:
    """(indices, host values, event or None, squared): a device block is copied to pinned memory
    without waiting; its event says when the copy is done."""
    if type(vals) is list or not vals.is_cuda:
        return (idx, vals, None, squared)
    host = torch.empty(vals.shape, dtype=_F32, pin_memory=True)
    host.copy_(vals, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return (idx, host, event, squared)


def record(step, idx, data) -> tuple:
    """One FINGERPRINTS record of ``data`` (8 bytes a value) for indices ``idx``: none stored
    where they are a run."""
    first = idx[0]
    if idx[-1] - first == len(idx) - 1 and idx == list(range(first, first + len(idx))):
        indices = None  # first, first + 1, ...: implied
    elif _U32_ARRAY:
        indices = array.array("I", idx).tobytes()
    else:
        indices = struct.pack(f"<{len(idx)}I", *idx)
    return (schema.FINGERPRINTS, step, first, data, indices)


_U32_ARRAY = array.array("I").itemsize == 4 and sys.byteorder == "little"
