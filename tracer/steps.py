"""The step state machine: when a step begins and ends, and what is written then.

A *root* is a module called while no traced call is open; one call of a root is one step.
Roots get their own forward pre/post hooks (two Python calls per step); global interception
(tracer/intercept.py) is installed only while a step inside the ``--steps`` window runs. A
framework integration may delimit steps itself (``begin_external_step``). CUDA-graph replays
are steps of their own (tracer/graph_replay.py).

Every function takes the tracer first.
"""

from __future__ import annotations

import functools
import sys
import threading
import time

import torch

from tensor_trace import schema
from tensor_trace.tracer import host_values, naming, native, spans

_get_ident = threading.get_ident
_now = time.monotonic_ns

LINEAGE_FIRST = 2  # traced steps of each kind that always record lineage
# Traced steps of each kind that always take fingerprints: enough for the verdicts' three sampled
# steps of each kind (exporters/analysis/verdicts.py) and one more, e.g. a decode step whose
# padded rows a DP-attention rank fills with NaN (exporters/analysis/rules.py, non-finite-values).
FINGERPRINT_FIRST = 4
_CALL_IMPL = torch.nn.Module._call_impl.__code__
_CUDA_BUILT = torch.backends.cuda.is_built()  # (a CPU build of torch captures no CUDA graph)


def hook_root(t, module) -> list:
    """A root's own step hooks (their handles)."""
    return [
        module.register_forward_pre_hook(functools.partial(root_pre, t), with_kwargs=True),
        module.register_forward_hook(functools.partial(root_post, t), with_kwargs=True,
                                     always_call=True),
    ]


def adopt_root(t, module, hooks: bool = True) -> None:
    """Give a newly seen outermost module its own step hooks and name its submodules."""
    t.roots[module] = hook_root(t, module) if hooks else []
    naming.name_root(t, module)
    if t.lineage is not None:
        t.lineage.add_params(module)
    t.record_module_attrs(module)
    if t.fingerprint and not is_capturing():
        naming.record_parameters(t, module)


def discover_root(t, module, args) -> None:
    """A module called while no step runs: the root of a new step."""
    t.busy = True
    try:
        adopt_root(t, module)
        begin_step(t, module, args)
    except Exception as exc:
        t.on_error("root discovery", exc)
    finally:
        t.busy = False


def root_pre(t, module, args, kwargs):
    if t.in_step or t._busy or not t.enabled:  # (_busy: Tracer.busy without its descriptor)
        return None
    try:
        begin_step(t, module, args)
    except Exception as exc:
        t.on_error("step begin", exc)
    return None


def root_post(t, module, args, *rest):
    if not t.in_step or t._busy:
        return None
    stack = t.stack
    if t._tracing_step:
        if len(stack) != 1 or stack[0][spans.F_MODULE] is not module:
            return None
    else:
        if t.step_root is module:
            # The end of a step outside the window: only the step state to reset (no lineage
            # mode, quiet hooks, capture or open call is ever set up for such a step), here
            # rather than in a function of its own (a call less at every such step)
            try:
                lineage = t.lineage
                if lineage is not None and (lineage.mode is not None or t.quiet_hooks):  # (never)
                    lineage.end_step()
                    t.set_quiet_hooks(False)
                if stack:
                    stack.clear()
                t.step_root = None  # never keep the model alive past its step
                t.in_step = False
                if t.step + 1 >= t.config.window.stop:
                    t.go_dormant()
            except Exception as exc:
                t.on_error("step end", exc)
                t.in_step = False
        return None
    t.busy = True  # the tracer's own tensor ops below are nobody's lineage
    try:
        end_step(t, error=len(rest) == 1 and sys.exc_info()[0] is not None, result=rest[-1],
                 kwargs=rest[0] if len(rest) == 2 else None)
    except Exception as exc:
        t.on_error("step end", exc)
        t.stack.clear()
        t.in_step = False
    finally:
        t.busy = False
        if t._tracing_step:  # (end_step's own, unless it failed first)
            t.tracing_step = False
    return None


def step_kind(path: str, attrs) -> tuple:
    """What kind of step this is, for the schedules of lineage and fingerprints: its root, and
    a framework's forward mode, draft flag (an EAGLE draft's steps are not the target's) and
    CUDA-graph role (SGLang's warm-up runs before a capture are not the decode steps they
    precede, and would use up the first steps of that kind).

    Under DP attention each DP rank has a forward mode of its own (idle where it has no
    tokens, extend on one while another decodes): counted by mode, the ranks' schedules would
    drift apart, and values are evidence only where every rank of a group took them. There the
    mode is replaced by what every rank knows alike: which DP ranks have tokens (``dp_tokens``)."""
    if not attrs:
        return (path,)
    mode = attrs.get("forward_mode")
    dp_tokens = attrs.get("dp_tokens")
    if isinstance(dp_tokens, (list, tuple)) and len(dp_tokens) > 1:
        mode = ("dp", tuple(bool(n) for n in dp_tokens))
    return (path, mode, attrs.get("draft"), attrs.get("cuda_graph"))


