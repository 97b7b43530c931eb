"""A module whose calls run compiled (torch.compile): the ops inside its graph are not recorded,
and the evidence of what it returns says so. Here its call issued no collective (one that its
graph runs is a span of its call: tests/integration/test_compiled_blocks.py), so what it returns,
equal on every rank, is computed locally."""

import torch
import torch.nn as nn

from synthetic_trace import SyntheticTrace, check, gen, items, point, pos, same
from tensor_trace.tracer.integrations import compiled_how, module_attrs

R = [0, 1]


def _step(tr, rng):
    x = pos(rng, 2, 4)
    y = pos(rng, 2, 4)
    with tr.call("model", same(x, R)) as outer:
        with tr.call("attn", same(x, R)) as c:  # its all_reduce ran inside the compiled graph
            c.returns(same(y, R))
        with tr.call("norm", same(y, R)) as c:
            c.returns(same(y * 2, R))
        outer.returns(same(y * 2, R))


def test_what_a_compiled_call_returns_says_its_inside_was_not_seen(tmp_path):
    tr = SyntheticTrace(2, root="run")
    tr.layer("attn", {"compiled": "torch.compile(module)"})
    with tr.step():
        _step(tr, gen(91))
    con = tr.merge(tmp_path)
    for name in ("attn:output", "norm:input.0"):
        p = point(con, name)
        check(p, "replicate", "no-reduction", "equal-values")
        assert any("attn:output ran compiled (torch.compile(module))" in i["text"] for i in items(p, "values")), p
    check(point(con, "norm:output"), "replicate", "no-reduction", "equal-values")


def test_without_compiled_calls_equal_values_are_computed_locally(tmp_path):
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _step(tr, gen(91))
    p = point(tr.merge(tmp_path), "attn:output")
    check(p, "replicate", "no-reduction", "equal-values")
    assert not any("ran compiled" in t for t in p["evidence"]), p["evidence"]


def test_the_tracer_says_which_modules_run_compiled():
    plain = nn.Linear(2, 2)
    assert compiled_how(plain) is None and module_attrs(plain) is None
    wrapped = torch.compile(nn.Linear(2, 2), backend="eager")
    assert compiled_how(wrapped) == "torch.compile(module)"
    assert module_attrs(wrapped) == {"compiled": "torch.compile(module)"}
    in_place = nn.Linear(2, 2)
    in_place.compile(backend="eager")
    assert compiled_how(in_place) == "module.compile()"


def test_a_compiled_sequence_parallel_blocks_residual_add_is_a_slice(tmp_path):
    """A held-out PyTorch TP plan with sequence parallel, each block torch.compile'd (not written
    here): the block's ops are not seen, only its collectives; its output is its input (the
    sequence's slice, shard(1)) plus its attention's and MLP's reduce_scatter outputs. It was
    divergent ('not derived locally: its call issued ...') and a check finding."""
    from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos

    R = [0, 1]  # (rank r's slice of the sequence, dim 1)
    rng = gen(91)
    e_full = rng.standard_normal((2, 8, 8))
    x = {r: e_full[:, 4 * r:4 * (r + 1)] for r in R}  # the embedding's reduced slice: shard(1)
    a_full, m_full = rng.standard_normal((2, 8, 8)), rng.standard_normal((2, 8, 8))
    a = {r: a_full[:, 4 * r:4 * (r + 1)] for r in R}
    m = {r: m_full[:, 4 * r:4 * (r + 1)] for r in R}
    tr = SyntheticTrace(2, root="run")
    tr.layer("layers.0", {"compiled": "torch.compile(module)"})
    with tr.step():
        ids = pos(rng, 2, 8)
        with tr.call("run", arrays({r: ids for r in R})) as root:
            with tr.call("embed", arrays({r: ids for r in R})) as c:
                tr.coll("reduce_scatter_tensor", [arrays({r: e_full * 0.5 for r in R})], [arrays(x)])
                c.returns(arrays(x))
            with tr.call("layers.0", arrays(x)) as c:
                tr.coll("reduce_scatter_tensor", [arrays({r: a_full * 0.5 for r in R})], [arrays(a)])
                tr.coll("reduce_scatter_tensor", [arrays({r: m_full * 0.5 for r in R})], [arrays(m)])
                c.returns(arrays({r: x[r] + a[r] + m[r] for r in R}))
            root.returns(arrays(x))
    con = tr.merge(tmp_path)
    p = point(con, "layers.0:output")
    check(p, "shard(1)", "no-reduction", "compiled-residual")
