"""Functional collectives (funcol, torch.ops._c10d_functional, DTensor redistribution) as spans,
against PyTorch's fake backend: a fake all_reduce leaves its input's values, so the output
fingerprint of an all_reduce is the input's; other fake outputs hold no meaningful values, so
only their structure is checked."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer import functional

WORLD = 4


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _trace(tmp_path, model, *inputs, steps=1, **opts):
    tracer.start(out_dir=str(tmp_path), **opts)
    try:
        with torch.no_grad():
            for _ in range(steps):
                model(*inputs)
    finally:
        tracer.stop()
    (path,) = rank_files(str(tmp_path))
    return load_rank_file(path)


def _spans(step):
    return {s.index: s for s in step.spans}


def _outputs(c):
    return [t for t in c.tensors if t.slot.startswith("output")]


def _inputs(c):
    return [t for t in c.tensors if t.slot.startswith("input")]


class Issue(nn.Module):
    """Issues an all_reduce and returns the unwaited result (an AsyncCollectiveTensor)."""

    def forward(self, x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)


class Use(nn.Module):
    def forward(self, y):
        return y.view(-1) + 1  # a view first (re-wrapped, not waited), then a real use


class IssuesThenUsesLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.issue = Issue()
        self.use = Use()

    def forward(self, x):
        pending = [self.issue(x) for _ in range(2)]
        return [self.use(y) for y in pending]


def test_parent_is_the_issuing_module_and_the_output_is_fingerprinted_at_the_wait(tmp_path, fake_world):
    x = torch.randn(4, 3)
    rt = _trace(tmp_path, IssuesThenUsesLater(), x, steps=2)
    step = rt.steps[1]
    spans = _spans(step)
    assert [c.op for c in step.collectives] == ["all_reduce", "all_reduce"]
    for c in step.collectives:
        assert spans[c.parent].path == "issue"
        assert c.flags & schema.FLAG_ASYNC and not c.flags & schema.FLAG_UNWAITED
        (inp,), (out,) = _inputs(c), _outputs(c)
        assert out.shape == [4, 3]
        # The fake all_reduce leaves the values: output == input == x * 2.
        assert inp.fp[0] == pytest.approx((x * 2).sum().item(), rel=1e-5, abs=1e-5)
        assert out.fp == pytest.approx(inp.fp, rel=1e-5, abs=1e-5)
    # Ordered by issue: indices and sequence numbers as the calls were made.
    a, b = step.collectives
    assert (a.index, b.index) == (0, 1) and b.seq == a.seq + 1
    assert a.t0 < b.t0
    # The module outputs that are the unwaited results carry the same values (the tracer's own
    # fingerprint of them is what waited here), and the waits, inside the tracer's work, took
    # no fingerprint index a span has.
    issue_out = [s.tensors[-1].fp for s in step.spans if s.path == "issue"]
    assert issue_out[0] == pytest.approx(a.tensors[-1].fp, rel=1e-5, abs=1e-5)
    reserved = {c.fp_refs[-1] for c in step.collectives}
    assert len(reserved) == 2 and not reserved & {r for s in step.spans for r in s.fp_refs}


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.issue = Issue()

    def forward(self, x):
        return self.issue(x)


def test_the_tracer_never_waits_for_a_module_output_the_program_has_not_waited(tmp_path, fake_world):
    # The step's result is the unwaited all_reduce. The tracer does not force the wait to
    # read it (tracer/kinds.py: an AsyncCollectiveTensor is read only once the program waited),
    # so the collective closes at the step's end as never waited, without output values, and
    # the module's output slot has no fingerprint rather than one read before the values exist.
    x = torch.randn(4, 3)
    root = Root()
    results = []
    root.register_forward_hook(lambda m, a, out: results.append(out))
    rt = _trace(tmp_path, root, x)
    for y in results:
        y.wait()  # after the step (and so that no collective stays pending for later tests)
    step = rt.steps[0]
    (c,) = step.collectives
    assert c.flags & schema.FLAG_UNWAITED
    assert _inputs(c)[0].fp == pytest.approx(((x * 2).sum().item(), (x * x * 4).sum().item()), rel=1e-5)
    assert _outputs(c)[0].fp is None
    assert {s.path: s.tensors[-1].fp for s in step.spans}["issue"] is None


class KeepsUnwaited(nn.Module):
    def __init__(self):
        super().__init__()
        self.kept = []

    def forward(self, x):
        self.kept.append(funcol.all_reduce(x, "sum", dist.group.WORLD))
        return x + 1


def test_a_result_never_waited_in_its_step_is_closed_as_unwaited(tmp_path, fake_world):
    m = KeepsUnwaited()
    rt = _trace(tmp_path, m, torch.randn(4, 3))
    for y in m.kept:
        y.wait()  # after the step: too late for the span
    (c,) = rt.steps[0].collectives
    assert c.flags & schema.FLAG_UNWAITED
    assert _inputs(c)[0].fp is not None and _outputs(c)[0].fp is None


class Dims(nn.Module):
    def forward(self, x):
        g = dist.group.WORLD
        a = funcol.all_gather_tensor(x, gather_dim=1, group=g)
        b = funcol.reduce_scatter_tensor(x.repeat(1, WORLD), "sum", -1, g)
        c = funcol.all_gather_single(x, 0, g)
        d = funcol.reduce_scatter_tensor_coalesced([x, x.repeat(1, WORLD)], "sum", [0, 1], g)
        return a + 0, b + 0, c + 0, [t + 0 for t in d]


def test_the_python_layers_dims_are_attributes_of_the_record(tmp_path, fake_world):
    rt = _trace(tmp_path, Dims(), torch.randn(WORLD * 2, 3))
    cs = rt.steps[0].collectives
    assert [c.op for c in cs] == ["all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_into_tensor",
                                  "reduce_scatter_tensor_coalesced"]
    assert [c.attrs for c in cs] == [{"gather_dim": 1}, {"scatter_dim": 1}, {"gather_dim": 0},
                                     {"scatter_dim": [0, 1]}]
    # The op itself works on dim 0: its shapes are those of the op, the dims say how to read them.
    assert [t.shape for t in cs[0].tensors] == [[8, 3], [32, 3]]
    assert [t.shape for t in cs[1].tensors] == [[32, 3], [8, 3]]
    assert all(not (c.flags & schema.FLAG_UNWAITED) for c in cs)
    assert all(r >= 0 for c in cs for r in c.fp_refs)


class Ops(nn.Module):
    """The ops called directly, as compiled code or other frameworks do."""

    def forward(self, x):
        ops, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
        y = x.clone()
        ops.all_reduce_(y, "sum", name)  # in place: its output is its input
        ops.wait_tensor(y)
        outs = ops.all_gather_into_tensor_coalesced([x, x + 1], WORLD, name)
        for t in outs:
            ops.wait_tensor(t)
        rs = ops.reduce_scatter_tensor_coalesced([x, x + 1], "sum", WORLD, name)
        ops.wait_tensor(rs[1])  # one wait completes the whole coalesced call
        a2a = funcol.all_to_all_single(x, None, None, dist.group.WORLD)
        bc = funcol.broadcast(x, 0, dist.group.WORLD)
        ag = torch.ops._c10d_functional_autograd.all_gather_into_tensor(x, WORLD, name)
        funcol.wait_tensor(ag)
        sd = torch.ops._dtensor.shard_dim_alltoall(x.repeat(1, WORLD), 0, 1, name)
        ops.wait_tensor(rs[0])  # (for the work registry: the span was closed by the first wait)
        return y, a2a + bc, sd, rs[0]


def test_every_functional_op_is_a_span_with_its_outputs(tmp_path, fake_world):
    x = torch.randn(WORLD, 3)
    rt = _trace(tmp_path, Ops(), x)
    cs = {c.op: c for c in rt.steps[0].collectives}
    assert list(cs) == ["all_reduce_", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
                        "all_to_all_single", "broadcast", "all_gather_into_tensor", "shard_dim_alltoall"]
    assert len(rt.steps[0].collectives) == len(cs)  # nothing counted twice
    ar = cs["all_reduce_"]
    assert [t.slot for t in ar.tensors] == ["input.0", "output.0"]
    assert ar.tensors[1].fp == pytest.approx((x.sum().item(), (x * x).sum().item()), rel=1e-5, abs=1e-5)
    assert [t.shape for t in _outputs(cs["all_gather_into_tensor_coalesced"])] == [[16, 3], [16, 3]]
    assert [t.shape for t in _outputs(cs["reduce_scatter_tensor_coalesced"])] == [[1, 3], [1, 3]]
    sd = cs["shard_dim_alltoall"]
    assert sd.attrs == {"gather_dim": 0, "shard_dim": 1} and not sd.flags & schema.FLAG_ASYNC
    for c in cs.values():
        assert not c.flags & schema.FLAG_UNWAITED, c.op
        assert all(r >= 0 for r in c.fp_refs), c.op
    seqs = [c.seq for c in rt.steps[0].collectives]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


class SlicesOfOneBuffer(nn.Module):
    def forward(self, x):
        ops, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
        buf = torch.cat([x, x * 3])
        ops.all_reduce_(buf[:4], "sum", name)
        ops.all_reduce_(buf[4:], "sum", name)
        ops.wait_tensor(buf)  # as PyTorch's work registry: waits every call on the storage
        return buf * 1


def test_a_wait_on_a_shared_storage_ends_every_call_on_it(tmp_path, fake_world):
    x = torch.randn(4, 3)
    rt = _trace(tmp_path, SlicesOfOneBuffer(), x)
    a, b = rt.steps[0].collectives
    assert not (a.flags | b.flags) & schema.FLAG_UNWAITED
    assert _outputs(a)[0].fp[0] == pytest.approx(x.sum().item(), rel=1e-5, abs=1e-5)
    assert _outputs(b)[0].fp[0] == pytest.approx(3 * x.sum().item(), rel=1e-5, abs=1e-5)


class Redistributes(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        d = DTensor.from_local(x, self.mesh, [Partial()], run_check=False)
        r = d.redistribute(self.mesh, [Replicate()], async_op=True)  # waited at its first use
        s = d.redistribute(self.mesh, [Shard(1)])
        return r.to_local() * 1, s.to_local() * 1


def test_dtensor_redistribution_says_its_placements(tmp_path, fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    x = torch.randn(2, WORLD * 2)
    rt = _trace(tmp_path, Redistributes(mesh), x)
    ar, rs = rt.steps[0].collectives
    assert ar.op == "all_reduce" and rs.op == "reduce_scatter_tensor"
    # (an all_reduce's CPU inputs also carry the rows they are nonzero in)
    assert ar.attrs["redistribute"] == {"from": ["P(sum)"], "to": ["R"], "async_op": True}
    assert set(ar.attrs) <= {"redistribute", "nonzero_rows"}
    assert rs.attrs == {"redistribute": {"from": ["P(sum)"], "to": ["S(1)"], "async_op": False},
                        "scatter_dim": 1}
    assert _outputs(ar)[0].fp == pytest.approx(_inputs(ar)[0].fp, rel=1e-5, abs=1e-5)
    assert not ar.flags & schema.FLAG_UNWAITED


def test_stop_puts_every_op_and_function_back(tmp_path, fake_world):
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    before = (torch.ops._c10d_functional.all_reduce, torch.ops._c10d_functional.wait_tensor,
              funcol.all_gather_single, _redistribute.redistribute_local_tensor,
              _dispatch.redistribute_local_tensor, _api.redistribute_local_tensor)
    tracer.start(out_dir=str(tmp_path))
    try:
        assert isinstance(torch.ops._c10d_functional.all_reduce, functional.OpPacketWrapper)
        assert isinstance(torch.ops._c10d_functional_autograd.all_to_all_single, functional.OpPacketWrapper)
        assert funcol.all_gather_single is not before[2]
        assert _dispatch.redistribute_local_tensor is _redistribute.redistribute_local_tensor
        assert _dispatch.redistribute_local_tensor is not before[3]
    finally:
        tracer.stop()
    after = (torch.ops._c10d_functional.all_reduce, torch.ops._c10d_functional.wait_tensor,
             funcol.all_gather_single, _redistribute.redistribute_local_tensor,
             _dispatch.redistribute_local_tensor, _api.redistribute_local_tensor)
    assert all(a is b for a, b in zip(after, before))


class CallsTheOverload(nn.Module):
    """Calls the overload from code named as a compiled graph's (an FX GraphModule's generated
    forward), as torch.compile's output does: ``torch.ops._c10d_functional.all_reduce.default``
    looked up on the namespace at the call."""

    def __init__(self, filename):
        super().__init__()
        src = ("def run(x):\n"
               "    y = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '0')\n"
               "    return torch.ops._c10d_functional.wait_tensor.default(y)\n")
        scope = {"torch": torch}
        exec(compile(src, filename, "exec"), scope)
        self.run = scope["run"]

    def forward(self, x):
        return self.run(x * 2)


@pytest.mark.parametrize("filename, seen", [("<eval_with_key>.7", True),
                                            ("/tmp/torchinductor_u/ab/cabcdef.py", True),
                                            ("user_code.py", False)])
def test_an_overload_called_from_a_compiled_graph_is_a_span(tmp_path, fake_world, filename, seen):
    x = torch.randn(4, 3)
    rt = _trace(tmp_path, CallsTheOverload(filename), x)
    step = rt.steps[0]
    assert [c.op for c in step.collectives] == (["all_reduce"] if seen else [])
    if seen:
        (c,) = step.collectives
        assert _outputs(c)[0].fp == pytest.approx(_inputs(c)[0].fp, rel=1e-5, abs=1e-5)
        assert not c.flags & schema.FLAG_UNWAITED


def test_an_overload_looked_up_elsewhere_is_the_real_one(tmp_path, fake_world):
    """inductor's lowerings and passes match node targets by identity: outside a compiled
    graph's code the wrapper hands out the real overload."""
    real = torch.ops._c10d_functional.all_reduce.default
    tracer.start(out_dir=str(tmp_path))
    try:
        assert isinstance(torch.ops._c10d_functional.all_reduce, functional.OpPacketWrapper)
        assert torch.ops._c10d_functional.all_reduce.default is real
    finally:
        tracer.stop()
