"""A collective of a group per rank of the judged TP group (a held-out DP x TP program, not
written here: TP groups [0, 1], [2, 3] declared, a metric all_reduce(sum) over the DP groups
[0, 2] and [1, 3], then halved): each TP rank issues its own group's collective, so they were
never matched across the TP group, and the metric read "computed locally". Matched by their
sequence, the metric is that reduction's output (times 0.5): post-reduction."""

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos

TP = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}


def test_a_metric_reduced_over_the_data_parallel_groups_is_post_reduction(tmp_path):
    rng = gen(61)
    a, b = pos(rng, 3), pos(rng, 3)  # each TP group's metric (other data)
    tr = SyntheticTrace(4, identity={r: dict(tp_ranks=TP[r], tp_size=2) for r in TP})
    tr.group("dp", {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]})
    per_group = arrays({0: a, 1: a, 2: b, 3: b})
    with tr.step():
        with tr.call("metrics", per_group) as c:
            tr.coll("all_reduce", [per_group], [arrays({r: a + b for r in TP})], group="dp")
            c.returns(arrays({r: (a + b) * 0.5 for r in TP}))
    p = point(tr.merge(tmp_path), "metrics:output")
    check(p, "replicate", "post-reduction", "reduction-output")
    assert any("of groups [0, 2], [1, 3] (each rank's own, alike)" in t and "times 0.5" in t for t in p["evidence"]), p
