"""The OpenTelemetry mapping of a trace, shared by ``tensor-trace export otlp`` (from the store)
and ``record --otlp-endpoint`` (live, from the records): the same span gets the same ids, name
and attributes both ways.

A resource per process; one trace per step, its id derived from the run id and the step, so
every rank's spans of a step land in one trace; a span per module call (its parent the
enclosing call) and per collective (its parent the module that issued it), its id derived from
the run id, the process (host, pid), the step and the record's index. What only the merged
store knows (placement verdicts, a collective's issuing module, device time) is added by the
export as extra attributes.
"""

from __future__ import annotations

import hashlib

from tensor_trace import schema
from tensor_trace.format.points import is_output

MODULE_SPAN = "m"
COLLECTIVE_SPAN = "c"


def _id(nbytes: int, *parts) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:nbytes], "big") or 1


def trace_id(run_id: str, step: int) -> int:
    return _id(16, "trace", run_id, step)


def span_id(run_id: str, host: str, pid: int, step: int, kind: str, index: int) -> int:
    """``kind``: MODULE_SPAN or COLLECTIVE_SPAN; ``index``: the record's index in its step."""
    return _id(8, "span", run_id, host, pid, step, kind, index)


def resource_attributes(run_id: str, host: str, pid: int, rank=None, tp_rank=None, world_size=None) -> dict:
    attrs = {"service.name": "tensor-trace", "host.name": host or "", "process.pid": pid or 0,
             "tensor_trace.run_id": run_id}
    for key, value in (("tensor_trace.rank", rank), ("tensor_trace.tp_rank", tp_rank),
                       ("tensor_trace.world_size", world_size)):
        if value is not None:
            attrs[key] = value
    return attrs


def step_attributes(step: int, step_attrs: dict) -> dict:
    """``step`` and a step's scalar attributes as ``step.NAME``."""
    out = {"step": step}
    out.update((f"step.{k}", v) for k, v in step_attrs.items() if isinstance(v, (str, int, float, bool)))
    return out


def _tensor_attributes(attrs: dict, tensors) -> None:
    if tensors:
        attrs["tensor.shape"] = [str(list(shape)) for _slot, shape, _dtype in tensors]
        attrs["tensor.dtype"] = [dtype for _slot, _shape, dtype in tensors]
        attrs["tensor.slot"] = [slot for slot, _shape, _dtype in tensors]


def module_span(path: str, cls: str | None, call: int, flags: int, tensors, step_attrs: dict):
    """(name, attributes) of a module call's span. ``tensors``: [(slot, shape, dtype), ...] of
    the call (its outputs are shown, or every tensor when it has none); ``step_attrs``: from
    ``step_attributes``."""
    attrs = {"module.path": path, "module.class": cls or "", "module.call": call, **step_attrs}
    if flags & schema.FLAG_REPLAYED:  # a CUDA-graph replay's span: the capture's times, the replay's values
        attrs["tensor_trace.replayed"] = True
    _tensor_attributes(attrs, [t for t in tensors if is_output(t[0])] or tensors)
    if flags & schema.FLAG_CAPTURED:
        attrs["cuda_graph.captured"] = True
    return path or "<root>", attrs


def collective_span(op: str, reduce_op: str | None, group_name: str, group_ranks: list, seq: int,
                    nbytes: int, tensors, step_attrs: dict):
    """(name, attributes) of a collective's span; ``tensors`` as for ``module_span`` (all shown)."""
    attrs = {"collective.op": op, "collective.group.name": group_name,
             "collective.group.ranks": list(group_ranks), "collective.seq": seq,
             "collective.bytes": nbytes or 0, **step_attrs}
    if reduce_op:
        attrs["collective.reduce_op"] = reduce_op
    _tensor_attributes(attrs, tensors)
    return op, attrs
