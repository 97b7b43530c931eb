"""OTLP export into a real receiver (gRPC and HTTP/protobuf), and an endpoint that is down."""

import collections
import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")

from otlp_receiver import GrpcReceiver, HttpReceiver, flatten, free_port  # noqa: E402

from tensor_trace.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def trace(example_traces, tmp_path_factory):
    out = example_traces.copy(2, tmp_path_factory.mktemp("otlp") / "trace")
    r = CliRunner().invoke(main, ["query", "sql", "SELECT p.rank, s.step, s.n_spans + s.n_collectives AS n "
                                  "FROM steps s JOIN processes p USING(proc)", "--trace", str(out), "--json"])
    expected = {(row["rank"], row["step"]): row["n"] for row in json.loads(r.stdout)}
    return str(out), expected


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_spans_reach_a_real_receiver(trace, protocol):
    out, expected = trace
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    with receiver:
        r = CliRunner().invoke(main, ["export", "otlp", "--endpoint", f"http://127.0.0.1:{receiver.port}",
                                      "--protocol", protocol, "--trace", out])
        assert r.exit_code == 0, r.output
    spans = flatten(receiver.requests)
    assert len(spans) == sum(expected.values())
    counts = collections.Counter((s["resource"]["tensor_trace.rank"], s["attrs"]["step"]) for s in spans)
    assert dict(counts) == expected
    for s in spans:
        res = s["resource"]
        assert res["service.name"] == "tensor-trace" and res["tensor_trace.world_size"] == 2
        assert res["host.name"] and res["process.pid"] > 0 and res["tensor_trace.run_id"]
        assert s["scope"] == "tensor-trace" and s["end"] >= s["start"] > 1.6e18  # wall-clock ns
    # One trace per step, shared by both ranks (the example's 3 steps, conftest.EXAMPLE_OPTIONS).
    by_step = collections.defaultdict(set)
    for s in spans:
        by_step[s["attrs"]["step"]].add(s["trace_id"])
    assert all(len(ids) == 1 for ids in by_step.values()) and len({next(iter(v)) for v in by_step.values()}) == 3
    # Parent/child: every parent is a span of the same rank and trace; one root per rank and step.
    ids = {(s["resource"]["tensor_trace.rank"], s["trace_id"], s["span_id"]): s for s in spans}
    roots = [s for s in spans if not s["parent"]]
    assert len(roots) == len(expected)
    for s in spans:
        if s["parent"]:
            parent = ids[(s["resource"]["tensor_trace.rank"], s["trace_id"], s["parent"])]
            assert parent["start"] <= s["start"] and s["end"] <= parent["end"] + 1000
    qkv = next(s for s in spans if s["name"] == "model.layers.0.self_attn.qkv_proj")
    assert qkv["attrs"]["tensor.placement"] == "shard(2)" and qkv["attrs"]["tensor.dtype"] == ["float32"]
    assert qkv["attrs"]["tensor.shape"] == ["[2, 8, 144]"]
    ar = next(s for s in spans if s["name"] == "all_reduce")
    assert ar["attrs"]["collective.reduce_op"] == "sum" and ar["attrs"]["collective.group.ranks"] == [0, 1]
    assert ar["attrs"]["collective.bytes"] > 0
    assert ids[(ar["resource"]["tensor_trace.rank"], ar["trace_id"], ar["parent"])]["name"] == "model.embed_tokens"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_endpoint_down_is_one_line_and_bounded(trace, protocol):
    out, _ = trace
    port = free_port()  # nothing listens there
    env = dict(os.environ, OTEL_EXPORTER_OTLP_TIMEOUT="3")
    t = time.monotonic()
    proc = subprocess.run([os.path.join(VENV_BIN, "tensor-trace"), "export", "otlp", "--endpoint",
                           f"http://127.0.0.1:{port}", "--protocol", protocol, "--trace", out],
                          capture_output=True, text=True, timeout=60, env=env)
    assert time.monotonic() - t < 30
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "did not accept the spans" in lines[0], proc.stderr


def _record(out, *extra, env=None):
    cmd = [os.path.join(VENV_BIN, "tensor-trace"), "record", "-o", str(out), *extra, "--",
           os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "tp_llama.py"), "--layers", "2", "--steps", "3"]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    return proc, time.monotonic() - t


