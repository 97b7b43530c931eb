"""An output computed from shards that the modules its call called made. The case from
held-out transformers tp_plan runs (not written here, 5 models): eager attention returns its
probabilities ``[b, heads, s, s]`` beside its output; the heads are the rank's own (q and k
from column-parallel projections inside the attention call), and they were judged divergent."""

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1]


def _attention(tr, rng, reduce_output: bool, watched: bool = True):
    x = pos(rng, 1, 8, 4)
    Wq, Wo = pos(rng, 8, 4), pos(rng, 4, 8)  # 4 heads of 2: rank r holds heads 2r, 2r + 1
    tr.param("attn.q_proj", "weight", arrays({r: Wq[4 * r:4 * (r + 1)] for r in R}))
    tr.param("attn.o_proj", "weight", arrays({r: Wo[:, 4 * r:4 * (r + 1)] for r in R}))
    q = {r: x @ Wq[4 * r:4 * (r + 1)].T for r in R}  # [1, 8, 4] shard(2)
    probs = {r: pos(rng, 1, 2, 8, 8) for r in R}  # [1, heads of the rank, s, s]
    ctx = {r: q[r] * 0.5 for r in R}
    part = {r: ctx[r] @ Wo[:, 4 * r:4 * (r + 1)].T for r in R}
    whole = part[0] + part[1]
    if watched:
        tr.recorded_op()  # (the step's ops were watched: none built the attention's outputs)
    with tr.call("model", same(x, R)) as outer:
        with tr.call("attn", same(x, R)) as a:
            with tr.call("attn.q_proj", same(x, R)) as c:
                c.returns(arrays(q))
            with tr.call("attn.o_proj", arrays(ctx)) as c:
                if reduce_output:
                    tr.coll("all_reduce", [arrays(part)], [same(whole, R)])
                    c.returns(same(whole, R))
                else:  # the bug: the row-parallel projection forgot its all_reduce
                    c.returns(arrays(part))
            a.returns(same(whole, R) if reduce_output else arrays(part), arrays(probs))
        outer.returns(same(x, R))


def test_attention_probabilities_are_the_ranks_heads(tmp_path):
    """In a step whose ops were watched and did not build them; in one whose ops were not
    watched nothing tells what built them, and they stay unexplained."""
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _attention(tr, gen(61), reduce_output=True)
    con = tr.merge(tmp_path)
    p = point(con, "attn:output.1")
    check(p, "shard(1)", "no-reduction", "derived-from-shard")
    assert any("computed inside its call from attn.o_proj:input.0" in i["text"] for i in items(p, "dataflow")), p["evidence"]


def test_an_output_of_another_size_than_the_inner_shard_stays_unexplained(tmp_path):
    """A block whose child made a column shard [1, 8, 4] returns values [1, 8, 8] that differ
    across ranks and that nothing explains (as a block that lost its reduction would): the shard
    inside does not make it one, its dim does not have the shard's size."""
    rng = gen(62)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        x = pos(rng, 1, 8, 4)
        W = pos(rng, 8, 4)
        tr.param("block.proj", "weight", arrays({r: W[4 * r:4 * (r + 1)] for r in R}))
        tr.recorded_op()
        with tr.call("model", same(x, R)) as outer:
            with tr.call("block", same(x, R)) as b:
                with tr.call("block.proj", same(x, R)) as c:
                    c.returns(arrays({r: x @ W[4 * r:4 * (r + 1)].T for r in R}))
                b.returns(arrays({r: pos(rng, 1, 8, 8) for r in R}))
            outer.returns(same(x, R))
    con = tr.merge(tmp_path)
    check(point(con, "block.proj:output"), "shard(2)", "no-reduction", "sharded-weight")
    check(point(con, "block:output"), "divergent", "unknown", "divergent")


def test_in_a_step_whose_ops_were_not_watched_the_inner_shard_says_nothing(tmp_path):
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _attention(tr, gen(63), reduce_output=True, watched=False)
    check(point(tr.merge(tmp_path), "attn:output.1"), "divergent", "unknown", "divergent")
