"""CUDA-graph capture of a traced step, and what its replays make of the graph's fingerprints.

While a step is captured (tracer/cuda_graphs.py), every floating tensor the kernel can read is
deferred: its values exist only at replay. ``CaptureState`` is what the capture keeps besides an
eager step's state (which tensors the current bucket holds, the kernel tables to fill once the
capture has ended); at the capture's end the step's values become one static buffer that the
graph's own kernels rewrite at every replay (``CapturedFingerprints``), and each replay's copy of
it becomes records through a layout resolved once (``ReplayPlan``).
"""

from __future__ import annotations

import torch

from tensor_trace import schema
from tensor_trace.format.fingerprints import dense_order
from tensor_trace.tracer.fingerprint_records import f32_bytes as _f32_bytes, record as _record, repeat_rows as _repeat_rows

_F32 = torch.float32


class CaptureState:
    """What a step being captured keeps apart from an eager step's: the tensors held in the
    current bucket (``GRAPH_DEFER_BYTES`` of tracer/fingerprint.py), so that a second sighting
    becomes a repeat rather than a second hold, and the multi-tensor kernel tables to fill once
    the capture has ended."""

    __slots__ = ("_held", "_fills")

    def __init__(self):
        self._held: dict = {}  # id(tensor) -> (index, version) held in this bucket
        self._fills: list = []

    def new_bucket(self) -> None:
        """The held tensors were reduced (or the step reset): nothing is held any more."""
        self._held = {}

    def first_sighting(self, idx: int, t, version) -> int:
        """The index of ``t``'s first sighting in this bucket at the same version, or -1 (then
        ``t`` is held as index ``idx`` from now on). Held twice, a tensor would count twice
        against the bucket's bytes, and more buckets mean more kernels in every replay.
        (Eagerly the lookup is not worth its cost.)"""
        key = id(t)
        first = self._held.get(key)
        if first is not None and first[1] == version:
            return first[0]
        self._held[key] = (idx, version)
        return -1

    def add_fills(self, fills) -> None:
        """Kernel tables of this capture (tracer/multi_tensor.py), filled after it has ended."""
        self._fills += fills

    def end(self) -> None:
        """The capture has ended (finished or not): its tables now belong to its result."""
        self._fills = []
        self._held = {}

    def finish(self, blocks, dups, count) -> "CapturedFingerprints | None":
        """The captured step's values (``blocks``, reduced inside the graph), its repeats and
        its number of fingerprints, gathered into one static buffer by kernels of the graph
        (nothing runs now); None if it has no fingerprint."""
        indices, vals = [], []
        # Only the graph's device can be rewritten by replays: host-side values (a CPU
        # tensor among a captured step's inputs) would be the capture's, so they are left out.
        device = next((v.device for _, v, _ in blocks if type(v) is not list and v.is_cuda), None)
        # The static buffer holds (sum, l2 norm) rows, as a replay's copy expects.
        for idx, v, squared in blocks:
            if type(v) is list:
                if device is not None:
                    continue
                v = torch.tensor(v, dtype=_F32).view(-1, 2)
            elif device is not None and v.device != device:
                continue
            if squared:
                v = v.clone()
                v[:, 1].sqrt_()
            indices += idx
            vals.append(v if v.dtype == _F32 else v.to(_F32))
        static = torch.cat(vals) if len(vals) > 1 else (vals[0] if vals else None)
        captured = CapturedFingerprints(indices, static, list(dups), count, self._fills)
        return captured if (captured.indices or captured.dups) else None


class CapturedFingerprints:
    """What a captured step leaves for its replays: a static ``[n, 2]`` fp32 device buffer that
    the graph's own kernels rewrite at every replay, the fingerprint index of each row, and the
    fingerprints that repeat another (same tensor seen twice)."""

    __slots__ = ("indices", "static", "dups", "count", "fills", "plans")

    def __init__(self, indices, static, dups, count, fills=()):
        self.indices, self.static, self.dups, self.count = indices, static, dups, count
        self.fills = list(fills)  # multi-tensor kernel tables, filled once the capture has ended
        self.plans: dict = {}  # first fingerprint index of a replay -> ReplayPlan

    def plan(self, base: int) -> "ReplayPlan":
        """How a replay's buffer becomes records when its fingerprints start at ``base`` (the
        same at every replay of a graph in practice: built once)."""
        plan = self.plans.get(base)
        if plan is None:
            if len(self.plans) > 16:
                self.plans.clear()
            plan = self.plans[base] = ReplayPlan(base, self.indices, self.dups)
        return plan

    def prepare(self) -> None:
        """Fill the tables the graph's fingerprint kernels read (after ``capture_end``, before
        the first replay). The tables stay referenced here: every replay reads them."""
        for fill in self.fills:
            fill.run()

    def before_replay(self) -> None:
        """Make the replaying stream wait for the tables' copies (once; no host wait)."""
        for fill in self.fills:
            fill.before_replay()

    def read_at_replay(self, on: bool) -> None:
        """Whether the graph's fingerprint kernels read their tensors at the next replays
        (tracer/multi_tensor.py's ``ReplayGate``; the stacked part of a capture, where the
        kernel was missing or its arena full, always runs)."""
        for fill in self.fills:
            if fill.gate is not None:
                fill.gate.set(on)  # (a device write only when it changes)


class ReplayPlan:
    """A captured step's record layout, resolved once: every replay writes the same rows, so its
    records are the buffer's bytes, the repeats' rows gathered in one op, and index bytes
    computed here (Python per fingerprint at every replay cost about 0.4 ms of host time on the
    H200 for a Llama-8B-shaped step's 906 fingerprints)."""

    __slots__ = ("first", "idx_bytes", "rep_first", "rep_idx_bytes", "rep_rows", "dense_rows")

    def __init__(self, base: int, indices, dups):
        idx = [base + i for i in indices]
        dst, rows = _repeat_rows(idx, [(base + i, base + j) for i, j in dups])
        self.first = self.idx_bytes = self.rep_first = self.rep_idx_bytes = self.rep_rows = None
        self.dense_rows = None  # the buffer's rows in index order, repeats included (format 2)
        if idx:
            record = _record(0, idx, b"")
            self.first, self.idx_bytes = record[2], record[4]
        if dst:
            record = _record(0, dst, b"")
            self.rep_first, self.rep_idx_bytes = record[2], record[4]
            self.rep_rows = torch.tensor(rows, dtype=torch.long)
        order = dense_order(idx + dst) if dst or self.idx_bytes is not None else None
        if order is not None:
            src = list(range(len(idx))) + rows
            self.first = order[0]
            self.dense_rows = torch.tensor([src[k] for k in order[1]], dtype=torch.long)

    def records(self, step: int, host) -> list:
        """FINGERPRINTS records of one replay from its copied ``[n, 2]`` (sum, l2 norm) buffer."""
        if self.first is None:
            return []
        if host.is_inference():  # copied under inference_mode, collected outside it
            host = host.clone()
        host[:, 1].square_()
        if self.dense_rows is not None:
            return [(schema.FINGERPRINTS, step, self.first, _f32_bytes(host.index_select(0, self.dense_rows)), None)]
        out = [(schema.FINGERPRINTS, step, self.first, _f32_bytes(host), self.idx_bytes)]
        if self.rep_rows is not None:
            out.append((schema.FINGERPRINTS, step, self.rep_first,
                        _f32_bytes(host.index_select(0, self.rep_rows)), self.rep_idx_bytes))
        return out
