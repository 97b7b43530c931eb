"""The format layer (tensor_trace/format): record fields by name against what the tracer writes,
the id resolver, fingerprint blobs, lineage refs, point names, and the OTLP mapping that export
and live streaming share."""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import iter_records, load_rank_file, rank_files
from tensor_trace.format import fingerprints as fpf
from tensor_trace.format import lineage_refs, points
from tensor_trace.format.records import (COLLECTIVE_FIELDS, SPAN_FIELDS, LOST_META, RecordResolver, SpanRecord,
                                         TensorMeta, decode)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        dist.all_reduce(y)
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture
def traced(tmp_path):
    """A rank file of two steps of Net with an all_reduce per block (fake process group)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        net = Net()
        tracer.start(out_dir=str(tmp_path), run_id="fmt-run")
        for _ in range(2):
            net(torch.randn(3, 4))
        tracer.stop()
    finally:
        dist.destroy_process_group()
    return tmp_path


def test_writer_records_decode_by_name_as_the_reader_resolves_them(traced):
    path = rank_files(str(traced))[0]
    resolved = load_rank_file(path)
    resolver = RecordResolver()
    spans, colls = {}, {}
    for rec in iter_records(path):
        if resolver.define(rec):
            continue
        if rec[0] == schema.SPAN:
            assert len(rec) == len(SPAN_FIELDS)  # the merge's hot loop relies on it
            span = decode(rec)
            spans[(span.step, span.index)] = (resolver.string(span.path), span.call,
                                              [slot for slot, _ in resolver.tensors(span.layout)])
        elif rec[0] == schema.COLLECTIVE:
            coll = decode(rec)
            colls[(coll.step, coll.index)] = (resolver.string(coll.op), coll.seq, coll.bytes,
                                              [meta.shape for _, meta in resolver.tensors(coll.layout)])
    want_spans = {(s.step, s.index): (s.path, s.call, [t.slot for t in s.tensors])
                  for st in resolved.steps.values() for s in st.spans}
    want_colls = {(c.step, c.index): (c.op, c.seq, c.bytes, [t.shape for t in c.tensors])
                  for st in resolved.steps.values() for c in st.collectives}
    assert spans == want_spans and colls == want_colls
    assert ("layers.1", 0, ["input.0", "output"]) in spans.values()
    assert [v[0] for v in colls.values()] == ["all_reduce"] * 4
    # The positions the merge loader indexes directly.
    assert (SPAN_FIELDS["path"], SPAN_FIELDS["layout"], SPAN_FIELDS["flags"]) == (4, 8, 12)
    assert (COLLECTIVE_FIELDS["op"], COLLECTIVE_FIELDS["group"], COLLECTIVE_FIELDS["layout"],
            COLLECTIVE_FIELDS["bytes"], COLLECTIVE_FIELDS["attrs"]) == (4, 6, 10, 15, 16)


def test_resolver_definitions_and_lost_ids():
    r = RecordResolver()
    for rec in ([schema.STRING, 0, "output"], [schema.STRING, 1, "float32"], [schema.STRING, 2, "cpu"],
                [schema.STRING, 3, "lin"], [schema.STRING, 4, "Linear"],
                [schema.META, 7, [2, 3], 1, 2], [schema.META, 8, [5], 1, 2, {"kind": "complex"}],
                [schema.LAYOUT, 9, [[0, 7], [0, 8], [0, 99]]], [schema.MODULE, 3, 4],
                [schema.GROUP, 0, "tp", [0, 1], "gloo"]):
        assert r.define(rec)
    assert not r.define([schema.SPAN, 0, 0, -1, 3, 0, 0, 1, 9, -1, -1, 0, 0])
    assert r.tensors(9) == [("output", TensorMeta([2, 3], "float32", "cpu", None)),
                            ("output", TensorMeta([5], "float32", "cpu", {"kind": "complex"})),
                            ("output", LOST_META)]
    assert r.tensors(42) == [] and r.string(77) == "?"
    assert r.modules == {"lin": "Linear"}
    assert (r.groups[0].name, r.groups[0].ranks, r.groups[0].pg_name) == ("tp", [0, 1], "")
    params = r.params([schema.PARAMS, 3, [[0, 7, 5], [0, 8, 6, {"kind": "DTensor"}]]])
    assert [(p.name, p.meta.shape, p.meta.kind, p.fp_index) for p in params] == [
        ("output", [2, 3], None, 5), ("output", [5], {"kind": "DTensor"}, 6)]


def test_decode_fills_optional_fields_and_rejects_short_records():
    coll = decode([schema.COLLECTIVE, 0, 1, 0, 5, -1, 0, 3, 10, 20, 2, -1, -1, 1, 0, 64])
    assert coll.attrs is None and coll.bytes == 64
    assert decode([schema.GROUP, 1, "world", [0], "gloo"]).pg_name == ""
    span = decode([schema.SPAN, 0, 1, -1, 5, 0, 10, 20, 2, -1, -1, 1, 0, "extra"])
    assert isinstance(span, SpanRecord) and span.flags == 0
    with pytest.raises(TypeError):
        decode([schema.SPAN, 0, 1])


def test_fingerprint_blobs_round_trip():
    data = fpf.encode_values([1.5, 2.25, -3.0, float("nan"), 4.0, 16.0])
    assert fpf.decode_fingerprints(10, data + b"\x01\x02", None, {}) == {10: (1.5, 2.25), 11: (-3.0, None),
                                                                          12: (4.0, 16.0)}
    indexed = fpf.decode_fingerprints(0, data, fpf.encode_indices([7, 3, 9]), {}, key=lambda i: ("p", i))
    assert indexed == {("p", 7): (1.5, 2.25), ("p", 3): (-3.0, None), ("p", 9): (4.0, 16.0)}
    raw = list(fpf.fingerprint_pairs(0, data, None))
    assert raw[0] == (0, 1.5, 2.25) and math.isnan(raw[1][2])
    assert fpf.fingerprint_refs(4, 2, 10, -1) == [10, 11, -1, -1]
    assert fpf.fingerprint_refs(3, 1, -1, 5) == [-1, 5, 6]


def test_values_of_shuffled_indices_go_in_index_order_without_indices():
    data = fpf.encode_values([1.0, 1.5, 2.0, 2.5, 3.0, float("nan")])
    first, dense = fpf.dense_values([11, 9, 10], data)
    assert first == 9 and dense == fpf.encode_values([2.0, 2.5, 3.0, float("nan"), 1.0, 1.5])
    assert fpf.decode_fingerprints(first, dense, None, {}) == fpf.decode_fingerprints(
        0, data, fpf.encode_indices([11, 9, 10]), {})
    assert fpf.dense_order([5, 7]) is None  # a gap: the indices stay
    assert fpf.dense_order([5, 6, 5]) is None  # an index twice
    assert fpf.dense_order([]) is None
    assert fpf.dense_values([4, 4], data[:16]) is None and fpf.dense_values([4, 6], data[:16]) is None


def test_lineage_refs():
    assert lineage_refs.decode_ref([0, 2, 5, 1]) == lineage_refs.SlotRef(2, 5, 1)
    assert lineage_refs.decode_ref([1, 2, 7]) == lineage_refs.NodeRef(2, 7)
    assert lineage_refs.decode_ref([2, 40, [4, 8]]) == lineage_refs.ValuesRef(40, [4, 8], None)
    assert lineage_refs.decode_ref([3, [4]]) == lineage_refs.UnknownRef([4])
    assert lineage_refs.with_step([2, 40, [4, 8]], 3) == [2, 40, [4, 8], 3]
    assert lineage_refs.with_step([2, 40, [4, 8], 1], 3) == [2, 40, [4, 8], 1]
    assert lineage_refs.with_step([1, 2, 7], 3) == [1, 2, 7]


def test_param_refs_carry_string_ids_in_a_rank_file_and_strings_in_the_store():
    ref = lineage_refs.param_ref(11, 12)
    assert ref == [lineage_refs.REF_PARAM, 11, 12]
    strings = {11: "model.layers.0.mlp.experts", 12: "gate_up_proj"}
    stored = lineage_refs.resolve_strings(ref, strings)
    assert stored == [4, "model.layers.0.mlp.experts", "gate_up_proj"]
    assert lineage_refs.decode_ref(stored) == lineage_refs.ParamRef("model.layers.0.mlp.experts", "gate_up_proj")
    assert lineage_refs.with_step(stored, 3) == stored
    # every older kind passes through the store's translation unchanged
    for old in ([0, 2, 5, 1], [1, 2, 7], [2, 40, [4, 8]], [3, [4]]):
        assert lineage_refs.resolve_strings(old, strings) == old


def test_point_names_parse_and_glob():
    assert points.point_name("model.embed", 0, "output", False) == "model.embed:output"
    assert points.point_name("model.norm", 2, "input.0", True) == "model.norm#2:input.0"
    assert points.point_name("capture:aux", 1, "output", True) == "capture:aux#1"
    assert points.point_name("capture:aux", 0, "output", False) == "capture:aux"
    assert points.parse_point("model.norm#2:input.0") == ("model.norm", 2, "input.0")
    assert points.parse_point("model.embed:output.0.key") == ("model.embed", None, "output.0.key")
    assert points.parse_point("model.norm#3") == ("model.norm", 3, None)
    assert points.parse_point("draft.fc") == ("draft.fc", None, None)
    g = points.PointGlob("model.layers.0.*")  # module paths, outputs only
    assert g.matches("model.layers.0.mlp:output", "model.layers.0.mlp", 0, "output")
    assert not g.matches("model.layers.0.mlp:input.0", "model.layers.0.mlp", 0, "input.0")
    assert points.PointGlob("model.norm#1").matches("model.norm#1:output", "model.norm", 1, "output")
    assert not points.PointGlob("model.norm#1").matches("model.norm#0:output", "model.norm", 0, "output")
    g = points.PointGlob("model.norm:input.*")  # whole names; every call
    assert g.matches("model.norm#1:input.0", "model.norm", 1, "input.0")
    assert g.matches("model.norm:input.0", "model.norm", 0, "input.0")
    assert not g.matches("model.norm:output", "model.norm", 0, "output")
    assert not points.PointGlob("model.norm#0:input.*").matches("model.norm#1:input.0", "model.norm", 1, "input.0")


def test_export_and_live_streaming_give_a_span_the_same_ids_and_attributes(traced):
    pytest.importorskip("opentelemetry.sdk")
    from tensor_trace.exporters.formats.otlp import span_rows
    from tensor_trace.exporters.pipeline import open_store
    from tensor_trace.tracer.live_otlp import LiveOTLP

    path = rank_files(str(traced))[0]
    records = list(iter_records(path))
    header = next(r[1] for r in records if r[0] == schema.HEADER)
    live = LiveOTLP("http://127.0.0.1:9", header["run_id"], header).rows(records)
    con = open_store(str(traced))
    exported = list(span_rows(con))
    con.close()
    assert len(live) == len(exported) == 2 * (1 + 2 * 3 + 2)  # root, 2 x (block, up, down), 2 all_reduce

    def key(span):
        return (span.trace_id, span.span_id)

    by_id = {key(s): s for s in exported}
    assert len(by_id) == len(exported)
    export_only = {"tensor.placement", "tensor.reduction", "module.path", "collective.device_time_ns"}
    for s in live:
        e = by_id[key(s)]
        assert (s.name, s.parent_id) == (e.name, e.parent_id)
        assert s.attrs == {k: v for k, v in e.attrs.items()
                           if k not in export_only or (k == "module.path" and "module.call" in e.attrs)}
        assert dict(s.resource)["tensor_trace.run_id"] == dict(e.resource)["tensor_trace.run_id"] == "fmt-run"
    up = next(s for s in live if s.name == "layers.0.up")
    assert up.attrs["module.class"] == "Linear" and list(up.attrs["tensor.slot"]) == ["output"]
    assert json.loads(up.attrs["tensor.shape"][0]) == [3, 8]
    ar = next(s for s in live if s.name == "all_reduce")
    assert by_id[key(ar)].parent_id == next(s for s in live if s.name == "layers.0").span_id


def test_batch_encoding_equals_the_sdk_encoder():
    """SpanBatch builds the very request opentelemetry-sdk's encoder makes of the same spans."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

    from tensor_trace.format.otlp_encode import SpanBatch, SpanRow

    resources = [{"service.name": "tensor-trace", "tensor_trace.rank": r} for r in (0, 1)]
    attrs = [{"module.path": "m", "module.call": 2, "f": 1.5, "b": True, "shape": ["[3, 8]"], "ranks": [0, 1]},
             {"module.call": 1, "b": 1, "ranks": [True, False], "x": 1.0}]  # 1 and True are not one value
    rows = [SpanRow(tuple(res.items()), f"s{i}", 7 + i, 100 + i, 90 if i % 2 else None, 5 * i, 5 * i + 3, a)
            for i, (res, a) in enumerate((res, a) for res in resources for a in attrs * 2)]
    flags = TraceFlags(TraceFlags.SAMPLED)
    scope = InstrumentationScope("tensor-trace", "v")
    sdk = [ReadableSpan(name=r.name, context=SpanContext(r.trace_id, r.span_id, False, flags),
                        parent=SpanContext(r.trace_id, r.parent_id, False, flags) if r.parent_id else None,
                        resource=Resource(dict(r.resource)), attributes=r.attrs, kind=SpanKind.INTERNAL,
                        start_time=r.start_ns, end_time=r.end_ns, instrumentation_scope=scope) for r in rows]
    for _ in range(2):  # the second time from the encoded-pair cache
        batch = SpanBatch("tensor-trace", "v")
        for r in rows:
            batch.add(r)
        assert len(batch) == len(rows) and batch.request() == encode_spans(sdk)


