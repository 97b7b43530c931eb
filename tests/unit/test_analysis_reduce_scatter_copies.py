"""Megatron-Core's MoE all-gather token dispatcher with tensor-parallel experts (a held-out real
megatron-core GPTModel at tp 2, not written here): each TP rank holds the same tokens, the
dispatcher all_gathers them (so every token twice), the experts' partial sums are
reduce_scattered back, and each rank receives the reduced rows of its own copy, the same on
every rank. That is a sum-reduction's output, replicate: post-reduction, not computed locally."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same

R = [0, 1]


def test_a_reduce_scatter_output_the_same_on_every_rank_is_post_reduction(tmp_path):
    rng = gen(71)
    x = pos(rng, 3, 4)
    gathered = np.concatenate([x, x])
    parts = {r: pos(rng, 6, 4) for r in R}  # each rank's experts' partial sums of all 6 rows
    total = parts[0] + parts[1]
    mine = {r: total[3 * r:3 * (r + 1)] for r in R}
    mine[1] = mine[0].copy()  # the rows of each copy reduce to the same values
    total[3:] = total[:3]
    parts[1][3:] = total[3:] - parts[0][3:]
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("mlp", same(x, R)) as c:
            tr.coll("all_gather_into_tensor", [same(x, R)], [same(gathered, R)])
            tr.coll("reduce_scatter_tensor", [arrays(parts)], [arrays(mine)])
            c.returns(arrays(mine))
    p = point(tr.merge(tmp_path), "mlp:output")
    check(p, "replicate", "post-reduction", "reduce-scatter-output")
