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


def _ops_with_faults(rng, n, faults):
    ops = [("all_reduce" if rng.random() < 0.7 else "all_gather", (4,)) for _ in range(n)]
    other = list(ops)
    for _ in range(faults):
        k = rng.randrange(n)
        if rng.random() < 0.5:
            other[k] = (other[k][0], (8,))
        else:
            del other[k]
    return ops, other


def test_digests_find_what_reading_every_collective_finds(tmp_path, monkeypatch):
    """The merge compares blocks of sequence numbers by digest and reads only blocks that
    differ: its issues are those of a read of every collective, wherever the fault is."""
    import random
    import sqlite3

    from tensor_trace.exporters.store import merge_align

    monkeypatch.setattr(merge_align, "DIGEST_BLOCK_SEQS", 4)
    rng = random.Random(5)
    found = 0
    for case in range(12):
        ops0, ops1 = _ops_with_faults(rng, 30, case % 3)
        d = tmp_path / f"c{case}"
        merged = _issues(d, ops0, ops1)
        con = sqlite3.connect(os.path.join(d, "merged.sqlite"))
        con.execute("DELETE FROM collective_issues")
        assert merged == merge_align.align_collectives(con), case
        found += bool(merged)
        con.close()
    assert found >= 6  # the faults were seen, not only agreement


def test_a_block_out_of_order_is_read(tmp_path, monkeypatch):
    """Sequence numbers that do not rise (an async collective recorded after a later one) mark
    their block to be read: a fault there is found even when the digests would agree."""
    from tensor_trace.exporters.store import merge_align

    monkeypatch.setattr(merge_align, "DIGEST_BLOCK_SEQS", 4)
    digest = merge_align.SequenceDigest()
    for seq in (0, 1, 3, 2, 4, 5, 6, 7):
        digest.add(0, seq, 1, 2, 3)
    lo, hi, blocks, to_read = digest.groups[0]
    assert (lo, hi, to_read) == (0, 7, {0})
    same = merge_align.SequenceDigest()
    for seq in range(8):
        same.add(0, seq, 1, 2, 3)
    assert same.groups[0][2] == blocks  # equal digests: only the mark sends block 0 to be read
    ranges = list(merge_align._ranges_to_read(0, [0, 1], 0, 7, {0: digest, 1: same}, 2))
    assert ranges == [(0, 3)]


def test_rows_of_a_step_give_the_digest_of_their_collectives(monkeypatch):
    """The loader hands a step's collective rows to the digest at once (``add_rows``): the digest
    is the one ``add`` makes of them one by one, with the texts' codes (0 or None: no reduce op),
    and rows without a group or an integer sequence number left out."""
    from tensor_trace.exporters.store import merge_align
    from tensor_trace.exporters.store.loader import COLLECTIVE_VALUES

    monkeypatch.setattr(merge_align, "DIGEST_BLOCK_SEQS", 4)
    sig_codes = [11, 22, 33]

    def row(gid, seq, op, redop, lid):
        r = [None] * COLLECTIVE_VALUES
        r[4], r[5], r[6], r[7], r[10] = op, redop, gid, seq, lid
        return r

    rows = [row(0, 0, "all_reduce", "sum", 1), row(0, 2, "all_gather", 0, 2), row(1, 0, "all_reduce", None, None),
            row(0, 1, "all_reduce", "sum", 0), row(None, 3, "all_reduce", "sum", 0), row(0, "x", "send", 0, 0),
            row(0, 5, "broadcast", "sum", 2)]
    by_rows = merge_align.SequenceDigest()
    by_rows.add_rows(rows[:3], sig_codes)
    by_rows.add_rows(rows[3:], sig_codes)
    one_by_one = merge_align.SequenceDigest()
    code = merge_align.text_code
    for gid, seq, op, redop, sig in [(0, 0, code("all_reduce"), code("sum"), 22), (0, 2, code("all_gather"), -1, 33),
                                     (1, 0, code("all_reduce"), -1, -1), (0, 1, code("all_reduce"), code("sum"), 11),
                                     (0, 5, code("broadcast"), code("sum"), 33)]:
        one_by_one.add(gid, seq, op, redop, sig)
    assert by_rows.groups == one_by_one.groups
    assert by_rows.groups[0][3] == {0}  # seq 1 after 2: its block is marked to be read
