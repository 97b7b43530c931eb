"""`compare` (two runs, any TP sizes) and `check` (one run) on small synthetic traces.

The same computation is written at TP 1 and TP 2 with real arrays (a row-parallel layer's
partial sums are products of slices, its all_reduce their sum), so the fingerprints relate as in
a traced program; planted bugs change the arrays, never the expected answers.
"""

import json
import sqlite3

import numpy as np
import pytest
from click.testing import CliRunner

from synthetic_trace import SyntheticTrace, arrays, gen, pos, same
from tensor_trace.cli import main
from tensor_trace.exporters import pipeline as mg
from tensor_trace.exporters.analysis.check import check
from tensor_trace.exporters.analysis.compare import compare, parse_steps
from tensor_trace.errors import BadInput

R = [0, 1]


def model_step(tr, x, w_col, w_row, tp, double=False, partial_out=False):
    """col (column parallel) -> row (row parallel, all_reduce inside) -> norm; at ``tp`` ranks."""
    ranks = list(range(tp))
    n = w_col.shape[0] // tp
    h = {r: x @ w_col[r * n:(r + 1) * n].T for r in ranks}
    with tr.call("col", same(x, ranks)) as c:
        c.returns(arrays(h))
    parts = {r: h[r] @ w_row[:, r * n:(r + 1) * n].T for r in ranks}
    total = sum(parts.values())
    with tr.call("row", arrays(h)) as c:
        if tp > 1 and not partial_out:
            tr.coll("all_reduce", [arrays(parts)], [same(total, ranks)])
            if double:
                tr.coll("all_reduce", [same(total, ranks)], [same(total * tp, ranks)])
                total = total * tp
            c.returns(same(total, ranks))
        else:
            c.returns(arrays(parts))
    if partial_out and tp > 1:
        tr.coll("all_reduce", [arrays(parts)], [same(total, ranks)])
    y = total / np.sqrt((total * total).mean(-1, keepdims=True) + 1e-6)
    with tr.call("norm", same(total, ranks)) as c:
        c.returns(same(y.astype(np.float32), ranks))


def weights(seed=0):
    rng = gen(seed)
    return pos(rng, 4, 8), rng.normal(size=(12, 8)).astype(np.float32), rng.normal(size=(8, 12)).astype(np.float32)


def run(tmp_path, name, tp, steps=(None, None), **kw):
    x, wc, wr = weights()
    tr = SyntheticTrace(tp)
    n = wc.shape[0] // tp
    tr.param("col", "weight", arrays({r: wc[r * n:(r + 1) * n] for r in range(tp)}))
    tr.param("row", "weight", arrays({r: wr[:, r * n:(r + 1) * n] for r in range(tp)}))
    for attrs in steps:
        with tr.step(attrs):
            model_step(tr, x, wc, wr, tp, **kw)
    d = tmp_path / name
    tr.merge(d)
    return d


def cmp(a, b, *args):
    return compare(mg.open_store(str(a)), mg.open_store(str(b)), *args)


def by_point(res):
    return {p["point"]: p for p in res["points"]}


def test_tp1_and_tp2_agree_through_shards_and_reductions(tmp_path):
    res = cmp(run(tmp_path, "a", 1), run(tmp_path, "b", 2))
    assert res["first_divergence"] is None
    pts = by_point(res)
    assert pts["col:output"]["placement_b"] == "shard(1)" and pts["col:output"]["status"] == "same"
    assert pts["row:output"]["status"] == "same" and pts["norm:output"]["status"] == "same"
    assert all(p["status"] == "same" for p in res["points"]), res["points"]
    assert res["steps"] == [[0, 0], [1, 1]]
    assert "TP 1 against TP 2" in res["tolerance"]["reason"] and res["tolerance"]["order"] == 2


