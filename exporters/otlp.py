"""OTLP export: the merged trace into any OpenTelemetry backend (Jaeger, Tempo, a Collector).

Spans go through opentelemetry-sdk's own OTLP exporters (gRPC or HTTP/protobuf), so the standard
``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, compression, certificates) apply as they
do to any OpenTelemetry program; ``--endpoint`` gives the endpoint.

Mapping: a resource per rank (``service.name`` tensor-trace, ``host.name``, ``process.pid``,
``tensor_trace.rank``, ``tensor_trace.tp_rank``, ``tensor_trace.world_size``,
``tensor_trace.run_id``); one trace per step, its trace id derived from the run id and the step,
so every rank's spans of a step land in one trace; a span per module call (its parent the
enclosing call) and per collective (its parent the module that issued it). Times are wall-clock
ns: the merge's aligned clock shifted by the reference process's wall-clock anchor.
"""

from __future__ import annotations

import hashlib
import json

from tensor_trace import progress, schema
from tensor_trace.errors import BadInput
from tensor_trace.exporters.base import ExportResult, SpanExporter
from tensor_trace.exporters.merge import open_store



def _id(nbytes: int, *parts) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:nbytes], "big") or 1


def trace_id(run_id: str, step: int) -> int:
    return _id(16, "trace", run_id, step)


def span_id(run_id: str, proc: int, step: int, kind: str, idx: int) -> int:
    return _id(8, "span", run_id, proc, step, kind, idx)


class OTLPExporter(SpanExporter):
    """Sends ``ReadableSpan`` batches through the SDK's OTLP exporter; failures are reported
    (``last_error``), never raised."""

    def __init__(self, endpoint: str, protocol: str = "grpc", timeout_s: float | None = None):
        # One way to build the SDK exporter, shared with record's live stream.
        from tensor_trace.tracer.live_otlp import make_exporter

        try:
            self._exporter, self.endpoint = make_exporter(endpoint, protocol, timeout_s)
        except ImportError as exc:
            raise BadInput(f"OTLP export needs the otlp extra: pip install 'tensor-trace[otlp]' ({exc})")
        except ValueError as exc:
            raise BadInput(str(exc))
        self.exported = 0
        self.failed_batches = 0

    def export(self, batch) -> ExportResult:
        from tensor_trace.tracer.live_otlp import export_ok

        if export_ok(self._exporter, batch):
            self.exported += len(batch)
            return ExportResult.SUCCESS
        self.failed_batches += 1
        return ExportResult.FAILURE

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return self._exporter.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._exporter.shutdown()


