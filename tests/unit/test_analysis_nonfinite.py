"""Non-finite values say nothing through their sums, but what built the tensor still places it.
The case from a hand-written Megatron-style program (not written here): a vocab-parallel head
tied to a padded embedding masks its padded vocab columns with -inf, so the last rank's logits
have an infinite sum, and the program gathers the logits and returns the local ones too."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1]


def _padded_head(tr, rng):
    x = pos(rng, 2, 3, 4)
    W = pos(rng, 8, 4)  # vocab 6 padded to 8: rank 1's last two rows are padding
    tr.param("lm_head", "weight", arrays({r: W[4 * r:4 * (r + 1)] for r in R}))
    local = {r: x @ W[4 * r:4 * (r + 1)].T for r in R}
    local[1][..., 2:] = -np.inf
    with tr.call("model", same(x, R)) as outer:
        with tr.call("lm_head", same(x, R)) as c:
            c.returns(arrays(local))
        whole = np.concatenate([local[0], local[1]], -1)
        tr.coll("all_gather_into_tensor", [arrays(local)], [same(whole, R)])
        outer.returns(same(whole[..., :6], R), arrays(local))


def test_a_sharded_head_with_infinite_padding_columns_is_placed_by_its_weight(tmp_path):
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _padded_head(tr, gen(3))
    con = tr.merge(tmp_path)
    p = point(con, "lm_head:output")
    check(p, "shard(2)", "no-reduction", "sharded-weight")
    assert any("non-finite values (NaN or inf) on ranks [1]" in i["text"] for i in items(p, "values")), p["evidence"]
    q = point(con, "model:output.1")
    check(q, "shard(2)", "no-reduction", "same-values")
    assert any("lm_head:output where they are finite" in i["text"] for i in items(q, "dataflow")), q["evidence"]
    check(point(con, "model:output.0"), "replicate", "no-reduction", "equal-values")


def test_non_finite_values_that_nothing_built_stay_unknown(tmp_path):
    """A module without weights whose input is no shard: no structure places -inf values."""
    rng = gen(4)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        ys = {r: pos(rng, 3, 4) for r in R}
        ys[0][0, 0] = np.inf
        with tr.call("buffer", same(pos(rng, 3, 4), R)) as c:
            c.returns(arrays(ys))
    p = point(tr.merge(tmp_path), "buffer:output")
    check(p, "unknown", "unknown", "non-finite-values")
