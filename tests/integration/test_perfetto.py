"""Perfetto export of a real 3-rank run: processes, nesting, flows, aligned timestamps."""

import collections
import gzip
import json
import os

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main


@pytest.fixture(scope="module")
def exported(example_traces, tmp_path_factory):
    out = example_traces.copy(3, tmp_path_factory.mktemp("perfetto") / "trace")
    r = CliRunner().invoke(main, ["export", "perfetto", "--trace", str(out)])
    assert r.exit_code == 0, r.output
    path = os.path.join(out, "trace.perfetto.json.gz")
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_every_rank_is_a_named_process(exported):
    names = {e["pid"]: e["args"]["name"] for e in exported if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2]
    for pid, name in names.items():
        assert name.startswith(f"rank {pid} ") and ":" in name  # rank, host:pid
    threads = {(e["pid"], e["args"]["name"]) for e in exported if e["name"] == "thread_name"}
    assert {(p, t) for p in range(3) for t in ("steps", "modules", "collectives")} <= threads


def test_module_spans_nest(exported):
    by_track = collections.defaultdict(list)
    for e in exported:
        if e["ph"] == "X" and e["tid"] == 1:
            by_track[e["pid"]].append(e)
    for pid, events in by_track.items():
        assert len(events) == 3 * 30
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in events:
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, (pid, e["name"])  # inside its parent
            stack.append(end)
    root = [e for e in by_track[0] if e["name"] == "<root>"]
    assert len(root) == 3
    qkv = next(e for e in by_track[1] if e["name"] == "model.layers.0.self_attn.qkv_proj")
    assert qkv["args"]["placement"] == "shard(2)" and qkv["args"]["tensors"]["output"] == "[2, 8, 96] float32"  # (6 + 2*6) heads * 16 / 3


def test_flows_join_each_collective_across_ranks(exported):
    flows = collections.defaultdict(dict)
    for e in exported:
        if e["ph"] in "stf":
            flows[e["id"]][e["pid"]] = e
    colls = [e for e in exported if e["ph"] == "X" and e["tid"] == 2]
    assert len(colls) == 3 * 3 * (1 + 2 * 2 + 1)  # ranks x steps x collectives per step
    assert len(flows) == len(colls) // 3
    for fid, by_pid in flows.items():
        assert sorted(by_pid) == [0, 1, 2]
        assert [by_pid[p]["ph"] for p in (0, 1, 2)] == ["s", "t", "f"]
        # Timestamps are aligned: the ranks enter the same collective within a short time.
        ts = [by_pid[p]["ts"] for p in (0, 1, 2)]
        assert max(ts) - min(ts) < 200_000  # microseconds
        for p, flow in by_pid.items():  # each flow point lies inside its collective's slice
            assert any(c["pid"] == p and c["ts"] <= flow["ts"] <= c["ts"] + c["dur"] for c in colls)
