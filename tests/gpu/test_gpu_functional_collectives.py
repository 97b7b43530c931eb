"""Functional collectives traced on CUDA tensors in one process (PyTorch's fake backend, world 4):
deferred fingerprints of AsyncCollectiveTensor module outputs, waits reached from the tracer's own
reads, the TP-API model's DTensor redistributions. tests/unit/test_functional_collectives_fake_pg.py
checks the same on a CPU."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration", "scripts")
UNWAITED = 16  # a collective's flag: closed without its result waited


class Issue(nn.Module):
    def forward(self, x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)


class Use(nn.Module):
    def forward(self, y):
        return y.view(-1) + 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.issue, self.use = Issue(), Use()

    def forward(self, x):
        pending = [self.issue(x) for _ in range(2)]
        # The last is never waited by the program: the tracer must not wait it either
        # (tracer/kinds.py), so it closes unwaited, without output values.
        return [self.use(y) for y in pending], self.issue(x)


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def traced(out, fn, steps=2):
    from tensor_trace import tracer
    from tensor_trace.exporters.store.reader import load_rank_file, rank_files

    tracer.start(out_dir=str(out))
    try:
        with torch.no_grad():
            for _ in range(steps):
                fn()
        torch.cuda.synchronize()
    finally:
        tracer.stop()
    (path,) = rank_files(str(out))
    return load_rank_file(path)


def test_waited_all_reduces_have_values_and_the_unwaited_one_none(tmp_path, fake_world):
    x = torch.randn(64, 48, device="cuda")
    net = Net()
    results = []
    rt = traced(tmp_path / "net", lambda: results.append(net(x)))
    for _uses, unwaited in results:  # c10d's registry is per process: leave nothing pending to later tests
        unwaited.wait()
    step = rt.steps[1]
    spans = {s.index: s for s in step.spans}
    cs = step.collectives
    assert len(cs) == 3 and all(spans[c.parent].path == "issue" for c in cs), [spans[c.parent].path for c in cs]
    assert [bool(c.flags & UNWAITED) for c in cs] == [False, False, True]
    want = (x * 2).sum().item()
    outs = [c.tensors[-1].fp for c in cs]
    assert all(o is not None and abs(o[0] - want) <= 1e-3 * max(1.0, abs(want)) for o in outs[:2]), (outs, want)
    assert outs[2] is None, outs
    # Whether one AsyncCollectiveTensor was waited is known only as "c10d's registry of unwaited
    # results is empty" (tracer/kinds.py waited()); with the third still unwaited at the step's
    # end no module output can be proven waited, so none is read: no values, never wrong ones.
    assert [s.tensors[-1].fp for s in step.spans if s.path == "issue"] == [None, None, None]
    assert not rt.errors, rt.errors[:3]
    assert all(c.device_ns is not None for c in cs[:2]), [c.device_ns for c in cs]


@pytest.mark.parametrize("plan", ["plain", "sp"])
def test_tp_api_redistributions_are_collectives_of_their_modules(tmp_path, fake_world, plan):
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, SCRIPTS)
    try:
        import funcol_tp
    finally:
        sys.path.remove(SCRIPTS)
    mesh = init_device_mesh("cuda", (4,))
    torch.manual_seed(0)
    sizes = dict(funcol_tp.SIZES, heads=8, kv_heads=8, hidden=96, seq=12, vocab=96, dim=48)
    model = funcol_tp.parallelize(funcol_tp.transformer(**sizes).to("cuda").eval(), mesh, plan)
    tokens = torch.randint(0, sizes["vocab"], (2, 12), device="cuda")
    rt = traced(tmp_path / plan, lambda: model(tokens))
    step = rt.steps[1]
    cs = step.collectives
    spans = {s.index: s for s in step.spans}
    assert cs and all(not c.flags & UNWAITED and c.fp_refs[-1] >= 0 for c in cs), sorted({c.op for c in cs})
    assert {spans[c.parent].path for c in cs} >= {"tok_embeddings", "layers.0.attention.wo"}
    if plan == "sp":
        assert all(c.attrs and ("scatter_dim" in c.attrs or "gather_dim" in c.attrs) for c in cs)
    assert not rt.errors, rt.errors[:3]