def test_double_reduction_is_the_first_divergence_and_exits_1(tmp_path):
    a, b = run(tmp_path, "a", 1), run(tmp_path, "b", 2, double=True)
    res = cmp(a, b)
    f = res["first_divergence"]
    assert f["point"] == "row:output" and f["step_a"] == 0 and f["step_b"] == 0
    assert f["rel_error"] == pytest.approx(0.5, rel=1e-3)  # norms 1 and 2: |1 - 2| / 2
    assert any("norm of B / norm of A = 2" in e for e in f["evidence"])
    assert any("input(s) agree" in e for e in f["evidence"])
    assert by_point(res)["col:output"]["status"] == "same"
    assert by_point(res)["row:output"]["status"] == "differs"
    r = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert r.exit_code == 1 and "first divergence: row:output" in r.output, r.output
    r = CliRunner().invoke(main, ["compare", str(a), str(b), "col*", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["first_divergence"] is None, r.output


def test_partial_is_compared_by_its_reduced_sum(tmp_path):
    """row:output returned before the reduction (deferred to the caller): per-rank sums add up to
    TP 1's sum; only the sum is compared."""
    res = cmp(run(tmp_path, "a", 1), run(tmp_path, "b", 2, partial_out=True))
    p = by_point(res)["row:output"]
    assert p["placement_b"] == "partial" and p["status"] == "same", p
    assert res["first_divergence"] is None


def test_steps_pair_by_forward_mode_and_tokens(tmp_path):
    ext5 = {"forward_mode": "extend", "tokens": 5, "batch_size": 1}
    dec = {"forward_mode": "decode", "tokens": 1, "batch_size": 1}
    warm = {"forward_mode": "extend", "tokens": 9, "batch_size": 1}
    a = run(tmp_path, "a", 1, steps=(ext5, dec, dec))
    b = run(tmp_path, "b", 2, steps=(warm, ext5, dec, dec))
    res = cmp(a, b)
    assert res["steps"] == [[0, 1], [1, 2], [2, 3]]
    assert res["unpaired"] == {"a": [], "b": [0]}
    res = cmp(a, b, None, ["0:0"])
    assert res["steps"] == [[0, 0]]
    assert "another execution" in res["tolerance"]["reason"] or "TP 1" in res["tolerance"]["reason"]


def test_parse_steps():
    assert parse_steps(["3:7,4:8", "5"]) == [(3, 7), (4, 8), (5, 5)]
    assert parse_steps(["0-2:10"]) == [(0, 10), (1, 11), (2, 12)]
    with pytest.raises(BadInput):
        parse_steps(["a:b"])


def test_a_step_not_in_the_trace_is_bad_usage(tmp_path):
    a = run(tmp_path, "a", 1)
    r = CliRunner().invoke(main, ["compare", str(a), str(a), "--steps", "0:9"])
    assert r.exit_code == 2 and "step 9" in r.output


def test_points_only_in_one_run_and_other_shapes(tmp_path):
    x, wc, wr = weights()
    tr = SyntheticTrace(1)
    with tr.step():
        model_step(tr, x, wc, wr, 1)
        with tr.call("extra", same(x, [0])) as c:
            c.returns(same(x[:2], [0]))
    tr.merge(tmp_path / "a")
    tr = SyntheticTrace(1)
    with tr.step():
        model_step(tr, x, wc, wr, 1)
        with tr.call("extra", same(x, [0])) as c:
            c.returns(same(x[:3], [0]))
        with tr.call("new", same(x, [0])) as c:
            c.returns(same(x, [0]))
    tr.merge(tmp_path / "b")
    res = cmp(tmp_path / "a", tmp_path / "b")
    pts = by_point(res)
    assert pts["new:output"]["status"] == "only in B"
    assert pts["extra:output"]["status"] == "not comparable" and "shapes differ" in pts["extra:output"]["reason"]
    assert res["first_divergence"] is None
    assert res["tolerance"]["order"] == 1


# ------------------------------------------------------------------------------ check
def test_check_names_the_double_reduction(tmp_path):
    con = mg.open_store(str(run(tmp_path, "b", 2, double=True)))
    found = [f for f in check(con) if f["kind"] == "double-reduction"]
    assert len(found) == 1, found
    f = found[0]
    assert f["point"] == "row:output"
    assert f["collective"]["op"] == "all_reduce" and f["collective"]["seq"] == 1
    assert "2 times its input" in f["detail"] and len(f["evidence"]) == 3


def test_check_clean_run_has_no_findings_and_exits_0(tmp_path):
    d = run(tmp_path, "b", 2)
    assert check(mg.open_store(str(d))) == []
    r = CliRunner().invoke(main, ["check", "--trace", str(d)])
    assert r.exit_code == 0 and "no findings" in r.output


def test_check_equal_partials_are_not_a_double_reduction(tmp_path):
    """Identical shards (dummy weights) give equal partial sums: summed once, not a finding."""
    x = pos(gen(1), 4, 8)
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("row", same(x, R)) as c:
            tr.coll("all_reduce", [same(x, R)], [same(2 * x, R)])
            c.returns(same(2 * x, R))
    assert [f for f in check(tr.merge(tmp_path)) if f["kind"] == "double-reduction"] == []


def test_check_divergent_point_and_foreign_group(tmp_path):
    rng = gen(2)
    x = pos(rng, 4, 8)
    tr = SyntheticTrace(4, readable=[0, 1], tp_ranks=[0, 1])
    tr.groups["world"] = (1, [0, 1, 2, 3])
    with tr.step():
        with tr.call("odd", same(x, R)) as c:
            c.returns(arrays({0: x, 1: x * 1.5}))
        parts = {r: pos(rng, 4, 8) for r in R}
        with tr.call("row", same(x, R)) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(parts[0] + parts[1], R)], group="world")
            c.returns(same(parts[0] + parts[1], R))
    con = tr.merge(tmp_path)
    kinds = {f["kind"]: f for f in check(con)}
    assert kinds["divergent"]["point"] == "odd:output"
    f = kinds["foreign-group-reduction"]
    assert f["collective"]["group_ranks"] == [0, 1, 2, 3] and "[0, 1]" in f["detail"]