def _expected(out, module_steps=None):
    """{(rank, step): spans}; with ``module_steps``, module spans only of those steps (the live
    streaming policy's sampled steps) and collectives of all."""
    r = CliRunner().invoke(main, ["query", "sql", "SELECT p.rank, s.step, s.n_spans, s.n_collectives "
                                  "FROM steps s JOIN processes p USING(proc)", "--trace", str(out), "--json"])
    return {(row["rank"], row["step"]): row["n_collectives"]
            + (row["n_spans"] if module_steps is None or row["step"] in module_steps else 0)
            for row in json.loads(r.stdout)}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_live_streaming_while_recording(tmp_path, protocol):
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    with receiver:
        proc, _ = _record(tmp_path / "t", "--otlp-endpoint", f"http://127.0.0.1:{receiver.port}",
                          env={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if protocol == "grpc" else "http/protobuf"})
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "live OTLP:" in proc.stderr and " 0 dropped" in proc.stderr
    # The policy streams module spans of the first STREAM_FIRST steps (0, 1) of the one kind,
    # then of every 16th: step 2's are left out, counted, and still in the rank files.
    every, sampled = _expected(tmp_path / "t"), _expected(tmp_path / "t", module_steps={0, 1})
    for rank in (0, 1):
        assert f" {every[rank, 2] - sampled[rank, 2]} module spans left out by the policy" in proc.stderr
    spans = flatten(receiver.requests)
    expected = sampled
    counts = collections.Counter((s["resource"]["tensor_trace.rank"], s["attrs"]["step"]) for s in spans)
    assert dict(counts) == expected
    by_step = collections.defaultdict(set)
    for s in spans:
        by_step[s["attrs"]["step"]].add(s["trace_id"])
    assert all(len(ids) == 1 for ids in by_step.values())
    ids = {(s["resource"]["tensor_trace.rank"], s["span_id"]) for s in spans}
    assert all((s["resource"]["tensor_trace.rank"], s["parent"]) in ids
               for s in spans if s["parent"] and s["attrs"]["step"] < 2)
    ar = next(s for s in spans if s["name"] == "all_reduce")
    assert ar["attrs"]["collective.group.ranks"] == [0, 1] and ar["attrs"]["tensor.dtype"] == ["float32", "float32"]


def test_live_streaming_to_a_dead_endpoint_costs_nothing_but_a_report(tmp_path):
    base, t_base = _record(tmp_path / "plain")
    assert base.returncode == 0
    proc, t_dead = _record(tmp_path / "dead", "--otlp-endpoint", f"http://127.0.0.1:{free_port()}",
                           env={"OTEL_EXPORTER_OTLP_TIMEOUT": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "live OTLP: 0 spans sent" in proc.stderr and "dropped" in proc.stderr
    assert _expected(tmp_path / "dead") == _expected(tmp_path / "plain")  # the rank files are complete
    assert t_dead < t_base + 15  # bounded: the exporter's timeout at most, at exit


def test_standard_otel_variables_are_honoured(trace):
    out, expected = trace
    with GrpcReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
               "OTEL_EXPORTER_OTLP_HEADERS": "x-team=inference,x-oncall=2am"}
        r = CliRunner().invoke(main, ["export", "otlp", "--trace", out], env=env)  # no --endpoint
        assert r.exit_code == 0, r.output
    assert len(flatten(receiver.requests)) == sum(expected.values())
    assert all(m.get("x-team") == "inference" and m.get("x-oncall") == "2am" for m in receiver.metadata)
    spans = flatten(receiver.requests)
    assert {s["resource"]["tensor_trace.tp_rank"] for s in spans} == {0, 1}  # the one TP group


def test_http_batch_over_the_size_limit_is_split_not_dropped():
    """The SDK drops a request over its max_request_size whole; a SpanBatch over it goes as
    smaller requests, each under the limit, every span received once."""
    from tensor_trace.format.otlp_encode import SpanBatch, SpanRow
    from tensor_trace.tracer.live_otlp import export_ok, make_exporter

    batch = SpanBatch("tensor-trace", "v")
    for i in range(100):
        res = (("service.name", "tensor-trace"), ("tensor_trace.rank", i % 2))
        batch.add(SpanRow(res, f"s{i}", 7, 100 + i, None, 5, 9, {"module.path": f"layers.{i}", "step": 3}))
    limit = len(batch.serialized()) // 5
    with HttpReceiver() as receiver:
        exporter, _ = make_exporter(f"http://127.0.0.1:{receiver.port}", "http", 5.0, max_request_size=limit)
        try:
            assert export_ok(exporter, batch)
            one = SpanBatch("tensor-trace", "v")
            one.add(SpanRow((("service.name", "x" * limit),), "big", 7, 1, None, 5, 9, {}))
            assert not export_ok(exporter, one)  # a single span over the limit cannot be split
        finally:
            exporter.shutdown()
    assert len(receiver.requests) >= 5
    assert all(r.ByteSize() <= limit for r in receiver.requests)
    assert sorted(s["name"] for s in flatten(receiver.requests)) == sorted(f"s{i}" for i in range(100))


def test_http_batch_goes_through_an_sdk_without_export_metrics():
    """pyproject admits opentelemetry-sdk from 1.20, whose HTTP exporter has no ``_metrics``:
    a SpanBatch is sent all the same (it raised AttributeError on every batch)."""
    from tensor_trace.format.otlp_encode import SpanBatch, SpanRow
    from tensor_trace.tracer.live_otlp import export_ok, make_exporter

    batch = SpanBatch("tensor-trace", "v")
    for i in range(3):
        batch.add(SpanRow((("service.name", "tensor-trace"),), f"s{i}", 7, 100 + i, None, 5, 9, {}))
    with HttpReceiver() as receiver:
        exporter, _ = make_exporter(f"http://127.0.0.1:{receiver.port}", "http", 5.0)
        try:
            exporter.__dict__.pop("_metrics", None)  # as an SDK before export metrics
            assert not hasattr(exporter, "_metrics")
            assert export_ok(exporter, batch)
        finally:
            exporter.shutdown()
    assert sorted(s["name"] for s in flatten(receiver.requests)) == ["s0", "s1", "s2"]
