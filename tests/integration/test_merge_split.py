"""A rank file split between a merge worker and the merging process (merge_workers.plan's split:
the worker loads its first chunks, the merging process the rest) gives the store one process
builds, row for row, wherever the cut falls."""

import os

import pytest

from tensor_trace.exporters.store import merge_workers
from tensor_trace.exporters.store.loader import FileLoader, SharedIds
from tensor_trace.exporters.store.reader import ReadReport, iter_chunks
from tensor_trace.exporters.store.tables import open_new_store

from test_merge_parallel import copy_ranks, merged


@pytest.fixture(scope="module")
def tp3(example_traces, tmp_path_factory):
    return example_traces.copy(3, tmp_path_factory.mktemp("tp3split") / "t")


def chunk_ends(path):
    """The byte offset after each intact chunk of a rank file."""
    where, ends = [0, False], []
    for _ in iter_chunks(path, ReadReport(path), where=where):
        ends.append(where[0])
    return ends


def test_a_file_split_anywhere_gives_the_same_store(tp3, tmp_path, monkeypatch):
    d = copy_ranks(tp3, tmp_path / "t")
    one, warn_one, _ = merged(d, 0)
    files = sorted(os.path.join(d, "ranks", n) for n in os.listdir(os.path.join(d, "ranks")))
    ends = chunk_ends(files[1])
    assert len(ends) >= 4  # enough chunks for cuts at the start, inside and at the end
    # After the first chunk (the header's), at a chunk's end, inside a chunk (the worker stops
    # at its end), before the last chunk and at the file's end (the worker loads it whole).
    stops = sorted({1, *ends, ends[len(ends) // 2] + 1})
    # Chunks end where they hold 256 records, mid-step: some cut leaves a step open, its
    # collectives waiting for their modules' spans (carried over to the merging process).
    open_steps = []
    for stop in stops:
        con = open_new_store(str(tmp_path / f"scratch{stop}.sqlite"))
        loader = FileLoader(con, 1, files[1], SharedIds(None))
        if not loader.load(stop):
            open_steps.append(bool(loader.step_colls))
        con.close()
    assert any(open_steps)
    for stop in stops:
        groups = [[(0, files[0])], [(1, files[1], stop), (2, files[2])]]
        monkeypatch.setattr(merge_workers, "plan", lambda files, workers, split=False: groups)
        many, warn_many, report = merged(d, 1)
        assert len(report["workers"]) == 1
        assert many == one and warn_many == warn_one, f"split at byte {stop} of {os.path.getsize(files[1])}"
