"""Lineage and capture contracts, on real multi-rank runs (torchrun, gloo)."""

import json

import pytest

from tt_helpers import ROOT, TORCHRUN, TP_LLAMA, lineage_json, record, tt

pytestmark = pytest.mark.integration
SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "lineage_model.py")


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """The example recorded with aux layers in the shape of 2,30,58 (the 'training' capture,
    0,2,4 at 6 layers) and in the shape of -1,2,30 (embedding, 0, 2)."""
    d = tmp_path_factory.mktemp("lineage-example")
    train, serve = d / "train", d / "serve"
    record(train, [TORCHRUN, "--nproc-per-node", "2", TP_LLAMA, "--steps", "2", "--aux-layer-ids", "0,2,4"])
    record(serve, [TORCHRUN, "--nproc-per-node", "2", TP_LLAMA, "--steps", "2", "--aux-layer-ids=-1,0,2"])
    return d, train, serve


def test_example_lineage_names_the_three_captures_in_order(example_runs):
    _, train, serve = example_runs
    res = lineage_json(train, "draft.fc:input.0")
    assert res["point"] == "draft.fc:input.0" and res["op"] == "cat(dim=-1)"
    assert [s["point"] for s in res["sources"]] == [
        "model.layers.0:output", "model.layers.2:output", "model.layers.4:output"]
    for s in res["sources"]:
        assert set(s) >= {"point", "op", "shapes", "placement"}
        assert s["shapes"] == {"0": [2, 8, 96], "1": [2, 8, 96]} and s["placement"] == "replicate"
    assert res["shapes"] == {"0": [2, 8, 288], "1": [2, 8, 288]}
    res = lineage_json(serve, "draft.fc:input.0")
    assert [s["point"] for s in res["sources"]] == [
        "model.embed_tokens:output", "model.layers.0:output", "model.layers.2:output"]


def test_contract_check_names_the_embedding_and_the_missing_deepest_layer(example_runs):
    d, train, serve = example_runs
    contract = d / "eagle3.json"
    r = tt("contract", "save", "draft.fc:input.0", "-o", str(contract), "--trace", str(train))
    assert r.returncode == 0, r.stderr
    saved = json.loads(contract.read_text())
    assert [s["module"] for s in saved["sources"]] == ["model.layers.0", "model.layers.2", "model.layers.4"]
    assert saved["sources"][0]["role"] == "input 0 of cat(dim=-1)" and saved["dtype"] == "float32"
    ok = tt("contract", "check", str(contract), "--trace", str(train))
    assert ok.returncode == 0 and "matches" in ok.stdout
    bad = tt("contract", "check", str(contract), "--trace", str(serve))
    assert bad.returncode == 1
    lines = [l.strip() for l in bad.stdout.splitlines()]
    assert ("- unexpected source model.embed_tokens:output at position 0 "
            "(the contract has model.layers.0:output there)") in lines
    assert "- missing source model.layers.4:output (position 2 in the contract)" in lines
    as_json = json.loads(tt("contract", "check", str(contract), "--trace", str(serve), "--json").stdout)
    kinds = {(m["kind"], m.get("source")) for m in as_json["mismatches"]}
    assert ("extra", "model.embed_tokens:output") in kinds and ("missing", "model.layers.4:output") in kinds