def readable_spans(con):
    """The store as ReadableSpan objects, one step of one process at a time."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

    import tensor_trace

    scope = InstrumentationScope("tensor-trace", tensor_trace.__version__)
    run_id = (con.execute("SELECT value FROM meta WHERE key='run_id'").fetchone() or [""])[0]
    procs = con.execute("SELECT proc, rank, tp_rank, world_size, host, pid, COALESCE(clock_offset_ns, 0), "
                        "mono_anchor_ns, wall_anchor_ns FROM processes ORDER BY rank IS NULL, rank, proc").fetchall()
    if not procs:
        return
    ref = procs[0]
    to_wall = (ref[8] or 0) - (ref[7] or 0)  # aligned monotonic -> wall clock
    from tensor_trace.exporters.analysis import inferred_tp_ranks

    tp_of = inferred_tp_ranks(con)
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    classes = dict(con.execute("SELECT path, class FROM modules"))
    groups = {gid: (name, json.loads(r)) for gid, name, r in con.execute("SELECT group_id, name, ranks FROM groups")}
    layouts: dict = {}

    def tensors(lid):
        hit = layouts.get(lid)
        if hit is None:
            row = con.execute("SELECT slots FROM layouts WHERE layout_id=?", (lid,)).fetchone()
            hit = json.loads(row[0]) if row else []
            layouts[lid] = hit
        return hit

    verdicts = {}
    for module, call, placement, reduction in con.execute(
            "SELECT module, call, placement, reduction FROM points WHERE slot LIKE 'output%' ORDER BY sort_key"):
        verdicts.setdefault((module, call), (placement, reduction))
    flags = TraceFlags(TraceFlags.SAMPLED)
    for proc, rank, tp_rank, world, host, pid, offset, _, _ in procs:
        attrs = {"service.name": "tensor-trace", "host.name": host or "", "process.pid": pid or 0,
                 "tensor_trace.run_id": run_id}
        for key, value in (("tensor_trace.rank", rank), ("tensor_trace.tp_rank", tp_of.get(proc, tp_rank)),
                           ("tensor_trace.world_size", world)):
            if value is not None:
                attrs[key] = value
        resource = Resource.create(attrs)
        for step, first, last, t_begin, step_attrs in con.execute(
                "SELECT step, span_first, span_last, t_begin, attrs FROM steps WHERE proc=? AND t_begin IS NOT NULL "
                "AND span_first IS NOT NULL ORDER BY step", (proc,)).fetchall():
            base = t_begin + offset + to_wall
            tid = trace_id(run_id, step)
            sattrs = {f"step.{k}": v for k, v in json.loads(step_attrs or "{}").items()
                      if isinstance(v, (str, int, float, bool))}
            rows = con.execute("SELECT idx, parent, module_id, call, t0, dur, layout_id, flags FROM spans "
                               "WHERE rowid BETWEEN ? AND ? AND step=?", (first, last, step)).fetchall()
            for idx, parent, mid, call, t0, dur, lid, fl in rows:
                path = modules.get(mid, "?")
                ctx = SpanContext(tid, span_id(run_id, proc, step, "m", idx), False, flags)
                pctx = (SpanContext(tid, span_id(run_id, proc, step, "m", parent), False, flags)
                        if parent >= 0 else None)
                a = {"module.path": path, "module.class": classes.get(path) or "", "module.call": call,
                     "step": step, **sattrs}
                if fl & REPLAYED:  # a CUDA-graph replay's span: the capture's times, the replay's values
                    a["tensor_trace.replayed"] = True
                slots = tensors(lid)
                outs = [s for s in slots if s[0].startswith("output")] or slots
                if outs:
                    a["tensor.shape"] = [json.dumps(s[1]) for s in outs]
                    a["tensor.dtype"] = [s[2] for s in outs]
                    a["tensor.slot"] = [s[0] for s in outs]
                v = verdicts.get((path, call))
                if v is not None:
                    a["tensor.placement"], a["tensor.reduction"] = v
                if fl & 1:
                    a["cuda_graph.captured"] = True
                yield ReadableSpan(name=path or "<root>", context=ctx, parent=pctx, resource=resource,
                                   attributes=a, kind=SpanKind.INTERNAL, start_time=base + t0,
                                   end_time=base + t0 + dur, instrumentation_scope=scope)
            for idx, parent, op, redop, gid, seq, t0, dur, lid, nbytes, mid, dev in con.execute(
                    "SELECT idx, parent, op, reduce_op, group_id, seq, t0, dur, layout_id, bytes, module_id, "
                    "device_ns FROM collectives WHERE proc=? AND step=? ORDER BY idx", (proc, step)).fetchall():
                gname, granks = groups.get(gid, ("?", []))
                ctx = SpanContext(tid, span_id(run_id, proc, step, "c", idx), False, flags)
                pctx = (SpanContext(tid, span_id(run_id, proc, step, "m", parent), False, flags)
                        if parent >= 0 else None)
                slots = tensors(lid)
                a = {"collective.op": op, "collective.group.name": gname, "collective.group.ranks": granks,
                     "collective.seq": seq, "collective.bytes": nbytes or 0, "step": step,
                     "module.path": modules.get(mid) or "",
                     "tensor.shape": [json.dumps(s[1]) for s in slots], "tensor.dtype": [s[2] for s in slots]}
                if redop:
                    a["collective.reduce_op"] = redop
                if dev is not None:
                    a["collective.device_time_ns"] = dev
                yield ReadableSpan(name=op, context=ctx, parent=pctx, resource=resource, attributes=a,
                                   kind=SpanKind.INTERNAL, start_time=base + t0, end_time=base + t0 + dur,
                                   instrumentation_scope=scope)


REPLAYED = schema.FLAG_REPLAYED


def export_otlp(trace_dir: str, endpoint: str, protocol: str = "grpc", batch: int = 512,
                timeout_s: float | None = None) -> dict:
    """Send every span of ``trace_dir`` to ``endpoint``. Raises BadInput (one line) when the
    endpoint refuses or does not answer within the exporter's timeout."""
    return _export_otlp(trace_dir, endpoint, protocol, batch, timeout_s)


def _export_otlp(trace_dir, endpoint, protocol, batch, timeout_s) -> dict:
    exporter = OTLPExporter(endpoint, protocol, timeout_s)
    con = open_store(trace_dir)
    pending: list = []
    sent = 0
    bar = progress.Task.open("export otlp: spans")
    try:
        for span in readable_spans(con):
            pending.append(span)
            if len(pending) >= batch:
                if exporter.export(pending) is not ExportResult.SUCCESS:
                    raise BadInput(f"OTLP endpoint {exporter.endpoint} ({protocol}) did not accept the spans "
                                   f"(down, refusing, or no answer within the timeout); {sent} spans sent")
                sent += len(pending)
                bar.advance(len(pending))
                pending = []
        if pending:
            if exporter.export(pending) is not ExportResult.SUCCESS:
                raise BadInput(f"OTLP endpoint {exporter.endpoint} ({protocol}) did not accept the spans "
                               f"(down, refusing, or no answer within the timeout); {sent} spans sent")
            sent += len(pending)
    finally:
        bar.close()
        try:
            exporter.shutdown()
        except Exception:
            pass
        con.close()
    return dict(endpoint=exporter.endpoint, protocol=protocol, spans=sent)
