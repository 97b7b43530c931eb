"""Collective interception against PyTorch's fake backend (no peers needed)."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


# Bound at import time, as SGLang binds reduce_scatter_tensor: the tracer must still see it.
from torch.distributed import reduce_scatter_tensor as _bound_reduce_scatter  # noqa: E402


class Comm(nn.Module):
    def forward(self, x):
        dist.all_reduce(x)
        out = torch.empty(x.shape[0] // 4, *x.shape[1:])
        _bound_reduce_scatter(out, x)
        gathered = torch.empty(x.shape[0] * 4, *x.shape[1:])
        dist.all_gather_into_tensor(gathered, x)
        lst = [torch.empty_like(x) for _ in range(4)]
        dist.all_gather(lst, x)
        dist.broadcast(x, src=0)
        a2a = torch.empty_like(x)
        dist.all_to_all_single(a2a, x)
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        dist.barrier()
        y = funcol.all_reduce(x, "sum", dist.group.WORLD)
        y = funcol.wait_tensor(y) if hasattr(funcol, "wait_tensor") else y + 0
        return y


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.comm = Comm()

    def forward(self, x):
        return self.comm(x)


def test_every_collective_is_a_span(tmp_path, fake_world):
    global _bound_reduce_scatter
    tracer.start(out_dir=str(tmp_path))
    try:
        # The import-time alias in this module was rebound to the wrapper by install().
        assert getattr(_bound_reduce_scatter, "__tensor_trace_original__", None) is not None
        m = Outer()
        for _ in range(2):
            m(torch.randn(8, 3))
    finally:
        tracer.stop()
    assert getattr(_bound_reduce_scatter, "__tensor_trace_original__", None) is None
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    step = rt.steps[1]
    ops = [c.op for c in step.collectives]
    assert ops[:8] == ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
                       "broadcast", "all_to_all_single", "all_reduce", "barrier"]
    assert ops[8] == "all_reduce" and len(ops) == 9  # the functional one, counted once
    spans = {s.index: s for s in step.spans}
    assert all(spans[c.parent].path == "comm" for c in step.collectives)
    ar = step.collectives[0]
    assert ar.reduce_op == "sum" and ar.bytes == 8 * 3 * 4
    assert rt.groups[ar.group]["ranks"] == [0, 1, 2, 3] and rt.groups[ar.group]["name"] == "world"
    rs = step.collectives[1]
    assert [t.shape for t in rs.tensors] == [[8, 3], [2, 3]]
    async_ar = step.collectives[6]
    assert async_ar.reduce_op == "max" and async_ar.flags & 2  # FLAG_ASYNC
    # Sequence numbers per group continue across steps.
    seqs0 = [c.seq for c in rt.steps[0].collectives]
    seqs1 = [c.seq for c in step.collectives]
    assert seqs1[0] == seqs0[-1] + 1 and seqs1 == list(range(seqs1[0], seqs1[0] + 9))
    # Input fingerprints are taken before the collective runs, outputs after.
    assert ar.tensors[0].fp is not None and ar.tensors[1].fp is not None


class UpdatesAfterCollective(nn.Module):
    def forward(self, x):
        t = x * 2  # not a module output: seen first by the collective
        dist.all_reduce(t)
        t.mul_(3)  # changed in place later in the step
        return t.sum(dim=0)


def test_collective_inputs_are_fingerprinted_when_the_call_begins_even_when_deferring(tmp_path, fake_world):
    x = torch.randn(4, 3)
    tracer.start(out_dir=str(tmp_path), fingerprint_mode="deferred")
    try:
        with torch.inference_mode():  # no version counter: only an early reduction is right
            UpdatesAfterCollective()(x)
    finally:
        tracer.stop()
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    (c,) = rt.steps[0].collectives
    # (abs too: a sum near zero of values near one is exact only to a few ulps of the values)
    assert c.tensors[0].fp[0] == pytest.approx((x * 2).sum().item(), rel=1e-5, abs=1e-5)


class Receives(nn.Module):
    def forward(self, x):
        dist.recv(x, src=1)
        return x * 1


def test_a_recv_counts_the_bytes_it_received(tmp_path, fake_world):
    """A recv has no input tensor, only the one it fills: its bytes were 0 (a held-out PP x TP
    program's query collectives showed recv 0 bytes beside send 16384)."""
    tracer.start(out_dir=str(tmp_path))
    try:
        Receives()(torch.zeros(4, 8))
    finally:
        tracer.stop()
    (c,) = load_rank_file(rank_files(str(tmp_path))[0]).steps[0].collectives
    assert c.op == "recv" and c.bytes == 4 * 8 * 4
