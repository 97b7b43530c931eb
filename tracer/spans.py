"""Span emission: the SPAN record of a module call, from its open frame to the rank file.

The hot path. Each function takes the tracer first and appends its record to the writer's
``pending`` list itself (``RankWriter.add`` inlined: a Python call less per span). A span's
tensor layout is interned by the writer; the keys that find a layout id without building the
nested slot tuple are cached here (``SpanLayouts``) and forgotten with the writer's ids.

Frame layout (a list, for speed): the open calls of the current step, ``Tracer.stack``.
"""

from __future__ import annotations

import time

import torch

from tensor_trace import schema
from tensor_trace.tracer import kinds
from tensor_trace.tracer.tensor_slots import (CONTEXT_TYPES, MAX_TENSORS, flatten_args, flatten_kwargs,
                                             flatten_output)

F_MODULE, F_INDEX, F_PARENT, F_PATH, F_CALL, F_T0, F_SLOTS, F_FP_PRE, F_SELECTED = range(9)

_now = time.monotonic_ns
_Tensor = torch.Tensor
_SPAN = schema.SPAN
_IN0 = "input.0"
_OUT = "output"
_FLAG_ERROR = schema.FLAG_ERROR
PLAIN = (int, float, str, bool)  # argument values that hold no tensor (and None)
# record_tensors takes a tuple or list one level down (an argument, an item of a tuple result) up
# to this long, as tracer/native.py's call_key does; a longer one is walked by pop_record.
_MAX_NESTED = 64
_slot = kinds.slot  # a layout entry for a tensor of any kind (the fast paths take plain ones only)


class SpanLayouts:
    """Layout ids of the current rank file by flat keys, cheaper to build than the nested slot
    tuple ``RankWriter.layout`` interns: valid until the writer forgets its ids (``clear``)."""

    __slots__ = ("one", "flat", "by_call_key", "coll")

    def __init__(self):
        # One tensor in and one out (the common call), keyed by (shape, dtype, device) of each
        # (or tracer/native.py's pair_key): building that key costs half the nested one.
        self.one: dict = {}
        self.flat: dict = {}  # calls of tensors and plain values, keyed flat (record_tensors)
        self.by_call_key: dict = {}  # the same by tracer/native.py's call_key: (layout, n_pre)
        # collectives' tensors by call_key: (layout, bytes of the inputs) (tracer/collectives.py)
        self.coll: dict = {}

    def clear(self) -> None:
        self.one.clear()
        self.flat.clear()
        self.by_call_key.clear()
        self.coll.clear()


class StepCounters:
    """A traced step's counters (``Tracer.counters``): the spans opened (``span_count``, the next
    span's index) and each module path's calls (a call's number in the step). In Python until
    tracer/native.py is built, then its C type of the same name (tracer/native_counters.py),
    which the C call wrapper counts in: both wrappers open calls through ``open``."""

    __slots__ = ("span_count", "calls")  # (calls assigned: the step starts over from them)

    def __init__(self):
        self.span_count = 0
        self.calls: dict = {}  # path id -> its last call's number in the step

    def open(self, path_id) -> tuple:
        """(call index of this module path in the step, span index) for a call being opened."""
        calls = self.calls
        call = calls.get(path_id, -1) + 1
        calls[path_id] = call
        index = self.span_count
        self.span_count = index + 1
        return call, index



def counters_in(make, old):
    """``make()`` (a StepCounters class) holding what ``old`` counted in this step."""
    new = make()
    new.calls = dict(old.calls)
    new.span_count = old.span_count
    return new


def _py_pair_key(a, r):
    return (a.shape, a.dtype, a.device, r.shape, r.dtype, r.device)


# The layout key of a call of tensors and plain values (record_tensors): tracer/native.py's
# call_key once that is built, else None (the key built in Python).
call_key = None

# The layout key of a one-tensor span: tracer/native.py's pair_key (an int; -1 for a tensor it
# does not read) once that is built, until then the six values as a tuple (0.75 us a call).
pair_key = _py_pair_key


def use_native_keys(native_pair_key, native_call_key=None) -> None:
    """Key spans' layouts with tracer/native.py's ``pair_key`` (one tensor in, one out) and
    ``call_key`` (tensors and plain values), or in Python where one is None."""
    global pair_key, call_key
    pair_key = native_pair_key if native_pair_key is not None else _py_pair_key
    call_key = native_call_key


