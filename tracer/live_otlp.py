"""Live OTLP: every rank streams its spans to a collector while it runs (``record --otlp-endpoint``).

The rank file stays the record of truth; this is a copy for the team's tracing backend. The
writer hands each flushed batch of records (once a second) to ``LiveOTLP.offer``, which only
appends to a bounded queue and, when it is full, drops the batch and counts its spans: a forward
never waits for the network. A daemon thread resolves the records (the format layer's
``RecordResolver``, as the reader and the merge use it) into OTLP protobuf spans, built in
batches (``format/otlp_encode.py``, no SDK span objects), and sends them with opentelemetry-sdk's
OTLP exporter.
What was sent and dropped is reported once at exit and kept in the rank file's END record.

Streaming policy (``StreamPolicy``): a GPU decode server makes about 420 module spans per 8 ms
step per rank (~52k spans/s), several times what one process can encode and send. So collective
spans always stream, and module spans stream for sampled steps only: the first ``STREAM_FIRST``
steps of each kind (root module, forward mode, draft flag, as lineage's schedule in
tracer/steps.py) and then every ``TraceConfig.otlp_module_every``-th step of that kind (1 = every
step). What the policy leaves out is counted (``live_otlp_left_out``) and reported at exit apart
from drops; the rank file still holds every span, and ``export otlp`` sends them all. A streamed
collective of an unsampled step names a parent span that was not streamed.

The mapping (``tensor_trace.format.otlp_spans``: a resource per process, one trace per step from
the run id and the step, a span per module call and per collective) is the one of ``tensor-trace
export otlp``, ids and attributes alike; what needs the merged store (placement verdicts, a
collective's issuing module, device time) is the export's alone.
"""

from __future__ import annotations

import contextlib

import collections
import os
import socket
import sys
import threading

from tensor_trace import schema
from tensor_trace.format import otlp_spans
from tensor_trace.format.otlp_encode import SpanBatch, SpanRow
from tensor_trace.format.otlp_spans import COLLECTIVE_SPAN, MODULE_SPAN
from tensor_trace.format.records import RecordResolver, decode

QUEUE_BATCHES = 64  # flushed batches waiting for the network; past that they are dropped
SEND_BATCH = 512
STREAM_FIRST = 2  # steps of each kind whose module spans always stream


class StreamPolicy:
    """Which spans of a flushed batch stream: collectives always, module spans of sampled steps."""

    def __init__(self, module_every: int = 1):
        self.module_every = module_every
        self.steps_of_kind: dict = {}
        self.sampled: set = set()  # steps whose module spans stream
        self.left_out = 0

    def filter(self, records: list) -> list:
        if self.module_every <= 1:
            return records
        out = []
        for rec in records:
            kind = rec[0]
            if kind == schema.SPAN:
                if rec[1] not in self.sampled:
                    self.left_out += 1
                    continue
            elif kind == schema.STEP_BEGIN:
                self._begin(rec)
            elif kind == schema.STEP_END:
                self.sampled.discard(rec[1])  # its spans came before it: a long run keeps no step numbers
            out.append(rec)
        return out

    def _begin(self, rec) -> None:
        begin = decode(rec)
        attrs = begin.attrs or {}
        kind = (begin.root, attrs.get("forward_mode"), attrs.get("draft"))
        n = self.steps_of_kind.get(kind, 0)
        self.steps_of_kind[kind] = n + 1
        if n < STREAM_FIRST or n % self.module_every == 0:
            self.sampled.add(begin.step)
        else:
            self.sampled.discard(begin.step)


