"""Functional collectives as spans: the ``torch.ops._c10d_functional`` ops (what
``torch.distributed._functional_collectives`` and DTensor redistribution call), their
``_c10d_functional_autograd`` twins and DTensor's ``_dtensor.shard_dim_alltoall``.

Issue. The op wrapper opens the span when the op is called: its index and per-group sequence
number, its parent (the innermost module span at that moment: the module whose call issued it,
wherever the result is waited later), its inputs' fingerprints; once the op returns, it reserves
the fingerprint indices of the outputs.

Wait. A functional op's result is complete only once ``wait_tensor`` ran on it, and every way
PyTorch waits ends at ``torch.ops._c10d_functional.wait_tensor``, looked up on the namespace at
each call: ``funcol.wait_tensor``, ``AsyncCollectiveTensor.wait`` and ``trigger_wait`` (its first
non-view use through ``__torch_dispatch__``, ``.numpy()``, ``.tolist()``, ``repr``),
``_maybe_wrap_tensor`` under a tracing mode (which waits at once), DTensor's
``redistribute(async_op=False)``. A wait may name a view of the result (an AsyncCollectiveTensor
re-wraps views, e.g. ``to_local``'s), so results are found by storage, as PyTorch's work
registry finds the work to wait for (a wait completes every call registered on the storage, and
every output of a coalesced call). There the op's own result
tensors (never an AsyncCollectiveTensor wrapper) are fingerprinted into the reserved indices.
A wait is often reached from inside the tracer (its fingerprint of a module output that is an
AsyncCollectiveTensor reads the values and so waits): the values are taken then, without
touching the fingerprint counter, and the record is written at the next safe point (the next
collective call, or the end of the step). A result still not waited when its step ends is closed
as unwaited, without output fingerprints. ``shard_dim_alltoall`` returns a finished tensor: it is
closed at once.

What the Python layer knew. ``gather_dim`` / ``scatter_dim`` of funcol's Python functions and
the placements of a DTensor redistribution are no arguments of the ops: those functions are
wrapped to hold them while their ops run, and each op's record carries them as ``attrs`` (the
optional last element of ``schema.COLLECTIVE``; docs/store-schema.md gives the keys).

Compiled graphs call the overloads (``torch.ops._c10d_functional.all_reduce_.default``), looked
up on the namespace when they run: an overload looked up from a compiled graph's code goes
through the wrapper as well (OpPacketWrapper), so the collectives inside a ``torch.compile``d
module are spans of that module's call. Not seen: overloads called from other code, and
collectives that run inside other C++ ops. The Python functions are
wrapped when the tracer installs, or, for modules imported later, when the bootstrap's import
watcher sees them imported (tracer/integrations): a tracer started in-process before funcol or
DTensor is first imported records their ops without those attributes.
"""

from __future__ import annotations

import functools
import sys
import time

import torch

from tensor_trace.tracer.patching import ORIGINAL, is_wrapped

_now = time.monotonic_ns

# op -> (parameter names, input argument, output: True for the result, else the argument that is it)
OP_SPECS = {
    "all_reduce": (("input", "reduce_op", "group_name"), "input", True),
    "all_reduce_": (("input", "reduce_op", "group_name"), "input", "input"),
    "all_reduce_coalesced": (("inputs", "reduce_op", "group_name"), "inputs", True),
    "all_reduce_coalesced_": (("inputs", "reduce_op", "group_name"), "inputs", "inputs"),
    "all_gather_into_tensor": (("input", "group_size", "group_name"), "input", True),
    "all_gather_into_tensor_out": (("input", "group_size", "group_name"), "input", "out"),
    "all_gather_into_tensor_coalesced": (("inputs", "group_size", "group_name"), "inputs", True),
    "reduce_scatter_tensor": (("input", "reduce_op", "group_size", "group_name"), "input", True),
    "reduce_scatter_tensor_coalesced": (("inputs", "reduce_op", "group_size", "group_name"), "inputs", True),
    "all_to_all_single": (("input", "output_split_sizes", "input_split_sizes", "group_name"), "input", True),
    "broadcast": (("input", "src", "group_name"), "input", True),
    "broadcast_": (("input", "src", "group_name"), "input", "input"),
}
NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
# (namespace, op) -> spec as in OP_SPECS, of an op whose result is finished when it returns
SYNC_OPS = {("_dtensor", "shard_dim_alltoall"): (("input", "gather_dim", "shard_dim", "group_name"), "input", True)}
SYNC_ATTRS = ("gather_dim", "shard_dim")

