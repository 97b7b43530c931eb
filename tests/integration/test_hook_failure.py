"""A tracer that fails in every hook must never break, slow down to a halt, or change the program."""

from __future__ import annotations

import re

import pytest

from tt_helpers import PYTHON, load_traces, record, run_cmd, write_script

STEPS = 30
MAX_ERRORS = 20  # TraceConfig.max_errors

BROKEN = """
    import sys
    import torch

    # Break the tracer from inside: flattening a module's output now raises. (The bootstrap
    # started tracing right after `import torch`; untraced, these functions are never called.)
    # The modules below return tuples, so every one of their calls needs the flattening.
    import tensor_trace.tracer.spans as spans
    import tensor_trace.tracer.tensor_slots as tensor_slots

    def broken_flatten_output(result, out):
        raise RuntimeError("flatten exploded")

    spans.flatten_output = tensor_slots.flatten_output = broken_flatten_output

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.tanh(self.fc(x)), x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Pair() for _ in range(3))
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x, _ = layer(x)
            return self.head(x), x

    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():
        for step in range(STEPS):
            y, h = m(torch.randn(4, 16))
            print(f"step {step} sum={y.sum().item()!r} first={y[0, 0].item()!r} h={h.sum().item()!r}",
                  flush=True)
    print("done", flush=True)
""".replace("STEPS", str(STEPS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broken")
    script = write_script(tmp, "broken.py", BROKEN)
    traced = record(tmp / "trace", [PYTHON, script], timeout=90)
    plain = run_cmd([PYTHON, script], timeout=90, check=True)
    return traced, plain, load_traces(tmp / "trace")


def test_program_output_is_unchanged(runs):
    traced, plain, _ = runs
    assert traced.returncode == 0
    assert traced.stdout == plain.stdout
    assert len(re.findall(r"^step \d+ sum=", traced.stdout, re.M)) == STEPS
    assert traced.stdout.rstrip().endswith("done")
    assert "Traceback" not in traced.stderr


def test_errors_are_reported_once_not_per_call(runs):
    traced, plain, _ = runs
    reported = [line for line in traced.stderr.splitlines() if line.startswith("tensor-trace: error in")]
    # one line per hook kind that failed (here the module post-hook and the step's end), each
    # once, never once per call
    assert 1 <= len(reported) <= 2, traced.stderr
    assert len({line.split(" (")[0] for line in reported}) == len(reported)
    assert all("RuntimeError: flatten exploded" in line for line in reported)
    assert "tensor-trace: error in forward hook" in reported[0]
    off = [line for line in traced.stderr.splitlines() if "tracing is now off" in line]
    assert len(off) == 1 and f"{MAX_ERRORS} errors in pid" in off[0], traced.stderr
    assert "tensor-trace: error" not in plain.stderr


def test_rank_file_records_the_errors_and_the_stop(runs):
    traced, _, traces = runs
    (t,) = traces
    assert len(t.errors) == MAX_ERRORS
    assert all(e["message"] == "RuntimeError: flatten exploded" for e in t.errors)
    assert {e["where"] for e in t.errors} <= {"forward hook", "step end"}
    assert t.end is not None and t.end["reason"] == "too many errors"
    assert t.end["stats"]["errors"] == MAX_ERRORS
    assert not t.report.problems()
    # tracing stopped within the first steps, not after all 30: the first two steps record
    # lineage (every call takes the general path: 4 errors each), later ones fail only in the
    # root's span (the pairs are recorded inline, without flattening): 20 errors by step 12
    assert t.steps and max(t.steps) < STEPS // 2, sorted(t.steps)
    assert f"{MAX_ERRORS} tracer error(s)" in traced.stderr
