"""A ceiling on the Python calls the tracer adds to a collective, and the records of the layout
cache that tracer/native.py's call_key keys (tracer/collectives.py ``_layout_of``).

Deterministic stand-in for a timing goal, as tests/unit/test_hot_path_calls.py is for module
calls: ``sys.setprofile`` counts the Python functions that run during steady-state steps of two
modules that differ only in how many ``all_reduce`` calls they make (the example's TP step makes
fourteen collectives; at two gloo ranks on a shared 2-core CPU each traced one cost about 65 us
of the rank's main thread with 30 Python calls, about 30 us with 5: bench/example_tp2_ab.py). The
difference per collective, less torch's own without the tracer, is the tracer's.
"""

import dataclasses
import gc
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

# Python calls the tracer adds per all_reduce (measured on the code of 2026-12-02: torch 2.13
# CPU, fake backend): in a traced step without fingerprints, with Python layout keys and with
# tracer/native.py built (its C path of collectives, tracer/native_coll.py: the wrapper's own
# frame only); before the --steps window (the sequence number only), without and with the
# build; after the window has closed for good (the wrappers taken out: none). Lower them when
# a change lowers the count; never raise them.
CEILING = {"traced-python-keys": 12, "traced-native-keys": 1, "before-window": 2,
           "before-window-native": 1, "after-window": 0, "after-window-native": 0}
WINDOWS = {"before": (1000, None), "after": (0, 1)}


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


class Reduces(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            dist.all_reduce(x, group=dist.group.WORLD)  # (as the example passes its TP group)
        return x


def _calls(fn):
    counts = {"call": 0}

    def profile(frame, event, arg):
        if event == "call":
            counts["call"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts["call"]


def _per_collective(run, small=2, large=12):
    return (run(Reduces(large)) - run(Reduces(small))) / (large - small)


def _steady(model, x, steps=5):
    """The fewest Python calls of a step over ``steps`` steps (a garbage collection, the writer
    thread's event only ever add calls)."""
    for _ in range(3):
        model(x)
    gc.disable()
    try:
        return min(_calls(lambda: model(x)) for _ in range(steps))
    finally:
        gc.enable()


def _added_per_collective(tmp_path, **options):
    x = torch.ones(4, 8)
    with torch.inference_mode():
        plain = _per_collective(lambda m: _steady(m, x))
        runs = iter(range(100))

        def traced(model):
            tr = tracer.start(out_dir=str(tmp_path / str(next(runs))), fingerprint=False, lineage=False,
                              **options)
            try:
                count = _steady(model, x)
                assert tr.errors == 0
                return count
            finally:
                tracer.stop()

        added = _per_collective(traced) - plain
    assert added == int(added)  # the same calls for every collective
    return added


def test_python_calls_per_traced_collective(tmp_path, monkeypatch, fake_world):
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")  # Python layout keys: the same on any host
    added = _added_per_collective(tmp_path)
    print(f"traced step, Python keys: +{added:g} Python calls per all_reduce")
    assert added <= CEILING["traced-python-keys"]


@pytest.mark.parametrize("window", ["before", "after"])
def test_python_calls_per_collective_outside_the_window(tmp_path, monkeypatch, fake_world, window):
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    # before: every counted step comes before the window (the wrapper keeps the group's
    # sequence); after: step 0 was traced and the window has closed for good (no wrapper left)
    added = _added_per_collective(tmp_path, steps=WINDOWS[window])
    print(f"{window} the window: +{added:g} Python calls per all_reduce")
    assert added <= CEILING[f"{window}-window"]


def test_python_calls_per_traced_collective_with_native_keys(tmp_path, monkeypatch, fake_world):
    from native_loaded import load_native_in_process

    load_native_in_process(monkeypatch)
    added = _added_per_collective(tmp_path)
    print(f"traced step, native keys: +{added:g} Python calls per all_reduce")
    assert added <= CEILING["traced-native-keys"]


@pytest.mark.parametrize("window", ["before", "after"])
def test_python_calls_per_collective_outside_the_window_with_native(tmp_path, monkeypatch, fake_world,
                                                                     window):
    from native_loaded import load_native_in_process

    load_native_in_process(monkeypatch)
    added = _added_per_collective(tmp_path, steps=WINDOWS[window])
    print(f"{window} the window, native: +{added:g} Python calls per all_reduce")
    assert added <= CEILING[f"{window}-window-native"]


class Mixed(nn.Module):
    """Collectives of several layouts, each layout twice in a step (the second from the cache),
    and all_reduces whose arguments come by keyword and by position."""

    def forward(self, x):
        for _ in range(2):
            dist.all_reduce(x)
            dist.all_reduce(x.to(torch.float64))
            lst = [torch.empty_like(x) for _ in range(4)]
            dist.all_gather(lst, x)
            out = torch.empty(x.shape[0] // 4, *x.shape[1:])
            dist.reduce_scatter_tensor(out, x)
            dist.broadcast(x[:2], src=0)
        # arguments by keyword and by position: the wrapper reads each where it was given
        dist.all_reduce(tensor=x, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        dist.all_reduce(x, dist.ReduceOp.MIN, None, False)
        work = dist.all_reduce(x, dist.ReduceOp.PRODUCT, None, True)
        work.wait()
        return x


def _collective_records(out_dir):
    """Every collective's record as read back, but its times."""
    (path,) = rank_files(str(out_dir))
    rt = load_rank_file(path)
    return [dataclasses.replace(c, t0=0, dur=0) for step in rt.steps.values() for c in step.collectives]


def test_collective_layouts_from_native_keys_match_the_python_path(tmp_path, monkeypatch, fake_world):
    """Each collective's record (slots, bytes, the rest but times) is the same whether its
    layout came from the cache keyed by tracer/native.py's call_key or from Python reads, over
    steps that reuse the layouts and a rank file whose interned ids were forgotten midway."""
    from native_loaded import load_native_in_process
    from tensor_trace.tracer import spans

    native = load_native_in_process(monkeypatch)
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    got = {}
    for label, key in (("native", native.call_key()), ("python", None)):
        monkeypatch.setenv("TENSOR_TRACE_NATIVE", "1" if key is not None else "0")
        monkeypatch.setattr(spans, "call_key", key)
        tr = tracer.start(out_dir=str(tmp_path / label), fingerprint=False, lineage=False)
        try:
            with torch.inference_mode():
                m = Mixed()
                for step in range(4):
                    if step == 2:
                        tr.writer._forget_ids()  # (as the intern bound does): layouts again
                    m(x)
            assert tr.errors == 0
            if key is not None:
                assert len(tr.layouts.coll) == 5  # the cache was used (five layouts)
            else:
                assert not tr.layouts.coll
        finally:
            tracer.stop()
        got[label] = _collective_records(tmp_path / label)
    assert len(got["native"]) == 4 * 13
    assert got["native"] == got["python"]
    last = got["python"][-3:]
    assert [c.reduce_op for c in last] == ["max", "min", "product"]
    assert [bool(c.flags & schema.FLAG_ASYNC) for c in last] == [False, False, True]
    assert all([t.shape for t in c.tensors] == [[8, 4], [8, 4]] for c in last)
