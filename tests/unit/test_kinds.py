"""Tensors that are not plain dense ones (tracer/kinds.py): each is recorded with the right
shape and meta, fingerprinted from its own values (or marked as having none), with no tracer
error, no warning and no collective of the tracer's own."""

import json
import math
import sqlite3
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import tracer
from tensor_trace.exporters.store import loader, tables
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

MODES = [("call", "auto"), ("call", "deferred"), ("hooks", "auto"), ("hooks", "deferred")]


class Emit(nn.Module):
    """Returns the tensor it holds, whatever its kind."""

    def __init__(self, t):
        super().__init__()
        self.t = t

    def forward(self, x):
        return self.t


class Take(nn.Module):
    """Takes tensors of any kind (positional and keyword), returns a plain one and them."""

    def forward(self, t, *more, extra=None):
        return torch.zeros(1), t


class Net(nn.Module):
    def __init__(self, items):
        super().__init__()
        self.emits = nn.ModuleList([Emit(t) for t in items])
        self.take = Take()

    def forward(self, x):
        for e in self.emits:
            t = e(x)
            self.take(t)  # one argument: the one-tensor paths
            self.take(t, x, extra=t)  # several, and a keyword: the general paths
        return x + 1


def _trace(tmp_path, net, intercept, mode, x=None, **opts):
    """One traced step of ``net`` on ``x``, with warnings recorded; the rank file read back."""
    x = torch.randn(2, 3) if x is None else x
    tracer.start(out_dir=str(tmp_path), intercept=intercept, fingerprint_mode=mode, **opts)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net(x)
    finally:
        tracer.stop()
    assert [str(w.message) for w in caught] == []
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    assert rt.errors == [] and rt.end["stats"]["errors"] == 0
    return rt


def _slots(rt, path):
    """Every tensor recorded for module ``path`` in step 0, in recording order."""
    return [t for sp in rt.steps[0].spans if sp.path == path for t in sp.tensors]


def _fp(values, sum_only=False):
    v = values.detach().double()
    return (v.sum().item(), None if sum_only else (v * v).sum().item())


def _close(got, want):
    assert got is not None and want is not None, (got, want)
    s, q = got
    assert math.isclose(s, want[0], rel_tol=1e-4, abs_tol=1e-4), (got, want)
    if want[1] is None:
        assert q is None, got
    else:
        assert q is not None and math.isclose(q, want[1], rel_tol=1e-4, abs_tol=1e-4), (got, want)