def test_host_values_past_float32s_range_pack_as_inf_and_wide_entries():
    from tensor_trace.format.fingerprints import decode_wide, pack_host_values, wide_record_values

    data, wide = pack_host_values([1.0, 2.0, -1e40, 3e78, 5.0, float("nan"), float("-inf"), float("inf")])
    assert list(fpf.fingerprint_pairs(7, data, None))[:2] == [(7, 1.0, 2.0), (8, float("-inf"), float("inf"))]
    assert wide == [(1, -1e40, 3e78)]  # a true -inf is not a wide value
    got = decode_wide(wide_record_values([(8, -1e40, 3e78), (9, 1e39, float("nan"))]), {})
    assert got == {8: (-1e40, 3e78), 9: (1e39, None)}


class _Masker(nn.Module):
    def forward(self, x):
        return torch.full((1, 1, 6, 6), torch.finfo(torch.float32).min).triu(1) + 0 * x.sum()


def test_a_value_past_float32s_range_reads_back_in_float64_from_the_file_and_the_store(tmp_path):
    """A traced finfo.min mask: load_rank_file and the merged store give its float64 sums,
    not the FINGERPRINTS record's +-inf."""
    import sqlite3

    from tensor_trace.exporters.pipeline import merge_ranks, store_path

    tracer.start(out_dir=str(tmp_path))
    _Masker()(torch.ones(2))
    tracer.stop()
    mask = torch.full((1, 1, 6, 6), torch.finfo(torch.float32).min).triu(1).double()
    want = (mask.sum().item(), mask.pow(2).sum().item())
    (span,) = [s for st in load_rank_file(rank_files(str(tmp_path))[0]).steps.values() for s in st.spans]
    fp = [t.fp for t in span.tensors if t.slot == "output"][0]
    assert math.isclose(fp[0], want[0], rel_tol=1e-12) and math.isclose(fp[1], want[1], rel_tol=1e-12)
    merge_ranks(str(tmp_path), warn=lambda msg: None)
    con = sqlite3.connect(store_path(str(tmp_path)))
    ((s, q),) = con.execute("SELECT sum, sumsq FROM wide_fingerprints").fetchall()
    assert math.isclose(s, want[0], rel_tol=1e-12) and math.isclose(q, want[1], rel_tol=1e-12)
