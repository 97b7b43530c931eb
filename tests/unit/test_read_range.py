"""reader.iter_chunks over a range of a rank file: a read stopped at a byte offset and one from
where it stopped meet every chunk once, as one read does (a merge worker loads a file's first
chunks and the merging process the rest: merge_workers.plan's split)."""

import os

from tensor_trace import schema
from tensor_trace.exporters.store.reader import ReadReport, iter_chunks
from tensor_trace.tracer.writer import RankWriter


def _file(path, spans=2000):
    w = RankWriter(str(path), dict(run_id="r", pid=1, host="h", mono_ns=0, wall_ns=0), flush_interval_s=3600)
    mod = w.module("m", "M")
    for i in range(spans):
        w.add((schema.SPAN, i // 100, i % 100, -1, mod, 0, i, 1, -1, -1, -1, 0, 0))
    w.close()
    return str(path)


def test_a_stopped_read_and_its_rest_meet_every_chunk_once(tmp_path):
    path = _file(tmp_path / "r.ttr")
    whole = list(iter_chunks(path, ReadReport(path)))
    assert len(whole) > 4
    size = os.path.getsize(path)
    for stop in (1, size // 3, size // 2, size - 1, size):
        where = [None, None]
        head = list(iter_chunks(path, ReadReport(path), stop=stop, where=where))
        assert where[0] >= min(stop, size) and where[1] == (where[0] < size)
        rest = list(iter_chunks(path, ReadReport(path), start=where[0])) if where[1] else []
        assert head + rest == whole and head, stop
