"""Tensor kinds on a GPU (tracer/kinds.py): the deferred paths, the C++ table's and Python's,
never read a kind's memory as its values; each fingerprint is that of the kind's own values,
with no tracer error and no synchronisation of the device."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; tests/unit/test_kinds.py checks the same on a CPU")


class Emit(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.t = t

    def forward(self, x):
        return self.t


class Take(nn.Module):
    def forward(self, t, *more):
        return t


class Net(nn.Module):
    def __init__(self, items):
        super().__init__()
        self.emits = nn.ModuleList([Emit(t) for t in items])
        self.take = Take()

    def forward(self, x):
        for e in self.emits:
            t = e(x)
            self.take(t)
            self.take(t, x)
        return x + 1


def _fp(v, sum_only=False):
    v = v.detach().double()
    return (v.sum().item(), None if sum_only else (v * v).sum().item())


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("use_native", [False, True])
def test_cuda_kinds_through_the_deferred_paths(tmp_path, monkeypatch, fake_world, use_native):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from tensor_trace import tracer
    from tensor_trace.exporters.store.reader import load_rank_file, rank_files
    from tensor_trace.tracer import native

    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "1" if use_native else "0")
    if use_native:
        native.ensure(block=True)
        assert native.table_class() is not None, native.error()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (2,))
    parts = [torch.randn(2, 8, device=dev), torch.randn(5, 8, device=dev)]
    local = torch.randn(4, 16, device=dev, dtype=torch.bfloat16)
    z = torch.randn(3, 4, device=dev, dtype=torch.complex64)
    coo = torch.randn(6, 5, device=dev).relu().to_sparse()
    csr = torch.randn(6, 5, device=dev).relu().to_sparse_csr()
    items = [  # (tensor, expected fingerprint, expected local shape)
        (torch.randn(64, 256, device=dev, dtype=torch.bfloat16), None, [64, 256]),  # a plain one
        (DTensor.from_local(local, mesh, [Shard(0)], run_check=False), _fp(local), [4, 16]),
        (DTensor.from_local(local * 3, mesh, [Partial()], run_check=False), _fp(local * 3), [4, 16]),
        (z, _fp(torch.view_as_real(z)), [3, 4]),
        (coo, _fp(coo.to_dense()), [6, 5]),
        (csr, _fp(csr.to_dense()), [6, 5]),
        (torch.nested.nested_tensor(parts), _fp(torch.cat(parts)), [2, -1, 8]),
        (torch.nested.nested_tensor(parts, layout=torch.jagged), _fp(torch.cat(parts)), [2, -1, 8]),
        (torch.empty(0, 7, device=dev), (0.0, 0.0), [0, 7]),
    ]
    items[0] = (items[0][0], _fp(items[0][0]), items[0][2])
    net = Net([t for t, _, _ in items])
    x = torch.randn(2, 3, device=dev)
    tracer.start(out_dir=str(tmp_path), fingerprint_mode="auto", lineage=False)
    try:
        for _ in range(2):  # the first step finds the C++ table
            torch.cuda.set_sync_debug_mode("error")
            try:
                net(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        tracer.stop()
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    assert rt.errors == [] and rt.end["stats"]["errors"] == 0
    for step in (0, 1):
        spans = rt.steps[step].spans
        for i, (t, want, shape) in enumerate(items):
            seen = [s.tensors[-1] for s in spans if s.path == f"emits.{i}"]
            seen += [x for s in spans if s.path == "take" and s.call in (2 * i, 2 * i + 1)
                     for x in s.tensors if x.slot in ("input.0", "output")]
            assert len(seen) == 5, (step, i)
            for got in seen:
                assert got.shape == shape and got.fp is not None, (step, i, got)
                s, q = got.fp
                tol = 1e-2 * math.sqrt(want[1]) + 1e-3
                assert abs(s - want[0]) <= tol and math.isclose(q, want[1], rel_tol=1e-2, abs_tol=1e-3), \
                    (step, i, got.fp, want)