class Counting(torch.Tensor):
    """A __torch_function__-only subclass that counts what runs its code."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _kinds():
    """(name, tensor, expected shape, expected meta or None, expected fingerprint or None)."""
    torch.manual_seed(0)
    z = torch.randn(3, 4, dtype=torch.complex64)
    coo = torch.randn(3, 4).to_sparse()
    dup = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [1, 1, 2]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    csr = torch.randn(3, 4).relu().to_sparse_csr()
    q = torch.quantize_per_tensor(torch.randn(5), 0.1, 3, torch.qint8)
    parts = [torch.randn(2, 3), torch.randn(4, 3)]
    nested = torch.nested.nested_tensor(parts)
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(6, 2)
    counted = torch.randn(4).as_subclass(Counting)
    cplx = {"kind": "complex", "fp": "view_as_real"}
    return [
        ("complex", z, [3, 4], cplx, _fp(torch.view_as_real(z))),
        ("conj", z.conj(), [3, 4], cplx, _fp(torch.view_as_real(z.conj().resolve_conj()))),
        ("coo", coo, [3, 4], None, _fp(coo.to_dense())),
        ("coo_uncoalesced", dup, [2, 3], None, _fp(dup.to_dense(), sum_only=True)),
        ("csr", csr, [3, 4], None, _fp(csr.to_dense())),
        ("quantized", q, [5], {"kind": "quantized", "fp": "int_repr"}, _fp(q.int_repr())),
        ("nested", nested, [2, -1, 3], {"kind": "nested", "layout": "strided", "fp": "values"},
         _fp(torch.cat(parts))),
        ("jagged", jagged, [2, -1, 3], {"kind": "NestedTensor", "layout": "jagged", "ragged_dim": 1,
                                        "fp": "values"}, _fp(torch.cat(parts))),
        ("meta", torch.empty(3, 4, device="meta"), [3, 4], {"kind": "meta", "no_fingerprint": True}, None),
        ("empty", torch.empty(0, 5), [0, 5], {"kind": "empty", "fp": "trivial"}, (0.0, 0.0)),
        ("fake", fake, [6, 2], {"kind": "FakeTensor", "no_fingerprint": True}, None),
        ("subclass", counted, [4], {"kind": "Counting", "fp": "base"}, _fp(counted.as_subclass(torch.Tensor))),
        ("parameter", nn.Parameter(torch.randn(2, 2)), [2, 2], None, None),
    ]


@pytest.mark.parametrize("intercept,mode", MODES)
def test_each_kind_recorded_from_its_own_values(tmp_path, intercept, mode):
    kinds = _kinds()
    net = Net([t for _, t, *_ in kinds])
    Counting.calls = 0
    rt = _trace(tmp_path, net, intercept, mode, lineage=False)
    assert Counting.calls == 0  # none of the subclass's code ran on the tracer's behalf
    for i, (name, t, shape, meta, fp) in enumerate(kinds):
        if name == "parameter":
            fp = _fp(t)
        emitted = _slots(rt, f"emits.{i}")[-1]
        assert (emitted.slot, emitted.shape, emitted.meta) == ("output", shape, meta), name
        seen = [emitted]
        for s in rt.steps[0].spans:  # its sightings as Take's input.0, input.extra and output.1
            if s.path == "take" and s.call in (2 * i, 2 * i + 1):
                seen += [x for x in s.tensors if x.slot in ("input.0", "input.extra", "output.1")]
        assert len(seen) == 6, name
        for x in seen:
            assert (x.shape, x.meta) == (shape, meta), (name, x.slot)
            if fp is None:
                assert x.fp is None, (name, x.slot)
            else:
                _close(x.fp, fp)


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _dtensor_net():
    """Modules that make, pass and return DTensors of each placement with no communication
    (from_local, elementwise ops on local shards, to_local), and a sharded parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class Make(nn.Module):
        def __init__(self, placement):
            super().__init__()
            self.placement = placement

        def forward(self, x):
            return DTensor.from_local(x, mesh, [self.placement], run_check=False)

    class Scale(nn.Module):
        def forward(self, d):
            return d * 2.0

    class Local(nn.Module):
        def forward(self, d):
            return d.to_local()

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(DTensor.from_local(torch.randn(3, 5), mesh, [Shard(0)], run_check=False))

        def forward(self, x):
            return x

    class DNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.shard, self.rep, self.part = Make(Shard(1)), Make(Replicate()), Make(Partial())
            self.cplx = Make(Shard(0))
            self.scale, self.local, self.holder = Scale(), Local(), Holder()

        def forward(self, x):
            d = self.scale(self.shard(x))
            outs = [d, self.rep(x), self.part(x), self.cplx(torch.polar(x.abs(), x))]
            return self.local(d) + self.holder(x), outs

    return DNet()


