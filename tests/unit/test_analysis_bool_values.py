"""Equal values of a dtype that is not floating point are whole at once; the evidence says
what they are: a bool tensor is a mask or flags, not ids or positions."""

import numpy as np

from synthetic_trace import SyntheticTrace, check, gen, point, pos, same

R = [0, 1]


def test_a_boolean_mask_is_said_to_be_one(tmp_path):
    """Equal non-float values are whole; a bool tensor's evidence names masks, not ids."""
    rng = gen(7)
    tr = SyntheticTrace(2, root="run")
    with tr.step():
        x = pos(rng, 2, 6, 4)
        with tr.call("layer", same(x, R), same(np.tril(np.ones((6, 6))), R, "bool"), same(np.arange(6), R, "int64")) as c:
            c.returns(same(x, R))
    con = tr.merge(tmp_path)
    p, q = point(con, "layer:input.1"), point(con, "layer:input.2")
    check(p, "replicate", "no-reduction", "equal-values")
    check(q, "replicate", "no-reduction", "equal-values")
    assert "boolean values (masks, flags) equal on every rank" in p["evidence"], p["evidence"]
    assert "integer values (ids, positions, lengths) equal on every rank" in q["evidence"], q["evidence"]
