"""The index built beside the verdicts (exporters/store/merge.py, ``_index_beside``): the analysis
reads and writes the store while a second connection builds it, and the store ends as a plain
file with every index, or is removed with everything beside it when the analysis fails."""

import os
import sqlite3

import pytest

from synthetic_trace import SyntheticTrace, arrays, gen, pos, same
from tensor_trace.exporters.store import merge

R = [0, 1]


def _trace(d):
    rng = gen()
    xs = {r: pos(rng, 2, 3) for r in R}
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("reduce", arrays(xs)) as c:
            tr.coll("all_reduce", [arrays(xs)], [same(xs[0] + xs[1], R)])
            c.returns(same(xs[0] + xs[1], R))
    tr.write(str(d))
    return str(d)


def test_analysis_runs_beside_the_index_and_the_store_ends_plain(tmp_path):
    d = _trace(tmp_path / "t")
    seen = {}

    def analyse(con):
        seen["mode"] = con.execute("PRAGMA journal_mode").fetchone()[0]
        seen["spans"] = con.execute("SELECT COUNT(*) FROM spans").fetchone()[0]
        # A write while the index is being built: it waits for the index's commit.
        con.execute("INSERT INTO points(point, module) VALUES ('x:output', 'x')")
        return 1

    report = merge.merge_ranks(d, warn=lambda m: None, workers=0, analyse=analyse)
    assert report["points"] == 1 and seen["spans"] > 0
    assert seen["mode"] == "wal"  # the analysis ran while the second connection held the index
    assert set(report["index_beside"]) == {"index_cpu_s", "beside_cpu_s"}
    path = merge.store_path(d)
    assert not [p for p in os.listdir(d) if p.startswith(os.path.basename(path)) and p != os.path.basename(path)]
    with open(path, "rb") as f:
        head = f.read(20)
    assert head[18:20] == b"\x01\x01"  # a rollback-journal file: readable read-only with no WAL beside it
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    names = {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"collectives_by_seq", "collectives_by_module", "fingerprints_by_step", "points_by_module"} <= names
    assert con.execute("SELECT point FROM points").fetchall() == [("x:output",)]
    con.close()


def test_a_failing_analysis_leaves_nothing_beside_the_trace(tmp_path):
    d = _trace(tmp_path / "t")

    def analyse(con):
        con.execute("SELECT COUNT(*) FROM spans").fetchone()
        raise RuntimeError("analysis failed")

    with pytest.raises(RuntimeError, match="analysis failed"):
        merge.merge_ranks(d, warn=lambda m: None, workers=0, analyse=analyse)
    assert sorted(os.listdir(d)) == ["ranks", "run.json"]  # no store, no part, no WAL file


def test_without_wal_the_index_is_built_first(tmp_path, monkeypatch):
    # A file system where WAL cannot work (no shared memory): the same store, built in turn.
    d = _trace(tmp_path / "t")
    real = merge.sqlite3.connect

    class NoWal(sqlite3.Connection):
        def execute(self, sql, *a):
            if sql.strip().upper() == "PRAGMA JOURNAL_MODE=WAL":
                raise sqlite3.OperationalError("disk I/O error")
            return super().execute(sql, *a)

    monkeypatch.setattr(merge, "open_new_store", lambda path: _plain(real(path, factory=NoWal)))
    seen = {}

    def analyse(con):
        seen["mode"] = con.execute("PRAGMA journal_mode").fetchone()[0]
        seen["indexes"] = {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        return 0

    report = merge.merge_ranks(d, warn=lambda m: None, workers=0, analyse=analyse)
    assert seen["mode"] != "wal" and "collectives_by_module" in seen["indexes"]
    assert "index_beside" not in report
    assert sorted(os.listdir(d)) == ["merged.sqlite", "ranks", "run.json"]


def _plain(con):
    from tensor_trace.exporters.store.tables import SCHEMA_SQL

    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    con.executescript(SCHEMA_SQL)
    return con


def test_the_pipelines_analysis_writes_nothing_before_its_verdicts(tmp_path, monkeypatch):
    # Its first write waits for the index's commit (busy_timeout): a write before the verdicts
    # (the analysis version in meta) would have them wait for the whole index, not run beside it.
    from tensor_trace.exporters import analysis, pipeline

    d = _trace(tmp_path / "t")
    seen = {}

    def verdicts(con):
        seen["in_transaction"] = con.in_transaction
        return 0

    monkeypatch.setattr(analysis, "compute_verdicts", verdicts)
    pipeline.merge_ranks(d, warn=lambda m: None, workers=0)
    assert seen == {"in_transaction": False}
    con = sqlite3.connect(f"file:{merge.store_path(d)}?mode=ro", uri=True)
    assert con.execute("SELECT value FROM meta WHERE key='analysis_version'").fetchone() == (analysis.version(),)
    con.close()


def _steps_trace(d):
    # Three steps; "reduce" runs twice a step (calls 0 and 1), "skip" in the first step only.
    rng = gen()
    tr = SyntheticTrace(2)
    for k in range(3):
        with tr.step():
            for _ in range(2):
                xs = {r: pos(rng, 2, 3) for r in R}
                with tr.call("reduce", arrays(xs)) as c:
                    tr.coll("all_reduce", [arrays(xs)], [same(xs[0] + xs[1], R)])
                    c.returns(same(xs[0] + xs[1], R))
            if k == 0:
                with tr.call("skip", arrays(xs)) as c:
                    c.returns(arrays(xs))
    tr.write(str(d))
    return str(d)


def test_the_first_process_spans_per_call_are_counted_while_loading(tmp_path):
    # The verdicts' steps seen per point come from the merge's count of the first file's spans
    # (a TEMP table of its connection), not from grouping that process's spans again; the same
    # counts as the grouping, which the verdicts fall back to without the table.
    from tensor_trace.exporters.analysis import verdicts

    d = _steps_trace(tmp_path / "t")
    seen = {}

    def analyse(con):
        seen["tables"] = {n for (n,) in con.execute("SELECT name FROM temp.sqlite_master")}
        seen["counted"] = sorted(verdicts.calls_seen(con))
        con.execute(f"DROP TABLE temp.{merge.CALLS_TABLE}")
        seen["grouped"] = sorted(verdicts.calls_seen(con))
        return 0

    merge.merge_ranks(d, warn=lambda m: None, workers=0, analyse=analyse)
    assert merge.CALLS_TABLE in seen["tables"]
    modules = dict(sqlite3.connect(merge.store_path(d)).execute("SELECT module_id, path FROM modules"))
    counted = {(modules[m], call): n for m, call, n in seen["counted"]}
    assert counted["reduce", 0] == counted["reduce", 1] == 3 and counted["skip", 0] == 1
    assert seen["counted"] == seen["grouped"]
