"""Lineage from module parameters (tracer/lineage_params.py, lineage_attrs.py): an MoE's experts
that index their stacked weights, multiply and split the product inside one call are recorded
from the weight (a ``[4, path, name]`` input) to what the activation receives."""

import json
import sqlite3

import pytest
import torch
import torch.nn as nn

from tensor_trace import schema, tracer
from tensor_trace.exporters.pipeline import merge_ranks, store_path
from tensor_trace.exporters.store.reader import iter_records, rank_files
from tensor_trace.tracer import lineage_attrs as _attrs
from tensor_trace.tracer.lineage_attrs import dims_attrs


class Experts(nn.Module):
    """transformers' batched_mm experts, reduced: gate_up_proj [E, 2I, H] indexed per token."""

    def __init__(self, e=3, i=4, h=6, k=2):
        super().__init__()
        self.k = k
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h))
        self.act_fn = nn.SiLU()

    def forward(self, x, ids):
        sel = x.repeat_interleave(self.k, dim=0)
        w = self.gate_up_proj[ids.reshape(-1)]
        out = torch.bmm(w, sel.unsqueeze(-1)).squeeze(-1)
        gate, up = out.chunk(2, dim=-1)
        return self.act_fn(gate) * up


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.experts = Experts()

    def forward(self, x, ids):
        return self.experts(self.norm(x), ids)


def _run(tmp_path, **kw):
    torch.manual_seed(0)
    m = Block()
    tracer.start(out_dir=str(tmp_path), **kw)
    try:
        with torch.no_grad():
            m(torch.randn(5, 6), torch.randint(0, 3, (5, 2)))
    finally:
        tracer.stop()


def test_an_experts_weight_is_followed_to_the_activation_input(tmp_path):
    _run(tmp_path)
    # in the rank file, the parameter's path and name are string ids
    recs = [r for f in rank_files(str(tmp_path)) for r in iter_records(f) if r[0] == schema.LINEAGE]
    params = [ref for r in recs for ref in r[5] if ref[0] == 4]
    assert params and all(isinstance(ref[1], int) and isinstance(ref[2], int) for ref in params)
    merge_ranks(str(tmp_path), warn=lambda msg: None)
    con = sqlite3.connect(store_path(str(tmp_path)))
    nodes = {n: (op, json.loads(a) if a else {}, json.loads(i), json.loads(s))
             for n, op, a, i, s in con.execute("SELECT node, op, attrs, inputs, shape FROM lineage WHERE step=0")}
    (getitem,) = [n for n, v in nodes.items() if v[0] == "getitem"]
    assert nodes[getitem][2] == [[4, "experts", "gate_up_proj"]]
    assert nodes[getitem][1] == {"dims": [0, 1, 2], "part": [0]}  # rows picked per token, dims kept
    (bmm,) = [n for n, v in nodes.items() if v[0] == "bmm"]
    assert nodes[bmm][1] == {"ndims": [3, 3]}
    assert nodes[bmm][2][0] == [1, 0, getitem]
    unsq = nodes[nodes[bmm][2][1][2]]
    assert unsq[0] == "unsqueeze" and unsq[1] == {"dims": [0, 1]}
    rep = nodes[unsq[2][0][2]]
    assert rep[0] == "repeat_interleave" and rep[1] == {"dims": [0, 1], "part": [0]}
    assert rep[2][0][0] == 0  # the norm's output, by identity
    # the activation's input is the first chunk of the squeezed product
    row = con.execute("SELECT s.ref FROM slot_sources s JOIN spans p ON p.proc=s.proc AND p.step=s.step "
                      "AND p.idx=s.span JOIN modules m USING(module_id) WHERE m.path='experts.act_fn'").fetchone()
    chunk = nodes[json.loads(row[0])[2]]
    assert chunk[0] == "chunk" and chunk[1]["index"] == 0
    squeeze = nodes[chunk[2][0][2]]
    assert squeeze[0] == "squeeze" and squeeze[1] == {"dims": [0, 1, -1]} and squeeze[2] == [[1, 0, bmm]]


def test_ops_on_tensors_nothing_recorded_made_stay_unrecorded(tmp_path):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            t = torch.randn(3, 4)  # not recorded, not a parameter
            return self.lin(x) + t.t().matmul(torch.ones(3, 4))[0]

    tracer.start(out_dir=str(tmp_path))
    try:
        Plain()(torch.randn(2, 4))
    finally:
        tracer.stop()
    recs = [r for f in rank_files(str(tmp_path)) for r in iter_records(f) if r[0] == schema.LINEAGE]
    assert len(recs) == 1 and recs[0][5][1] == [3, [4]]  # only the add of the linear's output


x = torch.zeros(4, 5, 6)


