"""tracer/native_coll.py's C path of a traced c10d collective writes the rank file that the Python
wrapper writes: every record the same but its times, whichever path recorded each collective
(arguments by keyword and by position, the default group, list outputs, a failing call, async
calls that the C path leaves to Python, steps outside the window, interned ids forgotten), on
steps with fingerprints (their indices and the inputs' nonzero rows) and without."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import iter_records, rank_files

# record type -> positions of its times (zeroed before comparing)
TIMES = {schema.STEP_BEGIN: (3,), schema.STEP_END: (2,), schema.SPAN: (6, 7), schema.COLLECTIVE: (8, 9)}
SKIPPED = {schema.HEADER, schema.IDENTITY, schema.END}  # (pids, clocks, stats)


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


class Collectives(nn.Module):
    def forward(self, x):
        world = dist.group.WORLD
        dist.all_reduce(x, group=world)
        dist.all_reduce(tensor=x, op=dist.ReduceOp.MAX, group=world)
        dist.all_reduce(x, dist.ReduceOp.MIN, None, False)
        dist.all_reduce(x)  # (the default group)
        dist.all_reduce(x.to(torch.float64), op=dist.ReduceOp.SUM)
        out = torch.empty(x.shape[0] * 4, *x.shape[1:])
        dist.all_gather_into_tensor(out, x)
        dist.all_gather_into_tensor(output_tensor=out, input_tensor=x, group=world)
        shard = torch.empty(x.shape[0] // 4, *x.shape[1:])
        dist.reduce_scatter_tensor(shard, x)
        dist.reduce_scatter_tensor(output=shard, input=x, op=dist.ReduceOp.MAX, group=world, async_op=False)
        dist.broadcast(x, src=0)
        dist.broadcast(x[:2], 0, world, False)
        dist.all_gather([torch.empty_like(x) for _ in range(4)], x, group=world)  # (a list out)
        dist.all_reduce(x, async_op=True).wait()  # (the Python wrapper's)
        dist.broadcast(x, 0, None, True).wait()
        try:
            dist.all_reduce(x, op="nope")  # (no such op: the call raises, its record says so)
        except (TypeError, ValueError, RuntimeError):
            pass
        return x


def _records(out_dir):
    (path,) = rank_files(str(out_dir))
    got = []
    for rec in iter_records(path):
        if rec[0] in SKIPPED:
            continue
        for i in TIMES.get(rec[0], ()):
            rec[i] = 0
        got.append(rec)
    return got


def _run(out_dir, monkeypatch, native, c_path, fingerprint=False):
    """The rank file of five steps (steps 1-4 traced), with the C path of collectives or without."""
    monkeypatch.setitem(native._state, "traced_collective",
                        native._state["traced_collective"] if c_path else None)
    tr = tracer.start(out_dir=str(out_dir), fingerprint=fingerprint, fingerprint_every=1, lineage=False,
                      steps=(1, 5))
    try:
        with torch.inference_mode():
            m = Collectives()
            x = torch.arange(32, dtype=torch.float32).reshape(8, 4)
            ic = tr.collectives  # (step 4 is the window's last: Tracer.go_dormant lets it go)
            for step in range(5):
                if step == 3:
                    tr.writer._forget_ids()  # (as the intern bound does): strings and layouts again
                if step == 4:
                    calls = ic.native_calls
                m(x)
        assert tr.dormant and tr.collectives is None
        recorded = sum(c.recorded for c in calls.values())
        seqs = dict(ic.seq)  # (advanced before the window too: step 0's calls)
        assert tr.errors == 0
    finally:
        tracer.stop()
    return _records(out_dir), calls, recorded, seqs


@pytest.mark.parametrize("fingerprint", [False, True])
def test_c_path_of_collectives_writes_the_python_paths_records(tmp_path, monkeypatch, fake_world, fingerprint):
    from native_loaded import load_native_in_process

    native = load_native_in_process(monkeypatch)
    c_records, c_calls, c_recorded, c_seqs = _run(tmp_path / "c", monkeypatch, native, True, fingerprint)
    py_records, py_calls, py_recorded, py_seqs = _run(tmp_path / "py", monkeypatch, native, False, fingerprint)
    assert not py_calls and py_recorded == 0
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather"} \
        <= set(c_calls)
    colls = [r for r in c_records if r[0] == schema.COLLECTIVE]
    assert len(colls) == 4 * 15
    # The C path wrote the twelve synchronous calls of a step but where a group or layout was new
    # to the rank file (the first traced step, and the step after its ids were forgotten).
    assert c_recorded >= 2 * 12
    assert c_records == py_records
    assert c_seqs == py_seqs == {0: 5 * 15}
    assert [r[14] for r in colls[12:15]] == [schema.FLAG_ASYNC, schema.FLAG_ASYNC, schema.FLAG_ERROR]
    fps = [(r[11], r[12]) for r in colls if not r[14] & schema.FLAG_ERROR]
    if fingerprint:  # (each with its inputs' and outputs' values; all_reduce's with nonzero rows)
        assert all(pre >= 0 and post >= 0 for pre, post in fps)
        assert sum(1 for r in colls if len(r) > 16 and r[16].get("nonzero_rows") == [[0, 7, 8]]) >= 4 * 5
        assert any(r[0] == schema.FINGERPRINTS for r in c_records)
    else:
        assert all(fp == (-1, -1) for fp in fps)