FUNCOL = "torch.distributed._functional_collectives"
REDISTRIBUTE = "torch.distributed.tensor._redistribute"
# funcol Python function -> (attribute, position of that argument); the deprecated ``*_tensor``
# aliases call the ``*_single`` functions (and are the implementation in older releases)
API_DIMS = {
    "all_gather_single": ("gather_dim", 1),
    "all_gather_single_autograd": ("gather_dim", 1),
    "all_gather_tensor": ("gather_dim", 1),
    "all_gather_tensor_autograd": ("gather_dim", 1),
    "reduce_scatter_single": ("scatter_dim", 2),
    "reduce_scatter_single_autograd": ("scatter_dim", 2),
    "reduce_scatter_tensor": ("scatter_dim", 2),
    "reduce_scatter_tensor_autograd": ("scatter_dim", 2),
    "reduce_scatter_single_coalesced": ("scatter_dim", 2),
    "reduce_scatter_tensor_coalesced": ("scatter_dim", 2),
}

# Token slots after the 12 of CollectiveInterceptor.begin: outputs, attrs, first reserved output
# fingerprint index (-1: none), host time of the wait (None until waited).
T_STEP, T_STARTED, T_OUT, T_ATTRS, T_FP_OUT, T_WAITED = 10, 11, 12, 13, 14, 15


def bind_args(names, args, kwargs) -> dict:
    """A collective's arguments by parameter name (``names`` in order, then ``kwargs``)."""
    bound = dict(zip(names, args))
    if kwargs:
        bound.update(kwargs)
    return bound


def _traced_only(x) -> bool:
    """Whether ``x`` (a tensor or a list of them) is one that torch.compile traces with: a
    FunctionalTensor or a FakeTensor, whose values no collective reads."""
    t = x[0] if isinstance(x, (list, tuple)) and x else x
    if type(t) is torch.Tensor or not isinstance(t, torch.Tensor):
        return False
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, FunctionalTensor) or is_fake(t)


