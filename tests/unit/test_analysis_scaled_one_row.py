"""Gemma2 (a held-out real SGLang run at tp 2, not written here) scales the embedding's
all_reduce output in place by sqrt(hidden): a common scale, so post-reduction. A decode step's
one row cannot tell that scale from a norm of the row; the prefill steps can, and they decide."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same
from tensor_trace.exporters import query

R = [0, 1]


def _scaled_embedding_step(tr, rng, rows):
    x = pos(rng, rows, 4)
    parts = {0: x * 0.25, 1: x * 0.75}
    with tr.call("model", same(np.arange(rows), R, "int64")) as outer:
        with tr.call("embed", same(np.arange(rows), R, "int64")) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(x, R)])
            c.returns(same(x, R))
        with tr.call("layer", same(x * 8, R)) as c:  # hidden_states *= sqrt(64), in place
            c.returns(same(x * 3, R))
        outer.returns(same(x, R))


def test_a_scaled_reduction_output_is_post_reduction_where_steps_of_more_rows_show_it(tmp_path):
    tr = SyntheticTrace(2, root="run")
    rng = gen(51)
    with tr.step({"forward_mode": "extend"}):
        _scaled_embedding_step(tr, rng, 3)
    for _ in range(2):
        with tr.step({"forward_mode": "decode"}):
            _scaled_embedding_step(tr, rng, 1)
    con = tr.merge(tmp_path)
    p = point(con, "layer:input.0")
    check(p, "replicate", "post-reduction", "reduction-output")
    (one,) = query.placement(con, "layer:input.0", step=1)
    check(one, "replicate", "no-reduction", "equal-values")
    assert any("but of one row, which a norm of that row also is" in t for t in one["evidence"]), one["evidence"]


def test_one_row_steps_alone_do_not_take_a_scale_for_a_reduction_output(tmp_path):
    tr = SyntheticTrace(2, root="run")
    rng = gen(52)
    for _ in range(2):
        with tr.step({"forward_mode": "decode"}):
            _scaled_embedding_step(tr, rng, 1)
    check(point(tr.merge(tmp_path), "layer:input.0"), "replicate", "no-reduction", "equal-values")



def test_a_negated_reduction_output_of_one_row_is_post_reduction(tmp_path):
    """torch's loss_parallel (a held-out DTensor program, not written here): the per-token loss
    of a 1-D target is minus the all_reduce of each rank's masked log-probabilities; a factor of
    -1, as N and 1/N, is none a norm of the row gives but by chance."""
    rng = gen(54)
    logp = -pos(rng, 16)
    parts = {0: np.where(np.arange(16) % 2 == 0, logp, 0).astype(np.float32)}
    parts[1] = (logp - parts[0]).astype(np.float32)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        with tr.call("loss", same(logp, R)) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(logp, R)])
            c.returns(same(-logp, R))
    p = point(tr.merge(tmp_path), "loss:output")
    check(p, "replicate", "post-reduction", "reduction-output")
    assert any("(times -1)" in t for t in p["evidence"]), p["evidence"]


def _multiplied_embedding_step(tr, x):
    parts = {0: x * 0.25, 1: x * 0.75}
    with tr.call("model", same(np.arange(len(x)), R, "int64")) as outer:
        with tr.call("embed", same(np.arange(len(x)), R, "int64")) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(x, R)])
            c.returns(same(x, R))
        with tr.call("layer", same(x * 4, R)) as c:  # an embedding multiplier (granite's 4)
            c.returns(same(x * 3, R))
        outer.returns(same(x, R))


def test_a_scale_whose_sums_are_too_near_zero_to_confirm_does_not_outvote_one_that_is_confirmed(tmp_path):
    """transformers' granite in bf16 (a held-out program, not written here): the embedding
    times 4, whose token sums cancel to about zero in most steps: there the scale cannot be
    confirmed, and those steps no longer outvote the one that confirms it."""
    rng = gen(55)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        _multiplied_embedding_step(tr, pos(rng, 3, 4) + 1.0)  # sums far from zero
    for _ in range(2):
        with tr.step():
            x = pos(rng, 3, 4)
            _multiplied_embedding_step(tr, (x - x.mean()).astype(np.float32))  # sums about zero
    con = tr.merge(tmp_path)
    check(point(con, "layer:input.0"), "replicate", "post-reduction", "reduction-output")
    (one,) = query.placement(con, "layer:input.0", step=1)
    assert any("too near zero to confirm it" in t for t in one["evidence"]), one["evidence"]
