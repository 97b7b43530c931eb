"""Replay steps: a CUDA-graph replay of traced captures, recorded as a step (or part of one).

tracer/cuda_graphs.py finds captures and replays (a captured step hands its fingerprint kernels
to its graph at its end, tracer/steps.py); this module is what the tracer writes for each
replay: the REPLAY records that point at the captured steps' spans, with fresh fingerprints. Every
function takes the tracer first.
"""

from __future__ import annotations

import threading
import time

from tensor_trace import schema
from tensor_trace.tracer import steps

_now = time.monotonic_ns
_get_ident = threading.get_ident


def run_replay(t, captured: list, fn, *args, **kwargs):
    """Run ``fn`` (the real ``CUDAGraph.replay``) as a traced replay of ``captured`` steps:
    a step of its own, or part of the step a framework has open."""
    if t.busy or (t.in_step and (not t.tracing_step or _get_ident() != t.step_thread)):
        _gate(t, captured, False)  # values that no one reads
        return fn(*args, **kwargs)
    own = not t.in_step
    started = None
    t.busy = True
    try:
        if own and not _begin_replay_step(t, captured):
            own = None
        else:
            static = next((c.fps.static for c in captured
                           if c.fps is not None and c.fps.static is not None), None)
            if static is not None and static.is_cuda:
                started = t.device_times.start(static.device)
    except Exception as exc:
        t.on_error("graph replay", exc)
        own = None if not t.in_step else own
    finally:
        t.busy = False
    # The graph's fingerprint kernels read their tensors only where the values are kept: a
    # replay step the schedule picks, or the framework step it is part of being fingerprinted.
    _gate(t, captured, own is not None and t.fp_now)
    if own is None:
        return fn(*args, **kwargs)
    t0 = _now()
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        if own:
            _end_replay_step(t)
        raise
    t1 = _now()
    t.busy = True
    try:
        _record_replays(t, captured, started, t0, t1)
    except Exception as exc:
        t.on_error("graph replay", exc)
    finally:
        t.busy = False
    if own:
        _end_replay_step(t)
    return result


def _gate(t, captured, read: bool) -> None:
    """Let the fingerprint kernels of the ``captured`` steps' graph read their tensors at this
    replay or not (multi_tensor's ``ReplayGate``); an error is reported, never raised."""
    for c in captured:
        if c.fps is not None:
            try:
                c.fps.read_at_replay(read)
            except Exception as exc:
                t.on_error("graph replay", exc)


def _record_replays(t, captured, started, t0, t1) -> None:
    step = t.step
    if started is not None:
        t.device_times.end(step, -1, started)
    writer = t.writer
    for c in captured:
        span_base, coll_base = t.counters.span_count, t.coll_count
        t.counters.span_count += c.n_spans
        t.coll_count += c.n_colls
        fp_base = -1
        if c.fps is not None and t.fp_now:
            fp_base = t.fps.reserve(c.fps.count)
            t.fps.add_replay(step, fp_base, c.fps)
        writer.add((schema.REPLAY, step, c.step, span_base, coll_base, fp_base,
                    t0 - t.step_t0_raw, t1 - t0))
    t.stats["graph_replays"] = t.stats.get("graph_replays", 0) + 1


def _begin_replay_step(t, captured) -> bool:
    c = captured[0]
    t.step += 1
    if not t.config.in_window(t.step):
        t.stats["steps_skipped"] += 1
        return False
    t.ensure_writer()
    t.in_step = t.tracing_step = True
    t.capturing = False
    path, cls = c.root
    attrs = {k: v for k, v in (c.attrs or {}).items() if k != "captured"}
    # Fingerprinted on the schedule of eager steps, counted apart for replays of each kind
    # (the graph's kernels are gated off on the others), where the graph holds fingerprint
    # kernels: a capture not begun through capture_begin holds none, and its replays must not
    # claim values that never come.
    fp_now = (t.fingerprint and any(x.fps is not None for x in captured)
              and steps.replay_fingerprint_due(t, steps.step_kind(path, attrs)))
    attrs["replay_of"] = c.step
    steps.open_traced_step(t, fp_now)
    t.span_flags = 0
    t.step_root = t.step_frame = None
    t.step_info = (path, cls, attrs)
    t.writer.add((schema.STEP_BEGIN, t.step, t.writer.module(path, cls), t.step_t0, attrs, t.fp_now))
    return True


def _end_replay_step(t) -> None:
    t.busy = True
    try:
        steps.end_step(t)
    except Exception as exc:
        t.on_error("graph replay", exc)
        t.in_step = t.tracing_step = False
    finally:
        t.busy = False
