"""transformers' eager attention returns its weights beside the all_reduced output (a held-out
tp_plan program in bf16, not written here): near-uniform softmax rows read equal on every rank,
not bit for bit, though each rank computed them from its own q and k heads. What is computed
from whole values after a reduction is the same bit for bit, so values that are not were
computed from the shard the call's own modules made, which differs across ranks."""

from synthetic_trace import SyntheticTrace, arrays, check, fps, gen, point, pos, same

R = [0, 1]


def test_attention_weights_returned_beside_a_reduced_output_stay_a_shard(tmp_path):
    rng = gen(81)
    x = pos(rng, 2, 4, 16)  # [b, s, hidden]
    Wq = pos(rng, 8, 16)
    tr = SyntheticTrace(2, root="run")
    tr.param("attn.q", "weight", arrays({r: Wq[4 * r:4 * (r + 1)] for r in R}))
    q = {r: x @ Wq[4 * r:4 * (r + 1)].T for r in R}  # [2, 4, 4]: each rank's heads
    parts = {r: pos(rng, 2, 4, 16) for r in R}
    with tr.step():
        tr.recorded_op()  # a step whose ops were watched
        with tr.call("attn", same(x, R)) as outer:
            with tr.call("attn.q", same(x, R)) as c:
                c.returns(arrays(q))
            with tr.call("attn.o", arrays(q)) as c:  # row-parallel: its own all_reduce
                tr.coll("all_reduce", [arrays(parts)], [same(parts[0] + parts[1], R)])
                c.returns(same(parts[0] + parts[1], R))
            weights = fps((2, 2, 4, 4), {0: (16.0, 4.2), 1: (16.0, 4.200004)})  # [b, heads/tp, s, s]
            outer.returns(same(parts[0] + parts[1], R), weights)
    con = tr.merge(tmp_path)
    check(point(con, "attn.q:output"), "shard(2)", "no-reduction", "sharded-weight")
    p = point(con, "attn:output.1")
    check(p, "shard(1)", "no-reduction", "derived-from-shard")
    assert any("a shard made inside it, differs across ranks" in t for t in p["evidence"]), p["evidence"]


def test_values_carried_on_from_a_reduction_inside_the_call_may_differ_in_their_last_bits(tmp_path):
    """A layer whose MoE reduce_scatters its experts' partial sums (real megatron-core, TP 2 x
    EP 2, not written here): each rank's slice is summed in its own order, so the layer's
    residual sum reads equal but not bit for bit. It is whole, not values that differ."""
    rng = gen(82)
    x = pos(rng, 4, 8)
    W = pos(rng, 8, 8)
    tr = SyntheticTrace(2, root="run")
    tr.param("layer.experts", "weight", arrays({r: W[4 * r:4 * (r + 1)] for r in R}))
    with tr.step():
        tr.recorded_op()
        with tr.call("layer", same(x, R)) as outer:
            with tr.call("layer.experts", same(x, R)) as c:
                c.returns(arrays({r: x @ W[4 * r:4 * (r + 1)].T for r in R}))  # [4, 4]: each rank's
            parts = {r: pos(rng, 8, 8) for r in R}
            tr.coll("reduce_scatter_tensor", [arrays(parts)], [fps((4, 8), {0: (5.0, 7.0), 1: (5.0, 7.000004)})])
            outer.returns(fps((4, 8), {0: (9.0, 11.0), 1: (9.0, 11.000006)}))
    p = point(tr.merge(tmp_path), "layer:output")
    check(p, "replicate", "no-reduction", "equal-values")
