"""A merge worker guesses the store's ids of its layouts once it has loaded its first rank file
(``merge_workers._guess_layout_ids``): where ranks are alike, each on its own device, its later parts are
copied as they are stored; where the guess is wrong they are mapped. The store is the one a single
process builds either way."""

import json
import os
import sqlite3

import pytest

from tensor_trace import schema
from tensor_trace.exporters.store import merge_workers
from tensor_trace.exporters.pipeline import merge_ranks, store_path
from tensor_trace.tracer.writer import RankWriter

RANKS = 4


def _rank_file(d, rank, steps, shared_device, shapes=3):
    """A TP rank: a root and two layers a step, an all_reduce in each; tensors on the rank's own
    device (a layout no other rank has), but the root's input on ``shared_device`` when given
    (a layout every rank has)."""
    w = RankWriter(os.path.join(d, "ranks", f"h-{rank}.ttr"), dict(run_id="run1", pid=rank, host="h",
                                                                     mono_ns=0, wall_ns=0),
                   flush_interval_s=3600)
    w.add((schema.IDENTITY, dict(rank=rank, world_size=RANKS)))
    w.add((schema.GROUP, 0, "world", list(range(RANKS)), "nccl", "0"))
    dev = f"cuda:{rank}"
    root = w.module("", "Net")
    layers = [w.module(f"layers.{i}", "Layer") for i in range(2)]
    seq = 0
    for step in range(steps):
        w.add((schema.STEP_BEGIN, step, root, 1000 * step, {}))
        for i, mod in enumerate(layers):
            # A new shape now and then: layouts keep appearing as the run goes, as batch sizes do.
            n = step % shapes + 1
            lay = w.layout((("input.0", (n, 8), "float32", dev), ("output.0", (n, 8), "float32", dev)))
            w.add((schema.COLLECTIVE, step, i, i + 1, w.string("all_reduce"), w.string("sum"), 0, seq, 10, 5, lay,
                   -1, -1, 1, 0, 32))
            seq += 1
            w.add((schema.SPAN, step, i + 1, 0, mod, 0, 10 * i, 8, lay, -1, -1, 1, 0))
        root_lay = w.layout((("input.0", (4,), "float32", shared_device or dev),))
        w.add((schema.SPAN, step, 0, -1, root, 0, 0, 500, root_lay, -1, -1, 1, 0))
        w.add((schema.STEP_END, step, 1000 * step + 600, 3, 2))
    w.close()


def _trace(d, shared_device=None, steps=7, shapes=3):
    os.makedirs(os.path.join(d, "ranks"))
    with open(os.path.join(d, "run.json"), "w") as f:
        json.dump(dict(run_id="run1"), f)
    for rank in range(RANKS):
        _rank_file(d, rank, steps, shared_device, shapes)
    return d


def _dump(d):
    con = sqlite3.connect(store_path(d))
    out = {t: con.execute(f"SELECT {'rowid, ' if t == 'spans' else ''}* FROM {t}").fetchall()
           for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")}
    con.close()
    return out


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shared_device", [None, "cpu"])
def test_parts_copied_as_stored_where_the_guess_holds(tmp_path, monkeypatch, shared_device, split):
    # Split: files of many chunks (256 records each), with shapes that appear until the end.
    d = _trace(str(tmp_path / "t"), shared_device, *((200, 150) if split else ()))
    merge_ranks(d, warn=lambda m: None, workers=0)
    one = _dump(d)
    copies = []  # per part copied: how its spans were copied
    copy = merge_workers.copy_part
    plan = merge_workers.plan
    worker_files = []

    def traced_copy(con, *a, **k):
        sql = []
        con.set_trace_callback(sql.append)
        try:
            return copy(con, *a, **k)
        finally:
            con.set_trace_callback(None)
            copies.append(next(s for s in sql if s.startswith("INSERT INTO main.spans")))

    def planned(files, workers, split=False):
        groups = plan(files, workers)
        if not split_head:
            return groups
        # The worker's first part: the first half of the merging process's last file.
        (proc, path), = groups[0][-1:]
        worker_files[:] = [(proc, path, os.path.getsize(path) // 2)] + groups[1]
        return [groups[0][:-1], worker_files]

    split_head = split
    monkeypatch.setattr(merge_workers, "copy_part", traced_copy)
    monkeypatch.setattr(merge_workers, "plan", planned)
    report = merge_ranks(d, warn=lambda m: None, workers=1)
    assert report["workers"] and len(copies) >= 2  # the worker loaded two files or more
    assert _dump(d) == one
    as_stored = [s.startswith("INSERT INTO main.spans SELECT * FROM part.spans") for s in copies]
    # No part needs its layouts mapped when every layout is the rank's own; they are mapped
    # when some are shared. After a file's first half (whose layouts are fewer than the whole
    # file's: shapes appear as the run goes), the worker's next parts are numbered right again.
    if split:
        assert len(copies) == len(worker_files) > 2  # the first part was half a file
        as_stored = as_stored[1:]
    assert as_stored == [shared_device is None] * len(as_stored)