@pytest.mark.parametrize("intercept,mode", MODES)
def test_dtensor_slots_are_local_with_their_placement(tmp_path, fake_world, intercept, mode):
    net = _dtensor_net()
    x = torch.randn(2, 3)
    _, outs = net(x)  # (untraced: the values to expect, the same each call)
    rt = _trace(tmp_path, net, intercept, mode, x)
    assert rt.steps[0].collectives == []  # the program issues none, and neither may the tracer

    def dt(placement, global_shape, offset, local=None):
        meta = {"kind": "DTensor", "fp": "local", "global_shape": global_shape, "placements": [placement],
                "mesh_shape": [2], "mesh_dim_names": ["tp"], "mesh_ranks": [0, 1], "coordinate": [0],
                "global_offset": offset}
        return dict(meta, local=local) if local else meta

    shard = dt("Shard(1)", [2, 6], [0, 0])
    expect = {
        "shard": [("input.0", [2, 3], None, _fp(x)), ("output", [2, 3], shard, _fp(x))],
        "scale": [("input.0", [2, 3], shard, _fp(x)), ("output", [2, 3], shard, _fp(outs[0].to_local()))],
        "rep": [("input.0", [2, 3], None, _fp(x)), ("output", [2, 3], dt("Replicate()", [2, 3], [0, 0]), _fp(x))],
        "part": [("input.0", [2, 3], None, _fp(x)), ("output", [2, 3], dt("Partial(sum)", [2, 3], [0, 0]), _fp(x))],
        "cplx": [("input.0", [2, 3], {"kind": "complex", "fp": "view_as_real"},
                  _fp(torch.view_as_real(outs[3].to_local()))),
                 ("output", [2, 3], dt("Shard(0)", [4, 3], [0, 0], {"kind": "complex", "fp": "view_as_real"}),
                  _fp(torch.view_as_real(outs[3].to_local())))],
        "local": [("input.0", [2, 3], shard, _fp(outs[0].to_local())), ("output", [2, 3], None,
                                                                         _fp(outs[0].to_local()))],
    }
    for path, want in expect.items():
        got = _slots(rt, path)
        assert [(t.slot, t.shape, t.meta) for t in got] == [w[:3] for w in want], path
        for t, w in zip(got, want):
            _close(t.fp, w[3])
    (w,) = rt.params["holder"]
    local = net.holder.weight.to_local()
    assert (w.slot, w.shape, w.meta) == ("weight", [3, 5], dt("Shard(0)", [6, 5], [0, 0]))
    _close(w.fp, _fp(local))
    root = [t for t in _slots(rt, "") if t.slot.startswith("output.1.")]
    assert [t.meta["placements"] for t in root] == [["Shard(1)"], ["Replicate()"], ["Partial(sum)"], ["Shard(0)"]]

    # The merge keeps the meta: a slot's fifth element in layouts.slots, params.meta.
    con = sqlite3.connect(":memory:")
    con.executescript(tables.SCHEMA_SQL)
    g = loader.SharedIds(con)
    loader.FileLoader(con, 0, rank_files(str(tmp_path))[0], g).load()
    g.write()
    stored = [json.loads(s) for (s,) in con.execute("SELECT slots FROM layouts")]
    assert [["output", [2, 3], "float32", "cpu", shard]] in [[e for e in s if e[0] == "output"] for s in stored]
    (meta,) = con.execute("SELECT p.meta FROM params p").fetchone()
    assert json.loads(meta) == w.meta


def test_async_collective_tensor_read_only_once_the_program_waited(tmp_path, fake_world):
    class Reduce(nn.Module):
        def forward(self, x):
            return funcol.all_reduce(x, "sum", dist.group.WORLD)

    class Use(nn.Module):
        def forward(self, y):
            return y + 1  # waits

    class ANet(nn.Module):
        def __init__(self):
            super().__init__()
            self.waited, self.use, self.left = Reduce(), Use(), Reduce()

        def forward(self, x):
            self.kept = self.left(x * 3)  # never waited in this step
            return self.use(self.waited(x))

    net = ANet()
    x = torch.randn(4)
    rt = _trace(tmp_path, net, "call", "auto", x)
    assert net.kept.completed is False  # the tracer did not wait on it
    meta = {"kind": "AsyncCollectiveTensor", "fp": "elem_once_waited"}
    (w_in, w_out) = _slots(rt, "waited")
    (l_in, l_out) = _slots(rt, "left")
    (u_in, u_out) = _slots(rt, "use")
    assert (w_out.meta, u_in.meta, l_out.meta, u_out.meta) == (meta, meta, meta, None)
    assert w_out.shape == u_in.shape == l_out.shape == [4]
    # (the fake backend leaves the reduced copy as it was)
    _close(w_out.fp, _fp(x))
    _close(u_in.fp, _fp(x))
    _close(u_out.fp, _fp(x + 1))
    assert l_out.fp is None  # not waited on when the step ended: no fingerprint, no wait
    net.kept.wait()  # (c10d's registry is per process: leave nothing pending to later tests)


