"""Values equal on every rank that a module returns beside, or computes from, a shard whose
ranks differ took nothing of the shard's values: they are whole. Two cases from held-out
programs not written here: a GPT-NeoX rotary embedding handed the sharded v only for its dtype
(DeepSpeed AutoTP style), whose cos and sin were judged shards of v; and a Megatron-style
attention block returning its row-parallel projection's bias beside its output under sequence
parallelism, judged a shard of the block's sequence-sharded input."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1]


def _column_parallel_v(tr, rng):
    """x whole, v = x @ W_r.T with W split along its output dim: each rank's heads of v."""
    x = pos(rng, 2, 3, 4)
    W = pos(rng, 8, 4)
    tr.param("v_proj", "weight", arrays({r: W[4 * r:4 * (r + 1)] for r in R}))
    return x, {r: x @ W[4 * r:4 * (r + 1)].T for r in R}


def test_rotary_tables_from_a_sharded_v_are_whole(tmp_path):
    rng = gen(11)
    tr = SyntheticTrace(2, root="model")
    cos, sin = pos(rng, 3, 2), pos(rng, 3, 2)  # from positions alone: the same on every rank
    with tr.step():
        x, v = _column_parallel_v(tr, rng)
        with tr.call("model", same(x, R)) as outer:
            with tr.call("v_proj", same(x, R)) as c:
                c.returns(arrays(v))
            with tr.call("rotary_emb", arrays(v)) as c:
                c.returns(same(cos, R), same(sin, R))
            outer.returns(arrays(v))
    con = tr.merge(tmp_path)
    check(point(con, "rotary_emb:input.0"), "shard(2)", "no-reduction", "same-values")
    for slot in ("output.0", "output.1"):
        check(point(con, f"rotary_emb:{slot}"), "replicate", "no-reduction", "equal-values")


def test_a_bias_returned_beside_a_sharded_input_is_whole(tmp_path):
    rng = gen(12)
    tr = SyntheticTrace(2, root="model")
    bias = pos(rng, 4)
    with tr.step():
        x, v = _column_parallel_v(tr, rng)
        with tr.call("model", same(x, R)) as outer:
            with tr.call("v_proj", same(x, R)) as c:
                c.returns(arrays(v))
            with tr.call("block", arrays(v)) as c:
                c.returns(arrays({r: v[r] * 2 for r in R}), same(bias, R))
            outer.returns(arrays(v))
    con = tr.merge(tmp_path)
    check(point(con, "block:output.0"), "shard(2)", "no-reduction", "derived-from-shard")
    check(point(con, "block:output.1"), "replicate", "no-reduction", "equal-values")


def test_each_rotated_output_is_derived_from_the_input_of_its_own_shape(tmp_path):
    """vLLM's rotary embedding returns (q, k) rotated; k's evidence names k, not q."""
    rng = gen(13)
    tr = SyntheticTrace(2, root="model")
    with tr.step():
        x = pos(rng, 2, 3, 4)
        Wq, Wk = pos(rng, 8, 4), pos(rng, 4, 4)
        tr.param("q_proj", "weight", arrays({r: Wq[4 * r:4 * (r + 1)] for r in R}))
        tr.param("k_proj", "weight", arrays({r: Wk[2 * r:2 * (r + 1)] for r in R}))
        q = {r: x @ Wq[4 * r:4 * (r + 1)].T for r in R}
        k = {r: x @ Wk[2 * r:2 * (r + 1)].T for r in R}
        with tr.call("model", same(x, R)) as outer:
            with tr.call("q_proj", same(x, R)) as c:
                c.returns(arrays(q))
            with tr.call("k_proj", same(x, R)) as c:
                c.returns(arrays(k))
            with tr.call("rotary_emb", arrays(q), arrays(k)) as c:
                c.returns(arrays({r: q[r][..., ::-1] * 1.5 for r in R}), arrays({r: k[r][..., ::-1] * 0.5 for r in R}))
            outer.returns(same(x, R))
    con = tr.merge(tmp_path)
    p = point(con, "rotary_emb:output.1")
    check(p, "shard(2)", "no-reduction", "derived-from-shard")
    assert any(i["refs"].get("point") == "rotary_emb:input.1" for i in items(p, "dataflow")), p["evidence_items"]


def test_a_bias_added_after_the_reduction_is_said_so_on_the_output_only(tmp_path):
    """DeepSpeed's LinearAllreduce: matmul, all_reduce, then the bias: the output is whole and
    not the reduction's output itself; its input, whole too, owes nothing to that reduction."""
    rng = gen(14)
    tr = SyntheticTrace(2, root="model")
    with tr.step():
        x, v = _column_parallel_v(tr, rng)
        W, b = pos(rng, 4, 8), pos(rng, 4)
        tr.param("dense", "weight", arrays({r: W[:, 4 * r:4 * (r + 1)] for r in R}))
        part = {r: v[r] @ W[:, 4 * r:4 * (r + 1)].T for r in R}
        with tr.call("model", same(x, R)) as outer:
            with tr.call("v_proj", same(x, R)) as c:
                c.returns(arrays(v))
            with tr.call("dense", arrays(v), same(x, R)) as c:  # (and a whole input: a residual)
                tr.coll("all_reduce", [arrays(part)], [same(part[0] + part[1], R)])
                c.returns(same(part[0] + part[1] + b, R))
            outer.returns(same(x, R))
    con = tr.merge(tmp_path)
    p = point(con, "dense:output")
    check(p, "replicate", "no-reduction", "equal-values")
    assert any("its call's sum-reduction" in i["text"] for i in items(p, "values")), p["evidence"]
    q = point(con, "dense:input.1")
    check(q, "replicate", "no-reduction", "equal-values")
    assert not any("its call's sum-reduction" in i["text"] for i in items(q, "values")), q["evidence"]


def test_an_input_derived_inside_a_call_follows_the_shard_of_its_own_rank(tmp_path):
    """Megatron's MLP: fc1 returns (output [s, b, ffn/N], bias [ffn/N]) and adds the bias before
    the activation; fc2's input is a shard of dim 2 like fc1's output, not of dim 0 like the
    1-D bias returned after it."""
    rng = gen(15)
    tr = SyntheticTrace(2, root="model")
    with tr.step():
        x = pos(rng, 3, 2, 4)
        W, b = pos(rng, 8, 4), pos(rng, 8)
        tr.param("mlp.fc1", "weight", arrays({r: W[4 * r:4 * (r + 1)] for r in R}))
        tr.param("mlp.fc1", "bias", arrays({r: b[4 * r:4 * (r + 1)] for r in R}))
        out = {r: x @ W[4 * r:4 * (r + 1)].T for r in R}
        with tr.call("model", same(x, R)) as outer:
            with tr.call("mlp", same(x, R)) as m:
                with tr.call("mlp.fc1", same(x, R)) as c:
                    c.returns(arrays(out), arrays({r: b[4 * r:4 * (r + 1)] for r in R}))
                with tr.call("mlp.fc2", arrays({r: (out[r] + b[4 * r:4 * (r + 1)]) * 0.5 for r in R})) as c:
                    c.returns(same(x, R))
                m.returns(same(x, R))
            outer.returns(same(x, R))
    p = point(tr.merge(tmp_path), "mlp.fc2:input.0")
    check(p, "shard(2)", "no-reduction", "derived-from-shard")