def due(counts: dict, kind, first: int, every: int) -> bool:
    """Count one more step of ``kind`` in ``counts``; whether it is one of the first ``first``
    of its kind or an ``every``-th one after them (``every`` <= 1: all are)."""
    n = counts.get(kind, 0)
    counts[kind] = n + 1
    return every <= 1 or n < first or n % every == 0


def _lineage_due(t, kind) -> bool:
    """Whether this step records lineage (``TraceConfig.lineage_every``)."""
    return due(t.lineage_steps, kind, LINEAGE_FIRST, t.config.lineage_every)


def replay_fingerprint_due(t, kind) -> bool:
    """Whether a CUDA-graph replay run as a step of its own takes fingerprints: the schedule of
    ``_fingerprint_due``, with replays of a kind counted apart from its eager steps."""
    return due(t.fp_steps, ("replay",) + tuple(kind), FINGERPRINT_FIRST, t.config.fingerprint_every)


def _fingerprint_due(t, kind, lineage_now: bool) -> bool:
    """Whether this (uncaptured) step takes fingerprints (``TraceConfig.fingerprint_every``).
    A step that records lineage always does: its refs name the values they carry."""
    return due(t.fp_steps, kind, FINGERPRINT_FIRST, t.config.fingerprint_every) or lineage_now


def open_traced_step(t, fingerprint: bool) -> int:
    """Reset the per-step state of a traced step on this thread; returns its start on the raw
    clock (span times are offsets from it)."""
    t.stats["steps"] += 1
    t.step_thread = _get_ident()
    counters = t.counters
    counters.calls = {}
    counters.span_count = t.coll_count = 0
    t0 = _now()
    t.step_t0_raw = t0
    t.step_t0 = t.absolute(t0)
    t.fp_now = fingerprint
    return t0


def begin_step(t, root, args) -> None:
    step = t.step = t.step + 1
    t.in_step = True
    t.step_root = root
    if step not in t.config.window:  # (TraceConfig.in_window's rule, without its call)
        # A step outside the window: no interception runs in it, so nothing looks for its
        # root's frame (step_is_stale); walking up to it makes frame objects for the calls on
        # the way (about 12 us a step of the example in one A/B, 1 process, noisy)
        t.step_frame = None
        if t._tracing_step:
            t.tracing_step = False
        t.stats["steps_skipped"] += 1
        if t.global_handles:
            t.remove_interception()
        if t.native_pending:
            # (asked for at the process's first step, traced or not: the C path of the
            # collectives then keeps their sequence numbers before the window too)
            _poll_native(t)
        return
    t.step_frame = None if t.external_steps else _root_call_frame()
    if not t.global_handles:
        t.install_interception()
    if t.writer is None:
        t.ensure_writer()
    if t.native_pending:
        _poll_native(t)
    t.tracing_step = True
    t.capturing = is_capturing()
    entry = t.names.get(root)
    if entry is None:
        t.names[root] = entry = naming.module_entry(t, "", root)
    attrs = t.step_attrs or {}
    kind = step_kind(entry[0], attrs)
    lineage_now = t.lineage is not None and _lineage_due(t, kind)
    # Under a capture, fingerprint kernels become part of the graph (tracer/cuda_graphs.py) and
    # run at every replay: a capture is fingerprinted whatever the schedule (and counts in no
    # kind's), but only one begun through CUDAGraph.capture_begin can hand its buffer to replays.
    graph_fp = t.capturing and t.graphs is not None and t.graphs.capturing is not None
    if t.capturing:
        fp_now = t.fingerprint and graph_fp
    else:
        fp_now = t.fingerprint and _fingerprint_due(t, kind, lineage_now)
    t0 = open_traced_step(t, fp_now)
    if graph_fp and fp_now:
        t.fps.begin_capture()
    t.span_flags = schema.FLAG_CAPTURED if t.capturing else 0
    path_id = t.writer.module(entry[0], entry[1])
    if t.capturing:
        attrs = dict(attrs, captured=True)
    if not t.identity.get("device"):
        dev = _first_device(args)
        if dev is not None:
            t.update_identity(device=dev)
    t.step_end_attrs = None
    t.writer.add((schema.STEP_BEGIN, t.step, path_id, t.step_t0, attrs, fp_now))
    t.step_info = (entry[0], entry[1], attrs)
    spans.push_root(t, root, args, entry, t0, path_id)
    if lineage_now:
        t.lineage.begin_step()
        t.set_quiet_hooks(True)


