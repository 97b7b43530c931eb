"""tracer/native_counters.py: a step's span and call counters in C, shared by the C call wrapper
and the Python one. A step whose calls of one module go through both wrappers numbers them as one
sequence, and the C ``StepCounters`` counts as tracer/spans.py's Python one does."""

import torch

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer import spans


class Add(torch.nn.Module):
    def forward(self, x, extra=None):
        return x if extra is None else x + extra["y"]


class Mixed(torch.nn.Module):
    """``add`` called with one tensor (the C wrapper's, with fingerprints on) and with a second in
    a dict (the Python wrapper's: an argument it walks), alternately, in one step."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.add = Add()

    def forward(self, x):
        x = self.lin(x)
        for i in range(6):
            x = self.add(x) if i % 2 == 0 else self.add(x, {"y": x})
        return self.lin(x)


def test_calls_of_a_module_through_both_wrappers_are_numbered_as_one_sequence(tmp_path, monkeypatch):
    from native_loaded import load_native_in_process

    native = load_native_in_process(monkeypatch)
    model, x = Mixed(), torch.randn(2, 4)
    recorded = []
    with torch.inference_mode():
        tr = tracer.start(out_dir=str(tmp_path), fingerprint=True, fingerprint_every=1, lineage=False)
        try:
            for _ in range(3):  # (the first names the modules: its first calls are the Python wrapper's)
                before = _recorded(tr)
                model(x)
                recorded.append(_recorded(tr) - before)
            assert type(tr.counters) is native.step_counters_class()
        finally:
            tracer.stop()
    assert recorded[0] > 0 and recorded[1:] == [5, 5]  # add's one-tensor calls and lin's, in C
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    assert len(rt.steps) == 3
    for step in rt.steps.values():
        got = sorted(step.spans, key=lambda s: s.index)
        assert [s.index for s in got] == list(range(len(got)))  # one index per span, none twice
        by_path = {}
        for s in got:
            by_path.setdefault(s.path, []).append(s.call)
        assert by_path["add"] == list(range(6))
        assert by_path["lin"] == [0, 1]
        adds = [s for s in got if s.path == "add"]
        assert [len(s.tensors) for s in adds] == [2, 3] * 3  # (in and out: one-tensor, two-tensor calls)


def _recorded(tr) -> int:
    """Spans the C call wrapper recorded so far (none before it is made, at the first step)."""
    call = tr.global_handles[0].native_call if tr.global_handles else None
    return 0 if call is None else call.recorded


def _drive(counters) -> list:
    seen = []
    for step in range(3):
        counters.calls = {}  # a new step (tracer/steps.py), then its root (spans.push_root)
        counters.span_count = 0
        seen.append((dict(counters.calls), counters.span_count))
        counters.calls = {7: 0}
        counters.span_count = 1
        for path in (3, 7, 3, 1 << 40, -2, 3, 1 << 40, 5 + step):
            seen.append(counters.open(path))
        seen.append(dict(counters.calls))
        counters.span_count = 0x123456789
        seen.append((counters.open(3), counters.span_count))
    return seen


def test_the_c_counters_count_as_the_python_ones(monkeypatch):
    from native_loaded import load_native_in_process

    make = load_native_in_process(monkeypatch).step_counters_class()
    want = _drive(spans.StepCounters())
    assert _drive(make()) == want
    assert want[9] == {3: 2, 7: 1, 1 << 40: 1, -2: 0, 5: 0}  # (after step 0's calls)
    old = spans.StepCounters()
    for path in (4, 4, 5):
        old.open(path)
    moved = spans.counters_in(make, old)
    assert (moved.span_count, moved.calls, moved.open(4), moved.open(6)) == (3, {4: 1, 5: 0}, (2, 3), (0, 4))
