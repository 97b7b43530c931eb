"""A stopped tracer holds no tensor, Work or process group.

The Tracer object itself outlives ``stop``: the atexit, multiprocessing and SIGTERM handlers that
tracer/env_start.py registers keep it until the interpreter finalizes. Anything it still held then
would be released during finalization, and a collective's tensor or Work whose last reference
goes away there can be destroyed on a gloo worker thread, which must take the GIL to drop the
tensor's Python object: during finalization that thread is made to exit and the process aborts
("terminate called without an active exception"). So every reference to the traced program's
tensors, Works and groups is dropped by ``stop``."""

import collections
import types
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch._C._distributed_c10d import ProcessGroup, Work
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import tracer

WORLD = 2
_CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque, collections.OrderedDict)


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _is_ours(obj) -> bool:
    return (getattr(type(obj), "__module__", "") or "").startswith("tensor_trace")


def held_by(root) -> list:
    """Paths from ``root`` to every tensor, Work and process group it holds: through containers,
    tensor_trace's own objects and the closures of tensor_trace's functions (not through a
    function's globals, nor into torch's objects, whose caches are torch's own)."""
    found, seen, todo = [], {id(root)}, [(root, type(root).__name__)]
    while todo:
        obj, path = todo.pop()
        if isinstance(obj, types.FunctionType):
            refs = [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None] \
                if obj.__module__.startswith("tensor_trace") else []
        else:
            refs = gc_referents(obj)
        for ref in refs:
            if id(ref) in seen:
                continue
            seen.add(id(ref))
            step = f"{path} -> {type(ref).__name__}"
            if issubclass(type(ref), (torch.Tensor, Work, ProcessGroup)) or type(ref).__name__ == "DeviceMesh":
                found.append(step)
            elif issubclass(type(ref), _CONTAINERS + (types.MethodType,)) or _is_ours(ref) \
                    or (type(ref) is types.FunctionType and ref.__module__.startswith("tensor_trace")):
                todo.append((ref, step))
    return found


def gc_referents(obj) -> list:
    import gc

    if isinstance(obj, weakref.ref):
        return []  # a weak reference keeps nothing alive
    return gc.get_referents(obj)


class Collectives(nn.Module):
    """Every kind of collective the tracer keeps state for while a step runs."""

    def forward(self, x):
        y = x * 2
        dist.all_reduce(y)  # sync c10d
        work = dist.all_reduce(z := x + 1, async_op=True)  # async c10d: a TracedWork
        work.wait()
        dist.all_reduce(x - 1, async_op=True)  # async, never waited (closed at the step's end)
        waited = funcol.all_reduce(x * 3, "sum", dist.group.WORLD).wait()  # funcol, waited
        if getattr(self, "unwaited", None) is not None:
            self.unwaited.wait()  # the previous step's, waited in this one
        self.unwaited = funcol.all_reduce(x * 4, "sum", dist.group.WORLD)  # funcol, not waited
        return y + z + waited


def _run_traced(tmp_path, steps=2):
    tr = tracer.start(out_dir=str(tmp_path))
    model = Collectives()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(4, 3))
    return tr, model


def test_the_walk_finds_what_a_running_tracer_holds(tmp_path, fake_world):
    # The check below can fail: in the middle of a step the tracer does hold the step's tensors.
    tr = tracer.start(out_dir=str(tmp_path))
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            dist.all_reduce(x, async_op=True)  # an open async collective holds its input
            seen.extend(held_by(tr))
            return x

    try:
        with torch.no_grad():
            Probe()(torch.randn(2, 2))
    finally:
        tracer.stop()
    assert any(p.endswith("Tensor") for p in seen), seen


def test_a_stopped_tracer_holds_no_tensor_work_or_group(tmp_path, fake_world):
    tr, model = _run_traced(tmp_path)
    tracer.stop()
    assert tracer.current() is None and tr.writer is None
    assert held_by(tr) == []
    model.unwaited.wait()


def test_stop_inside_a_step_releases_the_step_too(tmp_path, fake_world):
    # An exit (atexit, SIGTERM) may stop the tracer while a step runs.
    tr = tracer.start(out_dir=str(tmp_path))

    class StopsInside(nn.Module):
        def forward(self, x):
            dist.all_reduce(x, async_op=True)
            self.pending = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
            tracer.stop("exit")
            return x

    model = StopsInside()
    with torch.no_grad():
        model(torch.randn(2, 2))
    assert held_by(tr) == []
    model.pending.wait()
