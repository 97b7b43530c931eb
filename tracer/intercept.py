"""Interception of module calls: the call wrapper, the global hooks and their bodies.

Global interception (``--intercept call``: ``torch.nn.Module.__call__`` wrapped; ``hooks``:
``register_module_forward_pre_hook`` / ``register_module_forward_hook(always_call=True)``) is
installed only while a step inside the ``--steps`` window runs (tracer/steps.py), so steps
outside it cost nothing but the root's two hook calls. Before the first root is known it is
needed to find it.

Hot path: the hook bodies are module functions taking the tracer first; the hooks torch calls
are ``functools.partial`` objects over them (no Python frame of their own). Every body is
guarded: an exception goes to ``Tracer.on_error`` and the traced program goes on.
"""

from __future__ import annotations

import functools
import sys
import threading
import time

import torch
from torch.nn.modules import module as _nn_module

from tensor_trace import schema
from tensor_trace.tracer import naming, native, spans, steps
from tensor_trace.tracer.spans import (CONTEXT_TYPES, F_MODULE, argument_tensors, flatten_args,
                                       pop_record, record_tensors, span_one_tensor)

_now = time.monotonic_ns
_get_ident = threading.get_ident
_Tensor = torch.Tensor
_DisableTorchFunction = torch._C.DisableTorchFunction  # modes and subclasses both


def install_global_hooks(t) -> None:
    """Intercept every module call (``TraceConfig.intercept``), with the plain hook bodies or,
    while a step records lineage, the quiet ones."""
    if t.global_handles:
        return
    plain = (functools.partial(global_pre, t), functools.partial(global_post, t))
    quiet = (functools.partial(global_pre_quiet, t), functools.partial(global_post_quiet, t))
    t.hook_fns = {False: plain, True: quiet}
    t.pre_fn, t.post_fn = plain
    if t.config.intercept == "hooks":
        t.global_handles = [
            _nn_module.register_module_forward_pre_hook(plain[0]),
            _nn_module.register_module_forward_hook(plain[1], with_kwargs=True, always_call=True),
        ]
    else:
        t.global_handles = [CallWrapper.install(t)]
    t.quiet_hooks = False
    if t.lineage is not None and t.lineage.mode is not None:
        set_quiet_hooks(t, True)


def set_quiet_hooks(t, quiet: bool) -> None:
    """Swap the interception's functions (the hooks in place: same handles, same order among
    other hooks): a step that records lineage gets the quiet variants; every other step keeps
    the plain ones, with no wrapper call and no lineage test on the hot path."""
    if not t.global_handles or quiet == t.quiet_hooks:
        return
    pre, post = t.hook_fns[quiet]
    t.pre_fn, t.post_fn = pre, post
    if len(t.global_handles) == 2:
        h_pre, h_post = t.global_handles
        if h_pre.id in _nn_module._global_forward_pre_hooks:
            _nn_module._global_forward_pre_hooks[h_pre.id] = pre
        if h_post.id in _nn_module._global_forward_hooks:
            _nn_module._global_forward_hooks[h_post.id] = post
    t.quiet_hooks = quiet


def use_native_call(t) -> None:
    """tracer/native.py is ready (its layout keys taken): the call wrapper's C version in place
    of the Python one, if that is what intercepts calls now."""
    for h in t.global_handles:
        if isinstance(h, CallWrapper):
            h.use_native()


def remove_global_hooks(t) -> None:
    for handles in t.late_hooks.values():
        for h in handles:
            h.remove()
    t.late_hooks.clear()
    for h in t.global_handles:
        h.remove()
        # torch's handle forgets the hook's with_kwargs flag: left there, it makes
        # nn.modules.module._has_any_global_hook() true for the rest of the process.
        _nn_module._global_forward_hooks_with_kwargs.pop(getattr(h, "id", None), None)
    t.global_handles = []
    t.quiet_hooks = False


# With lineage on, the hooks run with the lineage mode off, and so does the body of every leaf
# module (no submodules: Linear, norms, embeddings, activations): that is where most torch
# calls of a step happen, and none of them can combine two recorded tensors, since a leaf's
# inputs and output are recorded at its boundary anyway.
def global_pre_quiet(t, module, args):
    with _DisableTorchFunction():
        result = global_pre(t, module, args)
    if (not module._modules and t.tracing_step and t.lineage.mode is not None
            and _get_ident() == t.step_thread and not _hands_sequence(args)):
        quiet = _DisableTorchFunction()
        quiet.__enter__()
        t.leaf_quiet.append((module, quiet))
    return result