def test_check_reports_collective_issues(tmp_path):
    d = run(tmp_path, "b", 2)
    mg.open_store(str(d)).close()
    rw = sqlite3.connect(mg.store_path(str(d)))
    rw.execute("INSERT INTO collective_issues VALUES (0, 0, 'skipped', '[1]', 'rank(s) [1] did not issue "
               "collective #0 of group 0 (all_reduce)')")
    rw.commit()
    rw.close()
    found = check(sqlite3.connect(mg.store_path(str(d))))
    assert [f["kind"] for f in found] == ["collective-skipped"]
    assert found[0]["point"] == "row" and found[0]["collective"]["op"] == "all_reduce"


def test_decode_steps_pair_by_sequence_length_and_request_ids(tmp_path):
    def dec(n, rid=None):
        a = {"forward_mode": "decode", "tokens": 1, "batch_size": 1, "seq_lens_sum": n}
        return dict(a, rids=[rid]) if rid else a

    a = run(tmp_path, "a", 1, steps=(dec(6), dec(7)))
    b = run(tmp_path, "b", 2, steps=(dec(6), dec(20), dec(7)))  # another request's step between
    assert cmp(a, b)["steps"] == [[0, 0], [1, 2]]
    # Request ids the client set: the same ids pair, whatever the lengths say.
    a = run(tmp_path, "c", 1, steps=(dec(6, "x"), dec(6, "y")))
    b = run(tmp_path, "d", 2, steps=(dec(6, "y"), dec(6, "x")))
    res = cmp(a, b)
    assert res["steps"] == [[0, 1], [1, 0]]


