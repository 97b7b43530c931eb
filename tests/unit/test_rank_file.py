"""Rank files: what the writer writes the reader reads, and damage costs only the damaged part."""

import os
import random

import pytest

from tensor_trace import schema
from tensor_trace.errors import BadInput
from tensor_trace.exporters.store.reader import ReadReport, iter_records, load_rank_file
from tensor_trace.tracer.writer import RankWriter


def _write(path, n_chunks=10, per_chunk=50, **kw):
    w = RankWriter(str(path), dict(run_id="r1", pid=1, host="h"), flush_interval_s=3600, **kw)
    for c in range(n_chunks):
        w.add((schema.STEP_BEGIN, c, w.string(""), c * 1000, {}))
        for i in range(per_chunk):
            w.add((schema.SPAN, c, i, -1, w.module(f"m{i}", "Linear"), 0, i, 1, w.layout(
                ((f"output", (2, i), "float32", "cpu"),)), -1, -1, 0, 0))
        w.add((schema.STEP_END, c, c * 1000 + 999, per_chunk, 0))
        w.flush()
    w.close()
    return w


def test_round_trip(tmp_path):
    p = tmp_path / "a.ttr"
    _write(p)
    rt = load_rank_file(str(p))
    assert rt.header["run_id"] == "r1"
    assert sorted(rt.steps) == list(range(10))
    assert [s.path for s in rt.steps[3].spans][:3] == ["m0", "m1", "m2"]
    assert rt.steps[3].spans[7].tensors[0].shape == [2, 7]
    assert rt.steps[3].spans[7].cls == "Linear"
    assert rt.report.problems() == []


def test_truncated_tail_returns_prefix(tmp_path):
    p = tmp_path / "a.ttr"
    _write(p)
    data = p.read_bytes()
    cut = tmp_path / "cut.ttr"
    cut.write_bytes(data[: len(data) - 37])
    rt = load_rank_file(str(cut))
    assert rt.report.truncated_tail
    assert sorted(rt.steps) == list(range(9)) and rt.steps[8].t_end is not None


def test_corrupt_middle_chunk_is_skipped(tmp_path):
    p = tmp_path / "a.ttr"
    _write(p)
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 20):
        data[i] ^= 0xFF
    bad = tmp_path / "bad.ttr"
    bad.write_bytes(bytes(data))
    rt = load_rank_file(str(bad))
    assert rt.report.corrupt_chunks >= 1 and rt.report.skipped_bytes > 0
    # Steps before and after the damage survive.
    assert 0 in rt.steps and 9 in rt.steps
    assert len(rt.steps) >= 8


def test_not_a_trace(tmp_path):
    p = tmp_path / "x.ttr"
    p.write_bytes(b"hello world, not a trace")
    with pytest.raises(BadInput, match="not a tensor-trace rank file"):
        load_rank_file(str(p))


def test_random_corruption_never_crashes_or_hangs(tmp_path):
    p = tmp_path / "a.ttr"
    _write(p, n_chunks=6, per_chunk=20)
    data = p.read_bytes()
    rng = random.Random(1234)
    for trial in range(300):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 12)):
            i = rng.randrange(len(schema.FILE_PREFIX), len(buf))
            buf[i] = rng.randrange(256)
        if rng.random() < 0.3:
            buf = buf[: rng.randrange(len(schema.FILE_PREFIX), len(buf))]
        f = tmp_path / f"c{trial % 3}.ttr"
        f.write_bytes(bytes(buf))
        try:
            rt = load_rank_file(str(f))
        except BadInput:
            continue  # the header chunk itself was destroyed: a clear error is the right answer
        for st in rt.steps.values():
            for s in st.spans:
                assert isinstance(s.path, str)


def test_writer_buffer_is_bounded(tmp_path):
    w = RankWriter(str(tmp_path / "b.ttr"), dict(run_id="r"), flush_interval_s=3600, max_buffered=100)
    peak = 0
    for i in range(5000):
        w.add((schema.ERROR, i, "x", "y", i))
        peak = max(peak, len(w.pending))
    w.close()
    assert peak <= 100
    report = ReadReport(str(tmp_path / "b.ttr"))
    n = sum(1 for r in iter_records(str(tmp_path / "b.ttr"), report) if r[0] == schema.ERROR)
    assert n == 5000


