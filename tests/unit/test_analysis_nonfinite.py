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


def _masks(tmp_path, per_rank):
    rng = gen(5)
    x = pos(rng, 2, 4, 4)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("mask_builder", same(x > 0.5, R, "bool")) as c:
                c.returns(arrays(per_rank))
            with tr.call("attn", same(x, R), arrays(per_rank)) as c:
                c.returns(same(x, R))
            root.returns(same(x, R))
    return tr.merge(tmp_path)


def test_a_minus_inf_mask_alike_on_every_rank_is_replicate(tmp_path):
    """A mask of -inf built alike on every rank (a held-out program's ``masked_fill(-inf)`` of a
    replicated padding mask, Meta's reference Llama's causal mask): its sums are -inf and +inf
    on every rank; what the tracer recorded of its finite values and of how many -inf it holds
    is the same everywhere: replicate."""
    mask = np.triu(np.full((4, 4), -np.inf), 1)
    con = _masks(tmp_path, {r: mask for r in R})
    for name in ("mask_builder:output", "attn:input.1"):
        p = point(con, name)
        check(p, "replicate", "no-reduction", "equal-values")
        assert any("the same non-finite values (6 -inf)" in i["text"] for i in items(p, "values")), p["evidence"]


def test_minus_inf_masks_that_differ_across_ranks_are_not_replicate(tmp_path):
    """The same count of -inf in other places (the finite values differ), or another count."""
    a = np.triu(np.full((4, 4), -np.inf), 1) + np.arange(16.0).reshape(4, 4)
    b = a.copy()
    b[0, 0], b[0, 1] = -np.inf, 1.0
    c = a.copy()
    c[3, 0] = -np.inf
    for i, other in enumerate((b, c)):
        p = point(_masks(tmp_path / str(i), {0: a, 1: other}), "mask_builder:output")
        assert p["placement"] != "replicate", p
