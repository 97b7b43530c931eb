"""Lineage through module boundaries and writes into slices of a buffer (in-process, one rank)."""

import pytest
import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.analysis import lineage as lin
from tensor_trace.exporters.pipeline import open_store
from tensor_trace.tracer.regions import box as _box

H = 4


class Layer(nn.Module):
    """Output = input + f(input): an add, which lineage does not look inside."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class Target(nn.Module):
    def __init__(self, aux=(0, 1, 3)):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.aux = list(aux)

    def forward(self, x):
        hs = []
        for layer in self.layers:
            x = layer(x)
            hs.append(x)
        return x, torch.cat([hs[i] for i in self.aux], dim=-1), tuple(hs)


def write(buf, slot, src, how):
    sl = slice(slot * H, (slot + 1) * H)
    if how == "copy_":
        buf[:, sl].copy_(src)
    elif how == "setitem":
        buf[..., sl] = src
    elif how == "index_copy_":
        buf.index_copy_(1, torch.arange(slot * H, (slot + 1) * H), src)
    else:
        raise ValueError(how)


class Packer(nn.Module):
    """Owns the target (so its body is watched) and packs the captures into one buffer."""

    def __init__(self, plan, slots=3):
        super().__init__()
        self.target = Target()
        self.plan = plan  # [(slot, capture index, how)] in time order
        self.slots = slots

    def forward(self, x):
        _, aux_cat, hs = self.target(x)
        picked = [hs[i] for i in self.target.aux]
        buf = picked[0].new_zeros(picked[0].shape[0], H * self.slots)
        for slot, k, how in self.plan:
            write(buf, slot, picked[k], how)
        return aux_cat, buf


class LeafPacker(nn.Module):
    """The same packing in a module without children: its body runs unwatched."""

    def forward(self, a, b, c):
        buf = a.new_empty(a.shape[0], 3 * H)
        for slot, t in ((2, c), (0, a), (1, b)):
            buf[:, slot * H:(slot + 1) * H].copy_(t)
        return buf


class Draft(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.fc = nn.Linear(n * H, H)

    def forward(self, x):
        return self.fc(x)


class Root(nn.Module):
    def __init__(self, plan, slots=3):
        super().__init__()
        self.packer = Packer(plan, slots)
        self.draft_cat = Draft()
        self.draft = Draft(slots)

    def forward(self, x):
        aux_cat, packed = self.packer(x)
        return self.draft_cat(aux_cat), self.draft(packed)


LAYERS = ["packer.target.layers.0:output", "packer.target.layers.1:output", "packer.target.layers.3:output"]
OUT_OF_ORDER = [(2, 2, "setitem"), (0, 0, "copy_"), (1, 1, "index_copy_")]


def _trace(tmp_path, model, *inputs, grad_mode=torch.inference_mode, **kw):
    torch.manual_seed(0)
    tracer.start(out_dir=str(tmp_path), **kw)
    try:
        with grad_mode():
            for _ in range(2):
                model(*inputs)
    finally:
        tracer.stop()
    return open_store(str(tmp_path))


@pytest.mark.parametrize("grad_mode", [torch.inference_mode, torch.no_grad])
def test_writes_into_slices_are_sources_in_slice_order_not_time_order(tmp_path, grad_mode):
    # Under inference_mode a view does not know the tensor it was taken from: the writes are
    # found by storage, on the buffer the module returns.
    torch.manual_seed(0)
    con = _trace(tmp_path, Root(OUT_OF_ORDER), torch.randn(3, H), grad_mode=grad_mode)
    res = lin.lineage(con, "draft.fc:input.0")
    assert res["op"] == "slices(dim=1)"
    assert [s["point"] for s in res["sources"]] == LAYERS
    assert [s["op"] for s in res["sources"]] == [
        "copy_(dim=1, 0:4)", "index_copy_(dim=1, 4:8)", "setitem(dim=1, 8:12)"]
    assert res["inside"] == ["packer:output.1"]
    assert all(s["shapes"] == {0: [3, H]} and s["placement"] == "replicate" for s in res["sources"])


def test_a_concatenation_returned_by_a_module_is_followed_inside(tmp_path):
    torch.manual_seed(0)
    con = _trace(tmp_path, Root(OUT_OF_ORDER), torch.randn(3, H))
    res = lin.lineage(con, "draft_cat.fc:input.0")
    assert res["op"] == "cat(dim=-1)" and res["inside"] == ["packer.target:output.1"]
    # The layer outputs are sums (x + f(x)): sources, not followed into.
    assert [s["point"] for s in res["sources"]] == LAYERS
    assert [s["module"] for s in res["sources"]] == [p.split(":")[0] for p in LAYERS]
    assert res["via"] == []  # by identity (the packer passes the tensor on), not by values
    # An outer module passing the concatenation on as is: the same answer at its output.
    outer = lin.lineage(con, "packer:output.0")
    assert [s["point"] for s in outer["sources"]] == LAYERS
    assert "draft_cat.fc:input.0" in lin.points_with_lineage(con)


def test_a_copy_by_an_op_not_watched_is_matched_by_values_then_followed_inside(tmp_path):
    class Root3(nn.Module):
        def __init__(self):
            super().__init__()
            self.packer = Packer(OUT_OF_ORDER)
            self.draft = Draft()

        def forward(self, x):
            aux_cat, _ = self.packer(x)
            return self.draft(aux_cat.neg().neg())  # a copy by unwatched ops: no identity to follow

    torch.manual_seed(0)
    con = _trace(tmp_path, Root3(), torch.randn(3, H))
    res = lin.lineage(con, "draft.fc:input.0")
    assert res["op"] == "cat(dim=-1)" and res["via"] == ["same values"]
    assert res["inside"] == ["packer.target:output.1"]
    assert [s["point"] for s in res["sources"]] == LAYERS
    assert "draft.fc:input.0" in lin.points_with_lineage(con)  # so query diff compares it


def test_writes_at_places_not_read_keep_their_time_order(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(), Layer()
            self.head = nn.Linear(2 * H, H)

        def forward(self, x):
            buf = x.new_zeros(x.shape[0], 2 * H)
            buf.index_copy_(1, torch.tensor([5, 4, 7, 6]), self.b(x))  # not one run: no box
            buf.index_copy_(1, torch.tensor([1, 0, 3, 2]), self.a(x))
            return self.head(buf)

    torch.manual_seed(0)
    con = _trace(tmp_path, M(), torch.randn(3, H))
    res = lin.lineage(con, "head:input.0")
    assert res["op"] == "slices"
    assert [(s["point"], s["op"]) for s in res["sources"]] == [
        ("b:output", "index_copy_"), ("a:output", "index_copy_")]


def test_a_draft_step_consuming_the_target_steps_packed_captures(tmp_path):
    # SGLang runs the target and the draft as separate forwards (separate traced steps): the
    # draft's input is the target step's output, by identity.
    con = _traced_target_and_draft(tmp_path, Packer(OUT_OF_ORDER))
    res = lin.lineage(con, "Draft.fc:input.0")
    assert res["op"] == "slices(dim=1)" and res["inside"] == [":output.1"]
    assert [s["point"] for s in res["sources"]] == [p.replace("packer.", "") for p in LAYERS]


def test_the_order_follows_the_place_so_two_write_orders_agree(tmp_path):
    torch.manual_seed(0)
    a = _trace(tmp_path / "a", Root(OUT_OF_ORDER), torch.randn(3, H))
    in_order = sorted(OUT_OF_ORDER)
    b = _trace(tmp_path / "b", Root(in_order), torch.randn(3, H))
    la, lb = lin.lineage(a, "draft.fc:input.0"), lin.lineage(b, "draft.fc:input.0")
    assert lin.compare(lin.make_contract(la), lb) == []
    # Another capture in slot 0 (layer 1's output there, layer 0's in slot 1): a mismatch.
    swapped = [(0, 1, "copy_"), (1, 0, "copy_"), (2, 2, "copy_")]
    c = _trace(tmp_path / "c", Root(swapped), torch.randn(3, H))
    lc = lin.lineage(c, "draft.fc:input.0")
    assert [s["point"] for s in lc["sources"]] == [LAYERS[1], LAYERS[0], LAYERS[2]]
    kinds = {m["kind"] for m in lin.compare(lin.make_contract(la), lc)}
    assert "moved" in kinds and "order" in kinds


def test_a_slice_written_twice_keeps_the_last_write_and_an_unwritten_one_is_named(tmp_path):
    plan = [(0, 2, "copy_"), (1, 1, "copy_"), (0, 0, "setitem")]  # slot 0 rewritten, slot 2 never
    torch.manual_seed(0)
    con = _trace(tmp_path, Root(plan), torch.randn(3, H))
    res = lin.lineage(con, "draft.fc:input.0")
    assert [s["point"] for s in res["sources"]] == [LAYERS[0], LAYERS[1], "<no recorded write: dim 1 [8:12]>"]
    assert res["sources"][0]["op"] == "setitem(dim=1, 0:4)"
    assert res["sources"][2]["placement"] == "unknown"


def test_a_leaf_packer_keeps_the_answer_by_values(tmp_path):
    # Nothing is watched inside a leaf module: its output stays the source (found by values).
    class Root2(nn.Module):
        def __init__(self):
            super().__init__()
            self.target = Target()
            self.packer = LeafPacker()
            self.draft = Draft()

        def forward(self, x):
            _, _, hs = self.target(x)
            return self.draft(self.packer(hs[0], hs[1], hs[3]))

    torch.manual_seed(0)
    con = _trace(tmp_path, Root2(), torch.randn(3, H))
    res = lin.lineage(con, "draft.fc:input.0")
    assert res["op"] == "identity" and "inside" not in res
    assert [(s["point"], s["via"]) for s in res["sources"]] == [("packer:output", ["same values"])]


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Layer(), Layer()

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=-1)


class Nest(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.inner, self.dim = Inner(), dim
        self.c = Layer() if dim == -1 else nn.Linear(H, 2 * H)
        self.head = nn.Linear(3 * H if dim == -1 else 2 * H, H)

    def forward(self, x):
        y = self.inner(x)
        z = self.c(x)
        # dim -1: the inner cat's dim (written as 1 here): one concatenation of three pieces;
        # dim 0: another dim, the inner cat stays one source, with its own sources
        return self.head(torch.cat([y, z], dim=1 if self.dim == -1 else 0))


def test_nested_concatenations_along_one_dim_are_flattened(tmp_path):
    torch.manual_seed(0)
    con = _trace(tmp_path, Nest(-1), torch.randn(3, H))
    res = lin.lineage(con, "head:input.0")
    assert res["op"] == "cat(dim=1)"
    assert [s["point"] for s in res["sources"]] == ["inner.a:output", "inner.b:output", "c:output"]
    assert [s.get("inside", []) for s in res["sources"]] == [["inner:output"], ["inner:output"], []]
    assert [s["op"] for s in res["sources"]] == ["cat(dim=-1)", "cat(dim=-1)", "cat(dim=1)"]


def test_a_concatenation_along_another_dim_stays_one_nested_source(tmp_path):
    torch.manual_seed(0)
    con = _trace(tmp_path, Nest(0), torch.randn(3, H))
    res = lin.lineage(con, "head:input.0")
    assert res["op"] == "cat(dim=0)"
    first, second = res["sources"]
    assert first["point"] == "cat(dim=-1) of [inner.a:output, inner.b:output]"
    assert first["inside"] == ["inner:output"]
    assert [s["point"] for s in first["sources"]] == ["inner.a:output", "inner.b:output"]
    assert second["point"] == "c:output"


def test_a_whole_buffer_copy_is_followed_and_a_scatter_is_ordered(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(), Layer()
            self.head = nn.Linear(3 * H, H)

        def forward(self, x):
            a, b = self.a(x), self.b(x)
            out = torch.empty_like(a)
            out.copy_(a)  # a copy of the whole: followed through
            buf = torch.zeros(x.shape[0], 3 * H)
            buf = torch.slice_scatter(buf, b, dim=1, start=2 * H, end=3 * H)
            buf = torch.slice_scatter(buf, out, dim=1, start=0, end=H)
            return self.head(buf)

    torch.manual_seed(0)
    con = _trace(tmp_path, M(), torch.randn(3, H))
    res = lin.lineage(con, "head:input.0")
    assert res["op"] == "slices(dim=1)"
    assert [(s["point"], s["op"], s["via"]) for s in res["sources"]] == [
        ("a:output", "slice_scatter(dim=1, 0:4)", ["copy_"]),
        ("<no recorded write: dim 1 [4:8]>", "slices(dim=1, 4:8)", []),
        ("b:output", "slice_scatter(dim=1, 8:12)", []),
    ]


def test_a_partly_overwritten_recorded_tensor_keeps_what_it_held(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.small = Layer(), nn.Linear(H, 2)
            self.head = nn.Linear(H, H)

        def forward(self, x):
            y = self.a(x)
            y[:, 0:2] = self.small(x)
            return self.head(y)

    torch.manual_seed(0)
    con = _trace(tmp_path, M(), torch.randn(3, H))
    res = lin.lineage(con, "head:input.0")
    assert [(s["point"], s["op"]) for s in res["sources"]] == [
        ("small:output", "setitem(dim=1, 0:2)"), ("a:output", "written into (dim=1, 2:4)")]


def test_box_reads_a_region_off_offsets_and_strides():
    buf = torch.empty(5, 12)
    geom = lambda t: (t.storage_offset(), tuple(t.shape), t.stride())  # noqa: E731
    assert _box(geom(buf[:, 4:8]), geom(buf)) == ([0, 4], [5, 4])
    assert _box(geom(buf[2]), geom(buf)) == ([2, 0], [1, 12])
    assert _box(geom(buf[:, 0:8]), geom(buf[:3])) == ([0, 0], [3, 8])  # cut to the rows it has
    assert _box(geom(buf[:, ::2]), geom(buf)) is None  # stepped
    # A transposed view still covers a box of the buffer (its source lands there transposed).
    assert _box(geom(buf.t()[:4]), geom(buf)) == ([0, 0], [5, 4])
    assert _box(geom(buf[3:, 8:]), geom(buf[:, 4:])) == ([3, 4], [2, 4])  # in a column slice
    assert _box(geom(buf[1:, 0:4]), geom(buf[:, 4:])) is None  # left of it
    b3 = torch.empty(2, 3, 24)
    assert _box(geom(b3[..., 16:24]), geom(b3)) == ([0, 0, 16], [2, 3, 8])


class CatLeaf(nn.Module):
    """Like SGLang's LogitsProcessor: no children, and it concatenates the list of captures it
    is handed (a leaf's body is otherwise unwatched)."""

    def forward(self, x, captures):
        return x, torch.cat(captures, dim=-1)


class CapturingTarget(nn.Module):
    """Captures the residual stream entering the layers in ``entering`` as named capture
    points, as SGLang's Llama does for EAGLE-3 (entering layer 0 = the embedding's output)."""

    def __init__(self, entering, packer=False):
        super().__init__()
        self.embed = nn.Linear(H, H)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.logits = CatLeaf()
        self.entering = list(entering)
        self.packer = packer  # SGLang's AuxHiddenStatePacker: copies into one preallocated buffer

    def forward(self, x):
        x = self.embed(x)
        captures = []
        buf = x.new_empty(x.shape[0], H * len(self.entering)) if self.packer else None
        for i, layer in enumerate(self.layers):
            if i in self.entering:
                k = len(captures)
                tracer.current().record_capture(f"aux.{k}", x, {"layer": f"layers.{i}"})
                if buf is not None:
                    buf[..., k * H:(k + 1) * H].copy_(x)
                captures.append(x.clone())
            x = layer(x)
        if buf is not None:
            return x, buf
        return self.logits(x, captures)


def _two_step_trace(tmp_path, entering, packer=False):
    return _traced_target_and_draft(tmp_path, CapturingTarget(entering, packer))


def _traced_target_and_draft(tmp_path, target):
    """Two traced steps of ``target`` then the draft on its packed output; the merged store."""
    draft = Draft()
    torch.manual_seed(0)
    tracer.start(out_dir=str(tmp_path))
    try:
        with torch.inference_mode():
            for _ in range(2):
                _, packed = target(torch.randn(3, H))
                draft(packed)
    finally:
        tracer.stop()
    return open_store(str(tmp_path))


@pytest.mark.parametrize("packer", [False, True])
def test_captures_concatenated_in_a_leaf_reach_the_draft_a_step_later(tmp_path, packer):
    res = lin.lineage(_two_step_trace(tmp_path, (1, 2, 3), packer), "Draft.fc:input.0")
    if packer:
        assert res["op"] == "slices(dim=1)" and res["inside"] == [":output.1"]
        assert [s["via"] for s in res["sources"]] == [[]] * 3
    else:
        assert res["op"] == "cat(dim=-1)" and res["inside"] == ["logits:output.1"]
        assert [s["via"] for s in res["sources"]] == [["clone"]] * 3
    assert [s["point"] for s in res["sources"]] == [f"capture:aux.{k}" for k in range(3)]
    # what each capture was handed: the output of the layer before
    assert [s["captured"] for s in res["sources"]] == [
        dict(op="identity", points=[f"layers.{k}:output"], via=[]) for k in range(3)]


def test_a_contract_names_a_capture_handed_another_tensor(tmp_path):
    wired = lin.lineage(_two_step_trace(tmp_path / "a", (1, 2, 3)), "Draft.fc:input.0")
    miswired = lin.lineage(_two_step_trace(tmp_path / "b", (0, 1, 2)), "Draft.fc:input.0")
    contract = lin.make_contract(wired)
    assert lin.compare(contract, wired) == []
    problems = lin.compare(contract, miswired)
    by_kind = {}
    for m in problems:
        by_kind.setdefault(m["kind"], []).append(m)
    # the point names are the same (captures are numbered), what they captured is not
    assert "extra" not in by_kind and "missing" not in by_kind
    assert [m["source"] for m in by_kind["captured"]] == [f"capture:aux.{k}" for k in range(3)]
    assert [(m["point"], m["source"]) for m in by_kind["capture_extra"]] == [("embed:output", "capture:aux.0")]
    assert [(m["point"], m["source"]) for m in by_kind["capture_missing"]] == [("layers.2:output", "capture:aux.2")]
