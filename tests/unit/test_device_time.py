"""Device time of collectives: CUDA-event bookkeeping, tested with stand-in events on the CPU.

The events here behave as CUDA events do for the tracer (record on a stream, query without
blocking, synchronize, elapsed_time in ms); on a GPU the same code path uses torch.cuda.Event
(shown on the H200s, bench/RESULTS.md)."""

import time

import torch
import torch.distributed as dist

from tensor_trace import schema, tracer
from tensor_trace.exporters import query as q
from tensor_trace.exporters.pipeline import merge_ranks, open_store
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer import device_time
from tensor_trace.tracer.device_time import CollectiveDeviceTimes


class FakeEvent:
    created = 0

    def __init__(self):
        FakeEvent.created += 1
        self.t = None
        self.done = True
        self.synced = False

    def record(self, stream=None):
        self.t = time.monotonic_ns()
        self.stream = stream

    def query(self):
        return self.done

    def synchronize(self):
        self.synced = True
        self.done = True

    def elapsed_time(self, end):
        if self.t is None or end.t is None:
            raise RuntimeError("event not recorded")
        return (end.t - self.t) / 1e6


def test_pending_until_the_end_event_completes():
    times = CollectiveDeviceTimes(event_factory=FakeEvent, stream_of=lambda d: f"stream-{d}")
    s = times.start("cuda:0")
    times.end(3, 7, s)
    end = times.pending[0][3]
    end.done = False
    assert times.collect() == []  # not complete: kept, nothing waited on
    assert not end.synced and len(times.pending) == 1
    end.done = True
    (rec,) = times.collect()
    assert rec[:3] == (schema.COLL_DEVICE, 3, 7) and rec[3] >= 0
    assert times.pending == []


def test_stop_waits_for_the_rest_and_events_are_reused():
    times = CollectiveDeviceTimes(event_factory=FakeEvent, stream_of=lambda d: None)
    FakeEvent.created = 0
    for i in range(3):
        s = times.start("cuda:0")
        times.end(0, i, s)
        times.pending[-1][3].done = False
    recs = times.collect(wait=True)
    assert [r[2] for r in recs] == [0, 1, 2]
    assert FakeEvent.created == 6
    for i in range(3):  # the next step's pairs come from the free list
        times.end(1, i, times.start("cuda:0"))
    assert FakeEvent.created == 6 and len(times.collect()) == 3


def test_bounded_pending_and_discard(monkeypatch):
    monkeypatch.setattr(device_time, "MAX_PENDING", 2)
    times = CollectiveDeviceTimes(event_factory=FakeEvent, stream_of=lambda d: None)
    for i in range(2):
        times.end(0, i, times.start("cuda:0"))
    assert times.start("cuda:0") is None and times.dropped == 1
    times.discard(None)  # an untimed collective
    free = len(times._free)
    times.collect()
    s = times.start("cuda:0")
    times.discard(s)  # a failed collective gives its event back
    assert len(times._free) == free + 4 - 1 + 1


def test_cpu_tensors_are_not_timed():
    assert CollectiveDeviceTimes.device_of([torch.zeros(2)]) is None


class Comm(torch.nn.Module):
    def forward(self, x):
        dist.all_reduce(x)
        work = dist.all_reduce(x, async_op=True)
        time.sleep(0.002)  # the async collective's device time ends at its wait
        work.wait()
        return x * 2


def test_collectives_carry_device_time_through_merge_and_query(tmp_path, fake_world, monkeypatch):
    # Every tensor counts as a device tensor, with stand-in events.
    monkeypatch.setattr(CollectiveDeviceTimes, "device_of", staticmethod(lambda ts: "cuda:0" if ts else None))
    monkeypatch.setattr(device_time, "_cuda_event", FakeEvent)
    monkeypatch.setattr(device_time, "_current_stream", lambda d: None)
    tracer.start(out_dir=str(tmp_path), fingerprint=False)
    try:
        m = Comm()
        for _ in range(2):
            m(torch.ones(4))
    finally:
        tracer.stop()
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    for st in rt.steps.values():
        sync_c, async_c = st.collectives
        assert sync_c.device_ns is not None and async_c.device_ns is not None
        assert async_c.device_ns >= 2_000_000 and async_c.flags & schema.FLAG_ASYNC
        assert async_c.device_ns <= async_c.dur + 1_000_000
    merge_ranks(str(tmp_path))
    con = open_store(str(tmp_path))
    n_timed = con.execute("SELECT COUNT(device_ns) FROM collectives").fetchone()[0]
    assert n_timed == 4
    (row,) = q.collectives(con, "")
    assert row["count"] == 4 and row["device_time_ms"] >= 2.0


def test_without_device_tensors_no_device_time(tmp_path, fake_world):
    tracer.start(out_dir=str(tmp_path), fingerprint=False)
    try:
        Comm()(torch.ones(4))
    finally:
        tracer.stop()
    merge_ranks(str(tmp_path))
    (row,) = q.collectives(open_store(str(tmp_path)), "")
    assert row["device_time_ms"] is None
