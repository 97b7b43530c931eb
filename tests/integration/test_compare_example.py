"""`tensor-trace compare` and `check` on real traced runs of the example (torchrun, gloo, CPU):
TP 1, 2 and 3 agree; the planted bugs (`--bug-double-reduce`, `--bug-aux-before-reduce`) are
named by compare against a clean run and by check on the buggy run alone."""

import json

import pytest

from tt_helpers import SMALL_MODEL, TENSOR_TRACE, run_cmd

STEPS = ["--steps", "2"]
# Five recorded runs in one module fixture: more than the default per-test limit on a busy host.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def runs(example_traces, tmp_path_factory):
    # Recorded once per session (test_merge_query.py's diff reads the same clean TP-2 run).
    d = tmp_path_factory.mktemp("compare")
    return dict(tp1=example_traces.copy(1, d / "tp1", (*SMALL_MODEL, *STEPS)),
                tp2=example_traces.copy(2, d / "tp2", (*SMALL_MODEL, *STEPS)),
                tp3=example_traces.copy(3, d / "tp3", (*SMALL_MODEL, *STEPS)),
                double=example_traces.copy(2, d / "double", (*SMALL_MODEL, *STEPS, "--bug-double-reduce", "1")),
                aux=example_traces.copy(2, d / "aux", (*SMALL_MODEL, *STEPS, "--bug-aux-before-reduce")))


def tt_json(*args, code):
    r = run_cmd([TENSOR_TRACE, *args, "--json"], timeout=240)
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return json.loads(r.stdout)


@pytest.mark.parametrize("a,b", [("tp1", "tp2"), ("tp1", "tp3"), ("tp2", "tp3")])
def test_clean_runs_agree_at_every_tp_size(runs, a, b):
    res = tt_json("compare", runs[a], runs[b], code=0)
    assert res["first_divergence"] is None
    assert res["steps"] == [[0, 0], [1, 1]]
    assert res["points"] and {p["status"] for p in res["points"]} == {"same"}, \
        [p for p in res["points"] if p["status"] != "same"]
    by = {p["point"]: p for p in res["points"]}
    if a != "tp1":
        assert by["model.layers.0.self_attn.qkv_proj:output"]["placement_a"] == "shard(2)"
    assert by["model.layers.0.self_attn.qkv_proj:output"]["placement_b"] == "shard(2)"


def test_clean_runs_have_no_findings(runs):
    for name in ("tp1", "tp2", "tp3"):
        assert tt_json("check", "--trace", runs[name], code=0) == []


def test_double_reduction_is_the_first_divergence_and_a_finding(runs):
    res = tt_json("compare", runs["tp1"], runs["double"], code=1)
    f = res["first_divergence"]
    assert f["point"] == "model.layers.1.self_attn.o_proj:output", f
    assert (f["step_a"], f["step_b"]) == (0, 0)
    assert f["rel_error"] == pytest.approx(0.5, abs=1e-3)  # twice the values: |1 - 2| / 2
    assert any("2 times the values" in e for e in f["evidence"]), f["evidence"]
    by = {p["point"]: p for p in res["points"]}
    assert by["model.layers.1.self_attn.o_proj:input.0"]["status"] == "same"
    assert by["model.layers.0:output"]["status"] == "same"
    found = tt_json("check", "--trace", runs["double"], code=1)
    assert [x["kind"] for x in found] == ["double-reduction"], found
    assert found[0]["point"] == "model.layers.1.self_attn.o_proj:output"
    assert found[0]["collective"]["op"] == "all_reduce" and found[0]["collective"]["seq"] == 4


def test_aux_capture_before_the_reduction(runs):
    res = tt_json("compare", runs["tp2"], runs["aux"], code=1)
    f = res["first_divergence"]
    # The model's aux hidden-state outputs are the first values to differ; everything before,
    # the MLP's partial sums included (compared by their reduced sums), agrees.
    assert f["point"] == "model:output.1.0", f
    by = {p["point"]: p for p in res["points"]}
    assert by["model.layers.0.mlp:output"]["placement_b"] == "partial"
    assert by["model.layers.0.mlp:output"]["status"] == "same"
    assert by["model.norm:output"]["status"] == "same"  # the main path is untouched
    found = tt_json("check", "--trace", runs["aux"], code=1)
    kinds = [x["kind"] for x in found]
    assert kinds == ["pre-reduction-capture", "pre-reduction-capture"], found
    assert [x["point"] for x in found] == ["model:output.1.0", "model:output.1.1"]
    assert all("draft.fc:input.0" in x["detail"] and x["collective"]["op"] == "all_reduce" for x in found)
    assert "model.layers.0.mlp.down_proj:output" in found[0]["evidence"][1]
