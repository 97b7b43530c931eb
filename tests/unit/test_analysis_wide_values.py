"""Fingerprints past float32's range (WIDE_FINGERPRINTS): an attention mask of
``torch.finfo(float32).min`` that every rank builds alike is whole; values that large that
differ across ranks are uninitialised memory, which says nothing (as their +-inf float32 sums
said before), not ranks that disagree."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, point, pos, same

R = [0, 1]
LOW = float(np.finfo(np.float32).min)


def test_a_finfo_min_mask_the_same_on_every_rank_is_replicated(tmp_path):
    rng = gen(5)
    mask = np.triu(np.full((1, 1, 6, 6), LOW, dtype=np.float32), 1)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        x = pos(rng, 2, 6, 4)
        with tr.call("layer", same(x, R), same(mask, R)) as c:
            c.returns(same(x, R))
    p = point(tr.merge(tmp_path), "layer:input.1")
    check(p, "replicate", "no-reduction", "equal-values")
    assert any("values equal on every rank" in i["text"] for i in items(p, "values")), p["evidence"]


def test_huge_values_that_differ_across_ranks_say_nothing(tmp_path):
    rng = gen(6)
    junk = {r: pos(rng, 3, 4).astype(np.float32) * np.float32(3e30) for r in R}
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("buffer", same(pos(rng, 3, 4), R)) as c:
            c.returns(arrays(junk))
    p = point(tr.merge(tmp_path), "buffer:output")
    check(p, "unknown", "unknown", "non-finite-values")

