"""The lineage watcher: active only inside traced steps, gone after them, off when asked."""

import pytest
import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack

from tensor_trace import schema, tracer
from tensor_trace.exporters.store.reader import iter_records, rank_files


class Cat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        seen.append(len(_get_current_function_mode_stack()))
        return torch.cat([self.a(x), self.b(x).clone()], dim=-1)


seen = []


def _records(path, kind):
    return [r for f in rank_files(path) for r in iter_records(f) if r[0] == kind]


def test_mode_only_inside_traced_steps_and_nothing_outside(tmp_path):
    seen.clear()
    m = Cat()
    torch.cat([torch.ones(1), torch.ones(1)])
    tracer.start(out_dir=str(tmp_path), steps=(1, 2))
    try:
        for _ in range(3):
            m(torch.randn(2, 4))  # steps 0 and 2 are outside the window
        torch.cat([torch.ones(1), torch.ones(1)])  # between steps: not recorded
    finally:
        tracer.stop()
    assert seen == [0, 1, 0]
    assert _get_current_function_mode_stack() == []
    nodes = _records(str(tmp_path), schema.LINEAGE)
    assert {r[1] for r in nodes} == {1}
    cat = [r for r in nodes if r[4] == {"dim": -1}]
    assert len(cat) == 1
    refs = cat[0][5]
    assert refs[0][0] == 0 and refs[1][0] == 1  # a's output by identity, b's through its clone


def test_lineage_off(tmp_path):
    seen.clear()
    tracer.start(out_dir=str(tmp_path), lineage=False)
    try:
        Cat()(torch.randn(2, 4))
    finally:
        tracer.stop()
    assert seen == [0]
    assert _records(str(tmp_path), schema.LINEAGE) == []


def test_a_step_that_raises_leaves_no_mode_behind(tmp_path):
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    tracer.start(out_dir=str(tmp_path))
    try:
        try:
            Boom()(torch.randn(2))
        except ValueError:
            pass
        assert _get_current_function_mode_stack() == []
    finally:
        tracer.stop()


@torch.compile(dynamic=True, backend="aot_eager")
def _masked(ids, lo: int, hi: int):
    # The shape of SGLang's compiled get_masked_input_and_mask (CPU SGLang compiles it too).
    mask = (ids >= lo) & (ids < hi)
    return mask * (ids - lo * mask), ~mask


class UsesCompiled(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 3)

    def forward(self, ids):
        local, outside = _masked(ids, 2, 6)
        out = self.emb(local)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return torch.cat([out, out.clone()], dim=-1)


def test_compiled_regions_inside_traced_steps_compute_the_same(tmp_path):
    torch.manual_seed(0)
    m = UsesCompiled()
    ids = torch.tensor([[0, 2, 3, 5, 7]])
    with torch.no_grad():
        want = m(ids)
        tracer.start(out_dir=str(tmp_path))
        try:
            got = [m(ids) for _ in range(3)]
        finally:
            tracer.stop()
    for g in got:
        assert torch.equal(g, want)
    assert _records(str(tmp_path), schema.ERROR) == []


class Leaf(nn.Module):
    def forward(self, x):
        states.append(("leaf", torch._C._is_torch_function_mode_enabled()))
        return x * 2


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = Leaf()

    def forward(self, x):
        states.append(("parent", torch._C._is_torch_function_mode_enabled()))
        y = self.leaf(x)
        states.append(("parent after", torch._C._is_torch_function_mode_enabled()))
        return torch.cat([y, x], dim=-1)


states = []


def test_leaf_module_bodies_run_without_the_mode(tmp_path):
    states.clear()
    tracer.start(out_dir=str(tmp_path))
    try:
        Parent()(torch.randn(2, 3))
    finally:
        tracer.stop()
    assert states == [("parent", True), ("leaf", False), ("parent after", True)]
    (cat,) = [r for r in _records(str(tmp_path), schema.LINEAGE) if r[4] == {"dim": -1}]
    assert [ref[0] for ref in cat[5]] == [0, 0]  # both inputs are recorded tensors: leaf's output, parent's input


class Wrap(nn.Module):
    """A second kind of step (another root module)."""

    def __init__(self):
        super().__init__()
        self.inner = Cat()

    def forward(self, x):
        return self.inner(x)


def test_lineage_sampled_per_step_kind(tmp_path):
    # lineage_every=3: the first 2 traced steps of each kind, then every 3rd of that kind.
    seen.clear()
    cat, wrap = Cat(), Wrap()
    tracer.start(out_dir=str(tmp_path), lineage_every=3)
    try:
        for _ in range(7):
            cat(torch.randn(2, 4))  # steps 0..6, the first kind
        wrap(torch.randn(2, 4))  # step 7, a new kind: recorded although step 7 of the process
    finally:
        tracer.stop()
    assert seen == [1, 1, 0, 1, 0, 0, 1, 1]  # the mode is entered only in sampled steps
    assert _get_current_function_mode_stack() == []
    with_nodes = {r[1] for r in _records(str(tmp_path), schema.LINEAGE)}
    assert with_nodes == {0, 1, 3, 6, 7}
    assert {r[1] for r in _records(str(tmp_path), schema.SLOT_SRC)} <= with_nodes
    spans = _records(str(tmp_path), schema.SPAN)
    assert {r[1] for r in spans} == set(range(8))  # every step is still traced


