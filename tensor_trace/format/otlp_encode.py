"""OTLP protobuf built directly, in batches: opentelemetry-sdk's encoder makes a ReadableSpan and
then a protobuf span per span (about 14k spans/s in one process). Here a span is written straight
to its protobuf wire bytes from the mapping in ``otlp_spans``: its attribute pairs, which mostly
repeat (a step's attributes on each of its spans, a module's path, tensor shapes), are serialised
once by opentelemetry-proto's messages and kept; only the span's own frame (ids, name, times) is
written per span. A batch is the request's bytes, ready for HTTP; gRPC gets the message parsed
from them. The request equals the SDK encoder's for the same spans (tests/unit/test_format.py)."""

from __future__ import annotations

import struct
from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span, SpanFlags

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
_encoded: dict = {}  # (key, value's type, value or its str) -> the pair as a span's attribute field


def _varint(n: int) -> bytes:
    if n < _SMALL:
        return _SMALL_VARINTS[n]
    return _varint_of(n)


def _varint_of(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = 1 << 14  # a span's length and most others: their varints made once
_SMALL_VARINTS = [_varint_of(n) for n in range(_SMALL)]


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def attribute_fields(attrs: dict) -> bytes:
    """``attrs`` as a message's repeated KeyValue field 9 (a Span's attributes). Most pairs
    repeat, so each encoded pair is kept for reuse."""
    out = []
    for k, v in attrs.items():
        # A str value keys by itself (no other type equals a str); 1, 1.0 and True are equal
        # keys, so other values key with their type, and lists by their repr.
        key = (k, v) if v.__class__ is str else (k, type(v), str(v) if isinstance(v, (list, tuple)) else v)
        kv = _encoded.get(key)
        if kv is None:
            if len(_encoded) >= _CACHE_MAX:
                _encoded.clear()
            kv = _encoded[key] = _field(b"\x4a", KeyValue(key=k, value=_value(v)).SerializeToString())
        out.append(kv)
    return b"".join(out)


# The fields of a Span (opentelemetry/proto/trace/v1/trace.proto) as tag bytes: trace_id 1,
# span_id 2, parent_span_id 4, name 5, kind 6, start 7 and end 8 (fixed64), status 15 (empty:
# unset), flags 16 (fixed32). A proto3 scalar equal to its default is not written.
_TRACE_ID, _SPAN_ID, _PARENT_ID = b"\x0a\x10", b"\x12\x08", b"\x22\x08"
_KIND_FIELD = b"\x30" + _varint(_KIND)
_START, _END = b"\x39", b"\x41"
_STATUS_AND_FLAGS = b"\x7a\x00" + b"\x85\x01" + struct.pack("<I", _FLAGS)
_fixed64 = struct.Struct("<Q").pack


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


def span_field(row: SpanRow) -> bytes:
    """``row`` as a ScopeSpans' spans field (2): the Span message's wire bytes, framed."""
    _resource, name, trace_id, span_id, parent_id, start_ns, end_ns, attrs = row
    body = b"".join((
        _TRACE_ID, trace_id.to_bytes(16, "big"), _SPAN_ID, span_id.to_bytes(8, "big"),
        _PARENT_ID + parent_id.to_bytes(8, "big") if parent_id is not None else b"",
        _field(b"\x2a", name.encode()) if name else b"", _KIND_FIELD,
        _START + _fixed64(start_ns) if start_ns else b"", _END + _fixed64(end_ns) if end_ns else b"",
        attribute_fields(attrs), _STATUS_AND_FLAGS))
    return _field(b"\x12", body)


class SpanBatch:
    """Spans of one instrumentation scope grouped by resource, as one export request, kept as
    wire bytes."""

    def __init__(self, scope_name: str, scope_version: str):
        self.scope_name, self.scope_version = scope_name, scope_version
        self.by_resource: dict = {}  # resource attributes (a tuple of items) -> [span field bytes]
        self.count = 0

    def add(self, row: SpanRow) -> None:
        spans = self.by_resource.get(row.resource)
        if spans is None:
            spans = self.by_resource[row.resource] = []
        spans.append(span_field(row))
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def serialized(self) -> bytes:
        """The ExportTraceServiceRequest's wire bytes: a ResourceSpans (field 1) per resource,
        each its Resource (1) and one ScopeSpans (2) of the scope (1) and the spans (2)."""
        scope = _field(b"\x0a", InstrumentationScope(name=self.scope_name,
                                                     version=self.scope_version).SerializeToString())
        return b"".join(
            _field(b"\x0a", _field(b"\x0a", _resource_bytes(res)) + _field(b"\x12", scope + b"".join(spans)))
            for res, spans in self.by_resource.items())

    def request(self) -> ExportTraceServiceRequest:
        return ExportTraceServiceRequest.FromString(self.serialized())

    def halves(self) -> tuple:
        """Two batches of about half the spans each (a request over the exporter's size limit is
        sent as smaller ones)."""
        items = [(res, span) for res, spans in self.by_resource.items() for span in spans]
        out = (SpanBatch(self.scope_name, self.scope_version), SpanBatch(self.scope_name, self.scope_version))
        for i, (res, span) in enumerate(items):
            half = out[i * 2 >= len(items)]
            half.by_resource.setdefault(res, []).append(span)
            half.count += 1
        return out


def _resource_bytes(resource: tuple) -> bytes:
    return Resource(attributes=[KeyValue(key=k, value=_value(v)) for k, v in resource]).SerializeToString()
