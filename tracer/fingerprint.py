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

Here is what the hooks run (``StepFingerprints``) and the state they write for each tensor; the
rest is in the modules that own its state: ``fingerprint_reduce.py`` reduces what a step holds
(the flush, immediate values, AsyncCollectiveTensors waited on later), ``fingerprint_records.py``
copies finished steps to the host and makes their records, ``fingerprint_capture.py`` keeps a
CUDA-graph capture's state and turns its replays into records.
"""

from __future__ import annotations

import weakref

import torch

from tensor_trace.tracer import config, host_values as _host_values, kinds, multi_tensor, native
from tensor_trace.tracer.fingerprint_capture import CaptureState, CapturedFingerprints
from tensor_trace.tracer.fingerprint_records import PendingCopies
from tensor_trace.tracer.fingerprint_reduce import (HOST_DTYPES as _HOST_DTYPES, AwaitedValues, HeldIndex,
                                                    device_blocks, host_pair as _host_pair,
                                                    pair as _pair, reduce_held)

_F32 = torch.float32
_sum = torch.sum
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_Tensor = torch.Tensor
_STRIDED = torch.strided


def _cpu_floats(t, pair) -> tuple:
    """A CPU tensor's (sum, l2 norm) as 0-d tensors made (sum, sum of squares) floats, as the
    host path gives them (no 0-d tensor to stack at the step's end). Where the float32 sums
    overflowed on finite values (a bfloat16 attention mask of finfo.min), added in float64:
    the writer keeps such values as WIDE_FINGERPRINTS."""
    s, n = pair[0].item(), pair[1].item()
    if s - s == 0.0 and n - n == 0.0:  # both finite
        return (s, n * n)
    d = t.detach().to(torch.float64)
    return (d.sum().item(), d.square().sum().item())


def _nonfinite_entry(idx: int, t) -> tuple:
    """(index, sum, sum of squares, +inf count, -inf count, NaN count) of a CPU tensor whose sums
    are not finite (an attention mask of -inf): its finite values' sums and how many of each
    non-finite value it holds, which tell ranks whose masks are equal from ranks whose are not
    (the sums alone are -inf on both). Rare: read again in float64."""
    d = t.detach().to(torch.float64)
    finite = d[torch.isfinite(d)]
    return (idx, finite.sum().item(), finite.square().sum().item(), int(torch.isposinf(d).sum()),
            int(torch.isneginf(d).sum()), int(torch.isnan(d).sum()))


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


class StepFingerprints:
    """Fingerprints of one process's current step, indexed in recording order.

    It owns what the hooks write for each tensor (the index count, the tensor added last, the
    deferred tensors held, the C++ table's handles, the cache of immediate values, the values
    computed so far and the repeats), as its own fields: a hook reaches each with one attribute
    load. It hands them over where they are reduced (``fingerprint_reduce.reduce_held``) or
    copied (``PendingCopies``), and holds the parts whose state no hook touches: the finished
    steps' copies, the capture's state, the AsyncCollectiveTensors awaited, the index of the held
    tensors by id."""

    def __init__(self, defer_cuda: bool = True, defer_cpu: bool = False,
                 hold_bytes: int = DEFER_BYTES, native_mode: str | None = None):
        self.defer_cuda = defer_cuda
        self.defer_cpu = defer_cpu  # for tests: the deferred path without a GPU
        self.stale = 0  # deferred tensors updated in place before they could be reduced
        self.copies = PendingCopies()  # finished steps, their values on the way to the host
        self.hold_bytes = hold_bytes  # TraceConfig.fp_hold_mib
        self.defer_bytes = hold_bytes
        self.capturing = False  # between begin_capture and finish_capture
        self._capture = CaptureState()  # (empty unless capturing)
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
        self._held_index = None  # HeldIndex of _def_ts by id, made by materialize when needed
        if self.capturing:  # (the bucket's tensors: empty unless capturing)
            self._capture.new_bucket()
        self._def_bytes = 0
        # (indices, values, squared): values a [k, 2] tensor of (sum, l2 norm), or of (sum, sum
        # of squares) when squared; or a flat list of (sum, sum of squares) computed on the host
        self._blocks: list = []
        self._dups: list = []  # (index, index it repeats)
        self._nonfinite: list = []  # _nonfinite_entry of each host value that is not finite
        self._seen: dict = {}
        self.last = None  # the tensor add_one added last, and its index (see add_one)
        self.last_idx = -1
        self.last_version = True  # True: deferred; else its version then (None: inference)
        # (tensor, index) of the deferred outputs ``add`` held last: a call's inputs are often
        # the previous call's outputs (rotary's q and k, then attention's), a repeat then
        self._last_out: list = []
        # AwaitedValues, made at the first AsyncCollectiveTensor: read at a flush once the program
        # has waited on them
        self._awaited = None

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

        Once tracer/native.py is built, its ``add_host`` (tracer/native_host.py) takes the
        tensors it can, one at a time from the first (``_add``'s immediate case of a plain CPU
        tensor, in C), and ``_add`` the rest from the first it leaves.
        """
        host = _host_values.native_add
        if host is not None and (type(tensors) is list or type(tensors) is tuple):
            done = 0
            for t in tensors:
                if host(self, t, store) is None:
                    break
                done += 1
            if done:
                base = self.count - done
                if done < len(tensors):
                    self.add(tensors[done:], store, immediate)
                return base
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
                if pair[0] - pair[0] != 0.0 or pair[1] - pair[1] != 0.0:  # (not both finite)
                    self._nonfinite.append(_nonfinite_entry(idx, t))
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
                if pair[0] - pair[0] != 0.0 or pair[1] - pair[1] != 0.0:  # (not both finite)
                    self._nonfinite.append(_nonfinite_entry(idx, t))
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

    def native_held(self) -> int | None:
        """How many tensors the C++ table holds now, or None while this instance has no table
        (none wanted, not built yet, or not usable on the tensors' device): for tests and benches."""
        return None if self._nt is None else self._nt.size()

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
        first = self._capture.first_sighting(idx, t, version)
        if first < 0:
            return False
        self._dups.append((idx, first))
        return True

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
        if self._nonfinite:  # (rare: the C path leaves repeats of such values to this one)
            entry = next((e for e in self._nonfinite if e[0] == src), None)
            if entry is not None:
                self._nonfinite.append((idx, *entry[1:]))

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
            if t.is_cpu and pair[1] is not None:
                pair = _cpu_floats(t, pair)
        if type(pair[0]) is float:
            self._host_pos[idx] = len(self._host_idx)
            self._host_idx.append(idx)
            self._host_vals += pair
            if pair[0] - pair[0] != 0.0 or pair[1] - pair[1] != 0.0:  # (not both finite)
                self._nonfinite.append(_nonfinite_entry(idx, t))
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
                if self._awaited is None:
                    self._awaited = AwaitedValues()
                self._awaited.hold(idx, data)
        finally:
            if grad:
                _set_grad(True)

    def _take_acts(self, final: bool) -> None:
        """The held AsyncCollectiveTensors: the values of those the program has waited on (and
        not updated in place since they were seen); the others are kept for the next flush, or,
        at the step's end (``final``), get none. Nothing waits here."""
        ready, stale = self._awaited.take(final)
        self.stale += stale
        for idx, kind, data in ready:
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
        by_id = self._held_index
        if by_id is None:
            by_id = self._held_index = HeldIndex()
        by_id.update(ts)  # the tensors held since the last call (only collectives need it)
        self._last_out = []  # (a collective: rare) their next sightings are new values too
        for t in tensors:
            if t is self.last:  # its next sighting is not a repeat: the value changes here
                self.last = None
            for j in by_id.pop(t):
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
        """Reduce what is held (tracer/fingerprint_reduce.py's ``reduce_held``): the tensors
        are let go, their values become blocks of this step."""
        if self._awaited is not None:
            self._take_acts(False)
        nt = self._nt
        if nt is not None and nt.size():
            self._flush_native(nt)
        ts, indices, versions = self._def_ts, self._def_i, self._def_v
        self._def_ts, self._def_i, self._def_v = [], [], []
        self._held_index = None
        if self.capturing:
            self._capture.new_bucket()
        self._def_bytes = 0
        if self.last_version is True:
            self.last = None
        self._last_out = []
        blocks, dups, fills, stale = reduce_held(indices, versions, ts, self.capturing)
        self.stale += stale
        self._dups += dups
        if fills:
            self._capture.add_fills(fills)
        self._blocks += blocks

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
            captured = self._capture.finish(self._blocks, self._dups, self.count)
        finally:
            self.reset()
            self.defer_bytes = self.hold_bytes
            self.capturing = False
            self._capture.end()
            if grad:
                _set_grad(True)
        return captured

    def reserve(self, n: int) -> int:
        """Reserve ``n`` fingerprint indices of the current step (a replayed graph's); return the first."""
        base = self.count
        self.count = base + n
        return base

    def add_replay(self, step: int, base: int, captured: CapturedFingerprints) -> None:
        """After a replay: copy the graph's static buffer to pinned host memory without waiting,
        as fingerprints ``base + i`` of ``step``; collected like any step's."""
        self.copies.add_replay(step, base, captured)

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
        if self._awaited is not None:
            self._take_acts(True)
        if self._def_ts or (self._nt is not None and self._nt.size()):
            self._flush_deferred()
        if self._imm_vals:
            self._blocks += device_blocks(self._imm_idx, self._imm_vals)
            self._imm_idx, self._imm_vals = [], []
        if self._host_idx:  # a flat list of (sum, sum of squares): no tensor needed
            self._blocks.append((self._host_idx, self._host_vals, True))
            self._host_idx, self._host_vals, self._host_pos = [], [], {}

    def _finish_step(self, step: int) -> None:
        self._reduce_rest()
        self.copies.add_step(step, self._blocks, self._dups, self._nonfinite)
        self.reset()

    def adopt_pending(self, other: "StepFingerprints") -> None:
        """Take ``other``'s finished steps (module parameters' fingerprints): they are written
        with this instance's next ones."""
        self.copies.adopt(other.copies)

    def collect(self, wait: bool = False) -> list:
        """Return FINGERPRINTS records whose copies have completed (all of them if ``wait``)."""
        return self.copies.collect(wait)
