"""Pipeline stages whose modules share names (a held-out PP x TP program with Megatron-style
per-stage layer numbering, not written here: TP groups [0, 1] and [2, 3], stage 1's
``layers.0`` another module than stage 0's). The verdicts of all steps kept one row per point,
voted over both groups: one group's answer stood for both and the other's was lost. Groups that
judge a point differently now get a row each, naming the other; groups that judge it alike
share one row, whose group names each of them."""

from synthetic_trace import SyntheticTrace, arrays, gen, pos, same
from tensor_trace.exporters.store.points import match_points

STAGE0, STAGE1, ALL = [0, 1], [2, 3], [0, 1, 2, 3]


def test_a_name_that_two_tp_groups_judge_differently_has_a_row_per_group(tmp_path):
    rng = gen(17)
    x, y = pos(rng, 2, 4), pos(rng, 2, 4)
    ident = {r: dict(tp_ranks=STAGE0 if r < 2 else STAGE1, tp_size=2) for r in ALL}
    tr = SyntheticTrace(4, identity=ident)
    tr.group("tp", {r: STAGE0 if r < 2 else STAGE1 for r in ALL})
    with tr.step():
        with tr.call("model", arrays({0: x, 1: x, 2: y, 3: y})) as outer:
            # stage 0: the embedding's all_reduce output; stage 1: the hidden state it received
            tr.coll("all_reduce", [arrays({0: x * 0.5, 1: x * 0.5})], [arrays({0: x, 1: x})])
            with tr.call("layers.0", arrays({0: x, 1: x, 2: y, 3: y})) as c:
                c.returns(arrays({0: x * 2 + 1, 1: x * 2 + 1, 2: y * 2 + 1, 3: y * 2 + 1}))
            outer.returns(arrays({0: x * 2 + 1, 1: x * 2 + 1, 2: y * 2 + 1, 3: y * 2 + 1}))
    con = tr.merge(tmp_path)
    rows = {tuple(sorted(p["shapes"])): p for p in match_points(con, "layers.0:input.0")}
    assert set(rows) == {(0, 1), (2, 3)}, rows
    assert rows[(0, 1)]["reduction"] == "post-reduction"
    assert rows[(2, 3)]["reduction"] == "no-reduction"
    assert rows[(2, 3)]["group"]["ranks"] == [[2, 3]]
    assert any("TP group [0, 1] holds another tensor under this name: replicate/post-reduction" in e
               for e in rows[(2, 3)]["evidence"]), rows[(2, 3)]["evidence"]
    # judged alike by both groups, each on its own: one row, whose group names both
    (out,) = match_points(con, "layers.0:output")
    assert out["group"]["ranks"] == [STAGE0, STAGE1] and out["placement"] == "replicate"
    assert sorted(out["shapes"]) == STAGE0


def test_undeclared_stages_say_which_groups_reduced(tmp_path):
    """Undeclared, the TP group is the world: a stage's module is seen on its ranks alone
    (unknown, missing ranks), and that evidence now names the groups the step's sum-reductions
    ran in and how to declare them (it was on one point of the run only)."""
    rng = gen(18)
    x = pos(rng, 2, 4)
    tr = SyntheticTrace(4)
    tr.group("pairs", {r: STAGE0 if r < 2 else STAGE1 for r in ALL})
    with tr.step():
        with tr.call("model", same(x, ALL)) as outer:
            tr.coll("all_reduce", [same(x * 0.5, ALL)], [same(x, ALL)], group="pairs")
            with tr.call("layers.0", same(x, STAGE0)) as c:
                c.returns(same(x * 2 + 1, STAGE0))
            outer.returns(same(x, ALL))
    (p,) = match_points(tr.merge(tmp_path), "layers.0:output")
    assert (p["placement"], p["rule"]) == ("unknown", "missing-ranks"), p
    assert any("declare each with tensor_trace.tracer.set_tp_group" in e for e in p["evidence"]), p["evidence"]
