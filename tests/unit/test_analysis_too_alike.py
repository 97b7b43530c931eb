"""Fingerprints too alike to tell apart: a small model's near-uniform attention probabilities,
computed on each rank from its own heads' scores, sum to the row count exactly and their sums
of squares differ by less than the tolerance, so they read equal on every rank. The case from a
held-out real megatron-core GPTModel (tp 2, layer 1): the probabilities and what followed them
were judged replicate. What a call computes locally from an input of its shape whose values
differ differs too, unless the values are the same bit for bit (a constant)."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, fps, gen, items, point, pos, same

R = [0, 1]
SHAPE = (2, 4, 4)  # [b, s, heads * ... ]: each rank's scores


def _step(tr, rng, probs: dict):
    x = pos(rng, 2, 4, 4)
    W = pos(rng, 8, 4)
    tr.param("q", "weight", arrays({r: W[4 * r:4 * (r + 1)] for r in R}))
    scores = {r: x @ W[4 * r:4 * (r + 1)].T for r in R}
    with tr.call("attn", same(x, R)) as outer:
        with tr.call("q", same(x, R)) as c:
            c.returns(arrays(scores))
        with tr.call("softmax", arrays(scores)) as c:
            c.returns(fps(SHAPE, probs))
        with tr.call("dropout", fps(SHAPE, probs)) as c:
            c.returns(fps(SHAPE, probs))
        outer.returns(same(x, R))


def test_near_uniform_probabilities_from_each_ranks_scores_stay_a_shard(tmp_path):
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _step(tr, gen(31), {0: (8.0, 2.0), 1: (8.0, 2.000005)})  # 2.5e-6 apart: beyond summing noise
    con = tr.merge(tmp_path)
    check(point(con, "q:output"), "shard(2)", "no-reduction", "sharded-weight")
    p = point(con, "softmax:output")
    check(p, "shard(2)", "no-reduction", "derived-from-shard")
    assert any("fingerprints too alike to tell apart" in i["text"] and "softmax:input.0" in i["text"]
               for i in items(p, "values")), p["evidence"]
    q = point(con, "dropout:input.0")
    check(q, "shard(2)", "no-reduction", "same-values")
    assert any("they are the values of softmax:output" in i["text"] for i in items(q, "values")), q["evidence"]
    check(point(con, "dropout:output"), "shard(2)", "no-reduction", "same-values")


def test_values_the_same_bit_for_bit_are_equal(tmp_path):
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _step(tr, gen(32), {0: (8.0, 2.0), 1: (8.0, 2.0)})
    check(point(tr.merge(tmp_path), "softmax:output"), "replicate", "no-reduction", "equal-values")


def test_sums_apart_by_no_more_than_two_ways_of_summing_are_equal(tmp_path):
    """A rank whose compiled fingerprint reader was not loaded yet sums with numpy, another with
    the extension: the same values' sums of squares then differ by about 1e-7 of them (the
    example at tp 3 in CI, whose gathered logits were taken for values that differ)."""
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _step(tr, gen(33), {0: (8.0, 2.0), 1: (8.0, 2.0000002)})
    check(point(tr.merge(tmp_path), "softmax:output"), "replicate", "no-reduction", "equal-values")
