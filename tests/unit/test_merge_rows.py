"""Rows the merge's loader inserts: values it binds in a cheaper form come out of the store as
the rank files said (exporters/store/loader.py, COLLECTIVE_ROW)."""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, gen, pos, same

R = [0, 1]


def test_collectives_keep_their_nulls_and_values(tmp_path):
    # A reduce op and attrs are bound as 0 when absent (None costs an adapter look-up a value):
    # the store must hold NULL there, and the text where they are present.
    rng = gen()
    xs = {r: pos(rng, 2, 3) for r in R}
    cat = np.concatenate([xs[0], xs[1]], 0)
    total = xs[0] + xs[1]
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("gather", arrays(xs)) as c:
            tr.coll("all_gather_into_tensor", [arrays(xs)], [same(cat, R)], reduce_op=None)
            c.returns(same(cat, R))
        with tr.call("reduce", arrays(xs)) as c:
            tr.coll("all_reduce", [arrays(xs)], [same(total, R)], attrs={"gather_dim": 1})
            c.returns(same(total, R))
    con = tr.merge(tmp_path)
    rows = con.execute("SELECT c.op, c.reduce_op, typeof(c.reduce_op), c.attrs, typeof(c.attrs), "
                       "typeof(c.device_ns), m.path FROM collectives c JOIN modules m USING(module_id) "
                       "ORDER BY c.proc, c.idx").fetchall()
    assert len(rows) == 4
    gathers = [r for r in rows if r[0] == "all_gather_into_tensor"]
    reduces = [r for r in rows if r[0] == "all_reduce"]
    assert gathers and all(r[1:3] == (None, "null") and r[3:6] == (None, "null", "null") and r[6] == "gather"
                           for r in gathers)
    has_attrs = {r[4] for r in reduces} == {"text"}  # the record format of this checkout carries attrs
    assert all(r[1:3] == ("sum", "text") and r[5] == "null" and r[6] == "reduce" for r in reduces)
    if has_attrs:
        assert {r[3] for r in reduces} == {'{"gather_dim": 1}'}
    summary = con.execute("SELECT op, reduce_op, typeof(reduce_op), count FROM collective_summary "
                          "ORDER BY op, proc").fetchall()
    assert summary == [("all_gather_into_tensor", None, "null", 1)] * 2 + [("all_reduce", "sum", "text", 1)] * 2