class LiveOTLP:
    def __init__(self, endpoint: str, run_id: str, header: dict, protocol: str | None = None,
                 timeout_s: float | None = None, module_every: int = 1):
        self.endpoint = endpoint
        self.run_id = run_id
        self.protocol = protocol or _protocol_from_env()
        self.timeout_s = timeout_s
        self.header = header
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.sent = 0
        self.dropped = 0
        self.failed = False
        self.error = ""
        self._closing = False
        self._thread = None
        self._exporter = None
        self.identity: dict = {}
        self.resolver = RecordResolver()
        self.steps: dict = {}  # step -> (mono_ns at its start, its span attributes)
        self.policy = StreamPolicy(module_every)
        self.pending = SpanBatch("tensor-trace", "live")  # encoded, not yet sent
        self._res = None

    # -- hot side: called from the writer, never blocks ---------------------------------------
    def offer(self, records: list) -> None:
        # The policy is the writer's alone (offer is called under its lock): filter before taking
        # the worker's lock, which the worker holds to pop batches.
        records = self.policy.filter(records)
        with self.cond:
            if len(self.queue) >= QUEUE_BATCHES or self.failed:
                self.dropped += sum(1 for r in records if r[0] in (schema.SPAN, schema.COLLECTIVE))
                # Definitions must still reach the resolver, or later spans would not resolve.
                defs = [r for r in records if r[0] not in (schema.SPAN, schema.COLLECTIVE)]
                if defs and not self.failed:
                    self.queue.append(defs)
                return
            self.queue.append(list(records))
            self.cond.notify()

    def start(self) -> "LiveOTLP":
        """Create the exporter and its thread now, while the program runs: at exit (where short
        programs flush everything) new thread pools can no longer be created."""
        try:
            self._exporter, _ = make_exporter(self.endpoint, self.protocol, self.timeout_s)
        except Exception as exc:
            self._fail(f"cannot create the OTLP exporter: {exc}")
            return self
        self._thread = threading.Thread(target=self._run, name="tensor-trace-otlp", daemon=True)
        self._thread.start()
        return self

    # -- worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self._closing:
                    self.cond.wait(0.5)
                if not self.queue and self._closing:
                    break
                batch = self.queue.popleft()
            try:
                rows = self.rows(batch)
            except Exception as exc:  # a record this resolver cannot read: skip the batch
                self.error = f"{type(exc).__name__}: {exc}"
                continue
            for row in rows:
                self.pending.add(row)
                if len(self.pending) >= SEND_BATCH:
                    self._send()
        if len(self.pending):
            self._send()

    def _send(self) -> None:
        spans, self.pending = self.pending, SpanBatch("tensor-trace", "live")
        if self.failed:
            self.dropped += len(spans)
            return
        if export_ok(self._exporter, spans):
            self.sent += len(spans)
        else:
            self.dropped += len(spans)
            self._fail(f"endpoint {self.endpoint} ({self.protocol}) did not accept spans")

    def _fail(self, why: str) -> None:
        # After a failed export (the SDK already retried for its timeout), stop trying: the
        # rank file has everything, and a dead collector must not cost the program anything.
        self.failed = True
        self.error = why
        with self.cond:
            while self.queue:
                self.dropped += sum(1 for r in self.queue.popleft() if r[0] in (schema.SPAN, schema.COLLECTIVE))

    def rows(self, records) -> list:
        """The spans of ``records`` (``SpanRow``), resolving what they define."""
        out = []
        to_wall = (self.header.get("wall_ns") or 0) - (self.header.get("mono_ns") or 0)
        resolver, steps, run_id = self.resolver, self.steps, self.run_id
        host, pid = self.header.get("host"), self.header.get("pid")
        strings = resolver.strings
        trace_id, span_id = otlp_spans.trace_id, otlp_spans.span_id

        def tensors(layout_id):
            return [(slot, meta.shape, meta.dtype) for slot, meta in resolver.tensors(layout_id)]

        for rec in records:
            kind = rec[0]
            if kind == schema.SPAN or kind == schema.COLLECTIVE:
                r = decode(rec)
                begin = steps.get(r.step)
                if begin is None:
                    continue
                if kind == schema.SPAN:
                    path = strings.get(r.path, "?")
                    name, attrs = otlp_spans.module_span(path, resolver.modules.get(path), r.call, r.flags,
                                                         tensors(r.layout), begin[1])
                    sid = span_id(run_id, host, pid, r.step, MODULE_SPAN, r.index)
                else:
                    group = resolver.groups.get(r.group)
                    name, attrs = otlp_spans.collective_span(
                        strings.get(r.op, "?"), strings.get(r.reduce_op, "?") if r.reduce_op >= 0 else None,
                        group.name if group else "?", group.ranks if group else [], r.seq, r.bytes,
                        tensors(r.layout), begin[1])
                    sid = span_id(run_id, host, pid, r.step, COLLECTIVE_SPAN, r.index)
                start = begin[0] + to_wall + r.t0
                parent = span_id(run_id, host, pid, r.step, MODULE_SPAN, r.parent) if r.parent >= 0 else None
                out.append(SpanRow(self._resource(), name, trace_id(run_id, r.step), sid, parent,
                                   start, start + r.dur, attrs))
            elif resolver.define(rec):
                pass
            elif kind == schema.STEP_BEGIN:
                begin = decode(rec)
                steps[begin.step] = (begin.mono_ns, otlp_spans.step_attributes(begin.step, begin.attrs or {}))
            elif kind == schema.IDENTITY:
                self.identity = dict(rec[1])
                self._resource(refresh=True)
        return out

    def _resource(self, refresh: bool = False) -> tuple:
        """This process's resource attributes, as SpanBatch keys them."""
        if refresh or self._res is None:
            ident = self.identity
            self._res = tuple(otlp_spans.resource_attributes(
                self.run_id, self.header.get("host") or socket.gethostname(), self.header.get("pid") or os.getpid(),
                ident.get("rank"), ident.get("tp_rank"), ident.get("world_size")).items())
        return self._res

    # -- end -----------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> dict:
        """Send what is queued (for at most ``timeout_s``), then report once on stderr."""
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                with self.cond:
                    while self.queue:
                        self.dropped += sum(1 for r in self.queue.popleft()
                                            if r[0] in (schema.SPAN, schema.COLLECTIVE))
        try:
            if self._exporter is not None:
                self._exporter.shutdown()
        except Exception:
            pass
        left_out = self.policy.left_out
        stats = dict(live_otlp_sent=self.sent, live_otlp_dropped=self.dropped, live_otlp_left_out=left_out)
        try:
            msg = f"tensor-trace: live OTLP to {self.endpoint}: {self.sent} spans sent, {self.dropped} dropped"
            if left_out:
                msg += f", {left_out} module spans left out by the policy (every {self.policy.module_every}th step)"
            if self.error:
                msg += f" ({self.error})"
            sys.stderr.write(msg + "\n")
        except Exception:
            pass
        return stats