def global_post_quiet(t, module, args, *rest):
    quiet = t.leaf_quiet
    if quiet and quiet[-1][0] is module:
        quiet.pop()[1].__exit__(None, None, None)
    with _DisableTorchFunction():
        return global_post(t, module, args, *rest)


def _hands_sequence(args) -> bool:
    """Whether a module call is handed a list or tuple of two or more tensors: a leaf that is
    gets to combine them (SGLang's logits processor concatenates the EAGLE-3 captures it is
    passed as a list), so its body keeps the lineage mode on. One pass over the arguments."""
    for a in args:
        if isinstance(a, (list, tuple)) and len(a) > 1:
            n = 0
            for x in a:
                if isinstance(x, torch.Tensor):
                    n += 1
                    if n > 1:
                        return True
    return False


def global_pre(t, module, args):
    # Hot path: runs before every module call of a traced step. Keep it lean: no torch call
    # unless fingerprints are on (inputs must be fingerprinted before the module runs).
    if _get_ident() != t.active_thread:
        return pre_outside(t, module, args)
    stack = t.stack
    try:
        if module is t.step_root and steps.step_is_stale(t):
            # The last step's root call ended by a BaseException (Ctrl-C): torch runs no
            # always_call hook for those, so close that step now, marked as failed; this
            # call's own root hook then starts a new step.
            steps.end_step(t, error=True)
            return None
        entry = t.ids.get(id(module))
        if entry is None or entry[3] is not t.writer.generation:
            entry = naming.entry_slow(t, module)
        top = stack[-1]
        parent = top[1] if top[8] else top[2]
        counters = t.counters
        if not entry[2] or counters.span_count >= t.max_spans:
            if entry[2]:
                t.stats["dropped_spans"] += 1
            stack.append([module, -1, parent, entry[4], 0, 0, None, -1, False])
            return None
        path_id = entry[4]
        call, index = counters.open(path_id)
    except Exception as exc:
        t.on_error("forward pre-hook", exc)
        if stack:  # an unrecorded frame, so that this call's post-hook finds its own
            stack.append([module, -1, -1, 0, 0, 0, None, -1, False])
        return None
    if t.fp_now:
        # No busy flag around these ops: nothing of ours reacts to them (a step with lineage
        # runs these hooks with torch functions off, see global_pre_quiet).
        try:
            if len(args) == 1 and type(args[0]) is _Tensor:
                # One tensor in: keep the args tuple, so the post-hook can take its fast path.
                slots = args
                fp_pre = t.fps.add_one(args[0], False)
            else:
                # Tensors and plain values only (None, numbers, a batch context object):
                # kept as they came, like the one-tensor case; anything else is walked.
                # (and tuples or lists of those, one level down, as record_tensors takes them)
                slots = tensors = args
                for a in args:
                    if not isinstance(a, _Tensor):  # not tensors only: a second look
                        tensors = argument_tensors(args)
                        if tensors is None:
                            slots = []
                            flatten_args(args, slots)
                            tensors = [s for _, s in slots]
                        break
                fp_pre = t.fps.add(tensors, store=False) if tensors else -1
        except Exception as exc:
            t.on_error("forward pre-hook", exc)
            slots, fp_pre = [], -1
        stack.append([module, index, parent, path_id, call, _now(), slots, fp_pre, True])
    else:
        stack.append([module, index, parent, path_id, call, _now(), args, -1, True])
    if module._forward_hooks and t.config.intercept == "hooks":
        late_post_hook(t, module)
    return None


def late_post_hook(t, module) -> None:
    """``--intercept hooks``: torch runs global forward hooks before a module's own, so the
    global post-hook would see an output the module's hooks then change (a DTensor plan's
    RowwiseParallel reduces its partial sums in one). For such a call, a forward hook of the
    module's own, registered now and so after its others, records the call instead, and is
    removed as it runs (or at stop)."""
    try:
        h = module.register_forward_hook(functools.partial(late_post, t), with_kwargs=True, always_call=True)
        t.late_hooks.setdefault(id(module), []).append(h)
    except Exception as exc:
        t.on_error("forward pre-hook", exc)


def late_post(t, module, args, *rest):
    handles = t.late_hooks.get(id(module))
    if handles:
        handles.pop().remove()
        if not handles:
            del t.late_hooks[id(module)]
    return t.post_fn(module, args, *rest)


