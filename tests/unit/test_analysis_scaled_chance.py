"""A common scale leaves one test of a fingerprint's sums (sum over sum of squares), which a
bfloat16 tolerance passes by chance now and then. The case from held-out transformers TP plans
in bfloat16 (not written here): Gemma2's residual stream entering layer 1 (a sum, as the point
that output it says) read as the embedding's all_reduce output "times -69.92"; and GLM-4-MoE's
activation input, the gate projection's column-parallel output handed on, read as a partial sum
because the ranks' sums added up to a later layer's all_reduce (one number). The point that
held these very values earlier in the step says what they are."""

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same

R = [0, 1]


def test_a_scaled_link_gives_way_to_the_point_that_held_the_values_earlier(tmp_path):
    rng = gen(71)
    x = pos(rng, 2, 8)
    h = x * 1.5 + 0.25  # computed locally from whole values
    reduced = h / -3.0  # a later, unrelated reduction's output: by the sums, a scaled copy of h
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("local", same(x, R)) as c:
                c.returns(same(h, R))
            with tr.call("other", same(x, R)) as c:
                tr.coll("all_reduce", [same(reduced / 2, R)], [same(reduced, R)])
                c.returns(same(reduced + 1.0, R))
            with tr.call("consumer", same(h, R)) as c:
                c.returns(same(h * 2, R))
            root.returns(same(x, R))
    con = tr.merge(tmp_path)
    check(point(con, "local:output"), "replicate", "no-reduction", "equal-values")
    p = point(con, "consumer:input.0")
    assert p["reduction"] == "no-reduction", p["evidence"]
    assert any("local:output held these very values earlier" in e for e in p["evidence"]), p["evidence"]


def test_sums_adding_up_to_one_number_give_way_to_the_shard_that_held_the_values(tmp_path):
    rng = gen(72)
    x = pos(rng, 2, 4)
    W = pos(rng, 8, 4)
    cols = {r: x @ W[4 * r:4 * (r + 1)].T for r in R}  # column-parallel: shard(1)
    total = cols[0].sum() + cols[1].sum()
    later = pos(rng, 2, 4)
    later *= total / later.sum()  # a later reduction's output whose sum is the ranks' sums' total
    tr = SyntheticTrace(2, root="run")
    tr.param("up", "weight", arrays({r: W[4 * r:4 * (r + 1)] for r in R}))
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("up", same(x, R)) as c:
                c.returns(arrays(cols))
            with tr.call("act", arrays(cols)) as c:
                c.returns(arrays({r: cols[r] * 2 for r in R}))
            with tr.call("next", same(x, R)) as c:
                tr.coll("all_reduce", [same(later / 2, R)], [same(later, R)])
                c.returns(same(later, R))
            root.returns(same(x, R))
    con = tr.merge(tmp_path)
    check(point(con, "up:output"), "shard(1)", "no-reduction", "sharded-weight")
    p = point(con, "act:input.0")
    assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]