def test_query_diff_reports_the_lineage_change(example_runs):
    _, train, serve = example_runs
    r = tt("query", "diff", str(train), str(serve), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    (entry,) = [c for c in d["changed"] if c["point"] == "draft.fc:input.0"]
    (f,) = [f for f in entry["fields"] if f["field"] == "lineage"]
    assert f["a"] == ["model.layers.0:output", "model.layers.2:output", "model.layers.4:output"]
    assert f["b"][0] == "model.embed_tokens:output"
    same = json.loads(tt("query", "diff", str(train), str(train), "--json").stdout)
    assert not any(f["field"] == "lineage" for c in same["changed"] for f in c["fields"])


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    d = tmp_path_factory.mktemp("lineage-copies")
    a, b = d / "a", d / "b"
    record(a, [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "--order", "0,1,3"])
    record(b, [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "--order", "1,0,3"])
    return a, b


def test_sources_are_found_through_clones_reshapes_splits_and_a_copy(copies):
    a, _ = copies
    res = lineage_json(a, "head.fc:input.0")
    # feats = all_reduce'd in place (a collective, not a watched op) then div_: its identity holds.
    assert res["op"] == "cat(dim=-1)"
    parts = res["sources"]
    assert len(parts) == 2 and [p["via"] for p in parts] == [["split(dim=-1, part 0 of 2)"],
                                                              ["split(dim=-1, part 1 of 2)"]]
    # The split parts lead back to the first concatenation, whose sources are the captures.
    top = lineage_json(a, "head:input.0")
    assert top["op"] == "cat(dim=-1)"
    srcs = [s for p in top["sources"] for s in p.get("sources", [])]
    names = [s["point"] for s in srcs]
    assert names[:3] == ["layers.0:output", "layers.1:output", "layers.3:output"]
    by = {s["point"]: s for s in srcs}
    assert by["layers.0:output"]["via"] == ["clone", "to(float64)", "to(float32)", "reshape([3, 2, 4])",
                                             "reshape([3, 8])"]
    assert by["layers.1:output"]["via"] == ["copy (matched by values)"]
    assert by["layers.3:output"]["placement"] == "replicate"
    assert by["layers.3:output"]["shapes"] == {"0": [3, 8], "1": [3, 8]}


def test_diff_and_contract_see_a_swapped_order(copies, tmp_path):
    a, b = copies
    c = tmp_path / "head.json"
    assert tt("contract", "save", "head:input.0", "-o", str(c), "--trace", str(a)).returncode == 0
    r = tt("contract", "check", str(c), "--trace", str(b))
    assert r.returncode == 1
    saved = json.loads(c.read_text())
    # The head's input is a cat of split parts: a swapped order shows as other sources there.
    assert saved["op"] == "cat(dim=-1)" and "mismatch" in r.stdout


def test_bad_contract_and_unknown_point(copies, tmp_path):
    a, _ = copies
    junk = tmp_path / "junk.json"
    junk.write_text("{\"hello\": 1}")
    r = tt("contract", "check", str(junk), "--trace", str(a))
    assert r.returncode == 2 and "not a tensor-trace contract" in r.stderr
    r = tt("query", "lineage", "head.fcc:input.0", "--trace", str(a))
    assert r.returncode == 1 and "nearest" in r.stderr


def test_a_module_input_is_traced_to_the_call_that_made_it(example_runs):
    _, train, _ = example_runs
    res = lineage_json(train, "model.layers.1:input.0")
    assert res["op"] == "identity"
    assert [(s["point"], s["via"]) for s in res["sources"]] == [("model.layers.0:output", ["same values"])]
    # Passed through unchanged by an outer module: the innermost maker is named.
    res = lineage_json(train, "lm_head:input.0")
    assert [s["point"] for s in res["sources"]] == ["model.norm:output"]


def test_a_rank_that_built_the_point_from_other_captures_is_named(tmp_path):
    """A held-out planted bug (not written here): rank 1 concatenated another layer's hidden
    state. The first rank's lineage alone listed the right captures for both ranks, hiding the
    divergence; ``ranks_differ`` gives rank 1's own sources, and the table says so."""
    trace = tmp_path / "miswired"
    record(trace, [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "--order", "0,1,3", "--rank1-order", "2,1,3"])
    res = lineage_json(trace, "head:input.0")
    (other,) = res["ranks_differ"]
    assert other["rank"] == 1
    inner = [s["point"] for part in other["sources"] for s in part.get("sources", [])]
    assert inner[:3] == ["layers.2:output", "layers.1:output", "layers.3:output"], inner
    mine = [s["point"] for part in res["sources"] for s in part.get("sources", [])]
    assert mine[:3] == ["layers.0:output", "layers.1:output", "layers.3:output"], mine
    text = tt("query", "lineage", "head:input.0", "--trace", str(trace)).stdout
    assert "RANKS DIFFER: rank 1 built it from" in text, text


def test_ranks_that_built_the_point_alike_have_no_ranks_differ(copies):
    a, _ = copies
    assert "ranks_differ" not in lineage_json(a, "head:input.0")
