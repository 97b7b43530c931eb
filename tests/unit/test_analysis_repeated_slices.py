"""A shard whose slices are each held by more than one rank says so. The case from a held-out
vLLM-style program (not written here): 2 KV heads at TP=4, each replicated on two ranks, so
k_proj's output on ranks 0 and 1 is KV head 0 and on ranks 2 and 3 KV head 1."""

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1, 2, 3]


def _k_proj(tr, rng, heads_of):
    x = pos(rng, 2, 3, 4)
    W = pos(rng, 4, 4)  # two KV heads of 2
    tr.param("k_proj", "weight", arrays({r: W[2 * heads_of[r]:2 * heads_of[r] + 2] for r in R}))
    with tr.call("model", same(x, R)) as outer:
        with tr.call("k_proj", same(x, R)) as c:
            c.returns(arrays({r: x @ W[2 * heads_of[r]:2 * heads_of[r] + 2].T for r in R}))
        outer.returns(same(x, R))


def test_kv_heads_replicated_on_pairs_of_ranks_are_said_to_repeat(tmp_path):
    tr = SyntheticTrace(4, root="run")
    with tr.step():
        _k_proj(tr, gen(31), heads_of={0: 0, 1: 0, 2: 1, 3: 1})
    p = point(tr.merge(tmp_path), "k_proj:output")
    check(p, "shard(2)", "no-reduction", "sharded-weight")
    said = [i["text"] for i in items(p, "values") if "distinct slices" in i["text"]]
    assert said and "ranks [0, 1]; ranks [2, 3]" in said[0] and "each of 2 distinct slices" in said[0], p["evidence"]


def test_distinct_slices_say_nothing_of_repeats(tmp_path):
    tr = SyntheticTrace(4, root="run")
    with tr.step():
        rng = gen(32)
        x = pos(rng, 2, 3, 4)
        W = pos(rng, 4, 4)
        tr.param("k_proj", "weight", arrays({r: W[r:r + 1] for r in R}))
        with tr.call("model", same(x, R)) as outer:
            with tr.call("k_proj", same(x, R)) as c:
                c.returns(arrays({r: x @ W[r:r + 1].T for r in R}))
            outer.returns(same(x, R))
    p = point(tr.merge(tmp_path), "k_proj:output")
    check(p, "shard(2)", "no-reduction", "sharded-weight")
    assert not any("distinct slices" in i["text"] for i in items(p, "values")), p["evidence"]