@pytest.mark.parametrize("name, args, want", [
    ("getitem", (x, torch.tensor([0, 2, 2])), {"dims": [0, 1, 2], "part": [0]}),
    ("getitem", (x, torch.tensor(1)), {"dims": [-1, 0, 1]}),
    ("getitem", (x, 1), {"dims": [-1, 0, 1]}),
    ("getitem", (x, (slice(None), slice(0, 3))), {"dims": [0, 1, 2], "part": [1]}),
    ("getitem", (x, (Ellipsis, None)), {"dims": [0, 1, 2]}),
    ("getitem", (x, (None, slice(None), 0)), {"dims": [1, -1, 2]}),
    ("getitem", (x, (slice(None), torch.zeros(2, 3, dtype=torch.long))), {"dims": [0, -1, 3]}),
    ("getitem", (x, (0, torch.tensor([1]))), None),  # an integer beside a tensor index
    ("getitem", (x, (torch.tensor([1]), torch.tensor([1]))), None),  # two tensor indices
    ("index_select", (x, 1, torch.tensor([0])), {"dims": [0, 1, 2], "part": [1]}),
    ("transpose", (x, -2, -1), {"dims": [0, 2, 1]}),
    ("permute", (x, (2, 0, 1)), {"dims": [1, 2, 0]}),
    ("Tensor.permute", (x, 2, 0, 1), {"dims": [1, 2, 0]}),
    ("unsqueeze", (x, -1), {"dims": [0, 1, 2]}),
    ("unsqueeze", (x, 1), {"dims": [0, 2, 3]}),
    ("repeat_interleave", (x, 2, 0), {"dims": [0, 1, 2], "part": [0]}),
    ("repeat_interleave", (x, 2), None),  # flattened
    ("movedim", (x, 0, -1), {"dims": [2, 0, 1]}),
    ("movedim", (x, (2, 0), (0, 1)), {"dims": [1, 2, 0]}),
    ("movedim", (x, (0, 0), (1, 2)), None),  # a dim moved twice: no dims
    ("swapaxes", (x, 0, 2), {"dims": [2, 1, 0]}),
])
def test_dims_of_dimension_moves(name, args, want):
    op = {"getitem": torch.Tensor.__getitem__, "index_select": torch.index_select, "transpose": torch.transpose,
          "permute": torch.permute, "Tensor.permute": torch.Tensor.permute, "unsqueeze": torch.unsqueeze,
          "repeat_interleave": torch.repeat_interleave, "movedim": torch.movedim, "swapaxes": torch.swapaxes}[name]
    try:
        out = op(*args)
    except (IndexError, RuntimeError):
        out = torch.zeros(1)
    tracked = _attrs.tracked()[op][0]  # (swapaxes is recorded as the transpose it is)
    got = dims_attrs(tracked, args[1:], {}, args[0].shape, out.dim())
    assert got == want
    if got is not None and not got.get("part"):  # each input dim lands where its size did
        assert all(out.shape[d] == args[0].shape[i] for i, d in enumerate(got["dims"]) if d >= 0)


@pytest.mark.parametrize("name, args, kwargs, want", [
    ("view", (torch.zeros(2, 6), -1, 3), {}, [-1, 3]),
    ("reshape", (torch.zeros(2, 6), (2, 6)), {}, None),  # no -1: nothing the shape does not say
    ("unflatten", (torch.zeros(3, 32), -1, (2, 16)), {}, None),
    ("unflatten", (torch.zeros(3, 32), -1, (-1, 16)), {}, [3, -1, 16]),
    ("unflatten", (torch.zeros(3, 32, 5), 1, (-1, 16)), {}, [3, -1, 16, 5]),
    ("flatten", (torch.zeros(3, 32),), {}, None),
])
def test_sizes_a_reshape_was_asked_for(name, args, kwargs, want):
    assert _attrs.asked_shape(name, args, kwargs) == want


def test_squeeze_dims_from_the_shape():
    y = torch.zeros(3, 1, 4, 1)
    assert dims_attrs("squeeze", (), {}, y.shape, 2) == {"dims": [0, -1, 1, -1]}
    assert dims_attrs("squeeze", (-1,), {}, y.shape, 3) == {"dims": [0, 1, 2, -1]}
    assert dims_attrs("squeeze", (0,), {}, y.shape, 4) == {"dims": [0, 1, 2, 3]}  # not size 1: kept


def test_baddbmm_operands_are_the_two_batches_and_what_it_adds_unless_beta_is_zero():
    """Megatron's core attention: torch.baddbmm(buffer, q, k^T, beta=0.0, alpha=...): the
    buffer's values do not count, so it is no operand."""
    buf, b1, b2 = torch.empty(2, 3, 3), torch.randn(2, 3, 4), torch.randn(2, 4, 3)
    assert _attrs.mm_inputs("baddbmm", (buf, b1, b2), {"beta": 0.0, "alpha": 0.5}) == [b1, b2]
    assert _attrs.mm_inputs("baddbmm", (buf, b1, b2), {}) == [b1, b2, buf]
    assert _attrs.mm_inputs("baddbmm", (buf,), {"batch1": b1, "batch2": b2, "beta": 2}) == [b1, b2, buf]
    assert _attrs.tracked()[torch.baddbmm] == ("baddbmm", "mm")
