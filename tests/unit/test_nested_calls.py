"""Calls with a tuple or list one level down: an argument (an EAGLE draft handed its captures as a
list) or an item of a tuple result (a model returning ``(hidden, [aux, ...])``).

spans.record_tensors records them by a flat layout key, and tracer/native.py's call_key keys them,
so that the C call wrapper records the next such call by its known layout: no Python of the
tracer's for them once a layout is known. The spans must be those the general path
(spans.pop_record, which walks the structures) writes."""

import pytest
import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer import spans


class Split(nn.Module):
    """``(x, [x * 2, None, 3, x[:, :2]])``: a tensor, then a list of tensors and plain values."""

    def forward(self, x):
        return x + 1, [x * 2, None, 3, x[:, :2]]


class Join(nn.Module):
    """Handed a list (and a plain value, and a tuple) as positional arguments."""

    def forward(self, xs, scale, pair):
        return torch.cat(list(xs) + [pair[0]], dim=-1)[:, :4] * scale


class Pairs(nn.Module):
    """A list result whose items are tuples."""

    def forward(self, x):
        return [(x, x - 1), ("tag", x + 2)]


class Model(nn.Module):
    def __init__(self, n=1):
        super().__init__()
        self.split = nn.ModuleList([Split() for _ in range(n)])
        self.join = nn.ModuleList([Join() for _ in range(n)])
        self.pairs = Pairs()

    def forward(self, x):
        for split, join in zip(self.split, self.join):
            h, aux = split(x)
            x = join([aux[0], aux[3]], 0.5, (h, None))
        (a, _), _ = self.pairs(x)
        return a


def _spans(folder):
    (path,) = rank_files(str(folder))
    rt = load_rank_file(path)
    return {n: sorted((s.index, s.parent, s.path, s.call, [repr(t) for t in s.tensors], s.fp_refs)
                      for s in step.spans) for n, step in sorted(rt.steps.items())}, rt.errors


def _record(folder, steps=8, **options):
    """Steps 0-4 and 6 fingerprinted (the first four, then every second), 5 and 7 not."""
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 4)
    tr = tracer.start(out_dir=str(folder), lineage=False, fingerprint_every=2, **options)
    try:
        with torch.inference_mode():
            for _ in range(steps):
                model(x)
        assert tr.errors == 0
    finally:
        tracer.stop()
    return _spans(folder)


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_nested_calls_record_what_the_general_path_does(tmp_path, monkeypatch, intercept):
    import tensor_trace.tracer.intercept as intercept_mod

    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    walked = []  # the calls pop_record took: the roots' only (close_open_calls)
    pop_record = spans.pop_record

    def counted(t, module, *rest):
        walked.append(type(module).__name__)
        return pop_record(t, module, *rest)

    with monkeypatch.context() as m:
        m.setattr(spans, "pop_record", counted)
        m.setattr(intercept_mod, "pop_record", counted)
        got, errors = _record(tmp_path / "flat", intercept=intercept)
    assert set(walked) == {"Model"}, walked
    slots = {s[2]: [r.split("'")[1] for r in s[4]] for s in got[2]}
    assert slots["split.0"] == ["input.0", "output.0", "output.1.0", "output.1.3"], slots
    assert slots["join.0"] == ["input.0.0", "input.0.1", "input.2.0", "output"], slots
    assert slots["pairs"] == ["input.0", "output.0.0", "output.0.1", "output.1.1"], slots
    # the general path: record_tensors declines every call, pop_record walks them
    monkeypatch.setattr(spans, "record_tensors", lambda *a: False)
    monkeypatch.setattr(intercept_mod, "record_tensors", lambda *a: False)
    want, want_errors = _record(tmp_path / "walked", intercept=intercept)
    assert got == want
    assert errors == want_errors == []


def test_nested_calls_in_c_record_the_same_and_run_no_python(tmp_path, monkeypatch):
    """With the C call wrapper: the same spans as the Python wrapper's, and a call with a list
    argument or a list inside its tuple result runs no Python function of the tracer's once its
    layout is known (no fingerprints)."""
    from native_loaded import load_native_in_process
    from test_hot_path_calls import _calls_per_step

    load_native_in_process(monkeypatch)
    got, errors = _record(tmp_path / "c")
    assert errors == []
    with monkeypatch.context() as m:
        m.setattr(spans, "pair_key", spans._py_pair_key)  # (the Python wrapper and keys)
        m.setattr(spans, "call_key", None)
        want, _ = _record(tmp_path / "py")
    assert got == want

    def per_step(traced):
        counts = {}
        for n in (2, 10):
            model = Model(n)
            if traced:
                tr = tracer.start(out_dir=str(tmp_path / f"count{n}"), lineage=False, fingerprint=False)
            try:
                with torch.inference_mode():
                    counts[n] = _calls_per_step(model, torch.randn(2, 4))["call"]
                if traced:
                    (wrapper,) = tr.global_handles
                    assert wrapper.native_call is not None and tr.errors == 0
            finally:
                if traced:
                    tracer.stop()
        return (counts[10] - counts[2]) / 8  # per (split, join) pair of calls

    added = per_step(True) - per_step(False)
    assert added == 0
