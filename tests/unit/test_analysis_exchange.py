"""all_to_all: each rank sends a piece of its input to every rank (an expert-parallel layer's
token dispatch). Its output is neither a reduction's nor a gather's: each rank holds the rows
the ranks sent it, a shard along dim 0, no-reduction (the contract keeps pre- and
post-reduction for sums). The case comes from a hand-written EP MoE (not written here)."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, names_collective, point, pos, same

R = [0, 1]


def test_the_output_of_an_all_to_all_is_each_ranks_rows_not_a_reduction(tmp_path):
    rng = gen(7)
    tokens = {r: pos(rng, 4, 3) for r in R}  # rows 2k, 2k+1 of each rank go to rank k
    got = {r: np.concatenate([tokens[s][2 * r:2 * r + 2] for s in R]) for r in R}
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("dispatch", arrays(tokens)) as c:
            tr.coll("all_to_all_single", [arrays(tokens)], [arrays(got)])
            c.returns(arrays(got))
        with tr.call("back", arrays({r: got[r] * 2.0 for r in R})) as c:
            tr.coll("all_to_all_single", [arrays({r: got[r] * 2.0 for r in R})],
                    [arrays({r: 2.0 * tokens[r] for r in R})])
            c.returns(arrays({r: (2.0 * tokens[r]).reshape(2, 2, 3) for r in R}))
        with tr.call("same", same(pos(rng, 3), R)) as c:  # every rank sends the same rows
            whole = pos(rng, 2, 3)
            tr.coll("all_to_all_single", [same(whole, R)], [same(whole, R)])
            c.returns(same(whole, R))
    con = tr.merge(tmp_path)
    p = point(con, "dispatch:output")
    check(p, "shard(0)", "no-reduction", "exchange-output")
    names_collective(p, "all_to_all_single", 0)
    q = point(con, "back:output")  # viewed as [2, 2, 3] after the exchange
    check(q, "shard(0)", "no-reduction", "exchange-output")
    names_collective(q, "all_to_all_single", 1)
    check(point(con, "same:output"), "replicate", "no-reduction", "exchange-output")
