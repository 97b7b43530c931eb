"""Two data-parallel replicas of a TP=2 model whose groups were made with ``new_group`` and
never declared: judged across the world (the contract's default), their points are divergent,
and the evidence names the groups the step's sum-reductions ran in, most used first, and how to
declare them. The case from a held-out program (not written here): 2 x TP=2 over 4 ranks, with a
metrics all_reduce over the data-parallel group."""

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1, 2, 3]


def _replicas(tr, rng, tp_groups, dp_groups):
    tr.groups.update({f"tp{i}": (10 + i, g) for i, g in enumerate(tp_groups)})
    tr.groups.update({f"dp{i}": (20 + i, g) for i, g in enumerate(dp_groups)})
    x = {r: pos(rng, 2, 4) for r in R}  # (each replica's own data)
    parts = {r: x[r] * (1 + R.index(r)) for r in R}
    with tr.call("model", arrays(x)) as outer:
        with tr.call("o_proj", arrays(x)) as c:
            for i, g in enumerate(tp_groups):
                tr.coll("all_reduce", [arrays({r: parts[r] for r in g})],
                        [arrays({r: sum(parts[q] for q in g) for r in g})], group=f"tp{i}")
            c.returns(arrays({r: sum(parts[q] for q in g) for g in tp_groups for r in g}))
        for i, g in enumerate(dp_groups):
            tr.coll("all_reduce", [arrays({r: x[r][:1] for r in g})],
                    [arrays({r: sum(x[q][:1] for q in g) for r in g})], group=f"dp{i}")
        outer.returns(arrays(x))


def test_undeclared_replicas_are_divergent_and_the_evidence_names_their_groups(tmp_path):
    tr = SyntheticTrace(4, root="run")
    with tr.step():
        _replicas(tr, gen(51), tp_groups=[[0, 1], [2, 3]], dp_groups=[[0, 2], [1, 3]])
    p = point(tr.merge(tmp_path), "o_proj:output")
    # each rank's values are its own TP group's all_reduce output (the groups' collectives are
    # matched by their sequence): post-reduction, and divergent across the world
    check(p, "divergent", "post-reduction", "reduction-output")
    said = [i["text"] for i in items(p, "groups")]
    assert said and "groups [0, 1], [2, 3]" in said[0] and "set_tp_group" in said[0], p["evidence"]


def test_one_group_over_the_world_gives_no_such_hint(tmp_path):
    rng = gen(52)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("model", same(pos(rng, 2, 4), [0, 1])) as outer:
            with tr.call("odd", same(pos(rng, 2, 4), [0, 1])) as c:
                c.returns(arrays({0: pos(rng, 2, 4), 1: pos(rng, 2, 4)}))
            outer.returns(same(pos(rng, 2, 4), [0, 1]))
    p = point(tr.merge(tmp_path), "odd:output")
    check(p, "divergent", "unknown", "divergent")
    assert not items(p, "groups"), p["evidence"]