def pre_outside(t, module, args):
    """The pre-hook when no traced step runs on this thread, or the tracer is busy."""
    busy = t._busy  # (Tracer.busy and .tracing_step without their descriptors' calls)
    if busy or not t._tracing_step:
        # Once a framework delimits steps, a module called outside them (a sampler) is not
        # a step of its own.
        if (not t.in_step and not busy and t.enabled and not t.external_steps
                and module not in t.roots):
            steps.discover_root(t, module, args)
    else:
        t.stats["foreign_thread_calls"] += 1
    return None


def global_post(t, module, args, *rest):
    # Hot path: runs after every module call of a traced step. The common case (the call's
    # frame on top, tensor in and tensor out, no lineage) is recorded inline; everything else
    # goes through pop_record.
    if _get_ident() != t.active_thread:
        return None
    if module._forward_hooks and t.late_hooks and id(module) in t.late_hooks:
        return None  # (--intercept hooks: late_post records it, after the module's own hooks)
    stack = t.stack
    if len(stack) <= 1:
        return None  # the root's own post-hook ends the step
    try:
        frame = stack[-1]
        _m, index, parent, path_id, call, t0, slots, fp_pre, selected = frame
        if _m is module and not selected:
            stack.pop()
            return None
        if (_m is module and len(rest) == 2 and not rest[0] and type(slots) is tuple
                and len(slots) == 1 and not t.quiet_hooks):
            result = rest[1]
            a = slots[0]
            if type(result) is _Tensor and type(a) is _Tensor:  # (subclasses: tracer/kinds.py)
                t1 = _now()
                stack.pop()
                span_one_tensor(t, index, parent, path_id, call, t0, t1, a, result, fp_pre, t.fp_now)
                return None
        if (_m is module and len(rest) == 2 and type(slots) is tuple and not t.quiet_hooks
                and record_tensors(t, frame, slots, rest[0], rest[1])):
            return None
        t.busy = True
        try:
            if len(rest) == 2:
                pop_record(t, module, rest[0], rest[1], False)
            else:  # the always_call path after an exception passes no kwargs
                pop_record(t, module, None, rest[0], sys.exc_info()[0] is not None)
        finally:
            t.busy = False
    except Exception as exc:
        t.on_error("forward hook", exc)
    return None


