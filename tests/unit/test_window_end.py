"""After the ``--steps`` window has closed for good, nothing of the tracer's runs (Tracer.go_dormant):
no hook, no collective wrapper; what was traced stays in the rank file, and a forked child, which
counts its own steps and window, traces again."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules import module as nn_module

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer.patching import is_wrapped


class Reduced(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        dist.all_reduce(y)
        return y


def _no_tracer_left():
    return (not is_wrapped(dist.all_reduce) and not nn_module._global_forward_pre_hooks
            and not nn_module._global_forward_hooks)


def test_nothing_runs_once_the_window_has_closed(tmp_path, fake_world):
    model, x = Reduced(), torch.ones(2, 4)
    tr = tracer.start(out_dir=str(tmp_path), steps=(1, 3), lineage=False)
    try:
        assert is_wrapped(dist.all_reduce)
        for step in range(6):
            model(x)
            # steps 0-2: the root's hooks stay (its steps are counted); from step 2's end on,
            # the window is behind for good
            assert tr.dormant == (step >= 2)
            assert (tr.hook_count() == 0) == (step >= 2)
        assert _no_tracer_left() and tr.collectives is None
        assert not model._forward_pre_hooks and not model._forward_hooks
        assert tr.stats["dormant_after_step"] == 2 and tr.stats["steps"] == 2
        assert tr.errors == 0
    finally:
        tracer.stop()
    assert _no_tracer_left()
    (path,) = rank_files(str(tmp_path))
    trace = load_rank_file(path)
    assert sorted(trace.steps) == [1, 2]
    # the collectives of the traced steps, numbered from the group's first call (step 0's)
    assert [(s, c.op, c.seq) for s in (1, 2) for c in trace.steps[s].collectives] == [
        (1, "all_reduce", 1), (2, "all_reduce", 2)]
    assert trace.end is not None and trace.end["stats"]["dormant_after_step"] == 2


def test_an_open_ended_window_never_closes(tmp_path, fake_world):
    model, x = Reduced(), torch.ones(2, 4)
    tr = tracer.start(out_dir=str(tmp_path), steps=(2, None), lineage=False)
    try:
        for _ in range(5):
            model(x)
        assert not tr.dormant and len(tr.roots[model]) == 2 and is_wrapped(dist.all_reduce)
    finally:
        tracer.stop()
    assert _no_tracer_left()


def test_a_child_forked_after_the_window_traces_its_own(tmp_path, fake_world):
    model, x = Reduced(), torch.ones(2, 4)
    # An earlier tracer of this process, stopped once dormant: its fork hook stays registered
    # and must not wake it in the child (it would wrap the collectives for itself, and the
    # running tracer's wake would find them wrapped already)
    tracer.start(out_dir=str(tmp_path / "earlier"), steps=(0, 1), lineage=False)
    for _ in range(2):
        model(x)
    tracer.stop()
    tr = tracer.start(out_dir=str(tmp_path), steps=(0, 1), lineage=False)
    try:
        for _ in range(3):
            model(x)
        assert tr.dormant and _no_tracer_left()
        pid = os.fork()
        if pid == 0:  # the child: trace, write its rank file, leave without pytest's teardown
            code = 1
            try:
                ok = not tr.dormant and len(tr.roots[model]) == 2 and is_wrapped(dist.all_reduce)
                for _ in range(3):
                    model(x)
                ok = ok and tr.dormant and tr.stats["dormant_after_step"] == 0
                tracer.stop()
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert tr.dormant and _no_tracer_left()  # the parent stays as it was
    finally:
        tracer.stop()
    traces = {t.header["pid"]: t for t in map(load_rank_file, rank_files(str(tmp_path)))}
    assert sorted(traces) == sorted([os.getpid(), pid])
    for trace in traces.values():
        assert sorted(trace.steps) == [0]
        assert [c.op for c in trace.steps[0].collectives] == ["all_reduce"]
        assert [s.path for s in trace.steps[0].spans if s.path] == ["proj"]
