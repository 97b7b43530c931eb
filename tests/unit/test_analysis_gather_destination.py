"""A tensor that only the destination of a ``gather`` holds: its placement across the group is
unknown (the other ranks hold nothing), but it was not reduced. The case from a held-out
vLLM-style program (not written here): the logits processor gathers the vocab shards to rank 0
(``dist.gather``; the other ranks return None) and the model returns them."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1]


def test_logits_gathered_to_rank_0_are_not_reduced(tmp_path):
    rng = gen(41)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        h = pos(rng, 2, 4)
        W = pos(rng, 6, 4)
        parts = {r: h @ W[3 * r:3 * (r + 1)].T for r in R}
        whole = np.concatenate([parts[0], parts[1]], -1)
        with tr.call("model", same(h, R)) as outer:
            with tr.call("lm_head", same(h, R)) as c:
                c.returns(arrays(parts))
            with tr.call("logits_processor", arrays(parts)) as c:
                tr.coll("gather", [arrays(parts)], [arrays({0: parts[0]}), arrays({0: parts[1]})])
                c.returns(arrays({0: whole[:, :5]}))  # the padded vocab trimmed
            outer.returns(arrays({0: whole[:, :5]}))
    con = tr.merge(tmp_path)
    p = point(con, "logits_processor:output")
    check(p, "unknown", "no-reduction", "gather-destination")
    assert any("seen on ranks [0] only" in i["text"] for i in items(p, "missing")), p["evidence"]
    check(point(con, "model:output"), "unknown", "no-reduction", "gather-destination")


def test_a_point_missing_on_a_rank_without_a_gather_stays_unknown(tmp_path):
    rng = gen(42)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        h = pos(rng, 2, 4)
        with tr.call("model", same(h, R)) as outer:
            with tr.call("only_on_0", same(h, R)) as c:
                c.returns(arrays({0: h * 2}))
            outer.returns(same(h, R))
    check(point(tr.merge(tmp_path), "only_on_0:output"), "unknown", "unknown", "missing-ranks")