def test_intern_tables_are_bounded(tmp_path):
    w = RankWriter(str(tmp_path / "i.ttr"), dict(run_id="r"), flush_interval_s=3600, max_interned=1000)
    for i in range(20000):
        w.meta((i,), "float32", "cpu")
        assert len(w._strings) + len(w._metas) + len(w.layout_ids) <= 1000
    w.close()
    # Re-emitted definitions still resolve: the last META of id 0 is the newest shape.
    metas = {}
    for r in iter_records(str(tmp_path / "i.ttr")):
        if r[0] == schema.META:
            metas[r[1]] = r[2]
    assert [19999] in metas.values()


@pytest.mark.parametrize("block", [64, 1000, 1 << 22])
def test_streaming_reader_across_block_boundaries(tmp_path, monkeypatch, block):
    from tensor_trace.exporters.store import reader

    monkeypatch.setattr(reader, "READ_BLOCK", block)
    p = tmp_path / "a.ttr"
    _write(p)
    rt = load_rank_file(str(p))
    assert sorted(rt.steps) == list(range(10)) and rt.report.problems() == []
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 30] = bytes(30)
    bad = tmp_path / "bad.ttr"
    bad.write_bytes(bytes(data[:-11]))
    rt = load_rank_file(str(bad))
    assert rt.report.corrupt_chunks >= 1 and rt.report.truncated_tail
    assert 0 in rt.steps and 8 in rt.steps and len(rt.steps) >= 7


def _wait_for(cond, timeout=10.0):
    import time

    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_idle_flush_writes_after_a_step_once_no_record_follows(tmp_path):
    # A server's last step: on disk soon after it ends, long before the periodic flush (an hour
    # here) or close, so a SIGKILL after it loses nothing; written by the thread, not the caller.
    import time

    w = RankWriter(str(tmp_path / "idle.ttr"), dict(run_id="r"), flush_interval_s=3600, idle_flush_s=0.3)
    on_disk = w.bytes_written
    w.add((schema.STEP_BEGIN, 0, w.string(""), 0, {}))
    w.add((schema.STEP_END, 0, 999, 0, 0))
    w.flush_when_idle()
    assert w.bytes_written == on_disk  # the caller never writes
    # Busy: another step begins within the delay and records keep coming: nothing written (the
    # periodic flush would take them), until that step ends and nothing follows.
    w.add((schema.STEP_BEGIN, 1, w.string(""), 1000, {}))
    for i in range(90):
        time.sleep(0.01)
        w.add((schema.SPAN, 1, i, -1, w.module("m", "Linear"), i, i, 1,
               w.layout((("output", (2,), "float32", "cpu"),)), -1, -1, 0, 0))
    assert w.bytes_written == on_disk and w.idle_flushes == 0
    w.add((schema.STEP_END, 1, 1999, 0, 0))
    w.flush_when_idle()
    assert _wait_for(lambda: w.idle_flushes == 1)
    size = os.path.getsize(w.path)
    assert size == w.bytes_written > on_disk
    rt = load_rank_file(w.path)  # readable as it is, without close
    assert sorted(rt.steps) == [0, 1] and rt.steps[1].t_end == 1999 and rt.end is None
    w.close()
    assert not w._thread.is_alive() or _wait_for(lambda: not w._thread.is_alive(), 5)


def test_a_traced_step_is_on_disk_once_the_process_goes_idle(tmp_path):
    # The tracer asks for the idle flush at each step end: a server's last step is readable
    # from its rank file while the process still runs (and could be SIGKILLed), periodic flush
    # or not.
    import torch

    from tensor_trace import tracer
    from tensor_trace.exporters.store.reader import rank_files

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    tr = tracer.start(out_dir=str(tmp_path), flush_interval_s=3600, idle_flush_s=0.05, lineage=False)
    try:
        for _ in range(3):
            net(torch.randn(2, 4))
        writer = tr.writer
        assert _wait_for(lambda: writer.idle_flushes >= 1)
        (f,) = rank_files(str(tmp_path))
        rt = load_rank_file(f)
        assert sorted(rt.steps) == [0, 1, 2] and all(s.t_end is not None for s in rt.steps.values())
        assert rt.end is None  # still running: written by the idle flush, not by stop
    finally:
        tracer.stop()
