"""Fingerprints: two fp32 numbers per tensor, (sum, sum of squares).

Both are invariant under reshape and view, and sums are additive, so the merge can recognise the
same values on another rank, behind a reshape, and partial sums that add up to a reduction's
output. Nothing is copied to the host inside a step: values stay on the tensor's device until
the end of the step, are stacked there, and copied with ``non_blocking=True`` into pinned memory;
the copy is collected once its CUDA event has completed (at a later step or at stop). So no hook
synchronises the device.

Two ways to compute them:

- *Immediate* (CPU tensors, integer tensors, large CUDA tensors): computed when the hook sees
  the tensor, so the values are those of that moment, whatever happens to the tensor later, and
  no tensor is held. A CPU tensor numpy can read gets two BLAS reductions (its sum against
  ones, a dot with itself; tracer/host_values.py) as Python floats; anything else one ``sum``
  and one ``vector_norm`` on its device.
- *Deferred* (floating CUDA tensors of up to ``DEFER_MAX_NUMEL`` elements): the tensor is
  kept until the end of the step (or until ``DEFER_BYTES`` are held); then one Triton kernel
  launch per dtype reads them all where they are (``tracer/multi_tensor.py``), and the rest
  (other views, no Triton) are stacked by shape and reduced together: a few launches per step
  instead of two per tensor (a launch from Python costs 10 to 30 microseconds of host time). The value is the tensor's value at the
  end of the step. The tracer materialises a deferred tensor at once before a collective
  updates it in place, and a tensor whose version counter moved is reported without a value;
  a tensor created under ``inference_mode`` (no version counter) that a module updates in place
  later in the same step is the one case where the deferred value is the later one.

The same tensor seen twice in a row (a module's output that is the next module's input, the
common case) is one fingerprint, found by one identity test: both sightings refer to its index. An immediate value is also found
later through a cache keyed by the tensor object (a weak reference, so a freed tensor whose id
is reused is not mistaken for it) and its version counter (bumped by in-place updates). A
deferred tensor seen again later is held twice and reduced twice: a row more in the step's
kernel costs less than a lookup in every hook. What a hook does for a deferred tensor is three
list appends; the step's flush builds the kernel's table in one pass.
"""

from __future__ import annotations

import array
import ctypes
import struct
import sys
import weakref

import torch

from tensor_trace import schema
from tensor_trace.format.fingerprints import dense_order, dense_values
from tensor_trace.tracer import config, host_values, kinds, multi_tensor, native

_F32 = torch.float32
_sum = torch.sum
_norm = torch.linalg.vector_norm
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_NAN = float("nan")
_Tensor = torch.Tensor
_STRIDED = torch.strided


def _dense(t) -> bool:
    """Whether ``t``'s memory is a strided buffer of its values on a real device (not sparse,
    nested or meta): what the deferred paths read where it is."""
    return t.layout is _STRIDED and not t.is_nested and not t.is_meta

# Larger CUDA tensors are reduced at once (never held past their module). Below it, holding is
# cheaper: an immediate value costs two reductions launched from Python (on the H200 host about
# 75 us for a [64, 28672] bf16 tensor), a deferred one a row of the step's one kernel launch.
DEFER_MAX_NUMEL = 1 << 24
# Held deferred tensors past this are reduced mid-step: the device memory fingerprints may hold
# beyond what the program holds is at most this plus one tensor of DEFER_MAX_NUMEL elements.
# A Llama-8B-shaped decode step at batch 64 holds about 300 MiB (one flush at 512, two at 256).
# TENSOR_TRACE_FP_HOLD_MIB sets it (TraceConfig.fp_hold_mib; a server with little free memory:
# lower, at some host time).
DEFER_BYTES = config.fp_hold_mib_from_env() << 20
# While a CUDA graph is captured, held tensors cannot give their memory back to the graph's pool
# until their bucket is reduced: a smaller bucket bounds that extra pool memory, but each bucket
# adds its own launches to every replay. Measured on the H200 (Llama-8B-shaped decode, batch 64,
# bench/cuda_graph_replay.py --graph-defer-mib): 4 MiB x1.39 of a plain replay, 16 MiB x1.25,
# 64 MiB x1.085, 256 MiB x1.044.
GRAPH_DEFER_BYTES = 256 << 20