def uses_python_keys() -> bool:
    """Whether one-tensor spans' layouts are keyed in Python (no native pair_key taken)."""
    return pair_key is _py_pair_key


def span_one_tensor(t, index, parent, path_id, call, t0, t1, a, result, fp_pre, fp_now) -> None:
    """Write the span of a call with one tensor in and one out (the common call, from either
    interception): its layout keyed flat, no slot list."""
    writer = t.writer
    try:
        key = pair_key(a, result)
        if key == -1:  # (a tensor the native key does not read)
            key = _py_pair_key(a, result)
        layouts = t.layouts.one
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = writer.layout(
                ((_IN0, a.shape, a.dtype, a.device), (_OUT, result.shape, result.dtype, result.device)))
    except RuntimeError:  # no readable shape (a nested tensor): its kind's slot, not keyed flat
        layout = writer.layout((_slot(_IN0, a), _slot(_OUT, result)))
    buf = writer.pending
    buf.append((_SPAN, t.step, index, parent, path_id, call, t0 - t.step_t0_raw, t1 - t0, layout,
                fp_pre, t.fps.add_one(result) if fp_now else -1, 1, t.span_flags))
    if len(buf) >= writer.max_buffered:
        writer.flush()


def argument_tensors(args: tuple):
    """The tensors of positional arguments that record_tensors takes as they are (tensors, plain
    values, a batch context object, tuples or lists of tensors and plain values), in the order
    tensor_slots.flatten_args finds them; None for arguments it walks."""
    out = []
    for x in args:
        if isinstance(x, _Tensor):
            out.append(x)
        elif type(x) is tuple or type(x) is list:
            if len(x) > _MAX_NESTED:
                return None
            for y in x:
                if isinstance(y, _Tensor):
                    out.append(y)
                elif not (y is None or isinstance(y, PLAIN)):
                    return None
        elif not (x is None or isinstance(x, PLAIN) or type(x) in CONTEXT_TYPES):
            return None
    return out if len(out) <= MAX_TENSORS else None


