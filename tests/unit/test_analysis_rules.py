"""The verdict engine's rules (exporters/analysis/rules.py) on small synthetic traces: ranks,
shapes, fingerprints, weights, concatenations, dataflow, declarations. The reductions and gathers
are in test_analysis_reductions.py.

Each test declares what a TP group did (synthetic_trace.py writes the rank files with the real
writer and merges them with the real merge) and reads the verdict back through
``tensor_trace.exporters.query``: placement, reduction, the rule that decided, and the evidence
item naming the collective, parameter or point the verdict relies on. Values are real arrays
(a column-parallel output is a product with a slice of the weight), so fingerprints relate as
they do in a traced program.
"""

import numpy as np
import pytest

from synthetic_trace import (SyntheticTrace, arrays, check, fps, gen, items, names_collective, names_param,
                             names_point, no_fp, point, pos, same, store_has)

R = [0, 1]
needs_param_meta = pytest.mark.skipif(
    not store_has("params", "meta"), reason="the store has no params.meta column yet: a parameter's DTensor "
                                            "placements cannot reach the engine")


# ------------------------------------------------------------------------- ranks and shapes
@pytest.mark.parametrize("world,tp_ranks", [(2, None), (2, [0, 1]), (4, None)])
def test_fewer_readable_ranks_than_the_group_is_unknown(tmp_path, world, tp_ranks):
    tr = SyntheticTrace(world, readable=[0], tp_ranks=tp_ranks)
    x = pos(gen(), 2, 4)
    with tr.step():
        with tr.call("m", same(x, [0])) as c:
            c.returns(same(2 * x, [0]))
    p = point(tr.merge(tmp_path), "m:output")
    check(p, "unknown", "unknown", "missing-ranks")
    (miss,) = items(p, "missing")
    assert "[0]" in miss["text"] and f"of a TP group of {world}" in miss["text"]


def test_one_rank_group_is_replicate(tmp_path):
    tr = SyntheticTrace(1)
    with tr.step():
        with tr.call("m", same(pos(gen(), 2, 4), [0])) as c:
            c.returns(same(pos(gen(1), 2, 3), [0]))
    check(point(tr.merge(tmp_path), "m:output"), "replicate", "no-reduction", "one-rank-group")


def test_uneven_shapes_along_one_dim_are_a_shard(tmp_path):
    rng = gen()
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("m", same(pos(rng, 4, 8), R)) as c:
            c.returns(arrays({0: pos(rng, 4, 3), 1: pos(rng, 4, 5)}))
    p = point(tr.merge(tmp_path), "m:output")
    check(p, "shard(1)", "no-reduction", "uneven-shard")
    assert p["shapes"] == {0: [4, 3], 1: [4, 5]}


def test_shapes_differing_in_two_dims_are_divergent(tmp_path):
    rng = gen()
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("m", same(pos(rng, 4, 8), R)) as c:
            c.returns(arrays({0: pos(rng, 4, 3), 1: pos(rng, 5, 6)}))
    check(point(tr.merge(tmp_path), "m:output"), "divergent", "unknown", "shapes-disagree")


def test_no_fingerprint_is_unknown(tmp_path):
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("m", no_fp((2, 4), R), no_fp=True) as c:
            c.returns(no_fp((2, 4), R))
    con = tr.merge(tmp_path)
    for name in ("m:input.0", "m:output"):
        check(point(con, name), "unknown", "unknown", "no-fingerprint")


# ------------------------------------------------------------------------- concatenation, weights
def test_concatenation_seen_in_the_step_is_a_shard(tmp_path):
    rng = gen()
    xs = {r: pos(rng, 3, 4) for r in R}
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("a", same(pos(rng, 3, 2), R)) as c:
            c.returns(arrays(xs))
        with tr.call("cat", arrays(xs)) as c:
            c.returns(same(np.concatenate([xs[0], xs[1]], 0), R))
    p = point(tr.merge(tmp_path), "a:output")
    check(p, "shard(0)", "no-reduction", "concatenation")
    names_point(p, "concat", "cat:output")


def test_slices_of_a_reduction_output_seen_earlier_are_post_reduction_shards(tmp_path):
    """A sequence-parallel plan's PrepareModuleInput (Replicate -> Shard(1)) of the embedding's
    all_reduce output: each rank's slice of the reduced values, carried on unchanged."""
    rng = gen()
    parts = {r: pos(rng, 2, 4, 3) for r in R}
    total = parts[0] + parts[1]
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("emb", same(pos(rng, 2, 4), R)) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(total, R)])
            c.returns(same(total, R))
        with tr.call("layer", arrays({r: total[:, 2 * r:2 * r + 2] for r in R})) as c:
            c.returns(arrays({r: total[:, 2 * r:2 * r + 2] * 3.0 + 1.0 for r in R}))
    con = tr.merge(tmp_path)
    check(point(con, "emb:output"), "replicate", "post-reduction", "reduction-output")
    p = point(con, "layer:input.0")
    check(p, "shard(1)", "post-reduction", "concatenation")
    names_point(p, "concat", "emb:output")


