"""OTLP protobuf built directly, in batches: opentelemetry-sdk's encoder makes a ReadableSpan and
then a protobuf span per span (about 14k spans/s in one process); building the protobuf messages
(opentelemetry-proto's, as the SDK's encoder does) from the mapping in ``otlp_spans`` skips the
SDK objects. The messages equal the SDK encoder's for the same spans (tests/unit/test_format.py)."""

from __future__ import annotations

from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, SpanFlags, Status

_KIND = Span.SpanKind.SPAN_KIND_INTERNAL
_FLAGS = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK  # as the SDK's: a local parent


def _value(v) -> AnyValue:
    if isinstance(v, bool):  # before int: bool is one
        return AnyValue(bool_value=v)
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(array_value=ArrayValue(values=[_value(x) for x in v]))


_CACHE_MAX = 50_000  # bounds the memory a traced rank spends on it
_encoded: dict = {}  # (key, value's type, value or its str) -> KeyValue


def attributes(attrs: dict) -> list:
    """KeyValues of ``attrs``. Most pairs repeat (step attributes on every span of a step, a
    module's path, tensor shapes), so each encoded pair is kept for reuse (protobuf copies it
    into the span)."""
    out = []
    for k, v in attrs.items():
        key = (k, type(v), str(v) if isinstance(v, (list, tuple)) else v)
        kv = _encoded.get(key)
        if kv is None:
            if len(_encoded) >= _CACHE_MAX:
                _encoded.clear()
            kv = _encoded[key] = KeyValue(key=k, value=_value(v))
        out.append(kv)
    return out


class SpanRow(NamedTuple):
    """One span as live streaming and ``export otlp`` both produce it."""
    resource: tuple  # the resource's attributes, as items
    name: str
    trace_id: int
    span_id: int
    parent_id: int | None
    start_ns: int
    end_ns: int
    attrs: dict


class SpanBatch:
    """Spans of one instrumentation scope grouped by resource, as one export request."""

    def __init__(self, scope_name: str, scope_version: str):
        self.scope = InstrumentationScope(name=scope_name, version=scope_version)
        self.by_resource: dict = {}  # resource attributes (a tuple of items) -> [Span]
        self.count = 0

    def add(self, row: SpanRow) -> None:
        resource, name, trace_id, span_id, parent_id, start_ns, end_ns, attrs = row
        spans = self.by_resource.get(resource)
        if spans is None:
            spans = self.by_resource[resource] = []
        spans.append(Span(trace_id=trace_id.to_bytes(16, "big"), span_id=span_id.to_bytes(8, "big"),
                          parent_span_id=parent_id.to_bytes(8, "big") if parent_id is not None else None,
                          name=name, kind=_KIND, start_time_unix_nano=start_ns, end_time_unix_nano=end_ns,
                          attributes=attributes(attrs), status=Status(), flags=_FLAGS))
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def request(self) -> ExportTraceServiceRequest:
        return ExportTraceServiceRequest(resource_spans=[
            ResourceSpans(resource=Resource(attributes=attributes(dict(res))),
                          scope_spans=[ScopeSpans(scope=self.scope, spans=spans)])
            for res, spans in self.by_resource.items()])