# Floating dtypes (the deferrable ones) and their element sizes: one lookup instead of two calls.
_FLOAT_SIZE = {d: torch.empty((), dtype=d).element_size()
               for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


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


class StepFingerprints:
    """Fingerprints of one process's current step, indexed in recording order."""

    def __init__(self, defer_cuda: bool = True, defer_cpu: bool = False,
                 hold_bytes: int = DEFER_BYTES, native_mode: str | None = None):
        self.defer_cuda = defer_cuda
        self.defer_cpu = defer_cpu  # for tests: the deferred path without a GPU
        self.stale = 0  # deferred tensors updated in place before they could be reduced
        self._pending: list = []  # (step, blocks, dups) waiting for their copies to finish
        self.hold_bytes = hold_bytes  # TraceConfig.fp_hold_mib
        self.defer_bytes = hold_bytes
        self.capturing = False  # between begin_capture and finish_capture
        self._fills: list = []
        # The C++ table of tracer/native.py (by default where CUDA is), once built and the
        # kernel is usable on a tensor's device; until then _native_wanted says to look again.
        # Tensors go in through native.hold_in(slot, ...), a plain C call.
        self._nt = None
        self._nt_slot = -1
        self._hold = None
        self._nt_bytes = 0
        self._native_wanted = native.enabled(native_mode) and (defer_cuda or defer_cpu)
        self.reset()

    def reset(self) -> None:
        self.count = 0
        if self._nt is not None:  # (empty after a flush; not after an error mid-step)
            self._nt.clear()
            self._nt_bytes = 0
        self._imm_idx: list = []
        self._imm_vals: list = []  # (sum, l2) 0-d tensors, or (sum, None)
        self._host_idx: list = []  # values computed on the host (_host_pair): index, and
        self._host_vals: list = []  # sum, sum of squares, flat, as Python floats
        self._host_pos: dict = {}  # index -> its position in _host_idx
        # Deferred tensors, in the order they were added: index, version (None for an inference
        # tensor) and the tensor itself (None once materialised). Appending to three lists is all
        # a hook does for one; repeats by id are found in bulk at the flush.
        self._def_i: list = []
        self._def_v: list = []
        self._def_ts: list = []
        self._def_pos: dict = {}  # id(tensor) -> its positions in _def_ts, built by materialize
        self._cap_pos: dict = {}  # capturing: id(tensor) -> (index, version) held in this bucket
        self._def_indexed = 0  # positions of _def_ts already in _def_pos
        self._def_bytes = 0
        # (indices, values, squared): values a [k, 2] tensor of (sum, l2 norm), or of (sum, sum
        # of squares) when squared; or a flat list of (sum, sum of squares) computed on the host
        self._blocks: list = []
        self._dups: list = []  # (index, index it repeats)
        self._seen: dict = {}
        self.last = None  # the tensor add_one added last, and its index (see add_one)
        self.last_idx = -1
        self.last_version = True  # True: deferred; else its version then (None: inference)
        # (tensor, index) of the deferred outputs ``add`` held last: a call's inputs are often
        # the previous call's outputs (rotary's q and k, then attention's), a repeat then
        self._last_out: list = []
        # (index, AsyncCollectiveTensor, its elem's version then): read at the next flush if
        # the program waited on it by then (tracer/kinds.py)
        self._acts: list = []

    def begin_capture(self) -> None:
        """The step is being captured into a CUDA graph: every floating tensor the kernel can read
        is deferred (its values exist only at replay), in buckets of ``GRAPH_DEFER_BYTES``."""
        self.capturing = True
        self.defer_bytes = GRAPH_DEFER_BYTES

    def add(self, tensors, store: bool = True, immediate: bool = False) -> int:
        """Fingerprint ``tensors``; return the index of the first.

        ``store`` says whether later calls may reuse these values: true for module outputs,
        false for inputs that the module is about to receive (it may update them in place).
        ``immediate`` reduces now even where deferral applies (a collective's inputs, which it
        may overwrite in place).
        Tensors created under ``inference_mode`` have no version counter, so their cached
        value is reused at most once (an output reused as the next module's input).
        """
        grad = _grad_enabled()
        if grad:  # never build autograd graphs (they would keep activations alive)
            _set_grad(False)
        try:
            return self._add(tensors, store, immediate)
        finally:
            if grad:
                _set_grad(True)

    def add_one(self, t, store: bool = True) -> int:
        """``add((t,), store)`` for one tensor (the hooks' common case), without the grad-mode
        switch unless the tensor needs it. ``t`` is a plain ``torch.Tensor`` (exact type: the
        hooks test that); a subclass goes through ``add``.

        The tensor added last is remembered: a module's output is most often the next module's
        input, and that second sighting then gets the first one's index back (the same value:
        no second index, no repeat to resolve when collecting, 8 bytes less on disk) at the cost
        of an identity test. So, unlike ``add``'s, the index returned may be an earlier one. A
        deferred value is the tensor's value at the flush (an in-place update in between makes
        the first sighting stale at the flush, and with it this repeat); an immediate one is
        repeated only while the version counter has not moved (once, for an inference tensor,
        which has none), as the ``_seen`` cache of ``_add`` does."""
        if t is self.last:
            version = self.last_version
            if version is True:  # deferred: the same value at the flush, so the same index
                return self.last_idx
            # an immediate value: only while the tensor is unchanged
            if version is None:  # an inference tensor (no version counter): reuse once
                self.last = None
                self._seen.pop(id(t), None)
            elif version != t._version:
                version = False
            if version is not False:
                return self.last_idx
        nt = self._nt
        if nt is not None and not self.capturing:
            # (first: the table takes tensors of its own device only, one where tensors are
            # deferred, so the device test below is not needed for what it takes)
            idx = self.count
            held = self._hold(self._nt_slot, t, idx)
            if held >= 0:  # in the C++ table (tracer/native.py)
                self.count = idx + 1
                self.last, self.last_idx, self.last_version = t, idx, True
                self._nt_bytes = held
                if held > self.defer_bytes:
                    self._flush_mid_step()
                return idx
            if held == -2:  # sparse, nested, meta: not memory the kernel may read
                self.count = idx + 1
                self._kind_value(idx, t)
                return idx
        if (self.defer_cuda and t.is_cuda) or self.defer_cpu:
            if nt is None and self._native_wanted:
                self._native_table(t)
            size = _FLOAT_SIZE.get(t.dtype)
            # (what the C++ table turned down is dense: it tells the other kinds apart itself)
            if size is not None and ((nt is not None and not self.capturing) or _dense(t)):
                n = t.numel()
                if n <= DEFER_MAX_NUMEL or (self.capturing and multi_tensor.usable(t)
                                            and multi_tensor.supported(t)):
                    idx = self.count
                    self.count = idx + 1
                    version = None if t.is_inference() else t._version
                    if self.capturing and self._captured_repeat(idx, t, version):
                        return idx
                    self._def_i.append(idx)
                    self._def_v.append(version)
                    self._def_ts.append(t)
                    self.last, self.last_idx, self.last_version = t, idx, True
                    self._def_bytes += n * size
                    if self._def_bytes > self.defer_bytes:
                        self._flush_mid_step()
                    return idx
        elif t.is_cpu:
            # A CPU tensor, fingerprinted at once: _add's work for one tensor, inline.
            if t.requires_grad and _grad_enabled():
                return self.add((t,), store)
            seen = self._seen
            key = id(t)
            version = None if t.is_inference() else t._version
            hit = seen.get(key)
            idx = self.count
            self.count = idx + 1
            if hit is not None and hit[0]() is t and (hit[1] is None or hit[1] == version):
                if hit[1] is None:  # an inference tensor: reuse once
                    del seen[key]
                self._repeat(idx, hit[2])
                return idx
            pair = _host_pair(t) if t.dtype in _HOST_DTYPES else None  # requires_grad: None
            if pair is None:
                self.reduce_now(idx, t)
            else:  # reduce_now's host case, inline
                host_idx = self._host_idx
                self._host_pos[idx] = len(host_idx)
                host_idx.append(idx)
                self._host_vals += pair
            if store or version is not None:
                try:
                    seen[key] = (weakref.ref(t), version, idx)
                except TypeError:
                    pass
            if store:
                self.last, self.last_idx, self.last_version = t, idx, version
            return idx
        if t.requires_grad and _grad_enabled():
            return self.add((t,), store)
        n_imm = len(self._imm_idx) + len(self._host_idx)
        idx = self._add((t,), store)
        if len(self._imm_idx) + len(self._host_idx) > n_imm and store and not t.is_cuda:
            # (a large CUDA tensor, reduced at once, is not held for this: it may be big)
            self.last, self.last_idx = t, idx
            self.last_version = None if t.is_inference() else t._version
        return idx

    def _add(self, tensors, store: bool, immediate: bool = False) -> int:
        base = idx = self.count
        seen = self._seen
        defer_all = self.defer_cpu and not immediate
        defer_cuda = self.defer_cuda and not immediate
        held = [] if store else None
        # The C++ table, when there is one and it may be used: tried first, as in add_one (it
        # takes tensors of its own device only, one where tensors are deferred).
        nt = None if immediate or self.capturing else self._nt
        if nt is not None:
            hold, slot = self._hold, self._nt_slot
            last = self.last if self.last_version is True else None
            last_out = self._last_out
        for t in tensors:
            if type(t) is not _Tensor:  # a subclass: its kind's values (tracer/kinds.py)
                self._kind_value(idx, t)
                idx += 1
                continue
            if nt is not None:
                if not store:  # _recent, inline: an output held just before is a repeat
                    src = self.last_idx if t is last else -1
                    if src < 0:
                        for u, i in last_out:
                            if u is t:
                                src = i
                                break
                    if src >= 0:
                        self._dups.append((idx, src))
                        idx += 1
                        continue
                nt_held = hold(slot, t, idx)
                if nt_held >= 0:  # in the C++ table (tracer/native.py)
                    self._nt_bytes = nt_held
                    if held is not None:
                        held.append((t, idx))
                    idx += 1
                    continue
                if nt_held == -2:  # sparse, nested, meta
                    self._kind_value(idx, t)
                    idx += 1
                    continue
            size = _FLOAT_SIZE.get(t.dtype) if (defer_cuda and t.is_cuda) or defer_all else None
            if size is not None and (nt is not None or _dense(t)):
                if not store and nt is None:  # (with the table: looked up above)
                    src = self._recent(t)
                    if src >= 0:  # an output held just before: its value at the flush
                        self._dups.append((idx, src))
                        idx += 1
                        continue
                if self._nt is None and self._native_wanted:
                    self._native_table(t)
                n = t.numel()
                if n <= DEFER_MAX_NUMEL or (self.capturing and multi_tensor.usable(t)
                                            and multi_tensor.supported(t)):
                    # Deferred: held until the step's flush (so its id is not reused before
                    # then, and the flush finds a second sighting by id).
                    version = None if t.is_inference() else t._version
                    if not (self.capturing and self._captured_repeat(idx, t, version)):
                        self._def_i.append(idx)
                        self._def_v.append(version)
                        self._def_ts.append(t)
                        self._def_bytes += n * size
                        if held is not None:
                            held.append((t, idx))
                    idx += 1
                    continue
            key = id(t)
            hit = seen.get(key)
            if hit is not None and hit[0]() is t:
                version = hit[1]
                if version is None:  # an inference tensor: reuse once
                    del seen[key]
                    self._repeat(idx, hit[2])
                    idx += 1
                    continue
                if version == t._version:
                    self._repeat(idx, hit[2])
                    idx += 1
                    continue
            tracked = not t.is_inference()
            version = t._version if tracked else None
            pair = (_host_pair(t) if t.is_cpu and t.dtype in _HOST_DTYPES and not t.requires_grad
                    else None)
            if pair is None:
                self.reduce_now(idx, t)
            else:  # reduce_now's host case, inline (a CPU step's multi-tensor calls)
                host_idx = self._host_idx
                self._host_pos[idx] = len(host_idx)
                host_idx.append(idx)
                self._host_vals += pair
            if store or tracked:
                try:
                    seen[key] = (weakref.ref(t), version, idx)
                except TypeError:
                    pass
            idx += 1
        self.count = idx
        if held:
            # the next call's inputs are looked up among these; its one-tensor input through
            # add_one's identity test with the last of them
            self._last_out = held
            self.last, self.last_idx = held[-1]
            self.last_version = True
        if self._def_bytes > self.defer_bytes or self._nt_bytes > self.defer_bytes:
            self._flush_deferred()
        return base

    def _native_table(self, t) -> None:
        """Take the C++ table for ``t``'s device once it is built and the kernel is usable
        there (the first step's tensors usually take the Python path while it builds). The
        build starts here, at the first deferred tensor: processes that never run a traced
        step (launchers, tokenizer workers) neither build nor load it."""
        native.ensure()
        cls = native.table_class()
        if cls is None:
            if native.error() is not None:
                self._native_wanted = False  # unavailable: stop looking
            return
        if self.capturing:  # (the kernel cannot be compiled and checked during a capture)
            return
        if multi_tensor.usable(t):
            self._nt = cls(DEFER_MAX_NUMEL, t.device)
            self._nt_slot, self._hold = self._nt.slot, native.hold_in()
        self._native_wanted = False

    def _recent(self, t) -> int:
        """The index of ``t`` if it is a deferred tensor held just before (the tensor added
        last, or one of the outputs ``add`` held last), else -1."""
        if t is self.last and self.last_version is True:
            return self.last_idx
        for u, i in self._last_out:
            if u is t:
                return i
        return -1

    def _captured_repeat(self, idx: int, t, version) -> bool:
        """Under capture, a tensor already held in this bucket (same version) is a repeat, not
        a second hold: held twice it would count twice against the bucket's bytes, and more
        buckets mean more kernels in every replay. (Eagerly the lookup is not worth its cost.)"""
        key = id(t)
        first = self._cap_pos.get(key)
        if first is not None and first[1] == version:
            self._dups.append((idx, first[0]))
            return True
        self._cap_pos[key] = (idx, version)
        return False

    def _flush_mid_step(self) -> None:
        """Past ``defer_bytes`` held: reduce what is held now (outside autograd)."""
        grad = _grad_enabled()
        if grad:
            _set_grad(False)
        try:
            self._flush_deferred()
        finally:
            if grad:
                _set_grad(True)

    def _repeat(self, idx: int, src: int) -> None:
        """Value ``idx`` repeats value ``src``: copied at once when ``src`` was computed on the
        host, else resolved when the values are collected."""
        p = self._host_pos.get(src)
        if p is None:
            self._dups.append((idx, src))
            return
        self._host_pos[idx] = len(self._host_idx)
        self._host_idx.append(idx)
        vals = self._host_vals
        vals += vals[2 * p:2 * p + 2]

    def reduce_now(self, idx: int, t, plain: bool = False) -> None:
        """Fingerprint ``t`` now as value ``idx``: on the host when it is a CPU tensor numpy
        can read (floats at once), else two reductions on its device; a tensor of another kind
        (complex, quantized, sparse, nested, meta) by its kind's values. ``plain``: ``t`` is
        known to be plain, dense and real (tracer/kinds.py's values of a kind)."""
        pair = None
        if t.is_cpu and t.dtype in _HOST_DTYPES and not t.requires_grad:
            pair = _host_pair(t)
        if pair is None:
            if not plain and (not _dense(t) or t.is_complex() or t.is_quantized):
                self._kind_value(idx, t)
                return
            pair = _pair(t, host=False)
        if type(pair[0]) is float:
            self._host_pos[idx] = len(self._host_idx)
            self._host_idx.append(idx)
            self._host_vals += pair
        else:
            self._imm_idx.append(idx)
            self._imm_vals.append(pair)

    def _kind_value(self, idx: int, t) -> None:
        """Value ``idx`` from the values tracer/kinds.py names for ``t`` (a subclass, or a
        tensor that is not dense and real): reduced now, left without a value, or, for an
        AsyncCollectiveTensor, read at the next flush if the program has waited on it."""
        grad = _grad_enabled()
        if grad:
            _set_grad(False)
        try:
            kind, data = kinds.source(t)
            if kind == kinds.FULL:
                self.reduce_now(idx, data, True)
            elif kind == kinds.SUM:
                self._imm_idx.append(idx)
                self._imm_vals.append((_sum(data, dtype=_F32), None))
            elif kind == kinds.AWAIT and not self.capturing:
                elem = getattr(data, "elem", None)
                version = None if elem is None or elem.is_inference() else elem._version
                self._acts.append((idx, data, version))
        finally:
            if grad:
                _set_grad(True)

    def _take_acts(self, final: bool) -> None:
        """The held AsyncCollectiveTensors: the values of those the program has waited on (and
        not updated in place since they were seen); the others are kept for the next flush, or,
        at the step's end (``final``), get none. Nothing waits here."""
        acts, self._acts = self._acts, []
        pending = not kinds.no_work_pending()
        for idx, act, version in acts:
            kind, data = kinds.waited(act, not pending)
            if kind == kinds.NONE:
                if not final:
                    self._acts.append((idx, act, version))
                continue
            if version is not None and act.elem._version != version:
                self.stale += 1
                continue
            if kind == kinds.FULL:
                self.reduce_now(idx, data, True)
            else:
                self._imm_idx.append(idx)
                self._imm_vals.append((_sum(data, dtype=_F32), None))

    def materialize(self, tensors) -> None:
        """Reduce deferred tensors now: the caller is about to update them in place."""
        nt = self._nt
        if nt is not None:
            for t in tensors:
                for index, stale in nt.materialize(t):
                    if stale:
                        self.stale += 1
                    else:
                        self.reduce_now(index, t)
                if t is self.last:
                    self.last = None
            self._last_out = []
        ts = self._def_ts
        if not ts:
            return
        pos = self._def_pos
        k = self._def_indexed
        if k < len(ts):  # index the tensors held since the last call (only collectives need it)
            for j in range(k, len(ts)):
                t = ts[j]
                if t is not None:
                    pos.setdefault(id(t), []).append(j)
            self._def_indexed = len(ts)
        self._last_out = []  # (a collective: rare) their next sightings are new values too
        for t in tensors:
            if t is self.last:  # its next sighting is not a repeat: the value changes here
                self.last = None
            for j in pos.pop(id(t), ()):
                held = ts[j]
                if held is None:
                    continue
                ts[j] = None
                version = self._def_v[j]
                if version is not None and held._version != version:
                    self.stale += 1  # already updated in place since that sighting
                else:
                    self.reduce_now(self._def_i[j], held)

    def forget(self, tensors) -> None:
        """Drop cached values of tensors that were just updated in place (e.g. by a collective)."""
        seen = self._seen
        self._last_out = []
        for t in tensors:
            seen.pop(id(t), None)
            if t is self.last:
                self.last = None

    def _flush_deferred(self) -> None:
        # One pass over the held tensors: stale ones (updated in place since they were seen) are
        # dropped, the rest sorted by how they are reduced. (Eagerly, a tensor seen again, not
        # right after it was added, is held twice and reduced twice: cheaper than finding it in
        # every hook. Under capture it becomes a repeat: replays are what must stay cheap.)
        # Where Triton is available (tracer/multi_tensor.py), tensors it can read where they are
        # (contiguous, or rows of a fused projection's split) go into one table per dtype and
        # device: one kernel launch each, eagerly. Otherwise tensors of one shape and dtype are
        # stacked (one copy) and reduced along the stacked dimension (two kernels): a decode
        # step has a handful of distinct shapes.
        if self._acts:
            self._take_acts(False)
        nt = self._nt
        if nt is not None and nt.size():
            self._flush_native(nt)
        ts, indices, versions = self._def_ts, self._def_i, self._def_v
        self._def_ts, self._def_i, self._def_v = [], [], []
        self._def_pos = {}
        self._cap_pos = {}
        self._def_indexed = 0
        self._def_bytes = 0
        if self.last_version is True:
            self.last = None
        self._last_out = []
        capturing = self.capturing
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
                self.stale += 1  # updated in place since it was seen: no honest value left
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
                    self._dups.append((index, seen[0]))
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
                self._blocks.append((idx, values, True))
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
                self._fills.append(fill)
            self._blocks.append((idx if type(order) is range else [idx[i] for i in order], values,
                                 False))
        for idx, group in groups.values():
            # (explicit sizes: a view of zero-size tensors cannot infer a -1)
            flat = torch.stack(group).view(len(group), group[0].numel())
            sums = torch.sum(flat, dim=1, dtype=_F32)
            l2 = _norm(flat, dim=1, dtype=_F32)
            self._blocks.append((idx, torch.stack((sums, l2), dim=1), False))

    def finish_step(self, step: int) -> None:
        """Start the device-to-host copy of this step's values; no synchronisation."""
        grad = _grad_enabled()
        if grad:
            _set_grad(False)
        try:
            self._finish_step(step)
        finally:
            if grad:
                _set_grad(True)

    def finish_capture(self) -> CapturedFingerprints | None:
        """End a step that is being captured into a CUDA graph: reduce what is left and gather
        every value into one static buffer, all as kernels of the graph (nothing runs now).
        Each replay then rewrites the buffer; ``add_replay`` copies it out."""
        grad = _grad_enabled()
        if grad:
            _set_grad(False)
        try:
            self._reduce_rest()
            indices, vals = [], []
            # Only the graph's device can be rewritten by replays: host-side values (a CPU
            # tensor among a captured step's inputs) would be the capture's, so they are left out.
            device = next((v.device for _, v, _ in self._blocks if type(v) is not list and v.is_cuda),
                          None)
            # The static buffer holds (sum, l2 norm) rows, as a replay's copy expects.
            for idx, v, squared in self._blocks:
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
            captured = CapturedFingerprints(indices, static, list(self._dups), self.count,
                                            self._fills)
        finally:
            self.reset()
            self.defer_bytes = self.hold_bytes
            self.capturing = False
            self._fills = []
            if grad:
                _set_grad(True)
        return captured if (captured.indices or captured.dups) else None

    def reserve(self, n: int) -> int:
        """Reserve ``n`` fingerprint indices of the current step (a replayed graph's); return the first."""
        base = self.count
        self.count = base + n
        return base

    def add_replay(self, step: int, base: int, captured: CapturedFingerprints) -> None:
        """After a replay: copy the graph's static buffer to pinned host memory without waiting,
        as fingerprints ``base + i`` of ``step``; collected like any step's."""
        static = captured.static
        if static is None:
            return
        # A CPU buffer is rewritten by the next "replay": copy it (a CUDA one is copied anyway).
        _, host, event, _ = _to_host(None, static if static.is_cuda else static.clone(), False)
        self._pending.append((step, None, (captured.plan(base), host, event)))

    def _flush_native(self, nt) -> None:
        """The C++ table's tensors: one launch over the buffer it built; its held memory is let
        go once the kernel that reads it is enqueued."""
        try:
            idx, buf, count, most, stale, code = nt.flush()
            self.stale += stale
            if idx is not None:
                values = multi_tensor.sum_sumsq_buffer(buf, count, most, multi_tensor.DTYPES[code],
                                                       nt.device)
                self._blocks.append((idx, values, True))
        finally:
            nt.clear()
            self._nt_bytes = 0

    def _reduce_rest(self) -> None:
        """Deferred tensors and immediate values of this step become blocks (on their devices)."""
        if self._acts:
            self._take_acts(True)
        if self._def_ts or (self._nt is not None and self._nt.size()):
            self._flush_deferred()
        if self._imm_vals:
            by_device: dict = {}
            for index, (s, q) in zip(self._imm_idx, self._imm_vals):
                idx, items = by_device.setdefault(s.device, ([], []))
                idx.append(index)
                items.append(s)
                items.append(q if q is not None else s.new_full((), _NAN))
            for idx, items in by_device.values():
                self._blocks.append((idx, torch.stack(items).view(-1, 2), False))
            self._imm_idx, self._imm_vals = [], []
        if self._host_idx:  # a flat list of (sum, sum of squares): no tensor needed
            self._blocks.append((self._host_idx, self._host_vals, True))
            self._host_idx, self._host_vals, self._host_pos = [], [], {}

    def _finish_step(self, step: int) -> None:
        self._reduce_rest()
        out = [_to_host(idx, vals, squared) for idx, vals, squared in self._blocks]
        if out or self._dups:
            self._pending.append((step, out, self._dups))
        self.reset()

    def adopt_pending(self, other: "StepFingerprints") -> None:
        """Take ``other``'s finished steps (module parameters' fingerprints): they are written
        with this instance's next ones."""
        self._pending.extend(other._pending)
        other._pending = []

    def collect(self, wait: bool = False) -> list:
        """Return FINGERPRINTS records whose copies have completed (all of them if ``wait``)."""
        records = []
        keep = []
        for step, blocks, dups in self._pending:
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
            for idx, host, event, squared in blocks:
                if event is not None and wait:
                    event.synchronize()
                idx_all += idx
                if type(host) is list:  # (sum, sum of squares) already
                    datas.append(struct.pack(f"<{len(host)}f", *host))
                    continue
                if host.dtype != _F32:
                    host = host.to(_F32)
                if not squared:  # our own copy: the l2 norm becomes the sum of squares in place
                    if host.is_inference():  # made under inference_mode, collected outside it
                        host = host.clone()
                    host[:, 1].square_()
                datas.append(_f32_bytes(host))
            if not idx_all:
                continue
            data = datas[0] if len(datas) == 1 else b"".join(datas)
            records += _step_records(step, idx_all, data, dups)
        self._pending = keep
        return records


def _step_records(step, idx_all, data, dups) -> list:
    """A step's FINGERPRINTS records: its values and repeats in index order as one record
    without indices where they cover a run of indices (format 2: 8 bytes a value, not 12),
    else the values and the repeats apart, with their indices."""
    dst, repeated = _repeats(idx_all, dups, data)
    if not dst and idx_all[-1] - idx_all[0] == len(idx_all) - 1 and idx_all == list(
            range(idx_all[0], idx_all[0] + len(idx_all))):
        return [(schema.FINGERPRINTS, step, idx_all[0], data, None)]  # in order already
    dense = dense_values(idx_all + dst, data + repeated)
    if dense is not None:
        return [(schema.FINGERPRINTS, step, dense[0], dense[1], None)]
    records = [_record(step, idx_all, data)]
    if dst:
        records.append(_record(step, dst, repeated))
    return records


def _repeats(idx_all, dups, data) -> tuple:
    """(indices, values): each repeat whose source has a value, and that value's 8 bytes from
    ``data`` (rows in ``idx_all`` order); a repeat of a stale or missing value is left out."""
    dst, rows = _repeat_rows(idx_all, dups)
    return dst, b"".join([data[8 * r:8 * r + 8] for r in rows])


def _repeat_rows(idx_all, dups) -> tuple:
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


def _f32_bytes(values) -> bytes:
    """The little-endian float32 bytes of a contiguous fp32 CPU tensor."""
    values = values.contiguous()
    if _LITTLE:
        return ctypes.string_at(values.data_ptr(), values.numel() * 4)
    flat = values.view(-1).tolist()
    return struct.pack(f"<{len(flat)}f", *flat)


_LITTLE = sys.byteorder == "little"


def _to_host(idx, vals, squared) -> tuple:
    """(indices, host values, event or None, squared): a device block is copied to pinned memory
    without waiting; its event says when the copy is done."""
    if type(vals) is list or not vals.is_cuda:
        return (idx, vals, None, squared)
    host = torch.empty(vals.shape, dtype=_F32, pin_memory=True)
    host.copy_(vals, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return (idx, host, event, squared)


def _pair(t, host: bool = True):
    """(sum, l2 norm) of ``t`` as 0-d fp32 tensors on its device (l2 None for bool tensors), or
    (sum, sum of squares) as Python floats when computed on the host (``_host_pair``)."""
    if host and t.is_cpu and t.dtype in _HOST_DTYPES and not t.requires_grad:
        pair = _host_pair(t)
        if pair is not None:
            return pair
    if t.is_floating_point():  # (complex ones come as their real view: tracer/kinds.py)
        return (_sum(t, dtype=_F32), _norm(t, dtype=_F32))
    if t.dtype is torch.bool:
        return (_sum(t, dtype=_F32), None)
    # Integer tensors (token ids, positions) sum exactly in fp32 only up to 2**24: good enough
    # to tell ranks apart.
    f = t.to(_F32)
    return (f.sum(), _norm(f))


_HOST_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)
# (sum, sum of squares) of a CPU tensor as Python floats, through numpy on its memory, or None
# (tracer/host_values.py). Two torch reductions from Python cost about 7 us on a CPU
# (``vector_norm`` alone about 4); two BLAS calls over the same flat buffer cost about 1 us, and
# give floats at once, so the step end has no 0-d tensors to stack.
_host_pair = host_values.pair


def _record(step, idx, data) -> tuple:
    first = idx[0]
    if idx[-1] - first == len(idx) - 1 and idx == list(range(first, first + len(idx))):
        indices = None  # first, first + 1, ...: implied
    elif _U32_ARRAY:
        indices = array.array("I", idx).tobytes()
    else:
        indices = struct.pack(f"<{len(idx)}I", *idx)
    return (schema.FINGERPRINTS, step, first, data, indices)


_U32_ARRAY = array.array("I").itemsize == 4 and sys.byteorder == "little"