def record_tensors(t, frame, args, kwargs, result) -> bool:
    """Record a call whose arguments (positional and keyword) are tensors or plain values
    (None, numbers, a batch context object) and whose result is a tensor, or a tuple or
    list of tensors and plain values (SGLang's ``(output, bias)``, ``(x, residual)``,
    rotary ``(q, k)``), without walking structures: the slots are those ``pop_record``
    would name. A positional argument or an item of the result may itself be a tuple or
    list of those, one level down (an EAGLE draft handed its captures as a list, a model
    returning ``(hidden, [aux, ...])``): tracer/native.py's C call wrapper then records the
    next such call by its known layout. False (nothing done) for any other call."""
    writer = t.writer
    layouts = t.layouts
    ckey = call_key(args, kwargs, result, CONTEXT_TYPES) if call_key is not None else -1
    known = layouts.by_call_key.get(ckey) if ckey >= 0 else None
    if known is not None:  # tracer/native.py read the call, and its layout is known to this file
        t1 = _now()
        t.stack.pop()
        layout, n_pre = known
        fp_post = -1
        if t.fp_now:
            post = [a for a in kwargs.values() if isinstance(a, _Tensor)] if kwargs else []
            if isinstance(result, _Tensor):
                post.append(result)
            elif result is not None:
                for r in result:
                    if isinstance(r, _Tensor):
                        post.append(r)
                    elif type(r) is tuple or type(r) is list:  # (one level down: call_key's)
                        post += [x for x in r if isinstance(x, _Tensor)]
            if post:
                fp_post = t.fps.add(post)
    else:
        # The layout key: (position or keyword, shape, dtype, device) per tensor; outputs at
        # position -1 ("output") or -2 - i ("output.i"). Plain tensors only: a subclass (a
        # DTensor's slot is its local tensor) is no plain value either, so pop_record takes
        # the call, as it does one whose tensor has no readable shape (a nested tensor).
        key = []
        i = n_pre = 0
        post = []
        try:
            for a in args:
                if type(a) is _Tensor:
                    key += (i, a.shape, a.dtype, a.device)
                    n_pre += 1
                elif type(a) is tuple or type(a) is list:  # input.i.j (an EAGLE draft's list)
                    if len(a) > _MAX_NESTED:
                        return False
                    j = 0
                    for x in a:
                        if type(x) is _Tensor:
                            key += ((i, j), x.shape, x.dtype, x.device)
                            n_pre += 1
                        elif not (x is None or isinstance(x, PLAIN)):
                            return False
                        j += 1
                elif not (a is None or isinstance(a, PLAIN) or type(a) in CONTEXT_TYPES):
                    return False
                i += 1
            if kwargs:
                for name, a in kwargs.items():
                    if type(a) is _Tensor:
                        key += (name, a.shape, a.dtype, a.device)
                        post.append(a)
                    elif not (a is None or isinstance(a, PLAIN) or type(a) in CONTEXT_TYPES):
                        return False
            if type(result) is _Tensor:
                key += (-1, result.shape, result.dtype, result.device)
                post.append(result)
            elif type(result) is tuple or type(result) is list:
                j = -2
                for r in result:
                    if type(r) is _Tensor:
                        key += (j, r.shape, r.dtype, r.device)
                        post.append(r)
                    elif type(r) is tuple or type(r) is list:  # output.j.k (a model's (hidden, aux))
                        if len(r) > _MAX_NESTED:
                            return False
                        k = 0
                        for x in r:
                            if type(x) is _Tensor:
                                key += ((j, k), x.shape, x.dtype, x.device)
                                post.append(x)
                            elif not (x is None or isinstance(x, PLAIN)):
                                return False
                            k += 1
                    elif not (r is None or isinstance(r, PLAIN)):
                        return False
                    j -= 1
            elif result is not None:
                return False
        except RuntimeError:
            return False
        t1 = _now()
        t.stack.pop()
        key = tuple(key)
        layout = layouts.flat.get(key)
        if layout is None:
            slots = []
            for k in range(0, len(key), 4):
                at = key[k]
                if type(at) is tuple:  # an item one level down
                    at, item = at
                    name = f"input.{at}.{item}" if at >= 0 else f"output.{-2 - at}.{item}"
                else:
                    name = (f"input.{at}" if type(at) is str or at >= 0 else
                            _OUT if at == -1 else f"output.{-2 - at}")
                slots.append((name, key[k + 1], key[k + 2], key[k + 3]))
            layout = layouts.flat[key] = writer.layout(tuple(slots))
        if ckey >= 0:
            layouts.by_call_key[ckey] = (layout, n_pre)
        fp_post = t.fps.add(post) if t.fp_now and post else -1
    t0 = frame[F_T0]
    buf = writer.pending
    buf.append((_SPAN, t.step, frame[F_INDEX], frame[F_PARENT], frame[F_PATH], frame[F_CALL],
                t0 - t.step_t0_raw, t1 - t0, layout, frame[F_FP_PRE], fp_post, n_pre, t.span_flags))
    if len(buf) >= writer.max_buffered:
        writer.flush()
    return True


