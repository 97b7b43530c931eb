"""Collective interception: every c10d and functional collective becomes a span.

Covered: ``torch.distributed`` all_reduce, reduce_scatter(_tensor), _reduce_scatter_base,
all_gather(_into_tensor, _object), _all_gather_base, all_to_all(_single), broadcast, reduce,
gather, scatter, barrier, send/recv, isend/irecv; and the functional collectives (funcol,
DTensor redistribution), intercepted at the ``torch.ops._c10d_functional`` namespace (which
``torch.distributed._functional_collectives`` looks up at every call), with the span of an
async result ending at its ``wait_tensor`` (tracer/functional.py).

Names bound at import time. Code such as ``from torch.distributed import all_reduce`` (SGLang
binds ``reduce_scatter_tensor`` this way) keeps the function object it got. Two things reach such
names: (1) the bootstrap patches right after ``import torch`` finishes, before user modules run
their imports, so they bind the wrapper; (2) ``install`` also walks ``sys.modules`` and rebinds
every module-level attribute that *is* an original function to its wrapper, for code imported
before tracing started. ``uninstall`` reverses both. The same holds for the Python functions
of funcol and DTensor that tracer/functional.py wraps; those modules are usually imported after
tracing started, and are wrapped when they are (``on_import``, through the bootstrap's watcher).

No double counting: a collective called while another is being recorded (``all_gather_object``
calls ``all_gather``; a functional wrapper calls its op) is passed straight through.

Sequence numbers: one counter per process group, advanced by every call through the wrappers,
traced or not, so that ranks agree on ``(group, seq)`` whatever their step windows.
"""

from __future__ import annotations

import functools
import sys
import time
import types

import torch

from tensor_trace import schema
from tensor_trace.tracer import functional, native, native_coll_type, spans
from tensor_trace.tracer.collective_specs import ALWAYS_ASYNC as _ALWAYS_ASYNC
from tensor_trace.tracer.collective_specs import C10D_SPECS as _C10D_SPECS
from tensor_trace.tracer.collective_specs import REDUCING as _REDUCING
from tensor_trace.tracer.collective_specs import ROW_CHECKED as _ROW_CHECKED
from tensor_trace.tracer.collective_specs import layout_of as _layout_of
from tensor_trace.tracer.collective_specs import nonzero_rows as _nonzero_rows
from tensor_trace.tracer.collective_specs import reduce_op_name as _reduce_op_name
from tensor_trace.tracer.functional import tensors_of
from tensor_trace.tracer.patching import ORIGINAL, is_wrapped

_ACTIVE = None  # the Tracer whose wrappers are installed
_c10d = None  # torch.distributed.distributed_c10d, once a tracer installed its wrappers
_FUNCTION = types.FunctionType
_now = time.monotonic_ns


_OpPacketWrapper = functional.OpPacketWrapper  # (its old name)


class TracedWork:
    """Stands in for an async collective's ``Work``: ends the span when it is waited on."""

    __slots__ = ("_work", "_token", "_interceptor")

    def __init__(self, work, token, interceptor):
        self._work = work
        self._token = token
        self._interceptor = interceptor

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._finish()
        return result

    def _finish(self):
        token, self._token = self._token, None
        if token is not None:
            self._interceptor.finish(token)

    def get_future(self):
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


