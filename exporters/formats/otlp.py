"""OTLP export: the merged trace into any OpenTelemetry backend (Jaeger, Tempo, a Collector).

Spans are encoded in batches straight into OTLP protobuf (``format/otlp_encode.py``) and go
through opentelemetry-sdk's own OTLP exporters (gRPC or HTTP/protobuf), so the standard
``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, compression, certificates) apply as they
do to any OpenTelemetry program; ``--endpoint`` gives the endpoint.

Mapping (``tensor_trace.format.otlp_spans``, shared with live streaming, so a span has the same
ids and attributes both ways): a resource per rank (``service.name`` tensor-trace, ``host.name``,
``process.pid``, ``tensor_trace.rank``, ``tensor_trace.tp_rank``, ``tensor_trace.world_size``,
``tensor_trace.run_id``); one trace per step, its trace id derived from the run id and the step,
so every rank's spans of a step land in one trace; a span per module call (its parent the
enclosing call) and per collective (its parent the module that issued it). The export adds what
only the merged store knows: a module output's placement and reduction, a collective's issuing
module and device time. Times are wall-clock ns: the merge's aligned clock shifted by the
reference process's wall-clock anchor.
"""

from __future__ import annotations

import json

from tensor_trace import progress
from tensor_trace.errors import BadInput
from tensor_trace.exporters.analysis import inferred_tp_ranks
from tensor_trace.exporters.formats.base import ExportResult, SpanExporter
from tensor_trace.exporters.pipeline import open_store
from tensor_trace.format import otlp_spans
from tensor_trace.format.otlp_spans import COLLECTIVE_SPAN, MODULE_SPAN
from tensor_trace.format.points import OUTPUTS_SQL


def _package_version() -> str:
    # From the installed distribution: importing the tensor_trace package here would make an
    # import cycle with its lazy API (tensor_trace -> api -> this module).
    from importlib import metadata

    try:
        return metadata.version("tensor-trace")
    except metadata.PackageNotFoundError:
        return "unknown"