def pop_record(t, module, kwargs, result, error) -> None:
    """Close the open call of ``module`` (unwinding calls left open above it) and record its
    span, whatever its arguments and result hold: the general path."""
    stack = t.stack
    frame = stack[-1]
    if frame[F_MODULE] is not module:
        # Unwind frames that never got their post-hook (an exception in a module whose
        # hooks did not run), then find ours.
        while len(stack) > 1 and stack[-1][F_MODULE] is not module:
            stack.pop()
        if stack[-1][F_MODULE] is not module:
            return
    stack.pop()
    if not frame[F_SELECTED]:
        return
    t1 = _now()
    slots = frame[F_SLOTS]
    writer = t.writer
    fp_post = -1
    if (type(slots) is tuple and not kwargs and len(slots) == 1 and type(slots[0]) is _Tensor
            and type(result) is _Tensor):
        # The common case, tensor in and tensor out: no list walking.
        a = slots[0]
        n_pre = 1
        try:
            key = ((_IN0, a.shape, a.dtype, a.device), (_OUT, result.shape, result.dtype, result.device))
        except RuntimeError:  # no readable shape (a nested tensor): its kind's slot
            key = (_slot(_IN0, a), _slot(_OUT, result))
        if t.fp_now:
            fp_post = t.fps.add((result,))
    else:
        if type(slots) is tuple:  # positional args kept as they came (one tensor, or no fingerprints)
            args = slots
            slots = []
            flatten_args(args, slots)
        n_pre = len(slots)
        if kwargs:
            flatten_kwargs(kwargs, slots, frame[F_INDEX] == 0)  # the root's: with context
        if isinstance(result, _Tensor):
            slots.append((_OUT, result))
        elif result is not None:
            flatten_output(result, slots)
        if len(slots) > n_pre and t.fp_now:
            fp_post = t.fps.add([x for _, x in slots[n_pre:]])
        try:
            key = tuple([(s, x.shape, x.dtype, x.device) if type(x) is _Tensor else _slot(s, x)
                         for s, x in slots])
        except RuntimeError:  # no readable shape (a nested tensor)
            key = tuple([_slot(s, x) for s, x in slots])
    layout = writer.layout_ids.get(key)
    if layout is None:
        layout = writer.layout(key)
    lineage = t.lineage
    if lineage is not None and lineage.mode is not None:
        if type(slots) is tuple:  # the fast path kept no slot list
            slots = [(_IN0, slots[0]), (_OUT, result)]
        lineage.link_span(t.step, frame[F_INDEX], slots)
    flags = t.span_flags | _FLAG_ERROR if error else t.span_flags
    t0 = frame[F_T0]
    buf = writer.pending
    buf.append((_SPAN, t.step, frame[F_INDEX], frame[F_PARENT], frame[F_PATH], frame[F_CALL],
                t0 - t.step_t0_raw, t1 - t0, layout, frame[F_FP_PRE], fp_post, n_pre, flags))
    if len(buf) >= writer.max_buffered:
        writer.flush()


def push_root(t, module, args, entry, t0, path_id=None) -> None:
    """Open the root's frame (the step's first call); ``path_id``, where the caller has it,
    is its path's id in the rank file."""
    if path_id is None:
        path, cls, _selected = entry
        path_id = t.writer.module(path, cls)
    counters = t.counters  # (no method called: the step's own Python calls are counted)
    counters.calls = {path_id: 0}
    counters.span_count = 1
    slots: list = []
    flatten_args(args, slots, True)  # the root's inputs: a batch context object too
    fp_pre = -1
    if slots and t.fp_now:
        fp_pre = t.fps.add([x for _, x in slots], store=False)
    t.stack.append([module, 0, -1, path_id, 0, t0, slots, fp_pre, True])


def record_capture(t, name: str, tensor, info: dict | None) -> None:
    """The span of a capture point ``capture:NAME`` inside the innermost open call (see
    ``Tracer.record_capture``); ``info`` written once per name and rank file."""
    writer = t.writer
    path = f"capture:{name}"
    path_id = writer.module(path, "capture")
    if info is not None and t.capture_info.get(path) != (writer.generation, info):
        t.capture_info[path] = (writer.generation, dict(info))
        writer.add((schema.CAPTURE_INFO, path_id, dict(info)))
    parent = innermost_span(t)
    call, index = t.counters.open(path_id)
    now = _now()
    fp = t.fps.add([tensor]) if t.fp_now else -1
    layout = writer.layout((_slot(_OUT, tensor),))
    writer.add((_SPAN, t.step, index, parent, path_id, call, now - t.step_t0_raw, 0, layout,
                -1, fp, 0, t.span_flags))
    if t.lineage is not None and t.lineage.mode is not None:
        t.lineage.link_capture(t.step, index, tensor)


def innermost_span(t) -> int:
    """Index of the innermost recorded module call, or -1."""
    for frame in reversed(t.stack):
        if frame[F_SELECTED]:
            return frame[F_INDEX]
    return -1


def close_open_calls(t, kwargs, result, error) -> None:
    """At a step's end: the calls left open by an exception, then the root's own span."""
    stack = t.stack
    while len(stack) > 1:
        pop_record(t, stack[-1][F_MODULE], None, None, True)
    if stack:
        pop_record(t, stack[0][F_MODULE], kwargs, result, error)

