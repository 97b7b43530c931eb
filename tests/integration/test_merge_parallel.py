"""Merges with worker processes (exporters/store/merge_workers.py) build the store one process builds,
row for row, on real traces and damaged ones, and leave no worker or part store behind."""

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from tensor_trace.errors import BadInput
from tensor_trace.exporters.store import merge_workers
from tensor_trace.exporters.pipeline import merge_ranks, store_path

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")


@pytest.fixture(scope="module")
def tp3(example_traces, tmp_path_factory):
    return example_traces.copy(3, tmp_path_factory.mktemp("tp3") / "t")


def copy_ranks(src, dst, names=None):
    """A trace folder with (some of) src's rank files and its run.json."""
    os.makedirs(os.path.join(dst, "ranks"))
    with open(os.path.join(src, "run.json"), "rb") as f, open(os.path.join(dst, "run.json"), "wb") as g:
        g.write(f.read())
    for name in names or sorted(os.listdir(os.path.join(src, "ranks"))):
        with open(os.path.join(src, "ranks", name), "rb") as f, open(os.path.join(dst, "ranks", name), "wb") as g:
            g.write(f.read())
    return str(dst)


def dump(d):
    """Every row of every table of the store (spans with their rowids), in a fixed order."""
    con = sqlite3.connect(store_path(d))
    out = {}
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
        n = len(con.execute(f"PRAGMA table_info({t})").fetchall()) + (t == "spans")
        cols = ("rowid, *" if t == "spans" else "*")
        out[t] = con.execute(f"SELECT {cols} FROM {t} ORDER BY {', '.join(str(i + 1) for i in range(n))}").fetchall()
    con.close()
    return out


def merged(d, workers):
    warnings = []
    report = merge_ranks(d, warn=warnings.append, workers=workers)
    return dump(d), warnings, report


def leftovers(d):
    """Part stores next to the store, and live processes whose command line names this folder."""
    parts = merge_workers.part_paths(store_path(d) + ".tmp")
    procs = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if os.path.abspath(d).encode() in f.read():
                        procs.append(int(pid))
            except OSError:
                pass
    return parts, procs


def test_workers_build_the_same_store(tp3, tmp_path):
    d = copy_ranks(tp3, tmp_path / "t")
    one, warn_one, _ = merged(d, 0)
    assert one["spans"] and one["collectives"] and one["lineage"] and one["points"]
    for workers in (1, 2):
        many, warn_many, report = merged(d, workers)
        assert len(report["workers"]) == workers  # the files really went to workers
        assert many == one and warn_many == warn_one
    assert not any(leftovers(d))


def test_spans_keep_their_rowids_when_a_part_is_not_dense(tp3, tmp_path, monkeypatch):
    # The part's rowids normally run 1..n (copied by appending); when they seem not to, each
    # span is copied with its own rowid: the store must be the same.
    d = copy_ranks(tp3, tmp_path / "t")
    one, _, _ = merged(d, 0)
    read = merge_workers.read_part

    def read_miscounted(part):
        data = read(part)
        data["results"][0].span_rows += 1
        return data

    monkeypatch.setattr(merge_workers, "read_part", read_miscounted)
    many, _, report = merged(d, 2)
    assert many == one and len(report["workers"]) == 2


