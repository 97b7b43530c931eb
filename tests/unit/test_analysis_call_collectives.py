"""A module call that runs collectives did not compute its output locally from its inputs: the
weight and input placement rules and the local derivation of a shard do not place its output.
Cases from programs written outside this project (hand-written Megatron-style TP, transformers'
Granite with biases): a row-parallel layer that adds its bias after its all_reduce, a maximum
taken across ranks, a sequence-parallel projection that gathers its input first.
"""

import numpy as np

from synthetic_trace import (SyntheticTrace, arrays, check, gen, items, names_collective, names_param, point, pos,
                             same)

R = [0, 1]


def _column(tr, x, W, k):
    """col: replicated x times its weight's rows (k rows of W per rank): a shard of the last dim."""
    tr.param("col", "weight", arrays({r: W[k * r:k * (r + 1)] for r in R}))
    ys = {r: x @ W[k * r:k * (r + 1)].T for r in R}
    with tr.call("col", same(x, R)) as c:
        c.returns(arrays(ys))
    return ys


def _row_with_bias_after_reduce(tr, ys, V, k, bias, meta=None):
    """row: each rank's shard times its columns of V, all_reduced, then a bias every rank holds."""
    tr.param("row", "weight", arrays({r: V[:, k * r:k * (r + 1)] for r in R}), meta=meta)
    parts = {r: ys[r] @ V[:, k * r:k * (r + 1)].T for r in R}
    total = parts[0] + parts[1]
    with tr.call("row", arrays(ys)) as c:
        tr.coll("all_reduce", [arrays(parts)], [same(total, R)])
        c.returns(same(total + bias, R))
    return total + bias


def test_bias_added_after_the_all_reduce_in_the_call_is_whole_not_a_shard(tmp_path):
    """The row-parallel output has its sharded input's local shape (4 = 8 / 2): a norm-like
    "derived from a shard" reading made it shard(1) although the call reduced it."""
    rng = gen()
    x, W, V, b = pos(rng, 2, 4), pos(rng, 8, 4), pos(rng, 4, 8), pos(rng, 4)
    tr = SyntheticTrace(2)
    with tr.step():
        ys = _column(tr, x, W, 4)
        _row_with_bias_after_reduce(tr, ys, V, 4, b)
    con = tr.merge(tmp_path)
    check(point(con, "row:input.0"), "shard(1)", "no-reduction", "same-values")
    p = point(con, "row:output")
    check(p, "replicate", "no-reduction", "equal-values")
    assert any("its call issued all_reduce(sum) #0" in i["text"] for i in items(p, "dataflow")), p["evidence"]


def test_declared_row_weight_with_bias_after_the_all_reduce_is_not_partial(tmp_path):
    """A DTensor weight split along its input dim says "partial" of what the call computes
    locally; the call's all_reduce completed that sum before the bias (transformers' Granite
    with ``attention_bias``)."""
    rng = gen()
    x, W, V, b = pos(rng, 2, 4), pos(rng, 6, 4), pos(rng, 5, 6), pos(rng, 5)
    tr = SyntheticTrace(2)
    with tr.step():
        ys = _column(tr, x, W, 3)
        _row_with_bias_after_reduce(tr, ys, V, 3, b, meta={"kind": "DTensor", "placements": ["Shard(1)"]})
        with tr.call("next", same(pos(rng, 5), R)) as c:  # a later sum-reduction of another tensor
            tr.coll("all_reduce", [arrays({r: pos(rng, 5) for r in R})], [same(pos(rng, 5), R)])
            c.returns(same(pos(rng, 5), R))
    p = point(tr.merge(tmp_path), "row:output")
    check(p, "replicate", "no-reduction", "equal-values")
    assert p["collective"] is None, p["collective"]


def test_a_maximum_across_ranks_is_whole_and_not_post_reduction(tmp_path):
    """all_reduce(max) of a vocab shard's per-row maxima: the output of a reduction that is not
    a sum, on every rank the same: not a shard of the input's (another rank of tensor)."""
    rng = gen()
    logits = {r: pos(rng, 2, 3, 5) for r in R}
    local = {r: logits[r].max(-1) for r in R}
    m = np.maximum(local[0], local[1])
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("vocab_max", arrays(logits)) as c:
            tr.coll("all_reduce", [arrays(local)], [same(m, R)], reduce_op="max")
            c.returns(same(m, R))
        with tr.call("after", same(m, R)) as c:
            c.returns(same(m * 2.0, R))
    con = tr.merge(tmp_path)
    p = point(con, "vocab_max:output")
    check(p, "replicate", "no-reduction", "non-sum-reduction-output")
    names_collective(p, "all_reduce", 0)
    check(point(con, "after:input.0"), "replicate", "no-reduction", "non-sum-reduction-output")