def test_each_ranks_rows_of_a_whole_tensor_with_its_leading_dims_flattened_are_a_shard(tmp_path):
    """An expert-parallel layer's own tokens, ``norm(x).reshape(-1, h)[r * n:(r + 1) * n]`` of
    a replicated [2, 4, 3] (a hand-written EP MoE): the whole is seen only unflattened; a
    tensor of the same size whose values are not those rows stays divergent."""
    rng = gen()
    whole = pos(rng, 2, 4, 3)
    rows = whole.reshape(-1, 3)
    for name, scale in (("router", lambda r: 1.0), ("other", lambda r: 1.5 + r)):
        tr = SyntheticTrace(2)
        with tr.step():
            with tr.call("norm", same(pos(rng, 2, 4, 3), R)) as c:
                c.returns(same(whole, R))
            with tr.call(name, arrays({r: rows[4 * r:4 * r + 4] * scale(r) for r in R})) as c:
                c.returns(same(pos(rng, 2), R))
        con = tr.merge(tmp_path / name)
        p = point(con, f"{name}:input.0")
        if name == "other":
            check(p, "divergent", "unknown", "divergent")
            continue
        check(p, "shard(0)", "no-reduction", "concatenation")
        names_point(p, "concat", "norm:output")
        assert any("leading dims [2, 4] flattened" in i["text"] for i in items(p, "concat")), p["evidence"]


def _column_then_row(tr, rng, with_act=False):
    """col: replicated x [2, 4] times its weight's rows (a slice of W [6, 4] per rank); row: that
    shard times its weight's columns (a slice of V [5, 6] per rank)."""
    x, W, V = pos(rng, 2, 4), pos(rng, 6, 4), pos(rng, 5, 6)
    tr.param("col", "weight", arrays({r: W[3 * r:3 * r + 3] for r in R}))
    tr.param("row", "weight", arrays({r: V[:, 3 * r:3 * r + 3] for r in R}))
    ys = {r: x @ W[3 * r:3 * r + 3].T for r in R}
    zs = {r: ys[r] @ V[:, 3 * r:3 * r + 3].T for r in R}
    with tr.call("col", same(x, R)) as c:
        c.returns(arrays(ys))
    if with_act:
        with tr.call("act", arrays(ys)) as c:
            c.returns(arrays({r: np.maximum(ys[r] - 2.0, 0) for r in R}))
    with tr.call("row", arrays(ys)) as c:
        c.returns(arrays(zs))
    return zs


def test_weight_split_by_rows_with_replicated_input_is_a_shard(tmp_path):
    tr = SyntheticTrace(2)
    with tr.step():
        _column_then_row(tr, gen())
    con = tr.merge(tmp_path)
    check(point(con, "col:input.0"), "replicate", "no-reduction", "equal-values")
    p = point(con, "col:output")
    check(p, "shard(1)", "no-reduction", "sharded-weight")
    names_param(p, "col.weight")


def test_weight_split_by_columns_with_input_sharded_along_its_last_dim_is_partial(tmp_path):
    tr = SyntheticTrace(2)
    with tr.step():
        _column_then_row(tr, gen())
    con = tr.merge(tmp_path)
    check(point(con, "row:input.0"), "shard(1)", "no-reduction", "same-values")
    p = point(con, "row:output")
    # No sum-reduction follows in this step: partial, reduction not seen.
    check(p, "partial", "unknown", "sharded-weight")
    names_param(p, "row.weight")


def test_input_with_the_values_of_an_earlier_output_inherits_its_verdict(tmp_path):
    tr = SyntheticTrace(2)
    with tr.step():
        _column_then_row(tr, gen(), with_act=True)
    p = point(tr.merge(tmp_path), "act:input.0")
    check(p, "shard(1)", "no-reduction", "same-values")
    names_point(p, "dataflow", "col:output")


def test_output_computed_locally_from_a_sharded_input_is_a_shard(tmp_path):
    tr = SyntheticTrace(2)
    with tr.step():
        _column_then_row(tr, gen(), with_act=True)
    p = point(tr.merge(tmp_path), "act:output")
    check(p, "shard(1)", "no-reduction", "derived-from-shard")
    names_point(p, "dataflow", "act:input.0")


def test_tensor_inside_a_call_derived_from_its_sharded_input_is_a_shard(tmp_path):
    """attn's input is a shard; inside attn a child call sees values computed from it."""
    rng = gen()
    tr = SyntheticTrace(2)
    with tr.step():
        x, W = pos(rng, 2, 4), pos(rng, 6, 4)
        tr.param("col", "weight", arrays({r: W[3 * r:3 * r + 3] for r in R}))
        ys = {r: x @ W[3 * r:3 * r + 3].T for r in R}
        with tr.call("col", same(x, R)) as c:
            c.returns(arrays(ys))
        with tr.call("attn", arrays(ys)) as c:
            with tr.call("attn.inner", arrays({r: np.exp(ys[r]) for r in R})) as inner:
                inner.returns(arrays({r: np.exp(ys[r]) * 2 for r in R}))
            c.returns(arrays({r: np.exp(ys[r]) * 3 for r in R}))
    p = point(tr.merge(tmp_path), "attn.inner:input.0")
    check(p, "shard(1)", "no-reduction", "derived-from-shard")
    names_point(p, "dataflow", "attn:input.0")


