"""Rank files: what the writer writes the reader reads, and damage costs only the damaged part."""

import json
import os
import random
import sqlite3
import zlib

import msgpack
import pytest

from tensor_trace import schema
from tensor_trace.errors import BadInput
from tensor_trace.exporters.store.merge import merge_ranks, store_path
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


def test_step_ends_of_a_busy_process_wake_the_writer_thread_once(tmp_path):
    # While steps follow each other the thread watches the queue by itself: only the first step
    # end of a burst sets the event (a futex wake-up and five Python calls on the traced
    # thread); the others read ``woken``. Once the steps stop, their records go out as one idle
    # chunk, and the next burst wakes the thread again.
    import time

    w = RankWriter(str(tmp_path / "busy.ttr"), dict(run_id="r"), flush_interval_s=3600, idle_flush_s=0.05)
    sets = []
    real_set = w._wake.set
    w._wake.set = lambda: (sets.append(1), real_set())
    for burst in (1, 2):
        for i in range(30):  # steps of 10 ms, well inside idle_flush_s: 300 ms of them
            w.add((schema.STEP_BEGIN, i, w.string(""), i, {}))
            time.sleep(0.01)
            w.add((schema.STEP_END, i, i + 1, 0, 0))
            w.flush_when_idle()
        assert _wait_for(lambda: w.idle_flushes == burst)
        assert len(sets) == burst and not w.woken
    rt = load_rank_file(w.path)
    assert sorted(rt.steps) == list(range(30))
    w.close()


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


FORMAT1 = os.path.join(os.path.dirname(__file__), "data", "format1")


def _resolved(rt) -> dict:
    """What tests/unit/data/format1/make.py kept of a resolved rank file, as JSON has it."""
    def tensors(ts):
        return [[t.slot, t.shape, t.dtype, list(t.fp) if t.fp is not None else None] for t in ts]
    return json.loads(json.dumps(dict(
        identity=rt.identity, modules=rt.modules, groups={str(k): v for k, v in rt.groups.items()},
        params={k: tensors(v) for k, v in rt.params.items()},
        steps={str(s): dict(root=st.root, spans=[[sp.index, sp.parent, sp.path, sp.call, sp.t0, sp.dur, sp.flags,
                                                  tensors(sp.tensors)] for sp in st.spans],
                            collectives=[[c.index, c.parent, c.op, c.reduce_op, c.seq, c.bytes, c.flags,
                                          tensors(c.tensors)] for c in st.collectives],
                            fingerprints={str(k): list(v) for k, v in sorted(st.fingerprints.items())})
               for s, st in sorted(rt.steps.items())})))


def test_a_format_1_file_reads_as_its_own_version_read_it():
    """A rank file written by the last format-1 writer (raw chunks, fingerprints with u32
    indices and repeats apart) resolves to what that version's reader made of it."""
    with open(os.path.join(FORMAT1, "expected.json")) as f:
        expected = json.load(f)
    assert expected.pop("format") == 1
    rt = load_rank_file(os.path.join(FORMAT1, "rank.ttr"))
    assert rt.header["format"] == 1 and rt.report.problems() == []
    assert _resolved(rt) == expected
    assert sum(len(st.spans) for st in rt.steps.values()) == 14


def test_a_format_1_file_merges(tmp_path):
    os.makedirs(tmp_path / "ranks")
    with open(os.path.join(FORMAT1, "rank.ttr"), "rb") as src, open(tmp_path / "ranks" / "h-1.ttr", "wb") as dst:
        dst.write(src.read())
    merge_ranks(str(tmp_path), warn=lambda msg: None, workers=0)
    con = sqlite3.connect(store_path(str(tmp_path)))
    assert con.execute("SELECT COUNT(*), SUM(fp_post >= 0) FROM spans").fetchone() == (14, 14)
    assert con.execute("SELECT COUNT(*) FROM collectives").fetchone()[0] == 4
    (indices,) = con.execute("SELECT indices FROM fingerprints WHERE step = 0").fetchone()
    assert indices is not None  # format 1's blob, stored as it came


def test_an_unknown_format_version_is_refused_in_one_line(tmp_path):
    p = tmp_path / "a.ttr"
    _write(p, n_chunks=1)
    data = bytearray(p.read_bytes())
    data[len(schema.MAGIC):len(schema.FILE_PREFIX)] = (9).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=r"a.ttr: format version 9, this tensor-trace reads 1 and 2$"):
        load_rank_file(str(p))