class CallWrapper:
    """``--intercept call``: ``torch.nn.Module.__call__`` replaced by a function that runs the
    tracer's pre- and post-hook bodies around torch's own ``__call__``.

    Same reach as global forward hooks (every ``module(...)``, nothing that calls ``forward``
    directly), same order (outside any hook a module has), and the post body runs however the
    call ends, BaseExceptions (Ctrl-C) included. What it saves is torch's hook machinery: with
    any global hook registered, every module call takes ``_call_impl``'s slow path (a closure,
    hook-dict copies, a set), which costs more than this wrapper and the hook bodies together
    (bench/RESULTS.md). Under ``torch.compile`` tracing the wrapper is a plain pass-through.
    Removal puts torch's function back if the wrapper is still the one installed; if someone
    patched ``__call__`` on top of it since, it stays in their chain as a pass-through.

    Once tracer/native.py is built (by default where CUDA is), ``use_native`` calls modules
    through the same wrapper in C (tracer/native_call.py): it records the common calls itself
    and hands every other call, whole or after torch's call, to the Python code here."""

    __slots__ = ("tracer", "active", "python_call", "native_call")

    def __init__(self, tracer):
        self.tracer = tracer
        self.active = True
        self.python_call = None  # the wrapper function
        self.native_call = None  # its C version, once tracer/native.py is built (use_native)

    @classmethod
    def install(cls, tracer) -> "CallWrapper":
        handle = cls(tracer)
        inner = torch.nn.Module.__call__
        get_ident = _get_ident
        compiling = torch.compiler.is_compiling

        tensor_type = _Tensor
        now = _now

        def __call__(module, *args, **kwargs):
            if compiling():  # first: what torch.compile traces here must be a plain call
                return inner(module, *args, **kwargs)
            t = handle.tracer
            if get_ident() != t.active_thread or not handle.active:
                if handle.active and t.enabled:
                    pre_outside(t, module, args)  # finds the first root; a root's hooks begin steps
                return inner(module, *args, **kwargs)
            frame = None
            if (len(args) == 1 and not kwargs and type(args[0]) is tensor_type and not t.quiet_hooks
                    and module is not t.step_root):
                # The common call, one tensor in (norms, projections, activations, most blocks):
                # global_pre's and global_post's bodies inline, without their two calls and
                # what they recompute. Anything unusual on the way takes the general path.
                a = args[0]
                try:
                    entry = t.ids.get(id(module))
                    counters = t.counters
                    if (entry is not None and entry[2] and entry[3] is t.writer.generation
                            and counters.span_count < t.max_spans):
                        stack = t.stack
                        top = stack[-1]
                        parent = top[1] if top[8] else top[2]
                        path_id = entry[4]
                        call, index = counters.open(path_id)
                        fp_now = t.fp_now
                        if fp_now:
                            fps = t.fps
                            if a is fps.last and fps.last_version is True:
                                # the previous call's output, deferred: its index (add_one's
                                # first case, without the call)
                                fp_pre = fps.last_idx
                            else:
                                fp_pre = fps.add_one(a, False)
                        else:
                            fp_pre = -1
                        t0 = now()
                        frame = [module, index, parent, path_id, call, t0, args, fp_pre, True]
                        stack.append(frame)
                except Exception as exc:
                    t.on_error("forward pre-hook", exc)
                    return inner(module, *args)  # this call untraced; its children still are
            if frame is not None:
                try:
                    result = inner(module, a)
                except BaseException:
                    t.post_fn(module, args, None)  # the error path, as always_call hooks get it
                    raise
                if type(result) is tensor_type and stack and stack[-1] is frame and not t.quiet_hooks:
                    try:
                        t1 = now()
                        stack.pop()
                        span_one_tensor(t, index, parent, path_id, call, t0, t1, a, result,
                                        fp_pre, fp_now)
                    except Exception as exc:
                        t.on_error("forward hook", exc)
                    return result
                # (output, bias) and the like: on to global_post's own next step, below
            else:
                t.pre_fn(module, args)
                try:
                    result = inner(module, *args, **kwargs)
                except BaseException:
                    t.post_fn(module, args, None)  # the error path, as always_call hooks get it
                    raise
            finish_call(t, module, args, kwargs, result)
            return result

        __call__.__wrapped__ = inner
        __call__._tensor_trace_wrapper = handle
        handle.python_call = __call__
        torch.nn.Module.__call__ = __call__
        handle.use_native()
        return handle

    def use_native(self) -> bool:
        """Call modules through tracer/native_call.py's ``TracedCall`` once tracer/native.py is
        built and spans' layouts are keyed by it (the same keys): the call slot of every class
        whose ``__call__`` is this Python wrapper points at it. Whether it does now.
        ``torch.nn.Module.__call__`` stays the Python wrapper."""
        make, patch = native.traced_call(), native.patch_call_slots()
        if not self.active or make is None or patch is None or spans.uses_python_keys():
            return False
        if vars(torch.nn.Module)["__call__"] is not self.python_call:
            return False  # (patched over since: their chain calls the Python wrapper)
        if self.native_call is None:
            self.native_call = make(self.python_call, self.python_call.__wrapped__, self.tracer, _Tensor,
                                    vars(torch.compiler), span_one_tensor, finish_call, CONTEXT_TYPES,
                                    schema.SPAN)
        return patch(self.native_call, torch.nn.Module, _calling_through_module()) > 0

    def remove(self) -> None:
        self.active = False
        if self.native_call is not None:
            self.native_call.close()
        fn = torch.nn.Module.__call__
        if getattr(fn, "_tensor_trace_wrapper", None) is self:
            torch.nn.Module.__call__ = fn.__wrapped__  # (CPython's call slots back too)


def _calling_through_module() -> list:
    """Every class (torch.nn.Module and its subclasses, now) whose ``__call__`` is Module's."""
    found, todo, seen = [], [torch.nn.Module], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        owner = next((c for c in cls.__mro__ if "__call__" in vars(c)), None)
        if owner is torch.nn.Module:
            found.append(cls)
        todo.extend(type.__subclasses__(cls))
    return found


def finish_call(t, module, args, kwargs, result) -> None:
    """The end of a wrapped call whose frame is on top (left by global_pre, the inline path, or
    tracer/native_call.py): recorded here as global_post would (its own checks already known
    true), else through it."""
    stack = t.stack
    if len(stack) > 1 and not t.quiet_hooks:
        frame = stack[-1]
        if frame[F_MODULE] is module and frame[8]:
            # global_post would only redo record_tensors before pop_record: straight there
            try:
                if type(frame[6]) is tuple and record_tensors(t, frame, frame[6], kwargs, result):
                    return
                t.busy = True
                try:
                    pop_record(t, module, kwargs, result, False)
                finally:
                    t.busy = False
            except Exception as exc:
                t.on_error("forward hook", exc)
            return
    t.post_fn(module, args, kwargs, result)
