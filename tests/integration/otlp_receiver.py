"""A real OTLP trace receiver on loopback, built from the official opentelemetry-proto service
definitions: gRPC (TraceService/Export) and HTTP/protobuf (POST /v1/traces)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


def flatten(requests) -> list[dict]:
    """Every received span as a dict: resource and span attributes, ids, times."""
    spans = []
    for req in requests:
        for rs in req.resource_spans:
            res = attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    spans.append(dict(resource=res, name=sp.name, trace_id=sp.trace_id.hex(),
                                      span_id=sp.span_id.hex(), parent=sp.parent_span_id.hex(),
                                      start=sp.start_time_unix_nano, end=sp.end_time_unix_nano,
                                      attrs=attrs(sp.attributes), scope=ss.scope.name))
    return spans


class DecodeClock:
    """CPU seconds the receiver spent decoding requests (``decode_s``): in a benchmark whose
    receiver runs in the exporter's process, the share of the time that is not the exporter's."""

    def __init__(self):
        self.decode_s = 0.0
        self._lock = threading.Lock()

    def parse(self, body: bytes):
        t = time.thread_time()
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        spent = time.thread_time() - t
        with self._lock:
            self.decode_s += spent
        return req


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer, DecodeClock):
    def __init__(self):
        DecodeClock.__init__(self)
        self.requests = []
        self.metadata = []
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        # The generated add_TraceServiceServicer_to_server, with the request decoded by parse.
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(
                self.Export, request_deserializer=self.parse,
                response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString)}),))
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    def Export(self, request, context):  # noqa: N802 (the service's method name)
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        return trace_service_pb2.ExportTraceServiceResponse()

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(grace=None)


class HttpReceiver(DecodeClock):
    def __init__(self):
        DecodeClock.__init__(self)
        self.requests = []
        self.port = free_port()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, as a collector's HTTP server does: one connection for an exporter's
            # requests (HTTP/1.0 would make it connect again for each).
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                receiver.requests.append(receiver.parse(body))
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