def test_a_projection_of_a_sequence_gathered_inside_its_call_is_a_shard_of_its_output_dim(tmp_path):
    """Sequence parallel: the call's input is each rank's rows (gathered by the all_gather it
    feeds), the call gathers them and multiplies by its weight's rows: a shard of the last dim,
    not of the rows its input was split along."""
    rng = gen()
    x, W = pos(rng, 4, 4), pos(rng, 6, 4)
    xs = {r: x[2 * r:2 * r + 2] for r in R}
    tr = SyntheticTrace(2)
    tr.param("fc1", "weight", arrays({r: W[3 * r:3 * r + 3] for r in R}))
    with tr.step():
        with tr.call("fc1", arrays(xs)) as c:
            tr.coll("all_gather_into_tensor", [arrays(xs)], [same(x, R)], reduce_op=None)
            c.returns(arrays({r: x @ W[3 * r:3 * r + 3].T for r in R}))
    con = tr.merge(tmp_path)
    check(point(con, "fc1:input.0"), "shard(0)", "no-reduction", "gather-input")
    p = point(con, "fc1:output")
    check(p, "shard(1)", "no-reduction", "sharded-weight")
    names_param(p, "fc1.weight")
    assert any("gathered inside the call by all_gather_into_tensor" in i["text"] for i in items(p, "dataflow")), \
        p["evidence"]


def test_a_layer_whose_children_communicate_keeps_its_sequence_shard(tmp_path):
    """Sequence parallel (a DTensor plan's PrepareModuleInput and RowwiseParallel(Shard(1))):
    the layer's attention gathers the sequence and reduce-scatters its output; the layer returns
    its input plus that, each rank's rows. The children's collectives made the children's
    outputs, which are judged on their own; the layer's own call issued none."""
    rng = gen()
    x = {r: pos(rng, 2, 2, 4) for r in R}
    full = np.concatenate([x[0], x[1]], 1)
    partial = {r: full * pos(rng, 4) - 1.0 for r in R}  # (each rank's own projection of the sequence)
    reduced = partial[0] + partial[1]
    out = {r: reduced[:, 2 * r:2 * r + 2] for r in R}
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("layer", arrays(x)) as lc:
            with tr.call("layer.attn", arrays(x)) as c:
                tr.coll("all_gather_into_tensor", [arrays(x)], [same(full, R)], reduce_op=None,
                        attrs={"gather_dim": 1})
                tr.coll("reduce_scatter_tensor", [arrays(partial)], [arrays(out)], attrs={"scatter_dim": 1})
                c.returns(arrays(out))
            lc.returns(arrays({r: x[r] + out[r] for r in R}))
    con = tr.merge(tmp_path)
    p = point(con, "layer.attn:output")
    assert (p["placement"], p["reduction"]) == ("shard(1)", "post-reduction"), p["evidence"]
    p = point(con, "layer:output")
    assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]


def test_a_column_output_whose_sums_happen_to_add_up_to_a_later_reduction_is_a_shard(tmp_path):
    """Real SGLang (Qwen3-MoE, DeepSeek-V2 at TP 2): a column-parallel projection's per-rank
    sums matched, within bf16 tolerance, the sum of a later layer's all_reduce output of the same
    size. One number that matches is weaker than a replicated input times a split weight."""
    rng = gen(11)
    x, W = pos(rng, 2, 4), pos(rng, 8, 4)
    tr = SyntheticTrace(2)
    with tr.step():
        ys = _column(tr, x, W, 4)
        target = ys[0].sum() + ys[1].sum()
        out = pos(rng, 2, 4)
        out += (target - out.sum()) / out.size  # another tensor, whose sum is theirs
        with tr.call("later", same(pos(rng, 2, 4), R)) as c:
            tr.coll("all_reduce", [arrays({r: pos(rng, 2, 4) for r in R})], [same(out, R)])
            c.returns(same(out, R))
    p = point(tr.merge(tmp_path), "col:output")
    check(p, "shard(1)", "no-reduction", "sharded-weight")
    assert any("a single number: the weights outrank it" in i["text"] for i in items(p, "collective")), p["evidence"]