def _poll_native(t) -> None:
    """Start tracer/native.py's build at the first step (processes that never run a step do not
    build), and take its pair_key once it is ready; the Python key until then or
    if it is unavailable."""
    if not native.enabled(t.config.native):
        t.native_pending = False
        return
    native.ensure()
    fn = native.pair_key()
    if fn is not None:
        spans.use_native_keys(fn, native.call_key())
        host_values.use_native(*native.host_values())
        t.native_pending = False
        t.use_native_call()
    elif native.error() is not None:
        t.native_pending = False


def begin_external_step(t, root, args, attrs=None) -> bool:
    """See ``Tracer.begin_external_step``."""
    if t.in_step or t.busy or not t.enabled:
        return False
    t.busy = True
    try:
        t.external_steps = True
        if root not in t.roots:
            adopt_root(t, root, hooks=False)
        t.step_attrs = attrs or None
        begin_step(t, root, args)
        return True
    except Exception as exc:
        t.on_error("step begin", exc)
        return False
    finally:
        t.step_attrs = None
        t.busy = False


def end_external_step(t, root, result, error: bool = False) -> None:
    if not t.in_step or t.step_root is not root:
        return
    t.busy = True
    try:
        end_step(t, error=error, result=result)
    except Exception as exc:
        t.on_error("step end", exc)
        t.stack.clear()
        t.in_step = t.tracing_step = False
    finally:
        t.busy = False


def step_is_stale(t) -> bool:
    """True when the frame that called the current step's root is no longer running."""
    frame = t.step_frame
    if frame is None:
        return False
    cur = sys._getframe(1)
    while cur is not None:
        if cur is frame:
            return False
        cur = cur.f_back
    return True


def end_step(t, error: bool = False, result=None, kwargs=None) -> None:
    step = t.step
    try:
        if t._tracing_step:
            spans.close_open_calls(t, kwargs, result, error)
    finally:
        lineage = t.lineage
        if lineage is not None and (lineage.mode is not None or t.quiet_hooks):
            # (after the root's record: its outputs may be nodes) also when recording it
            # failed: a lineage mode left on would stay on the program's torch function stack
            # for good, under the next step's
            lineage.end_step()
            t.set_quiet_hooks(False)
    if t._tracing_step:
        if t.collectives is not None:
            t.collectives.end_step()
        rec = (schema.STEP_END, step, t.absolute(_now()), t.counters.span_count, t.coll_count)
        if t.step_end_attrs:
            rec += (t.step_end_attrs,)
            t.step_end_attrs = None
        t.writer.add(rec)
        fps = t.fps
        if t.capturing:
            _end_captured_step(t, step)
        elif t.fp_now:
            fps.finish_step(step)
        elif fps.count:  # (a step that took no value has nothing to clear: no new lists a step)
            fps.reset()
        if not t.capturing:  # no event may be queried while a stream is being captured
            # (an earlier step's deferred values too, when this one took none; each source's
            # queue read first, as its collect would, without a call when it is empty)
            if fps.copies.pending:
                for rec in fps.collect():
                    t.writer.add(rec)
            if t.device_times.pending:
                for rec in t.device_times.collect():
                    t.writer.add(rec)
        t.stats["spans"] += t.counters.span_count
        t.stats["collectives"] += t.coll_count
        writer = t.writer
        if not writer.woken:  # on disk soon if no step follows (never written here)
            writer.flush_when_idle()
    t.stack.clear()
    t.step_root = None  # never keep the model alive past its step
    t.step_frame = None
    t.in_step = False
    t.tracing_step = False
    t.capturing = False
    # (the window is one range: a step in it is followed by one in it or by its close; a step
    # before it found interception taken out at its begin)
    if step + 1 >= t.config.window.stop:
        t.go_dormant()


def _end_captured_step(t, step: int) -> None:
    """The step that just ended was captured into a CUDA graph: its fingerprint kernels go into
    the graph, and the graph remembers the step for its replays (tracer/graph_replay.py)."""
    from tensor_trace.tracer.cuda_graphs import CapturedStep

    fps = t.fps.finish_capture()  # also ends begin_capture's settings
    if not t.fp_now:
        fps = None
    if t.graphs is not None and t.graphs.capturing is not None:
        path, cls, attrs = t.step_info
        t.graphs.add_captured(CapturedStep(step, (path, cls), attrs, t.counters.span_count, t.coll_count, fps))


def _root_call_frame():
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    return frame


def is_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    try:
        return _CUDA_BUILT and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _first_device(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return str(a.device)
    return None