def tensors_of(x) -> list:
    """The tensors of a collective's argument or result: a tensor, or those of a list or tuple."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def _storage_key(t):
    """What a wait on ``t`` or on any view of it shares with the result: its storage. (The
    token holds the result until it is closed, so the storage cannot be reused meanwhile.)"""
    try:
        return t.untyped_storage()._cdata
    except Exception:  # no storage (a wrapper subclass): only the tensor itself
        return ("id", id(t))


def _dim(d, t):
    """``d`` as a dimension >= 0 of ``t`` (funcol accepts negative ones)."""
    if isinstance(d, int) and d < 0 and isinstance(t, torch.Tensor):
        return d + t.dim()
    return d


def api_attrs(key, dims, first) -> dict | None:
    """The attribute a funcol Python function knew: ``{key: dim}``, or a list of dims for the
    coalesced functions (one per input)."""
    if isinstance(dims, (list, tuple)):
        ts = first if isinstance(first, (list, tuple)) else [None] * len(dims)
        return {key: [int(_dim(d, t)) for d, t in zip(dims, ts)]}
    if isinstance(dims, int):
        return {key: int(_dim(dims, first))}
    return None


class OpPacketWrapper:
    """Stands in for a ``torch.ops`` packet: calls go through ``call``; attributes such as
    ``.default`` (used by the dispatcher and AsyncCollectiveTensor) reach the real packet."""

    def __init__(self, packet, call):
        self._packet = packet
        self._call = call
        self._overloads = frozenset(packet.overloads())  # (read at each attribute look-up)
        self.__tensor_trace_original__ = packet

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    @property
    def __class__(self):
        # isinstance(w, OpOverloadPacket), as the real packet: torch.compile's inductor registers
        # its lowerings of these ops on the overloads of what it finds in the namespace, and
        # expands a packet's overloads only for such an instance. For a plain object it
        # registered none for them, and compiled TP blocks computed other results
        # (tests/integration/test_compiled_blocks.py, inductor)
        return type(self._packet)

    def __getattr__(self, name):
        real = getattr(self._packet, name)
        if name in self._overloads and compiled_frame(sys._getframe(1)):
            # A compiled graph calls the overload (``torch.ops._c10d_functional.all_reduce_
            # .default(buf, 'sum', '0')``), looked up on the namespace at each call: there its
            # call goes through the wrapper too. Anywhere else (inductor's lowerings, its
            # passes that match node targets) the real overload, which they compare by identity.
            return OverloadCall(real, self._call)
        return real


class OverloadCall:
    """An overload as a compiled graph's code calls it: the call through the packet's wrapper
    (the packet resolves to the same overload for the same arguments)."""

    __slots__ = ("_overload", "_call")

    def __init__(self, overload, call):
        self._overload, self._call = overload, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._overload, name)


def compiled_frame(frame) -> bool:
    """Whether ``frame`` runs a compiled graph's code: an FX GraphModule's generated forward
    (``<eval_with_key>.N``, aot_eager's and inductor's fallbacks) or a module inductor wrote
    to its code cache (``.../torchinductor_USER/xx/cxxx.py``)."""
    name = frame.f_code.co_filename if frame is not None else ""
    return name.startswith("<eval_with_key>") or "torchinductor" in name


class FunctionalCollectives:
    """The functional half of a CollectiveInterceptor: op and wait wrappers, the Python-layer
    attribute wrappers, and the waited spans whose records are still to be written."""

    def __init__(self, interceptor):
        self.ic = interceptor
        self.tracer = interceptor.tracer
        self.ops: list = []  # (namespace, name, original packet)
        self.awaiting: dict = {}  # storage key of a result -> the tokens awaiting it
        self.ready: list = []  # waited tokens whose records are not written yet
        self.attrs = None  # what the Python function now calling an op knew (a dict)

    # ------------------------------------------------------------------ install
    def install_ops(self) -> None:
        for ns_name in NAMESPACES:
            try:
                ns = getattr(torch.ops, ns_name)
            except Exception:
                continue
            for name, spec in OP_SPECS.items():
                self._patch_op(ns_name, ns, name, lambda orig, n=name, s=spec: self._op_wrapper(n, orig, s, False))
        try:
            ns = torch.ops._c10d_functional
            self._patch_op("_c10d_functional", ns, "wait_tensor", self._wait_wrapper)
        except Exception:
            pass
        for (ns_name, name), spec in SYNC_OPS.items():
            try:
                ns = getattr(torch.ops, ns_name)
            except Exception:
                continue
            self._patch_op(ns_name, ns, name, lambda orig, n=name, s=spec: self._op_wrapper(n, orig, s, True))

    def _patch_op(self, ns_name, ns, name, make) -> None:
        try:
            orig = getattr(ns, name)
        except Exception:  # not in this release (or its library is not loaded)
            return
        if isinstance(orig, OpPacketWrapper):
            return
        self.ops.append((ns, name, orig))
        setattr(ns, name, make(orig))

    def python_functions(self, module_name: str, module) -> list:
        """(name, original, wrapper) for the Python functions of ``module`` that know what the
        ops they call do not (nothing for other modules)."""
        out = []
        if module_name == FUNCOL:
            for name, (key, pos) in API_DIMS.items():
                orig = original_of(getattr(module, name, None))
                if orig is not None:
                    out.append((name, orig, self._api_wrapper(orig, key, pos)))
        elif module_name == REDISTRIBUTE:
            orig = original_of(getattr(module, "redistribute_local_tensor", None))
            if orig is not None:
                out.append(("redistribute_local_tensor", orig, self._redistribute_wrapper(orig)))
        return out

    def uninstall(self) -> None:
        for ns, name, orig in self.ops:
            try:
                setattr(ns, name, orig)
            except Exception:
                pass
        self.ops = []
        self.awaiting.clear()
        self.ready.clear()
        self.attrs = None

    # ------------------------------------------------------------------ wrappers
    def _op_wrapper(self, name, orig, spec, sync):
        """The wrapper of op ``name`` (``spec`` as in OP_SPECS). ``sync``: its result is finished
        when it returns (SYNC_OPS), so its record is closed at once, the dims it was given among
        its attributes."""
        names, in_arg, out_spec = spec
        tracer, ic, fc = self.tracer, self.ic, self

        def wrapper(*args, **kwargs):
            if not tracer.enabled or tracer.in_collective or tracer.busy:
                return orig(*args, **kwargs)
            token = attrs = None
            try:
                bound = bind_args(names, args, kwargs)
                if _traced_only(bound.get(in_arg)):
                    # torch.compile tracing the op (its tensors functional or fake): no
                    # collective runs, and the compiled graph's own calls are not seen
                    return orig(*args, **kwargs)
                group = ic.group_seq(bound.get("group_name"))
                if tracer.tracing_step:
                    x = bound.get(in_arg)
                    if sync:
                        attrs = dict(fc.attrs or ())
                        for key in SYNC_ATTRS:
                            if isinstance(bound.get(key), int):
                                attrs[key] = int(_dim(bound[key], x))
                    token = ic.begin(name, bound.get("reduce_op"), group, tensors_of(x), not sync)
            except Exception as exc:
                tracer.on_error(f"collective {name}", exc)
                token = None
            result = ic.call(token, orig, args, kwargs)
            if token is not None:
                try:
                    outputs = tensors_of(result if out_spec is True else bound.get(out_spec))
                    if sync:
                        fc.issued(token, outputs, attrs, True)
                        fc.drain()
                    else:
                        fc.issued(token, outputs, fc.attrs, False)
                except Exception as exc:
                    tracer.on_error(f"collective {name}", exc)
            return result

        return OpPacketWrapper(orig, wrapper)

    def _wait_wrapper(self, orig):
        awaiting, tracer, fc = self.awaiting, self.tracer, self

        def wrapper(tensor, *args, **kwargs):
            result = orig(tensor, *args, **kwargs)
            if awaiting and not _traced_only(tensor):  # (a traced wait waits for no call of the run)
                try:
                    # As PyTorch's work registry does: every call registered on the storage
                    # is waited for, whichever of its tensors or views is named.
                    for token in awaiting.pop(_storage_key(tensor), ()):
                        fc.waited(token)
                except Exception as exc:
                    tracer.on_error("collective wait_tensor", exc)
            return result

        return OpPacketWrapper(orig, wrapper)

    def _api_wrapper(self, orig, key, pos):
        tracer, fc = self.tracer, self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not tracer.tracing_step or tracer.busy or not tracer.enabled:
                return orig(*args, **kwargs)
            prev = fc.attrs
            try:
                dims = kwargs[key] if key in kwargs else args[pos]
                first = args[0] if args else next(iter(kwargs.values()), None)
                extra = api_attrs(key, dims, first)
                if extra:
                    fc.attrs = {**prev, **extra} if prev else extra
            except Exception:  # a call torch itself will reject: let it say why
                pass
            try:
                return orig(*args, **kwargs)
            finally:
                fc.attrs = prev

        setattr(wrapper, ORIGINAL, orig)
        return wrapper

    def _redistribute_wrapper(self, orig):
        tracer, fc = self.tracer, self

        @functools.wraps(orig)
        def wrapper(local_tensor, current_spec, target_spec, *args, **kwargs):
            if not tracer.tracing_step or tracer.busy or not tracer.enabled:
                return orig(local_tensor, current_spec, target_spec, *args, **kwargs)
            prev = fc.attrs
            try:
                info = {"from": [str(p) for p in current_spec.placements],
                        "to": [str(p) for p in target_spec.placements],
                        "async_op": bool(kwargs.get("async_op", False))}
                fc.attrs = {**(prev or {}), "redistribute": info}
            except Exception:
                pass
            try:
                return orig(local_tensor, current_spec, target_spec, *args, **kwargs)
            finally:
                fc.attrs = prev

        setattr(wrapper, ORIGINAL, orig)
        return wrapper

    # ------------------------------------------------------------------ spans
    def issued(self, token, outputs, attrs, done: bool) -> None:
        """The op returned ``outputs``: reserve their fingerprint indices and await them (or,
        when ``done``, they are finished: take them now)."""
        tracer = self.tracer
        fp = tracer.fps.reserve(len(outputs)) if outputs and tracer.fp_now else -1
        token += (outputs, dict(attrs) if attrs else None, fp, None)
        if done:
            self.waited(token)
            return
        awaiting = self.awaiting
        for t in outputs:
            tokens = awaiting.setdefault(_storage_key(t), [])
            if not any(k is token for k in tokens):  # (outputs that are views of one buffer)
                tokens.append(token)

    def waited(self, token) -> None:
        """``token``'s results are complete: fingerprint them into its reserved indices (without
        moving the fingerprint counter: this may run inside the tracer's own fingerprinting)
        and queue the record."""
        if token[T_WAITED] is not None:
            return
        token[T_WAITED] = _now()
        outputs = token[T_OUT]
        awaiting = self.awaiting
        for t in outputs:  # one wait completes every output of a coalesced call
            key = _storage_key(t)
            tokens = awaiting.get(key)
            if tokens:
                tokens[:] = [k for k in tokens if k is not token]  # (lists: by identity)
                if not tokens:
                    del awaiting[key]
        tracer = self.tracer
        was = tracer.busy
        tracer.busy = True  # the reductions below are nobody's lineage
        try:
            started = token[T_STARTED]
            if started is not None:
                token[T_STARTED] = None
                if token[T_STEP] == tracer.step and not tracer.capturing:
                    self.ic.device_times.end(token[T_STEP], token[5], started)
                else:
                    self.ic.device_times.discard(started)
            base = token[T_FP_OUT]
            if base >= 0:
                if token[T_STEP] == tracer.step and tracer.fp_now:
                    _fingerprint_at(tracer.fps, base, outputs)
                else:
                    token[T_FP_OUT] = -1
        except Exception as exc:
            token[T_FP_OUT] = -1
            tracer.on_error(f"collective {token[0]}", exc)
        finally:
            tracer.busy = was
        self.ready.append(token)

    def drain(self) -> None:
        """Write the records of waited spans (from a point where no record is being made)."""
        ready = self.ready
        while ready:
            self.ic.finish(ready.pop(0))

    def end_step(self) -> None:
        self.drain()
        self.awaiting.clear()
        self.attrs = None


def _fingerprint_at(fps, base, tensors) -> None:
    """Fingerprint ``tensors`` now as values ``base``, ``base + 1``, ... (indices ``reserve``
    gave), outside autograd."""
    fps.forget(tensors)  # an in-place op's input: its cached value is the old one
    grad = torch.is_grad_enabled()
    if grad:
        torch._C._set_grad_enabled(False)
    try:
        for i, t in enumerate(tensors):
            fps.reduce_now(base + i, t)
    finally:
        if grad:
            torch._C._set_grad_enabled(True)


def original_of(fn):
    """The function a wrapper replaced (a stale wrapper of a stopped tracer), or ``fn``."""
    while fn is not None and is_wrapped(fn):
        fn = getattr(fn, ORIGINAL)
    return fn if callable(fn) else None


def loaded_modules() -> list:
    """(name, module) of the modules with functions to wrap that are imported already."""
    return [(n, sys.modules[n]) for n in (FUNCOL, REDISTRIBUTE) if n in sys.modules]