def test_values_that_differ_with_no_explanation_are_divergent(tmp_path):
    rng = gen()
    tr = SyntheticTrace(2)
    tr.param("m", "weight", same(pos(rng, 3, 4), R))  # whole on every rank: explains nothing
    with tr.step():
        with tr.call("m", same(pos(rng, 2, 4), R)) as c:
            c.returns(arrays({r: pos(rng, 2, 3) for r in R}))
    p = point(tr.merge(tmp_path), "m:output")
    check(p, "divergent", "unknown", "divergent")


# ------------------------------------------------------------------------- declarations
def _declared_param(tmp_path, placement, equal):
    rng = gen()
    x = pos(rng, 2, 4)
    w = pos(rng, 3, 4)
    dt = {"kind": "DTensor", "placements": [placement]}
    tr = SyntheticTrace(2)
    tr.param("lin", "weight", same(w, R) if equal else arrays({r: pos(rng, 3, 4) for r in R}), meta=dt)
    with tr.step():
        with tr.call("lin", same(x, R)) as c:
            c.returns(same(x @ w.T, R) if equal else arrays({r: pos(rng, 2, 3) for r in R}))
    con = tr.merge(tmp_path)
    assert con.execute("SELECT COUNT(*) FROM params WHERE meta IS NOT NULL").fetchone()[0] == 2, \
        "the merge did not take the parameter meta as synthetic_trace.py writes it"
    return point(con, "lin:output")


@needs_param_meta
@pytest.mark.parametrize("equal", [False, True])
def test_dtensor_weight_shard0_with_replicated_input_is_a_shard(tmp_path, equal):
    p = _declared_param(tmp_path, "Shard(0)", equal)
    assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]
    assert p["rule"] == "sharded-weight"
    names_param(p, "lin.weight")


@needs_param_meta
@pytest.mark.parametrize("equal", [False, True])
def test_dtensor_weight_shard1_with_replicated_input_is_partial(tmp_path, equal):
    p = _declared_param(tmp_path, "Shard(1)", equal)
    assert p["placement"] == "partial" and p["rule"] == "sharded-weight", p["evidence"]
    names_param(p, "lin.weight")


def test_sglang_column_parallel_with_identical_shards_is_a_shard(tmp_path):
    x, y = pos(gen(), 2, 4), pos(gen(1), 2, 6)
    tr = SyntheticTrace(2)
    tr.layer("qkv", {"sglang_class": "QKVParallelLinear", "gather_output": False})
    with tr.step():
        with tr.call("qkv", same(x, R)) as c:
            c.returns(same(y, R))
    p = point(tr.merge(tmp_path), "qkv:output")
    check(p, "shard(1)", "no-reduction", "layer-semantics")
    assert any("QKVParallelLinear" in i["text"] for i in items(p, "semantics")), p["evidence"]
    assert any("identical shards" in i["text"] for i in items(p, "values")), p["evidence"]


def test_sglang_row_parallel_without_reduce_with_identical_shards_is_partial(tmp_path):
    """reduce_results=False: the caller reduces later, the sum of this and another partial (so
    the reduction's input is not this tensor)."""
    x, y, other = pos(gen(), 2, 4), pos(gen(1), 2, 6), pos(gen(2), 2, 6)
    tr = SyntheticTrace(2)
    tr.layer("down", {"sglang_class": "RowParallelLinear", "reduce_results": False})
    with tr.step():
        with tr.call("down", same(x, R)) as c:
            c.returns(same(y, R))
        tr.coll("all_reduce", [same(y + other, R)], [same(2 * (y + other), R)])
    p = point(tr.merge(tmp_path), "down:output")
    check(p, "partial", "pre-reduction", "layer-semantics")
    assert any("RowParallelLinear" in i["text"] for i in items(p, "semantics")), p["evidence"]
    assert any("identical shards" in i["text"] for i in items(p, "values")), p["evidence"]
    names_collective(p, "all_reduce", 0)


def test_fingerprints_given_explicitly_are_read_as_written(tmp_path):
    """The helper's explicit form: two ranks, sums 1% apart, float32: the ranks disagree."""
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("m", fps((8,), {0: (4.0, 2.0), 1: (4.0, 2.0)})) as c:
            c.returns(fps((8,), {0: (10.0, 14.0), 1: (10.1, 14.2)}))
    con = tr.merge(tmp_path)
    check(point(con, "m:input.0"), "replicate", "no-reduction", "equal-values")
    p = point(con, "m:output")
    check(p, "divergent", "unknown", "divergent")
    assert p["fingerprint"] == [10.0, 14.0]