def test_damaged_files_give_the_same_store_and_warnings(tp3, tmp_path):
    d = copy_ranks(tp3, tmp_path / "t")
    ranks = os.path.join(d, "ranks")
    files = sorted(os.listdir(ranks))
    with open(os.path.join(ranks, files[0]), "rb") as f:
        data = f.read()
    with open(os.path.join(ranks, files[0]), "wb") as f:
        f.write(data[: int(len(data) * 0.8)])  # killed mid-write
    with open(os.path.join(ranks, files[2]), "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)  # a corrupt chunk in the middle
    with open(os.path.join(ranks, files[2]), "wb") as f:
        f.write(bytes(data))
    headerless = bytearray(data)
    headerless[12:12 + 200] = bytes(200)  # the chunk holding the header is gone
    with open(os.path.join(ranks, files[1] + "-headerless.ttr"), "wb") as f:
        f.write(bytes(headerless))
    with open(os.path.join(ranks, "zz-junk.ttr"), "w") as f:
        f.write("this is not a trace")
    one, warn_one, _ = merged(d, 0)
    assert any("truncated tail" in w for w in warn_one) and any("corrupt chunk" in w for w in warn_one)
    assert any("skipping" in w and "no header" in w for w in warn_one)
    assert any("not a tensor-trace rank file" in w for w in warn_one)
    for workers in (1, 3):
        many, warn_many, _ = merged(d, workers)
        assert many == one and warn_many == warn_one


def test_a_failed_worker_is_replaced_by_the_merging_process(tp3, tmp_path, monkeypatch):
    d = copy_ranks(tp3, tmp_path / "t")
    one, _, _ = merged(d, 0)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every worker exits at once with status 1
    many, warnings, report = merged(d, 2)
    assert many == one
    assert report["workers"] == [] and len(warnings) == 2 and all("merge worker failed" in w for w in warnings)
    assert not any(leftovers(d))


@linux_only
def open_fifo_writer(fifo, timeout=60):
    """The FIFO's write end once a reader has it open (a non-blocking write-open fails before),
    or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            time.sleep(0.01)
    return None


def test_parts_are_copied_while_the_worker_loads_its_next_files(tp3, tmp_path):
    """The worker completes a part store per rank file; the merging process copies each into the
    store (and removes it) while the worker goes on with its next file: here a FIFO that keeps it
    busy until the test writes to it."""
    d = copy_ranks(tp3, tmp_path / "t")
    one, warn_one, _ = merged(d, 0)
    fifo = os.path.join(d, "ranks", "zz.ttr")
    os.mkfifo(fifo)
    assert [len(g) for g in merge_workers.plan(sorted(
        os.path.join(d, "ranks", n) for n in os.listdir(os.path.join(d, "ranks"))), 1)] == [1, 3]
    prefix = store_path(d) + ".tmp.part1"  # the worker's parts: .0 and .1 for its rank files, .2 the FIFO's
    out = {}
    merging = threading.Thread(target=lambda: out.update(result=merged(d, 1)))
    merging.start()
    fd = None
    try:
        # A FIFO opens for writing without blocking only once a reader has it open: then the
        # worker has completed its two parts and waits on the FIFO until the test writes to it.
        fd = open_fifo_writer(fifo)
        assert fd is not None, "the worker never got to the FIFO"
        assert os.path.exists(prefix + ".2"), "the worker's third file has no part store of its own"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (os.path.exists(prefix + ".0") or os.path.exists(prefix + ".1")):
            time.sleep(0.01)
        assert not os.path.exists(prefix + ".0") and not os.path.exists(prefix + ".1"), \
            "the worker's completed parts were not copied while it worked on"
        assert merging.is_alive()
    finally:
        if fd is None:  # failed before the worker reached the FIFO: let it go on when it does
            fd = open_fifo_writer(fifo)
        if fd is not None:
            os.write(fd, b"this is not a trace")
            os.close(fd)
        merging.join(120)
    many, warnings, report = out["result"]
    assert many == one and len(report["workers"]) == 1
    assert warnings == warn_one + [w for w in warnings if "not a tensor-trace rank file" in w] and len(warnings) == len(warn_one) + 1
    assert not any(leftovers(d))


@linux_only
def test_no_worker_outlives_a_merge_that_fails(tp3, example_traces, tmp_path):
    d = copy_ranks(tp3, tmp_path / "t")
    os.mkfifo(os.path.join(d, "ranks", "zz.ttr"))  # the worker reading it waits for a writer: still busy
    other = str(example_traces.original(2))  # copied as aa.ttr, sorted first: the merging process meets it first
    name = sorted(os.listdir(os.path.join(other, "ranks")))[0]
    with open(os.path.join(other, "ranks", name), "rb") as f, open(os.path.join(d, "ranks", "aa.ttr"), "wb") as g:
        g.write(f.read())
    with pytest.raises(BadInput, match="belongs to run"):
        merge_ranks(d, warn=lambda m: None, workers=1)
    assert leftovers(d) == ([], [])
    assert not os.path.exists(store_path(d)) and not os.path.exists(store_path(d) + ".tmp")


@linux_only
def test_a_worker_exits_when_the_merging_process_is_killed(tp3, tmp_path):
    d = copy_ranks(tp3, tmp_path / "t")
    os.mkfifo(os.path.join(d, "ranks", "zz.ttr"))  # keeps the worker busy until it is told to stop
    code = ("import sys; from tensor_trace.exporters.pipeline import merge_ranks; "
            "merge_ranks(sys.argv[1], workers=1)")
    merging = subprocess.Popen([sys.executable, "-c", code, d], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not [p for p in leftovers(d)[1] if p != merging.pid]:
            assert merging.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.05)
    finally:
        merging.send_signal(signal.SIGKILL)
        merging.wait()
    deadline = time.monotonic() + 20
    while [p for p in leftovers(d)[1] if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in leftovers(d)[1] if _alive(p)], "a worker outlived the merging process"
    # The next merge clears what the killed one left (its temporary store and parts).
    os.remove(os.path.join(d, "ranks", "zz.ttr"))
    merge_ranks(d, warn=lambda m: None, workers=1)
    assert leftovers(d) == ([], []) and dump(d)["spans"]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
