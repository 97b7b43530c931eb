"""Fingerprints on a schedule of steps (``TraceConfig.fingerprint_every``): the first
FINGERPRINT_FIRST traced steps of each kind, then every Nth of that kind, and every step that
records lineage; spans on every traced step."""

import os

import pytest
import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer import steps
from tensor_trace.tracer.steps import FINGERPRINT_FIRST, due, step_kind


def _decisions(kinds, first, every) -> list:
    counts: dict = {}
    return [due(counts, k, first, every) for k in kinds]


def test_first_steps_then_every_nth_of_one_kind():
    got = _decisions(["a"] * 14, 4, 4)
    assert [i for i, d in enumerate(got) if d] == [0, 1, 2, 3, 4, 8, 12]


def test_kinds_are_counted_independently():
    kinds = ["a", "b"] * 10  # interleaved: each kind's own count decides
    got = _decisions(kinds, 2, 3)
    assert [i // 2 for i, d in enumerate(got) if d and kinds[i] == "a"] == [0, 1, 3, 6, 9]
    assert [i // 2 for i, d in enumerate(got) if d and kinds[i] == "b"] == [0, 1, 3, 6, 9]


def test_every_one_is_every_step():
    assert all(_decisions(["a", "b", "a"] * 7, 4, 1))


def test_step_kind_is_root_mode_draft_and_graph_role():
    assert step_kind("", None) == ("",)
    decode = step_kind("model", {"forward_mode": "decode", "batch_size": 3})
    assert decode == step_kind("model", {"forward_mode": "decode", "batch_size": 8})  # sizes: one kind
    assert decode != step_kind("model", {"forward_mode": "extend"})
    assert decode != step_kind("model", {"forward_mode": "decode", "draft": True})
    # SGLang's warm-up runs before a capture do not use up the decode steps' first ones
    assert decode != step_kind("model", {"forward_mode": "decode", "cuda_graph": "capture"})


def test_step_kind_under_dp_attention_is_the_same_on_every_rank():
    # One DP rank decodes while the other is idle, or extends: the ranks' modes differ, the
    # split of the tokens (dp_tokens, the same on every rank) does not.
    busy_idle = [step_kind("model", {"forward_mode": m, "dp_tokens": [1, 0]}) for m in ("decode", "idle")]
    assert busy_idle[0] == busy_idle[1]
    both = [step_kind("model", {"forward_mode": m, "dp_tokens": [4, 1]}) for m in ("extend", "decode")]
    assert both[0] == both[1] == step_kind("model", {"forward_mode": "decode", "dp_tokens": [1, 1]})
    assert busy_idle[0] != both[0] != step_kind("model", {"forward_mode": "idle", "dp_tokens": [0, 5]})


class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class B(A):
    pass


def _steps(out) -> dict:
    (path,) = rank_files(str(out))
    return load_rank_file(path).steps


def _run(tmp_path, n, **options) -> dict:
    torch.manual_seed(0)
    a, b = A(), B()
    tracer.start(out_dir=str(tmp_path), **options)
    try:
        for _ in range(n):
            a(torch.randn(2, 4))
            b(torch.randn(2, 4))
    finally:
        tracer.stop()
    return _steps(tmp_path)


def _fingerprint_refs(st) -> list:
    return [t.fp for s in st.spans for t in s.tensors]


def test_tracer_fingerprints_scheduled_steps_of_each_root(tmp_path):
    got = _run(tmp_path, 12, fingerprint_every=3, lineage=False)
    assert sorted(got) == list(range(24))
    # the roots alternate: A's k-th step is step 2k, B's 2k+1
    scheduled = {k for k in range(12) if k < FINGERPRINT_FIRST or k % 3 == 0}
    want = {2 * k for k in scheduled} | {2 * k + 1 for k in scheduled}
    assert {s for s, st in got.items() if st.fingerprinted} == want
    for s, st in got.items():
        assert len(st.spans) == 2  # spans on every traced step
        values = _fingerprint_refs(st)
        if s in want:
            assert all(v is not None for v in values) and st.fingerprints
        else:
            assert all(v is None for v in values) and not st.fingerprints


def test_record_summary_says_the_schedule(tmp_path):
    from tensor_trace.exporters.formats.summary import format_summary, summarize

    _run(tmp_path / "sched", 6, fingerprint_every=3, lineage=False)
    text = format_summary(summarize(str(tmp_path / "sched")))
    # each root: its steps 0-3 (the first 4), then none of 4-5 (every 3rd: 6, ...)
    assert ("fingerprints: first 4 steps of each kind, then every 3rd (--fingerprint-every 1 for all); "
            "8 of 12 step(s) fingerprinted") in text
    _run(tmp_path / "off", 2, fingerprint=False, lineage=False)
    assert "fingerprints: off (--no-fingerprint); 0 of 4 step(s)" in format_summary(summarize(str(tmp_path / "off")))


def test_lineage_steps_are_fingerprinted(tmp_path):
    got = _run(tmp_path, 12, fingerprint_every=8, lineage_every=5)
    lineage = {k for k in range(12) if k < steps.LINEAGE_FIRST or k % 5 == 0}
    fps = {k for k in range(12) if k < FINGERPRINT_FIRST or k % 8 == 0}
    assert {s for s, st in got.items() if st.fingerprinted and s % 2 == 0} == {2 * k for k in lineage | fps}


@pytest.mark.parametrize("options", [dict(fingerprint_every=1), dict(fingerprint=False)])
def test_every_step_or_none(tmp_path, options):
    got = _run(tmp_path, 6, lineage=False, **options)
    assert {st.fingerprinted for st in got.values()} == {options.get("fingerprint", True)}
    assert all(bool(st.fingerprints) == options.get("fingerprint", True) for st in got.values())


def test_default_schedule_and_step_attrs_kinds(tmp_path):
    # With a framework's forward modes (tracer.set_step_attrs), each mode is a kind of its own.
    a = A()
    tracer.start(out_dir=str(tmp_path))
    try:
        for i in range(20):
            tracer.set_step_attrs(forward_mode="extend" if i % 5 == 0 else "decode")
            a(torch.randn(2, 4))
    finally:
        tracer.stop()
    got = _steps(tmp_path)
    decode = [s for s in sorted(got) if s % 5]
    extend = [s for s in sorted(got) if s % 5 == 0]
    fingerprinted = {s for s, st in got.items() if st.fingerprinted}
    assert set(extend) <= fingerprinted  # 4 extend steps: all among the first of their kind
    assert [k for k, s in enumerate(decode) if s in fingerprinted] == [0, 1, 2, 3, 8]


# ---------------------------------------------------------------- readers: which steps have values

def _store(tmp_path, rows):
    """A store holding only steps rows: (proc, step, forward mode, fingerprinted)."""
    import json

    from tensor_trace.exporters.store.tables import open_new_store

    con = open_new_store(str(tmp_path / "steps.sqlite"))
    con.executemany("INSERT INTO steps(proc, step, root, t_begin, t_end, attrs, fingerprinted) "
                    "VALUES (?, ?, '', 0, 1, ?, ?)",
                    [(p, s, json.dumps({"forward_mode": m}), fp) for p, s, m, fp in rows])
    return con


def test_verdicts_sample_fingerprinted_steps_of_each_kind(tmp_path):
    from tensor_trace.exporters.analysis.verdicts import sample_steps

    rows = []
    for s in range(12):
        mode = "extend" if s < 2 else "decode"
        # decode steps 2-5 lack values on proc 1 only (its schedule counted otherwise), 6-11 have them
        rows += [(0, s, mode, 1), (1, s, mode, int(not 2 <= s <= 5))]
    con = _store(tmp_path, rows + [(0, 12, "idle", 0), (1, 12, "idle", 0)])
    # extend: both; decode: the first three with values on every process; idle: none has values,
    # sampled all the same (shapes and collectives)
    assert sample_steps(con, [0, 1]) == [0, 1, 6, 7, 8, 12]
    assert sample_steps(con, [0]) == [0, 1, 2, 3, 4, 12]


def test_placement_note_for_a_step_without_values(tmp_path):
    from tensor_trace.exporters.analysis.verdicts import unfingerprinted_note

    con = _store(tmp_path, [(0, s, "decode", int(s < 4 or s % 4 == 0)) for s in range(10)])
    assert unfingerprinted_note(con, [0], 8) is None
    note = unfingerprinted_note(con, [0], 5)
    assert note.startswith("step 5 was not fingerprinted") and "steps of this kind: 0, 1, 2, 3, 4, 8;" in note


def test_placement_note_when_no_step_has_values(tmp_path):
    from tensor_trace.exporters.analysis.verdicts import unfingerprinted_note

    con = _store(tmp_path, [(0, s, "decode", 0) for s in range(3)])
    assert "nor was any step (recorded with --no-fingerprint?)" in unfingerprinted_note(con, [0], 1)


def test_compare_keeps_pairs_fingerprinted_on_both_sides():
    from types import SimpleNamespace

    from tensor_trace.exporters.analysis.compare_steps import with_values

    pairs = [(0, 0), (1, 1), (2, 5), (3, 6)]
    a, b = SimpleNamespace(fingerprinted={0, 1, 2, 3}), SimpleNamespace(fingerprinted={0, 1, 6})
    assert with_values(a, b, pairs) == ([(0, 0), (1, 1), (3, 6)], [(2, 5)])
    # no pair with values on both sides: every pair's structure is still compared, values on none
    assert with_values(a, b, [(2, 5)]) == ([], [(2, 5)])
    # runs without any fingerprints (--no-fingerprint): the pairs stay (their points: not comparable)
    none = SimpleNamespace(fingerprinted=set())
    assert with_values(none, none, pairs) == (pairs, [])


def test_python_api_takes_the_option_and_query_steps_says(tmp_path):
    import tensor_trace

    a = A()
    with tensor_trace.trace(out_dir=str(tmp_path), fingerprint_every=2, lineage=False) as rec:
        for _ in range(8):
            a(torch.randn(2, 4))
    with rec.open() as trace:
        rows = trace.steps()
        assert [r["step"] for r in rows if r["fingerprinted"]] == [0, 1, 2, 3, 4, 6]
        (row,) = trace.sql("SELECT COUNT(DISTINCT step) FROM fingerprints WHERE step >= 0").values
        assert row == [6]


def test_a_forked_child_starts_both_schedules_afresh(tmp_path):
    # The child counts its own steps: its first steps of a kind are fingerprinted, whatever
    # its parent had traced before the fork.
    a = A()
    tracer.start(out_dir=str(tmp_path), fingerprint_every=8)
    try:
        for _ in range(6):
            a(torch.randn(2, 4))
        pid = os.fork()
        if pid == 0:  # the child: trace, write its rank file, leave without pytest's teardown
            code = 1
            try:
                for _ in range(FINGERPRINT_FIRST + 1):
                    a(torch.randn(2, 4))
                tracer.stop()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        tracer.stop()
    files = rank_files(str(tmp_path))
    assert len(files) == 2
    child = next(load_rank_file(p) for p in files if load_rank_file(p).header.get("pid") == pid)
    got = {s: st.fingerprinted for s, st in child.steps.items()}
    assert got == {s: s < FINGERPRINT_FIRST for s in range(FINGERPRINT_FIRST + 1)}


def test_a_step_without_its_step_begin_is_not_known_to_be_fingerprinted(tmp_path):
    from tensor_trace.exporters.analysis.verdicts import sample_steps
    from tensor_trace.exporters.store.reader import step_fingerprinted

    on, off = {"config": {"fingerprint": True}}, {"config": {"fingerprint": False}}
    assert step_fingerprinted(on, False, None) is None and step_fingerprinted(off, False, None) is None
    assert step_fingerprinted(on, True, None) is True and step_fingerprinted(off, True, None) is False
    assert step_fingerprinted(off, True, 1) is True and step_fingerprinted(on, True, 0) is False
    # unknown (NULL, its STEP_BEGIN lost) is not sampled before steps known to hold values
    con = _store(tmp_path, [(0, s, "decode", None if s < 3 else int(s % 2)) for s in range(12)])
    assert sample_steps(con, [0]) == [3, 5, 7]


def test_loader_and_reader_store_the_same_flags(tmp_path):
    from tensor_trace.exporters import pipeline as mg

    got = _run(tmp_path, 12, fingerprint_every=3, lineage=False)
    con = mg.open_store(str(tmp_path))
    stored = dict(con.execute("SELECT step, fingerprinted FROM steps"))
    assert stored == {s: int(st.fingerprinted) for s, st in got.items()}


def test_a_step_of_unknown_fingerprinting_is_shown_and_noted_as_such(tmp_path):
    # query steps and the placement note read a lost STEP_BEGIN (NULL) as analysis does: not
    # known to hold values, never as fingerprinted
    from tensor_trace.exporters import query as q
    from tensor_trace.exporters.analysis.verdicts import unfingerprinted_note

    con = _store(tmp_path, [(0, 0, "decode", 1), (0, 1, "decode", None), (0, 2, "decode", 0)])
    assert [r["fingerprinted"] for r in q.steps(con)] == [True, None, False]
    note = unfingerprinted_note(con, [0], 1)
    assert note is not None and note.startswith("step 1 was not fingerprinted") and ": 0;" in note