def test_no_matching_point_or_step_pair_is_no_answer(tmp_path):
    a = run(tmp_path, "a", 1)
    r = CliRunner().invoke(main, ["compare", str(a), str(a), "nothing*"])
    assert r.exit_code == 1 and "no point matches" in r.output
    b = run(tmp_path, "b", 2, steps=({"forward_mode": "decode", "tokens": 1},))
    c = run(tmp_path, "c", 2, steps=({"forward_mode": "extend", "tokens": 4},))
    r = CliRunner().invoke(main, ["compare", str(b), str(c)])
    assert r.exit_code == 1 and "--steps" in r.output
    r = CliRunner().invoke(main, ["compare", str(b), str(c), "--steps", "0:0"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("upstream,status", [("bfloat16", "same"), ("float32", "differs")])
def test_tolerance_follows_the_coarsest_dtype_upstream(tmp_path, upstream, status):
    """float32 logits computed from bfloat16 hidden states differ by bfloat16 rounding between
    runs; from float32 ones, the same difference is a divergence."""
    rng = gen(4)
    x = pos(rng, 4, 8)
    w = rng.normal(size=(6, 8)).astype(np.float32)
    for name, scale in (("a", 1.0), ("b", 1.0 + 2e-3)):
        tr = SyntheticTrace(1)
        with tr.step():
            with tr.call("hidden", same(x, [0])) as c:
                c.returns(same(x, [0], dtype=upstream))
            with tr.call("logits", same(x, [0], dtype=upstream)) as c:
                c.returns(same((x @ w.T) * scale, [0]))
        tr.merge(tmp_path / name)
    res = cmp(tmp_path / "a", tmp_path / "b")
    assert by_point(res)["logits:output"]["status"] == status, res["points"]


def _masked(tmp_path, name, tp, low):
    """A model step handed an additive attention mask: 0, and ``low`` where a position may not
    attend."""
    mask = np.triu(np.full((1, 1, 4, 4), low, dtype=np.float32), 1)
    x = pos(gen(41), 2, 4, 4)
    tr = SyntheticTrace(tp)
    with tr.step():
        with tr.call("layer", same(x, range(tp)), same(mask, range(tp))) as c:
            c.returns(same(x, range(tp)))
    tr.merge(tmp_path / name)
    return tmp_path / name


def test_a_finfo_min_mask_compares_by_its_float64_sums_and_a_minus_inf_one_is_not_comparable(tmp_path):
    """A mask of finfo(float32).min has sums past float32's range, kept in float64: compared
    as any values (another mask differs). A -inf mask has no finite sums: not comparable,
    where the +-inf of both sides read as "same" before (their error was NaN)."""
    low = float(np.finfo(np.float32).min)
    pts = by_point(cmp(_masked(tmp_path, "a", 1, low), _masked(tmp_path, "b", 2, low)))
    assert pts["layer:input.1"]["status"] == "same", pts["layer:input.1"]
    pts = by_point(cmp(_masked(tmp_path, "a", 1, low), _masked(tmp_path, "d", 2, low / 2)))
    assert pts["layer:input.1"]["status"] == "differs", pts["layer:input.1"]
    pts = by_point(cmp(_masked(tmp_path, "e", 1, -np.inf), _masked(tmp_path, "f", 2, -np.inf)))
    p = pts["layer:input.1"]
    assert p["status"] == "not comparable" and "non-finite" in p["reason"], p


def test_a_divergence_on_rank_1_shows_rank_1s_values(tmp_path):
    """A held-out planted bug (rank 1 alone fed another tensor): the detail printed both sides'
    first-rank values, equal, beside an error measured on rank 1."""
    rng = gen(4)
    x = pos(rng, 3, 4)
    dirs = {}
    for name, other in (("a", x), ("b", x * 3)):
        tr = SyntheticTrace(2)
        with tr.step():
            with tr.call("feed", same(x, R)) as c:
                c.returns(arrays({0: x, 1: other}))
        dirs[name] = tmp_path / name
        tr.merge(dirs[name])
    f = cmp(dirs["a"], dirs["b"])["first_divergence"]
    assert f["point"] == "feed:output", f
    want = f"B rank 1: sum {float((x * 3).sum()):.6g}"
    assert want in f["detail"], f["detail"]


def test_a_double_reduction_whose_output_no_point_holds_names_the_issuing_module(tmp_path):
    """A held-out planted bug (a second all_reduce in a row-parallel layer that adds its bias
    after the reductions): no point has the collective's values, and the finding's point was
    null; it is the issuing module's output."""
    x, wc, wr = weights()
    n = wc.shape[0] // 2
    h = {r: x @ wc[r * n:(r + 1) * n].T for r in R}
    parts = {r: h[r] @ wr[:, r * n:(r + 1) * n].T for r in R}
    total = parts[0] + parts[1]
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("row", arrays(h)) as c:
            tr.coll("all_reduce", [arrays(parts)], [same(total, R)])
            tr.coll("all_reduce", [same(total, R)], [same(total * 2, R)])
            c.returns(same(total * 2 + 1.0, R))
    tr.merge(tmp_path / "b")
    found = [f for f in check(mg.open_store(str(tmp_path / "b"))) if f["kind"] == "double-reduction"]
    assert [f["point"] for f in found] == ["row:output"], found


def test_a_send_paired_with_a_recv_is_no_collective_mismatch(tmp_path):
    """Pipeline stages (a held-out PP x TP program, not written here): rank 0 sends the hidden
    state that rank 1 receives, both numbered in the world group's sequence. Matched by group
    and sequence number as a collective, they read as a mismatch ('send ... ; recv ...') and
    check exited 1 on a correct program; point-to-point ops are not matched across the group."""
    rng = gen(8)
    x = pos(rng, 2, 4)
    tr = SyntheticTrace(2)
    with tr.step():
        with tr.call("stage", same(x, R)) as c:
            tr.coll({0: "send", 1: "recv"}, [arrays({0: x})], [arrays({1: x})], reduce_op=None)
            c.returns(same(x, R))
    tr.merge(tmp_path / "pp")
    con = sqlite3.connect(mg.store_path(str(tmp_path / "pp")))
    assert con.execute("SELECT COUNT(*) FROM collectives").fetchone()[0] == 2
    assert [f for f in check(con) if f["kind"].startswith("collective-")] == []