def _protocol_from_env() -> str:
    value = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
             or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    return "http" if value.startswith("http") else "grpc"


def make_exporter(endpoint: str, protocol: str, timeout_s: float | None = None,
                  max_request_size: int | None = None):
    """(opentelemetry-sdk OTLP span exporter, the endpoint it sends to), for ``record``'s live
    stream and for ``tensor-trace export otlp`` alike. The OTEL_EXPORTER_OTLP_* variables apply;
    without a timeout from them the timeout is 30 s. ``max_request_size`` (HTTP): the SDK's
    limit on a request's bytes (its default without). Raises ValueError for a bad protocol or
    URL, ImportError without the otlp extra."""
    import logging
    from urllib.parse import urlparse

    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # one line from us instead
    if protocol not in ("grpc", "http"):
        raise ValueError(f"protocol {protocol!r}: use grpc or http")
    url = urlparse(endpoint)
    if not url.scheme or not url.netloc:
        raise ValueError(f"endpoint {endpoint!r}: expected a URL such as http://127.0.0.1:4317")
    if timeout_s is None and not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
                                  or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        timeout_s = 30.0
    kwargs = {"timeout": timeout_s} if timeout_s is not None else {}
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        class GrpcBatches(Grpc):
            def _translate_data(self, data):  # a SpanBatch is sent as the request it built
                return data.request() if isinstance(data, SpanBatch) else super()._translate_data(data)

        return GrpcBatches(endpoint=endpoint, insecure=url.scheme == "http", **kwargs), endpoint
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    from opentelemetry.sdk.trace.export import SpanExportResult

    class HttpBatches(Http):
        """A SpanBatch goes as the request bytes it built through the SDK's own client (retries,
        compression, headers) and export metrics. A batch over the SDK's request size limit
        (which the SDK drops whole) is sent as two halves, each split again while too large."""

        def export(self, spans):
            if not isinstance(spans, SpanBatch):
                return super().export(spans)
            if self._shutdown:
                return SpanExportResult.FAILURE
            data = spans.serialized()
            too_large = 0 < getattr(self, "_max_request_size", 0) < len(data)
            if too_large and len(spans) > 1:
                del data
                for half in spans.halves():
                    if self.export(half) != SpanExportResult.SUCCESS:
                        return SpanExportResult.FAILURE
                return SpanExportResult.SUCCESS
            with _export_operation(self, len(spans)) as result:
                if too_large:  # one span alone
                    result.error = ValueError(f"one span of {len(data)} bytes, over max_request_size")
                    return SpanExportResult.FAILURE
                sent = self._client.export(data)
                if not sent.success:
                    result.error = sent.error
                    return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

    if url.path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    if max_request_size is not None:
        kwargs["max_request_size"] = max_request_size
    return HttpBatches(endpoint=endpoint, **kwargs), endpoint


def export_ok(exporter, spans) -> bool:
    """Send ``spans``; True when the endpoint accepted them (the SDK retried until its timeout)."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    try:
        return exporter.export(spans) == SpanExportResult.SUCCESS
    except Exception:
        return False


class _Outcome:
    error = None


@contextlib.contextmanager
def _bare_operation():
    yield _Outcome()


def _export_operation(exporter, n: int):
    """The SDK exporter's metrics context for one export (``_metrics``, in recent SDKs), or a bare
    one where this SDK has none: pyproject admits opentelemetry-sdk from 1.20."""
    metrics = getattr(exporter, "_metrics", None)
    return metrics.export_operation(n) if metrics is not None else _bare_operation()