def test_chunks_are_stored_compressed_unless_that_is_longer():
    records = [[schema.SPAN, 0, i, -1, 3, 0, 1000 * i, 500, 1, -1, -1, 1, 0] for i in range(100)]
    payload = msgpack.packb(records)
    framed = schema.chunk(payload)
    sync, length, crc = schema.CHUNK_HEAD.unpack_from(framed)
    assert sync == schema.SYNC_ZLIB and length < len(payload) / 2
    assert schema.chunk_payload(sync, framed[schema.CHUNK_HEAD.size:]) == payload
    tiny = msgpack.packb([[schema.STEP_END, 1, 2, 3, 4]])
    assert schema.chunk(tiny)[:4] == schema.SYNC and schema.chunk(payload, compress=False)[:4] == schema.SYNC
    with pytest.raises(ValueError):
        schema.chunk_payload(schema.SYNC_ZLIB, b"not zlib")
    bomb = zlib.compress(bytes(schema.MAX_CHUNK_BYTES + 1))
    with pytest.raises(ValueError):
        schema.chunk_payload(schema.SYNC_ZLIB, bomb)


def test_a_compressed_chunk_that_does_not_inflate_is_skipped(tmp_path):
    """A chunk whose CRC holds but whose bytes do not inflate (a writer's bug, not disk damage)
    costs that chunk only."""
    p = tmp_path / "a.ttr"
    _write(p, n_chunks=3)
    data = p.read_bytes()
    pos, spans = len(schema.FILE_PREFIX), []
    while pos < len(data):
        sync, length, _ = schema.CHUNK_HEAD.unpack_from(data, pos)
        spans.append((pos, sync, length))
        pos += schema.CHUNK_HEAD.size + length
    assert sum(sync == schema.SYNC_ZLIB for _, sync, _ in spans) >= 3
    at, _, length = [s for s in spans if s[1] == schema.SYNC_ZLIB][1]
    junk = bytes(length)
    bad = (data[:at] + schema.CHUNK_HEAD.pack(schema.SYNC_ZLIB, length, zlib.crc32(junk)) + junk
           + data[at + schema.CHUNK_HEAD.size + length:])
    p.write_bytes(bad)
    rt = load_rank_file(str(p))
    assert rt.report.corrupt_chunks == 1
    assert 0 in rt.steps and 2 in rt.steps and len(rt.steps[2].spans) == 50


def test_a_record_appended_to_the_queue_a_hook_read_before_a_flush_is_kept(tmp_path):
    """A hook reads the writer's queue, runs Python code (a span's fingerprint) while the
    writer's thread flushes, then appends: the record goes out with the next chunk (it was lost
    when a flush swapped in a new list: 5 spans of 20,200 with a flush every 0.5 ms)."""
    p = tmp_path / "a.ttr"
    w = RankWriter(str(p), dict(run_id="r"), flush_interval_s=3600)
    queue = w.pending
    w.add((schema.ERROR, 1, "first", "m", 1))
    w.flush()
    queue.append((schema.ERROR, 2, "second", "m", 2))
    w.close()
    assert [e["where"] for e in load_rank_file(str(p)).errors] == ["first", "second"]


@pytest.mark.parametrize("case", ["chunk", "not zlib", "bomb", "cut short", "junk after"])
def test_isal_inflates_chunks_as_zlib_does(case, monkeypatch):
    """Where the optional isal package is installed, chunks are inflated with it (about half of
    zlib's time): the same payload, and the same refusals, as the zlib fallback."""
    pytest.importorskip("isal")
    records = [[schema.SPAN, 0, i, -1, 3, 0, 1000 * i, 500, 1, -1, -1, 1, 0] for i in range(200)]
    stored = {"chunk": zlib.compress(msgpack.packb(records), schema.ZLIB_LEVEL), "not zlib": b"not zlib",
              "bomb": zlib.compress(bytes(schema.MAX_CHUNK_BYTES + 1)),
              "cut short": zlib.compress(msgpack.packb(records))[:-7],
              "junk after": zlib.compress(msgpack.packb(records)) + b"junk"}[case]
    assert schema.inflate_with()[0] is schema.inflate_with("isal")[0]  # isal by default where installed
    out = {}
    for name in ("isal", "zlib"):
        monkeypatch.setattr(schema, "_INFLATE", schema.inflate_with(name))
        try:
            out[name] = schema.chunk_payload(schema.SYNC_ZLIB, stored)
        except ValueError:
            out[name] = ValueError
    assert out["isal"] == out["zlib"]
    assert (out["zlib"] is ValueError) == (case in ("not zlib", "bomb", "cut short"))
