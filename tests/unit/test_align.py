"""Collective alignment across ranks: a skipped or different collective is reported."""

import json
import os

from tensor_trace import schema
from tensor_trace.exporters.pipeline import merge_ranks
from tensor_trace.tracer.writer import RankWriter


def _rank_file(d, rank, ops):
    """A rank that ran one step issuing ``ops`` [(op, shape)] on the world group."""
    w = RankWriter(os.path.join(d, "ranks", f"h-{rank}.ttr"), dict(run_id="run1", pid=rank, host="h",
                                                                     mono_ns=0, wall_ns=0),
                   flush_interval_s=3600)
    w.add((schema.IDENTITY, dict(rank=rank, world_size=2)))
    w.add((schema.GROUP, 0, "world", [0, 1], "gloo", "0"))
    root = w.module("", "Net")
    w.add((schema.STEP_BEGIN, 0, root, 1000, {}))
    lay = w.layout((("input.0", (4,), "float32", "cpu"),))
    w.add((schema.SPAN, 0, 0, -1, root, 0, 0, 500, lay, -1, -1, 1, 0))
    for seq, (op, shape) in enumerate(ops):
        clay = w.layout((("input.0", shape, "float32", "cpu"), ("output.0", shape, "float32", "cpu")))
        w.add((schema.COLLECTIVE, 0, seq, 0, w.string(op), w.string("sum"), 0, seq, 10 + seq, 5, clay,
               -1, -1, 1, 0, 16))
    w.add((schema.STEP_END, 0, 2000, 1, len(ops)))
    w.close()


def _issues(tmp_path, ops0, ops1):
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "ranks"))
    with open(os.path.join(d, "run.json"), "w") as f:
        json.dump(dict(run_id="run1"), f)
    _rank_file(d, 0, ops0)
    _rank_file(d, 1, ops1)
    return merge_ranks(d, warn=lambda m: None)["collective_issues"]


def test_matching_collectives_report_nothing(tmp_path):
    ops = [("all_reduce", (4,)), ("all_gather", (4,))]
    assert _issues(tmp_path, ops, ops) == []


def test_different_shape_is_reported(tmp_path):
    (issue,) = _issues(tmp_path, [("all_reduce", (4,)), ("all_reduce", (4,))],
                       [("all_reduce", (4,)), ("all_reduce", (8,))])
    gid, seq, kind, ranks, detail = issue
    assert (seq, kind) == (1, "mismatch")
    assert "[4] float32" in detail and "[8] float32" in detail


def test_different_op_is_reported(tmp_path):
    (issue,) = _issues(tmp_path, [("all_reduce", (4,))], [("broadcast", (4,))])
    assert issue[2] == "mismatch" and "all_reduce" in issue[4] and "broadcast" in issue[4]


def test_skipped_collective_is_reported(tmp_path):
    (issue,) = _issues(tmp_path, [("all_reduce", (4,)), ("all_reduce", (4,)), ("all_gather", (4,))],
                       [("all_reduce", (4,)), ("all_gather", (4,)), ("all_gather", (4,))])
    # Rank 1 skipped the second all_reduce: its next collective is an all_gather.
    assert issue[1] == 1 and issue[2] == "mismatch" and "all_gather" in issue[4]