@pytest.mark.parametrize("intercept", ["call", "hooks"])
def test_quiet_interception_only_in_steps_that_record_lineage(tmp_path, intercept):
    # Steps with lineage run the hooks' quiet variants (torch functions off around them); the
    # other steps get the plain ones, swapped in place (hooks keep their handles and order).
    from torch.nn.modules import module as nn_module

    quiet = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            tr = tracer.current()
            quiet.append(tr.quiet_hooks and tr.pre_fn is tr.hook_fns[True][0])
            if intercept == "hooks":
                fns = list(nn_module._global_forward_pre_hooks.values())
                assert fns == [tr.hook_fns[tr.quiet_hooks][0]]
            return self.a(x)

    m = Probe()
    tracer.start(out_dir=str(tmp_path), lineage_every=3, intercept=intercept)
    try:
        for _ in range(5):
            m(torch.randn(2, 4))
    finally:
        tracer.stop()
    assert quiet == [True, True, False, True, False]  # steps 0, 1, then every 3rd
    assert len(_records(str(tmp_path), schema.SPAN)) == 5 * 2


class SharedPlusRouted(nn.Module):
    """A shared expert's output that the routed experts' output is then added into, in place,
    as SGLang's DeepSeek MoE does (``shared.add_(routed)``)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.routed = nn.Linear(4, 4)

    def forward(self, x):
        shared = self.shared(x)
        shared.add_(self.routed(x))
        shared.mul_(2.0)
        return shared


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_an_output_updated_in_place_later_keeps_its_value_at_return(tmp_path, mode):
    m = SharedPlusRouted()
    x = torch.randn(3, 4)
    with torch.no_grad():
        want_shared = m.shared(x)
        want_out = (want_shared + m.routed(x)) * 2.0
    tracer.start(out_dir=str(tmp_path), fingerprint_mode=mode)
    try:
        with torch.inference_mode():  # no version counter that would tell the update
            m(x)
    finally:
        tracer.stop()
    from tensor_trace.exporters.store.reader import load_rank_file

    rt = load_rank_file(rank_files(str(tmp_path))[0])
    step = rt.steps[0]
    outs = {s.path: s for s in step.spans}
    shared = [t for t in outs["shared"].tensors if t.slot.startswith("output")][0]
    root = [t for t in outs[""].tensors if t.slot.startswith("output")][0] if "" in outs else None
    assert shared.fp[0] == pytest.approx(want_shared.sum().item(), rel=1e-5, abs=1e-5)
    if root is not None:
        assert root.fp[0] == pytest.approx(want_out.sum().item(), rel=1e-5, abs=1e-5)


class Parts(nn.Module):
    """A recorded output taken apart three ways, each piece passed to a module of its own."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Identity()

    def forward(self, x):
        y = self.a(x).view(2, 3, 2)  # [2, 3, 2]
        for piece in (*torch.unbind(y, 1), *y.unbind(dim=-1), *y.chunk(3, 1), *torch.split(y, 1, -1)):
            self.b(piece)
        return y


def test_split_and_unbind_record_the_dimension_they_take_apart(tmp_path):
    """unbind's dimension is its second argument (split's and chunk's their third); unbind's
    negative one is recorded as the dimension it counts back to (split's as written)."""
    tracer.start(out_dir=str(tmp_path))
    try:
        Parts()(torch.randn(2, 4))
    finally:
        tracer.stop()
    dims = {}
    for r in _records(str(tmp_path), schema.LINEAGE):
        attrs = r[4] or {}
        if "of" in attrs:
            dims.setdefault(r[3], set()).add(attrs["dim"])
    names = {}
    for f in rank_files(str(tmp_path)):
        for rec in iter_records(f):
            if rec[0] == schema.STRING:
                names[rec[1]] = rec[2]
    by_name = {names.get(k, k): v for k, v in dims.items()}
    assert by_name == {"unbind": {1, 2}, "chunk": {1}, "split": {-1}}


@pytest.mark.parametrize("placement, dim, want", [
    ("shard(2)", 1, "shard(1)"),   # past the removed dimension: moves in
    ("shard(0)", 1, "shard(0)"),   # before it: unchanged
    ("shard(1)", 1, None),         # the removed dimension itself: no answer
    ("replicate", 0, "replicate"),
    ("partial", 0, "partial"),
])
def test_a_shard_after_unbind(placement, dim, want):
    from tensor_trace.exporters.analysis.dataflow import unbind_placement

    assert unbind_placement(placement, dim) == want


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        y = self.b(h * 0.5)  # a common scale of a module output: a node with its factor
        z = self.b(2.0 * (h / 4))
        return self.b(h * y), z  # a product of two tensors is no scale: no node


def test_a_tensor_times_or_over_a_number_is_a_scale_node_with_its_factor(tmp_path):
    tracer.start(out_dir=str(tmp_path))
    try:
        Scaled()(torch.randn(2, 4))
    finally:
        tracer.stop()
    names = {}
    for f in rank_files(str(tmp_path)):
        for rec in iter_records(f):
            if rec[0] == schema.STRING:
                names[rec[1]] = rec[2]
    scales = sorted((names.get(r[3], r[3]), r[4]["factor"]) for r in _records(str(tmp_path), schema.LINEAGE)
                    if names.get(r[3], r[3]) in ("mul", "div"))
    assert scales == [("div", 0.25), ("mul", 0.5), ("mul", 2.0)]