class CollectiveInterceptor:
    """Installs and removes the collective wrappers for one Tracer."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.originals: dict[str, object] = {}
        self.wrappers: dict[str, object] = {}
        self.rebound: list = []  # (module dict, name, original)
        self.groups: dict[str, tuple] = {}  # c10d group name -> (gid, None, name, ranks, ...)
        self.seq: dict[int, int] = {}
        self.open_async: dict[int, tuple] = {}  # token id -> token (for unwaited at step end)
        self.rows_of: dict = {}  # token id -> nonzero rows of its inputs, until its record is written
        self.device_times = tracer.device_times
        self.functional = functional.FunctionalCollectives(self)
        self.native_paths: dict = {}  # name -> (set its C path, the Python path, torch's function)
        self.native_calls: dict = {}  # name -> its C path in use (tracer/native_coll.py)

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        global _ACTIVE, _c10d
        import torch.distributed as dist

        if not dist.is_available():
            return
        from torch.distributed import distributed_c10d as c10d

        _c10d = c10d
        _ACTIVE = self.tracer
        for name, spec in _C10D_SPECS.items():
            orig = getattr(c10d, name, None)
            if orig is None or is_wrapped(orig):
                continue
            wrapper = self._c10d_wrapper(name, orig, spec)
            self.originals[name] = orig
            self.wrappers[name] = wrapper
        for name in ("init_process_group", "new_group"):
            orig = getattr(c10d, name, None)
            if orig is not None and not is_wrapped(orig):
                self.originals[name] = orig
                self.wrappers[name] = self._identity_wrapper(orig)
        fc = self.functional
        fc.install_ops()
        for mod_name, mod in functional.loaded_modules():
            for name, orig, wrapper in fc.python_functions(mod_name, mod):
                self.originals[f"{mod_name}.{name}"] = orig
                self.wrappers[f"{mod_name}.{name}"] = wrapper
        self._rebind(list(sys.modules.items()), self.originals)

    def _rebind(self, modules, originals) -> None:
        """Point every module-level name bound to one of ``originals`` (or to a stopped
        tracer's wrapper of one) at its wrapper."""
        by_original = {id(o): (n, o) for n, o in originals.items()}
        for mod_name, mod in modules:
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict) or mod_name.startswith("tensor_trace"):
                continue
            try:
                items = list(d.items())
            except Exception:
                continue
            for attr, value in items:
                hit = by_original.get(id(value))
                # (getattr: reading a function's __dict__ creates one for every function of every
                # module, and those allocations set off full garbage collections over torch's
                # objects: 82 ms of each traced process's start against 12)
                if hit is None and type(value) is _FUNCTION and getattr(value, ORIGINAL, None) is not None:
                    inner = functional.original_of(value)
                    hit = by_original.get(id(inner))
                    if hit is not None and hit[1] is inner and value is not self.wrappers[hit[0]]:
                        value = inner
                    else:
                        hit = None
                if hit is not None and hit[1] is value:
                    d[attr] = self.wrappers[hit[0]]
                    self.rebound.append((d, attr, value))

    def on_import(self, mod_name: str, module) -> None:
        """A module with functions to wrap was imported after ``install``: wrap them in it
        (right after it ran, before other modules import names from it)."""
        found = {}
        for name, orig, wrapper in self.functional.python_functions(mod_name, module):
            key = f"{mod_name}.{name}"
            if key in self.originals:
                continue
            self.originals[key] = orig
            self.wrappers[key] = wrapper
            found[key] = orig
        if found:
            self._rebind([(mod_name, module)], found)

    def use_native(self) -> int:
        """tracer/native.py is ready: each wrapper of a collective of tensors calls its C path
        first (tracer/native_coll.py). How many do."""
        return native_coll_type.attach(self, native.traced_collective(), native.call_key())

    def uninstall(self) -> None:
        global _ACTIVE
        native_coll_type.detach(self)
        for d, attr, value in self.rebound:
            d[attr] = value
        self.rebound = []
        self.functional.uninstall()
        if _ACTIVE is self.tracer:
            _ACTIVE = None

    # ------------------------------------------------------------------ wrappers
    def _identity_wrapper(self, orig):
        tracer = self.tracer

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            result = orig(*args, **kwargs)
            try:
                if tracer.enabled:
                    tracer.update_identity()
            except Exception as exc:
                tracer.on_error("identity", exc)
            return result

        wrapper.__tensor_trace_original__ = orig
        return wrapper

    def _c10d_wrapper(self, name, orig, spec):
        names, in_arg, out_arg, has_op = spec
        tracer = self.tracer
        interceptor = self
        group_seq = self.group_seq
        always_async = name in _ALWAYS_ASYNC
        # Positions of the arguments read below (len(names): only by keyword), so that a call
        # builds no dict of its arguments.
        at = {n: i for i, n in enumerate(names)}
        group_at, in_at, out_at = at["group"], at.get(in_arg, 0), at.get(out_arg, 0)
        op_at, async_at = at.get("op", len(names)), at.get("async_op", len(names))
        fast = None  # this collective's C path (tracer/native_coll.py), once built: use_native

        def make(native_first):  # (two functions of one body: the C path's fallback skips it)
            @functools.wraps(orig)
            def wrapper(*args, **kwargs):
                if native_first and fast is not None:
                    return fast(*args, **kwargs)  # (it calls the other one for what it does not do)
                # (``_busy``, ``_tracing_step``: what Tracer.busy and .tracing_step return, read
                # without their descriptor's Python call; this wrapper runs for every collective of
                # every step, inside the window or not: what it reads is read in place, with no
                # call of bind_args or tensors_of for a lone tensor)
                if not tracer.enabled or tracer.in_collective or tracer._busy:
                    return orig(*args, **kwargs)
                token = None
                try:
                    n = len(args)
                    group = group_seq(args[group_at] if group_at < n else
                                      kwargs.get("group") if kwargs else None)
                    if tracer._tracing_step:
                        is_async = always_async or bool(args[async_at] if async_at < n else
                                                        kwargs.get("async_op") if kwargs else None)
                        if in_arg:
                            inputs = args[in_at] if in_at < n else kwargs.get(in_arg) if kwargs else None
                            inputs = [inputs] if type(inputs) is _Tensor else tensors_of(inputs)
                        else:
                            inputs = []
                        if out_arg:
                            out = args[out_at] if out_at < n else kwargs.get(out_arg) if kwargs else None
                            outputs = [out] if type(out) is _Tensor else tensors_of(out)
                        else:
                            out = outputs = None
                        op = None
                        if has_op:
                            op = args[op_at] if op_at < n else kwargs.get("op") if kwargs else None
                        token = interceptor.begin(name, op, group, inputs, is_async, outputs)
                        token.append(out)
                except Exception as exc:
                    tracer.on_error(f"collective {name}", exc)
                    token = None
                # interceptor.call inlined (a Python frame less per collective)
                tracer.in_collective = True
                try:
                    result = orig(*args, **kwargs)
                except BaseException:
                    tracer.in_collective = False
                    if token is not None:
                        interceptor.finish(token, error=True)
                    raise
                tracer.in_collective = False
                if token is None:
                    return result
                if token[_T_ASYNC] and result is not None:
                    return TracedWork(result, token, interceptor)
                interceptor.finish(token)
                return result

            wrapper.__tensor_trace_original__ = orig
            return wrapper

        def use_native(c):
            nonlocal fast
            fast = c

        wrapper, python_path = make(True), make(False)
        self.native_paths[name] = (use_native, python_path, orig)
        return wrapper

    # ------------------------------------------------------------------ groups
    def group_seq(self, group) -> tuple:
        """(per-process group id, this call's sequence number) for a process group or its name
        (None = the default group); advances the group's sequence."""
        c10d = _c10d
        # Keyed by c10d's group name: holding the group object itself would keep a destroyed
        # process group alive (and gloo aborts at exit when one outlives its store).
        if group is None:
            group = c10d._get_default_group()
        elif isinstance(group, str):
            group = c10d._resolve_process_group(group)
        pg_name = getattr(group, "group_name", "") or str(id(group))
        entry = self.groups.get(pg_name)
        if entry is None:
            try:
                ranks = c10d.get_process_group_ranks(group)
            except Exception:
                ranks = []
            try:
                backend = str(c10d.get_backend(group))
            except Exception:
                backend = ""
            desc = getattr(group, "group_desc", "") or ""
            is_default = group is c10d._get_default_group()
            name = "world" if is_default else (desc if desc and desc != "undefined" else pg_name)
            return self.seq_for(pg_name, name, list(ranks), backend, pg_name)
        gid = entry[0]
        if gid not in self.tracer.written_groups and self.tracer.writer is not None:
            return self._next_seq(entry)  # (its GROUP record first; none before the rank file)
        seq = self.seq[gid]
        self.seq[gid] = seq + 1
        return gid, seq

    def seq_for(self, key: str, name: str, ranks: list, backend: str, pg_name: str) -> tuple:
        """(group id, sequence number) of a call on the group known by ``key`` (a framework's
        own group object, e.g. SGLang's GroupCoordinator, or a c10d group name)."""
        entry = self.groups.get(key)
        if entry is None:
            entry = (len(self.groups), None, name, list(ranks), backend, pg_name)
            self.groups[key] = entry
            self.seq[entry[0]] = 0
        return self._next_seq(entry)

    def _next_seq(self, entry) -> tuple:
        gid = entry[0]
        written = self.tracer.written_groups
        if gid not in written and self.tracer.writer is not None:
            _, _, name, ranks, backend, pg_name = entry
            self.tracer.writer.add((schema.GROUP, gid, name, ranks, backend, pg_name))
            written.add(gid)
        seq = self.seq[gid]
        self.seq[gid] = seq + 1
        return gid, seq

    # ------------------------------------------------------------------ spans
    def call(self, token, fn, args, kwargs):
        """Run the real collective with ``in_collective`` set, so that the paths it takes inside
        (a c10d call under a framework's method, an op under a functional wrapper) pass through
        unrecorded; an exception ends the span as failed and propagates."""
        tracer = self.tracer
        tracer.in_collective = True
        try:
            return fn(*args, **kwargs)
        except BaseException:
            tracer.in_collective = False
            if token is not None:
                self.finish(token, error=True)
            raise
        finally:
            tracer.in_collective = False

    def begin(self, op, reduce_op, group_seq, inputs, is_async, outputs=None):
        """Open a collective's span (a token list; the caller appends the outputs to it).
        ``outputs``, when known before the call, only helps find the device to time on."""
        tracer = self.tracer
        if self.functional.ready:
            self.functional.drain()
        t0 = _now()
        index = tracer.coll_count
        tracer.coll_count = index + 1
        fp_pre, rows = -1, None
        if inputs and tracer.fp_now:
            fp_pre, rows = self.fp_inputs(inputs, op in _ROW_CHECKED and not tracer.capturing)
        gid, seq = group_seq
        started = None
        if not tracer.capturing:
            # (the first CUDA tensor's device, inputs first: one call for both lists)
            device = self.device_times.device_of(inputs + outputs if outputs else inputs)
            if device is not None:
                started = self.device_times.start(device)
        parent = -1  # spans.innermost_span inlined
        for frame in reversed(tracer.stack):
            if frame[_F_SELECTED]:
                parent = frame[_F_INDEX]
                break
        token = [op, reduce_op, gid, seq, t0, index, parent, inputs, fp_pre, is_async, tracer.step,
                 started]
        if is_async:
            self.open_async[id(token)] = token
        if rows is not None:
            self.rows_of[id(token)] = rows
        return token

    def fp_inputs(self, inputs, rows_wanted: bool) -> tuple:
        """A collective's inputs fingerprinted before the call, and (``rows_wanted``) their
        nonzero rows: ``(fp_pre, rows)``. Also what tracer/native_coll.py's C path calls on a
        fingerprinted step."""
        tracer = self.tracer
        was = tracer._busy
        tracer.busy = True  # the tracer's own ops: never lineage, never traced
        try:
            fps = tracer.fps
            # A deferred fingerprint of a tensor this collective may update in place must be
            # taken now.
            fps.materialize(inputs)
            fp_pre = fps.add(inputs, store=False, immediate=True)
            return fp_pre, (_nonzero_rows(inputs) if rows_wanted else None)
        finally:
            tracer.busy = was

    def fp_outputs(self, outputs) -> int:
        """A collective's outputs fingerprinted after the call (their cached values, from before
        it, dropped first): the index of the first. Also what the C path calls."""
        tracer = self.tracer
        was = tracer._busy
        tracer.busy = True
        try:
            fps = tracer.fps
            fps.forget(outputs)
            return fps.add(outputs)
        finally:
            tracer.busy = was

    def finish(self, token, error: bool = False, unwaited: bool = False) -> None:
        """Write a collective's record. A functional collective's token (tracer/functional.py)
        carries its attributes, and once waited the time of the wait and its output
        fingerprints, taken then."""
        tracer = self.tracer
        if tracer.writer is None:
            return
        if token[_T_ASYNC] and self.open_async.pop(id(token), None) is None:
            return  # already closed (e.g. as unwaited at the end of its step)
        # The tracer's own tensor ops below (fingerprints; shape reads under a lineage step's
        # torch function mode) are never traced: busy meanwhile. A step without either runs
        # none, and skips setting it (two Python calls of busy's descriptor per collective).
        lineage = tracer.lineage
        guard = tracer.fp_now or (lineage is not None and lineage.mode is not None)
        if guard:
            was = tracer._busy  # (at the end of a step: the tracer's own work goes on after this)
            tracer.busy = True
        try:
            n = len(token)
            op, reduce_op, gid, seq, t0, index, parent, inputs, fp_pre, is_async, step, started = token[:12]
            out = token[12] if n > 12 else None
            outputs = [out] if type(out) is _Tensor else tensors_of(out)
            attrs = token[functional.T_ATTRS] if n > functional.T_ATTRS else None
            rows = self.rows_of.pop(id(token), None) if self.rows_of else None
            if rows is not None:
                attrs = dict(attrs or {}, nonzero_rows=rows)
            waited = token[functional.T_WAITED] if n > functional.T_WAITED else None
            t1 = _now() if waited is None else waited
            if started is not None:
                if error or unwaited or step != tracer.step:
                    self.device_times.discard(started)
                else:
                    self.device_times.end(step, index, started)
            writer = tracer.writer
            fp_post = -1
            if waited is not None:
                fp_post = token[functional.T_FP_OUT]
            elif outputs and tracer.fp_now and step == tracer.step and not unwaited and n <= 13:
                fp_post = self.fp_outputs(outputs)
            # The layout: from the cache by tracer/native.py's call_key where it is built (see
            # _layout_of; its hit inlined here).
            key_fn = spans.call_key
            key = key_fn(tuple(inputs), None, outputs, _NO_CONTEXT) if key_fn is not None else -1
            hit = tracer.layouts.coll.get(key) if key >= 0 else None
            layout, nbytes = hit if hit is not None else _layout_of(tracer, writer, inputs, outputs, key)
            flags = ((schema.FLAG_ASYNC if is_async else 0) | (schema.FLAG_ERROR if error else 0)
                     | (schema.FLAG_CAPTURED if tracer.capturing else 0)
                     | (schema.FLAG_UNWAITED if unwaited else 0))
            # (interned string ids looked up in the writer's table first: a method call only
            # for a string new to the file)
            strings = writer.string_ids
            if reduce_op is not None or op in _REDUCING:
                redop_name = "sum" if reduce_op is None else _reduce_op_name(reduce_op)
                redop = strings.get(redop_name)
                if redop is None:
                    redop = writer.string(redop_name)
            else:
                redop = -1
            op_id = strings.get(op)
            if op_id is None:
                op_id = writer.string(op)
            record = (schema.COLLECTIVE, step, index, parent, op_id, redop, gid, seq,
                      t0 - tracer.step_t0_raw, t1 - t0, layout, fp_pre, fp_post, len(inputs), flags,
                      nbytes)
            buf = writer.pending  # (writer.add inlined, as tracer/spans.py does)
            buf.append(record + (attrs,) if attrs else record)
            if len(buf) >= writer.max_buffered:
                writer.flush()
        except Exception as exc:
            tracer.on_error(f"collective {token[0]}", exc)
        finally:
            if guard:
                tracer.busy = was

    def end_step(self) -> None:
        """Write the records of this step's waited functional collectives, and close the async
        collectives that were never waited on."""
        fc = self.functional
        if fc.ready or fc.awaiting or fc.attrs is not None:  # (a step of none: no call)
            fc.end_step()
        if self.open_async:
            for token in list(self.open_async.values()):
                self.finish(token, unwaited=True)
            self.open_async.clear()
        if self.rows_of:
            self.rows_of.clear()


_T_ASYNC = 9
_F_SELECTED, _F_INDEX = spans.F_SELECTED, spans.F_INDEX
_NO_CONTEXT: set = set()  # (call_key's registered plain types: a collective's slots hold tensors only)
_Tensor = torch.Tensor


def on_import(mod_name: str, module) -> None:
    """A module named by tracer/functional.py was imported: wrap its functions for the active
    tracer (one started later wraps them when it installs)."""
    tracer = _ACTIVE
    if tracer is not None and getattr(tracer, "collectives", None) is not None:
        tracer.collectives.on_import(mod_name, module)