def test_async_collective_tensor_waited_through_a_view(tmp_path, fake_world):
    """A view of an AsyncCollectiveTensor is a new wrapper: waiting on it leaves the first one
    unmarked. Once nothing is pending in the process, the first one's values are complete."""

    class Reduce(nn.Module):
        def forward(self, x):
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)

    class ViewUse(nn.Module):
        def forward(self, y):
            return y.view(-1) + 1

    class VNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.reduce, self.use = Reduce(), ViewUse()

        def forward(self, x):
            self.y = self.reduce(x)
            return self.use(self.y)

    net = VNet()
    x = torch.randn(4, 3)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    rt = _trace(tmp_path, net, "call", "auto", x)
    assert net.y.completed is False  # (the view was waited on, not it)
    (_, out), (seen, _) = _slots(rt, "reduce"), _slots(rt, "use")
    _close(out.fp, _fp(x * 2))
    _close(seen.fp, _fp(x * 2))


def test_meta_written_by_hand_reads_back(tmp_path):
    """A trace written with the real writer (as synthetic traces are): a slot's kind through
    ``kinds.from_dict``, a parameter's either through its META or as its PARAMS entry's fourth
    element; the reader and the merge give the same dicts back."""
    from tensor_trace import schema
    from tensor_trace.tracer import kinds
    from tensor_trace.tracer.writer import RankWriter

    dt = {"kind": "DTensor", "fp": "local", "global_shape": [4, 3], "placements": ["Shard(0)"],
          "local": {"kind": "complex", "fp": "view_as_real"}}
    side = {"kind": "DTensor", "placements": ["Shard(1)"]}
    path = tmp_path / "ranks" / f"h-1{schema.RANK_FILE_SUFFIX}"
    w = RankWriter(str(path), dict(format=schema.FORMAT_VERSION, run_id="r", pid=1, mono_ns=0, wall_ns=0))
    w.add((schema.STEP_BEGIN, 0, w.module("", "Net"), 0, {}))
    lay = w.layout((("input.0", (2, 3), "complex64", "cpu"), ("output", (2, 3), "complex64", "cpu",
                                                               kinds.from_dict(dt))))
    w.add((schema.SPAN, 0, 0, -1, w.string(""), 0, 0, 5, lay, -1, -1, 1, 0))
    w.add((schema.STEP_END, 0, 10, 1, 0))
    w.add((schema.PARAMS, w.module("lin", "Linear"), [
        [w.string("weight"), w.meta((2, 3), "float32", "cpu", kinds.from_dict(dt)), 0],
        [w.string("bias"), w.meta((3,), "float32", "cpu"), 1, side]]))
    w.add((schema.END, dict(reason="exit", stats={})))
    w.close()
    rt = load_rank_file(str(path))
    (span,) = rt.steps[0].spans
    assert [t.meta for t in span.tensors] == [{"kind": "complex", "fp": "view_as_real"}, dt]
    assert [(p.slot, p.meta) for p in rt.params["lin"]] == [("weight", dt), ("bias", side)]
    con = sqlite3.connect(":memory:")
    con.executescript(tables.SCHEMA_SQL)
    g = loader.SharedIds(con)
    loader.FileLoader(con, 0, str(path), g).load()
    g.write()
    (slots,) = con.execute("SELECT slots FROM layouts").fetchone()
    assert json.loads(slots) == [["input.0", [2, 3], "complex64", "cpu", {"kind": "complex", "fp": "view_as_real"}],
                                 ["output", [2, 3], "complex64", "cpu", dt]]
    got = {n: json.loads(m) for n, m in con.execute("SELECT name, meta FROM params")}
    assert got == {"weight": dt, "bias": side}
