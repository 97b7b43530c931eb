"""Fingerprints: two fp32 numbers per tensor, (sum, sum of squares).

Both are invariant under reshape and view, and sums are additive, so the merge can recognise the
same values on another rank, behind a reshape, and partial sums that add up to a reduction's
output. Each is computed on the tensor's own device, at the moment the hook sees the tensor (so a
later in-place update cannot change it: the kernels are stream-ordered), and kept as 0-d device
tensors. Nothing is copied to the host inside a step: at the end of a step the values are stacked
once per device and copied with ``non_blocking=True`` into pinned memory; the copy is collected
once its CUDA event has completed (at a later step or a flush), so no hook ever synchronises.

The same tensor seen twice in a step (a module's output that is the next module's input) is
computed once: the cache key is the tensor object (through a weak reference, so a freed tensor
whose id is reused is not mistaken for it) and its version counter (bumped by in-place updates).
"""

from __future__ import annotations

import struct
import weakref

import torch

from tensor_trace import schema

_F32 = torch.float32
_sum = torch.sum
_norm = torch.linalg.vector_norm
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled


class StepFingerprints:
    """Fingerprints of one process's current step, indexed in recording order."""

    def __init__(self):
        self.count = 0
        self._values: list = []  # per index: (sum, l2) 0-d tensors, or None when not computable
        self._seen: dict[int, tuple] = {}
        self._pending: list = []  # (step, device payloads) waiting for their copies to finish

    def reset(self) -> None:
        self.count = 0
        self._values = []
        self._seen = {}

    def add(self, tensors, store: bool = True) -> int:
        """Fingerprint ``tensors``; return the index of the first.

        ``store`` says whether later calls may reuse these values: true for module outputs,
        false for inputs that the module is about to receive (it may update them in place).
        Tensors created under ``inference_mode`` have no version counter, so their cached
        value is reused at most once (an output reused as the next module's input).
        """
        grad = _grad_enabled()
        if grad:  # never build autograd graphs (they would keep activations alive)
            _set_grad(False)
        try:
            return self._add(tensors, store)
        finally:
            if grad:
                _set_grad(True)

    def _add(self, tensors, store: bool) -> int:
        base = self.count
        values = self._values
        seen = self._seen
        for t in tensors:
            key = id(t)
            tracked = not t.is_inference()
            hit = seen.get(key)
            if hit is not None and hit[0]() is t and (not tracked or hit[1] == t._version):
                values.append(hit[2])
                if not tracked:
                    del seen[key]
                continue
            if t.is_floating_point() or t.is_complex():
                pair = (_sum(t, dtype=_F32), _norm(t, dtype=_F32))
            elif t.dtype is torch.bool:
                pair = (_sum(t, dtype=_F32), None)
            else:
                # Integer tensors (token ids, positions) sum exactly in fp32 only up to 2**24:
                # good enough to tell ranks apart.
                f = t.to(_F32)
                pair = (f.sum(), _norm(f))
            values.append(pair)
            if store or tracked:
                try:
                    seen[key] = (weakref.ref(t), t._version if tracked else None, pair)
                except TypeError:
                    pass
        self.count = len(values)
        return base

    def forget(self, tensors) -> None:
        """Drop cached values of tensors that were just updated in place (e.g. by a collective)."""
        seen = self._seen
        for t in tensors:
            seen.pop(id(t), None)

    def finish_step(self, step: int) -> None:
        """Start the device-to-host copy of this step's values; no synchronisation."""
        if not self._values:
            self.reset()
            return
        by_device: dict = {}
        for index, pair in enumerate(self._values):
            s, q = pair
            dev = s.device
            by_device.setdefault(dev, ([], []))
            idx, items = by_device[dev]
            idx.append(index)
            items.append(s)
            items.append(q if q is not None else s.new_full((), float("nan")))
        payloads = []
        for dev, (idx, items) in by_device.items():
            stacked = torch.stack(items).view(-1, 2)
            if dev.type == "cuda":
                host = torch.empty(stacked.shape, dtype=_F32, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                payloads.append((idx, host, event))
            else:
                payloads.append((idx, stacked, None))
        self._pending.append((step, payloads))
        self.reset()

    def collect(self, wait: bool = False) -> list:
        """Return FINGERPRINTS records whose copies have completed (all of them if ``wait``)."""
        records = []
        keep = []
        for step, payloads in self._pending:
            if not wait and any(ev is not None and not ev.query() for _, _, ev in payloads):
                keep.append((step, payloads))
                continue
            for idx, host, event in payloads:
                if event is not None and wait:
                    event.synchronize()
                values = host.clone()
                values[:, 1].square_()  # the l2 norm becomes the sum of squares
                data = values.numpy().astype("<f4", copy=False).tobytes()
                contiguous = idx[-1] - idx[0] + 1 == len(idx)
                indices = None if contiguous else _pack_indices(idx)
                records.append((schema.FINGERPRINTS, step, idx[0], data, indices))
        self._pending = keep
        return records


def _pack_indices(idx: list) -> bytes:
    return struct.pack(f"<{len(idx)}I", *idx)
