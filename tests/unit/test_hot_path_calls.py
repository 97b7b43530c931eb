"""A ceiling on the Python calls the tracer adds to a traced one-tensor module call.

Deterministic stand-in for a timing goal: ``sys.setprofile`` counts the Python functions that
run ('call' events; C functions are counted apart, 'c_call') during steady-state steps of two
models that differ only in how many one-tensor leaf modules they call. The difference, divided
by the difference in calls, is the cost of one more module call; the same figure without the
tracer is torch's own, and what is left is the tracer's. A change to the hot path may lower it,
never raise it unseen (bench/call_patterns.py has the time it costs).
"""

import gc
import sys

import pytest
import torch
import torch.nn as nn

from tensor_trace import tracer

# Python calls the tracer adds per traced one-tensor module call (measured on the code of
# 2026-12-02: torch 2.13 CPU, Python keys, immediate CPU fingerprints). Lower them when a
# refactor lowers the count; never raise them.
CEILING = {
    ("call", False): 6,
    ("call", True): 9,
    ("hooks", False): 8,
    ("hooks", True): 11,
}


class Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.ones(2, 4)

    def forward(self, x):
        return self.out  # a fresh tensor each call would be the same; this one does no work


class Chain(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.leaves = nn.ModuleList([Leaf() for _ in range(n)])

    def forward(self, x):
        for leaf in self.leaves:
            x = leaf(x)
        return x


def _count_calls(fn):
    counts = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def _calls_per_step(model, x, steps=7):
    """The fewest calls of a step, over ``steps`` steps: what varies between steps (the writer
    thread's idle-flush event, a garbage collection) only ever adds calls."""
    for _ in range(3):  # warm: names, layouts, the writer's tables
        model(x)
    gc.disable()
    try:
        per_step = [_count_calls(lambda: model(x)) for _ in range(steps)]
    finally:
        gc.enable()
    return {k: min(c[k] for c in per_step) for k in per_step[0]}


def _per_module_call(run, small=8, large=40):
    """Python ('call') and C ('c_call') calls of one more module call in a step."""
    x = torch.ones(2, 4)
    a = run(Chain(small), x)
    b = run(Chain(large), x)
    return {k: (b[k] - a[k]) / (large - small) for k in a}


def calls_with_tracer(tmp_path, check=lambda tr: None, **options):
    """(with the tracer, without): Python and C calls of one more traced one-tensor module call,
    the tracer started with ``options``; ``check(tracer)`` after the counted steps."""
    with torch.inference_mode():
        plain = _per_module_call(_calls_per_step)

        def traced(model, x):
            tr = tracer.start(out_dir=str(tmp_path), lineage=False, fingerprint_mode="immediate",
                              fingerprint_every=1, **options)  # (fp: fingerprints on every step)
            try:
                counts = _calls_per_step(model, x)
                check(tr)
                # what was counted is tracing: every call a span, no error
                assert tr.errors == 0 and tr.stats["spans"] == tr.stats["steps"] * (len(model.leaves) + 1)
                return counts
            finally:
                tracer.stop()

        return _per_module_call(traced), plain


@pytest.mark.parametrize("intercept,fingerprint", sorted(CEILING))
def test_python_calls_per_traced_module_call(tmp_path, monkeypatch, intercept, fingerprint):
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")  # Python layout keys: the same on any host
    with_tracer, plain = calls_with_tracer(tmp_path, intercept=intercept, fingerprint=fingerprint)
    added = with_tracer["call"] - plain["call"]
    assert added == int(added), (with_tracer, plain)  # the same calls for every module call
    print(f"{intercept} fingerprint={fingerprint}: +{added:g} Python calls, "
          f"+{with_tracer['c_call'] - plain['c_call']:g} C calls per module call")
    assert added <= CEILING[(intercept, fingerprint)]


# Python functions of the tracer's (tracer/) that one step of a root with one leaf runs: before
# the --steps window (root_pre, begin_step, root_post), after it has closed for good (none: the
# root's hooks are taken out, Tracer.go_dormant), and traced without fingerprints or
# lineage on the Python path (measured 2026-12-03, CPU, Python keys; the step's begin and end:
# 17 and 51, then 5 and 38, before then; the step end no longer calls the fingerprints' reset
# and the three collects when they have nothing, nor flush_when_idle while the writer's thread
# is watching the queue, nor Tracer.now). Lower them when a change lowers the count.
STEP_CEILING = {"before": 3, "after": 0, "traced": 31}


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = Leaf()

    def forward(self, x):
        return self.leaf(x)


@pytest.mark.parametrize("window", sorted(STEP_CEILING))
def test_python_calls_of_the_tracer_per_step(tmp_path, monkeypatch, window):
    import os

    from tensor_trace.tracer import __file__ as package_file

    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    folder = os.path.dirname(package_file) + os.sep
    model, x = _Root(), torch.ones(2, 4)
    counted = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(folder):
            counted[-1] += 1

    tr = tracer.start(out_dir=str(tmp_path), lineage=False, fingerprint=False,
                      steps={"before": (1000, None), "after": (0, 1)}.get(window, (0, None)))
    try:
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            gc.disable()
            try:
                for _ in range(5):
                    counted.append(0)
                    sys.setprofile(profile)
                    try:
                        model(x)
                    finally:
                        sys.setprofile(None)
            finally:
                gc.enable()
        traced, skipped = {"before": (0, 8), "after": (1, 0)}.get(window, (8, 0))
        assert tr.errors == 0 and tr.stats["steps"] == traced
        assert tr.stats["steps_skipped"] == skipped  # (none counted once dormant)
        assert tr.dormant == (window == "after")
    finally:
        tracer.stop()
    print(f"{window}: {min(counted)} Python calls of the tracer's per step")
    assert min(counted) <= STEP_CEILING[window]
