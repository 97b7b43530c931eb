"""A module's own forward hooks run inside its call: the output a caller gets is the one they
return (a DTensor plan's RowwiseParallel reduces its partial sums in one, ColwiseParallel with
Replicate() output gathers in one). Both interception modes record that output; with
``--intercept hooks``, where torch runs the tracer's global hook before the module's own, a hook
of the module's own records it (intercept.late_post_hook), and none is left after stop."""

import pytest
import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(self.proj(x))


def _halve(module, args, output):
    return output[..., :3] * 2.0  # what the caller gets: another shape and other values


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_the_output_recorded_is_the_one_the_modules_own_hooks_return(tmp_path, monkeypatch, intercept):
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 4)
    own = model.proj.register_forward_hook(_halve)
    tr = tracer.start(out_dir=str(tmp_path), lineage=False, intercept=intercept)
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x)
        assert tr.errors == 0
        assert list(model.proj._forward_hooks) == [own.id], "a late hook outlived its call"
    finally:
        tracer.stop()
    assert tr.hook_count() == 0
    assert list(model.proj._forward_hooks) == [own.id]
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    for step in rt.steps.values():
        by_path = {s.path: s for s in step.spans}
        slots = {repr(t).split("'")[1]: t for t in by_path["proj"].tensors}
        assert list(slots["output"].shape) == [2, 3], slots  # after the hook, not [2, 6]
        assert list(slots["input.0"].shape) == [2, 4], slots
    own.remove()


def test_a_stop_inside_a_hooked_call_leaves_no_late_hook(tmp_path, monkeypatch):
    """tracer.stop() from a module's own pre-hook (torch ran the tracer's global pre-hook first,
    so its late hook is registered and has not run): stop removes it."""
    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "0")
    model, x = Model(), torch.randn(2, 4)
    model.proj.register_forward_hook(_halve)
    stopped = []

    def stop_inside(module, args):
        if len(stopped) == 0 and tr.step >= 1:
            stopped.append(tracer.stop())

    model.proj.register_forward_pre_hook(stop_inside)
    tr = tracer.start(out_dir=str(tmp_path), lineage=False, intercept="hooks")
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x)
    finally:
        tracer.stop()
    assert stopped, "the stop inside a call did not run"
    assert tr.hook_count() == 0
    assert len(model.proj._forward_hooks) == 1
