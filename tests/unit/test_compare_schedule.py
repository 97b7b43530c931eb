"""``compare`` on runs fingerprinted on a schedule (``fingerprint_every``): structure, shapes
and dtypes are compared on every step pair, values only on pairs fingerprinted in both runs;
a module called in one run only at an unfingerprinted step is still reported."""

import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters import pipeline as mg
from tensor_trace.exporters.analysis import compare as cmp_mod

N = 8
EXTRA_AT = 5  # not among the first 4 steps nor a multiple of 8: not fingerprinted at every=8


class Model(nn.Module):
    def __init__(self, extra_at=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.extra_at, self.n = extra_at, 0

    def forward(self, x):
        y = self.lin(x)
        if self.n == self.extra_at:
            y = self.extra(y)
        self.n += 1
        return y


def _record(out, extra_at=None, **options):
    torch.manual_seed(0)
    m = Model(extra_at)
    xs = [torch.randn(2, 4) for _ in range(N)]
    tracer.start(out_dir=str(out), **options)
    try:
        with torch.no_grad():
            for x in xs:
                m(x)
    finally:
        tracer.stop()
    return mg.open_store(str(out))


def _status(res) -> dict:
    return {p["point"]: p["status"] for p in res["points"]}


def _both(a, b):
    scalar = cmp_mod.compare(a, b, vector=False)
    assert cmp_mod.compare(a, b, vector=True) == scalar
    return scalar


def test_extra_module_on_an_unfingerprinted_step_is_reported(tmp_path):
    a = _record(tmp_path / "a", fingerprint_every=8)
    b = _record(tmp_path / "b", extra_at=EXTRA_AT, fingerprint_every=8)
    res = _both(a, b)
    st = _status(res)
    extra = [p for p in st if p.startswith("extra")]
    assert extra and all(st[p] == "only in B" for p in extra), st
    assert all(s == "same" for p, s in st.items() if not p.startswith("extra")), st
    assert res["steps"] == [[s, s] for s in range(4)]
    assert res["steps_not_fingerprinted"] == [[s, s] for s in range(4, N)]
    # with every step fingerprinted: the same point only in B, and values compared on all
    every = _both(_record(tmp_path / "a1", fingerprint_every=1),
                  _record(tmp_path / "b1", extra_at=EXTRA_AT, fingerprint_every=1))
    assert {p: s for p, s in _status(every).items() if p.startswith("extra")} == {p: st[p] for p in extra}
    assert every["steps_not_fingerprinted"] == [] and len(every["steps"]) == N


def test_no_fingerprint_against_fingerprints_compares_structure(tmp_path):
    a = _record(tmp_path / "a", fingerprint=False)
    b = _record(tmp_path / "b", extra_at=EXTRA_AT, fingerprint_every=1)
    res = _both(a, b)
    st = _status(res)
    assert res["first_divergence"] is None and res["steps"] == []
    assert res["steps_not_fingerprinted"] == [[s, s] for s in range(N)]
    assert any(p.startswith("extra") and s == "only in B" for p, s in st.items()), st
    common = [p for p in st if not p.startswith("extra")]
    assert common and all(st[p] == "not comparable" for p in common), st
    assert all("fingerprinted" in p["reason"] for p in res["points"] if p["status"] == "not comparable")
    # an explicit pair of unfingerprinted steps is compared too, not refused
    one = cmp_mod.compare(a, b, steps=[f"{EXTRA_AT}:{EXTRA_AT}"])
    assert one["steps_not_fingerprinted"] == [[EXTRA_AT, EXTRA_AT]]
    assert any(p["status"] == "only in B" for p in one["points"])
