"""`compare`'s vector path (``compare_vector``) gives what its scalar path gives, number for
number, on runs with planted divergences in some steps; and its reader matches the scalar one."""

import math
import struct

import numpy as np
import pytest

from synthetic_trace import SyntheticTrace, fps, gen, pos
from test_compare_check import model_step, weights
from tensor_trace.exporters import pipeline as mg
from tensor_trace.exporters.analysis import compare as cmp_mod
from tensor_trace.exporters.analysis import compare_vector as cv
from tensor_trace.exporters.analysis.compare_steps import _column


def run(tmp_path, name, tp, bad_steps=(), noise=0.0, partial_out=False, n_steps=6):
    """``n_steps`` steps of other inputs; a double reduction in ``bad_steps``; ``noise``: a
    relative change of the inputs in every step (within the tolerance or not). Each step begins
    with integer ids (a sum, no sum of squares) turned into a zero tensor, left to the scalar
    code among the replicated points the vector path settles."""
    _, wc, wr = weights()
    rng = gen(7)
    xs = [pos(rng, 4, 8) for _ in range(n_steps)]
    tr = SyntheticTrace(tp)
    for i, x in enumerate(xs):
        with tr.step({"forward_mode": "decode", "tokens": 4, "batch_size": 4}):
            with tr.call("ids", fps((4,), {r: (float(i + 6), math.nan) for r in range(tp)}, "int64")) as c:
                c.returns(fps((4, 8), {r: (0.0, 0.0) for r in range(tp)}))
            model_step(tr, (x * (1.0 + noise)).astype(np.float32), wc, wr, tp, double=i in bad_steps,
                       partial_out=partial_out)
    tr.merge(tmp_path / name)
    return mg.open_store(str(tmp_path / name))


def both(a, b, monkeypatch, *args):
    """(scalar result, vector result, points the vector path settled itself), with relative
    errors and tolerances unrounded (the same floats, not only the same 4 digits)."""
    monkeypatch.setattr(cmp_mod, "_round", lambda x: x)
    settled = []
    settle = cv.PairColumns.settle

    def counting(self, ca, cb):
        left = settle(self, ca, cb)
        settled.append(sum(len(g[0]) for _, g in self.groups) + len(self.scalar) - len(left))
        return left

    scalar = cmp_mod.compare(a, b, *args, vector=False)
    monkeypatch.setattr(cv.PairColumns, "settle", counting)
    vector = cmp_mod.compare(a, b, *args, vector=True)
    return scalar, vector, sum(settled)


@pytest.mark.parametrize("tp_a,tp_b,kw_b,noise", [
    (1, 2, dict(bad_steps=(3,)), 0.0),  # a double reduction in step 3 only
    (2, 2, dict(bad_steps=(0, 4)), 0.0),
    (1, 2, dict(partial_out=True), 0.0),  # row:output partial in B
    (2, 2, dict(partial_out=True), 3e-6),  # partial in both: compared by the bounds of their norms
    (1, 2, {}, 1e-3),  # every step off by more than float32 rounding
    (1, 2, {}, 3e-6),  # some points just beyond their tolerance, others just within
    (2, 1, {}, 1e-7),  # within the tolerance
])
def test_vector_path_gives_the_scalar_results(tmp_path, monkeypatch, tp_a, tp_b, kw_b, noise):
    a = run(tmp_path, "a", tp_a, partial_out=kw_b.get("partial_out", False) and tp_a == tp_b)
    b = run(tmp_path, "b", tp_b, noise=noise, **kw_b)
    scalar, vector, settled = both(a, b, monkeypatch)
    assert vector == scalar
    assert settled > 0  # the vector path decided points itself, not only the scalar code
    if kw_b.get("bad_steps"):
        first = scalar["first_divergence"]
        assert first["point"] == "row:output" and first["step_b"] == kw_b["bad_steps"][0]


def test_vector_path_with_a_pattern_and_explicit_steps(tmp_path, monkeypatch):
    a, b = run(tmp_path, "a", 1), run(tmp_path, "b", 2, bad_steps=(2,))
    scalar, vector, _ = both(a, b, monkeypatch, "row*", ["1:2,2:1"])
    assert vector == scalar and scalar["first_divergence"]["step_a"] == 1


def _rows(entries):
    """Fingerprint rows (first, data, indices) from (first, [(s, q)], indices or None)."""
    out = []
    for first, vals, idx in entries:
        data = b"".join(struct.pack("<ff", s, q) for s, q in vals)
        out.append((first, data, None if idx is None else struct.pack(f"<{len(idx)}I", *idx)))
    return out


def _scaled(rows, k):
    """The same rows with other values."""
    out = []
    for first, data, indices in rows:
        flat = struct.unpack(f"<{len(data) // 4}f", data)
        out.append((first, struct.pack(f"<{len(flat)}f", *(x * k for x in flat)), indices))
    return out


def test_read_columns_matches_the_scalar_reader():
    """Dense and indexed rows, an index written three times (the later value wins, within a row
    and across rows), a dense row past the end, a slot without values (-1) and one whose index
    no row writes."""
    cases = [
        (_rows([(0, [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)], None), (0, [(7.0, 8.0), (8.0, 8.0), (9.0, 10.0)], [1, 2, 2]),
                (4, [(0.5, 0.5)] * 4, None)]), [2, 1, -1, 0, 5, 6], 6),
        (_rows([(2, [(-1.5, 0.25)] * 4, None), (0, [(float("nan"), 1.0)], [0])]), [0, 3, 2, -1, 5], 5),
        (_rows([(0, [(1.0, 2.0), (3.0, 4.0)], None), (1, [(5.0, 6.0)], [0])]), [1, 0, 1], 1),  # all read
    ]
    known: dict = {}
    for rows, refs, largest in cases + [(_scaled(rows, 3.0), refs, largest) for rows, refs, largest in cases]:
        sums, squares = cv.read_columns(rows, refs, largest, known)  # the second time: laid out as known
        got = cv.StepColumns([sums], [squares]).columns()[0]
        assert list(map(repr, got)) == list(map(repr, _column(rows, refs, largest)))
    assert len(known) == 3
    sums, _ = cv.read_columns(cases[0][0], cases[0][1], 6)
    assert sums == [9.0, 7.0, None, 1.0, 0.5, 0.5]


def test_rows_only_the_scalar_reader_handles():
    """An index past the end (the scalar reader skips it) and a negative start."""
    assert cv.read_columns(_rows([(0, [(1.0, 1.0)], [9])]), [0], 2) is None
    assert cv.read_columns(_rows([(-1, [(1.0, 1.0)], None)]), [0], 2) is None