class OTLPExporter(SpanExporter):
    """Sends ``SpanBatch``es through the SDK's OTLP exporter; failures are reported
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


def span_rows(con):
    """The store as ``SpanRow``s, one step of one process at a time."""
    from opentelemetry.sdk.resources import Resource

    from tensor_trace.format.otlp_encode import SpanRow

    run_id = (con.execute("SELECT value FROM meta WHERE key='run_id'").fetchone() or [""])[0]
    procs = con.execute("SELECT proc, rank, tp_rank, world_size, host, pid, COALESCE(clock_offset_ns, 0), "
                        "mono_anchor_ns, wall_anchor_ns FROM processes ORDER BY rank IS NULL, rank, proc").fetchall()
    if not procs:
        return
    ref = procs[0]
    to_wall = (ref[8] or 0) - (ref[7] or 0)  # aligned monotonic -> wall clock
    tp_of = inferred_tp_ranks(con)
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    classes = dict(con.execute("SELECT path, class FROM modules"))
    groups = {gid: (name, json.loads(r)) for gid, name, r in con.execute("SELECT group_id, name, ranks FROM groups")}
    layouts: dict = {}

    def tensors(lid):
        """[(slot, shape, dtype), ...] of a layout."""
        hit = layouts.get(lid)
        if hit is None:
            row = con.execute("SELECT slots FROM layouts WHERE layout_id=?", (lid,)).fetchone()
            hit = [(slot, shape, dtype) for slot, shape, dtype, *_ in json.loads(row[0])] if row else []
            layouts[lid] = hit
        return hit

    verdicts = {}
    for module, call, placement, reduction in con.execute(
            f"SELECT module, call, placement, reduction FROM points WHERE {OUTPUTS_SQL} ORDER BY sort_key"):
        verdicts.setdefault((module, call), (placement, reduction))
    for proc, rank, tp_rank, world, host, pid, offset, _, _ in procs:
        resource = tuple(Resource.create(otlp_spans.resource_attributes(
            run_id, host, pid, rank, tp_of.get(proc, tp_rank), world)).attributes.items())

        def span_id(step, kind, idx):
            return otlp_spans.span_id(run_id, host, pid, step, kind, idx)

        def module_span_id(step, idx, ids):
            # A module span's id is also its children's parent id: hashed once per step.
            sid = ids.get(idx)
            if sid is None:
                sid = ids[idx] = span_id(step, MODULE_SPAN, idx)
            return sid

        for step, first, last, t_begin, step_attrs in con.execute(
                "SELECT step, span_first, span_last, t_begin, attrs FROM steps WHERE proc=? AND t_begin IS NOT NULL "
                "AND span_first IS NOT NULL ORDER BY step", (proc,)).fetchall():
            base = t_begin + offset + to_wall
            trace_id = otlp_spans.trace_id(run_id, step)
            sattrs = otlp_spans.step_attributes(step, json.loads(step_attrs or "{}"))
            rows = con.execute("SELECT idx, parent, module_id, call, t0, dur, layout_id, flags FROM spans "
                               "WHERE rowid BETWEEN ? AND ? AND step=?", (first, last, step)).fetchall()
            ids: dict = {}  # module span index -> its span id
            for idx, parent, mid, call, t0, dur, lid, fl in rows:
                path = modules.get(mid, "?")
                name, a = otlp_spans.module_span(path, classes.get(path), call, fl, tensors(lid), sattrs)
                v = verdicts.get((path, call))
                if v is not None:
                    a["tensor.placement"], a["tensor.reduction"] = v
                yield SpanRow(resource, name, trace_id, module_span_id(step, idx, ids),
                              module_span_id(step, parent, ids) if parent >= 0 else None,
                              base + t0, base + t0 + dur, a)
            for idx, parent, op, redop, gid, seq, t0, dur, lid, nbytes, mid, dev in con.execute(
                    "SELECT idx, parent, op, reduce_op, group_id, seq, t0, dur, layout_id, bytes, module_id, "
                    "device_ns FROM collectives WHERE proc=? AND step=? ORDER BY idx", (proc, step)).fetchall():
                gname, granks = groups.get(gid, ("?", []))
                name, a = otlp_spans.collective_span(op, redop, gname, granks, seq, nbytes, tensors(lid), sattrs)
                a["module.path"] = modules.get(mid) or ""
                if dev is not None:
                    a["collective.device_time_ns"] = dev
                yield SpanRow(resource, name, trace_id, span_id(step, COLLECTIVE_SPAN, idx),
                              module_span_id(step, parent, ids) if parent >= 0 else None,
                              base + t0, base + t0 + dur, a)




# Spans per request (about 400 bytes each, so 200 KiB and 800 KiB: well under the 4 MiB a
# Collector takes by default). An HTTP request costs more than a gRPC call (the requests library's
# Python work, a round trip the exporter waits for), so fewer of them; over gRPC a larger message
# measured no faster.
BATCH_SPANS = {"grpc": 512, "http": 2048}


def export_otlp(trace_dir: str, endpoint: str, protocol: str = "grpc", batch: int | None = None,
                timeout_s: float | None = None) -> dict:
    """Send every span of ``trace_dir`` to ``endpoint``, ``batch`` spans a request (default
    ``BATCH_SPANS`` of the protocol). Raises BadInput (one line) when the endpoint refuses or does
    not answer within the exporter's timeout."""
    return _export_otlp(trace_dir, endpoint, protocol, batch or BATCH_SPANS.get(protocol, 512), timeout_s)


def _export_otlp(trace_dir, endpoint, protocol, batch, timeout_s) -> dict:
    exporter = OTLPExporter(endpoint, protocol, timeout_s)
    from tensor_trace.format.otlp_encode import SpanBatch  # after the exporter: the otlp extra is there

    version = _package_version()
    con = open_store(trace_dir)
    pending = SpanBatch("tensor-trace", version)
    sent = 0
    bar = progress.Task.open("export otlp: spans")
    try:
        for row in span_rows(con):
            pending.add(row)
            if len(pending) >= batch:
                if exporter.export(pending) is not ExportResult.SUCCESS:
                    raise BadInput(f"OTLP endpoint {exporter.endpoint} ({protocol}) did not accept the spans "
                                   f"(down, refusing, or no answer within the timeout); {sent} spans sent")
                sent += len(pending)
                bar.advance(len(pending))
                pending = SpanBatch("tensor-trace", version)
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
