"""Lineage through module boundaries on real 2-rank runs (torchrun, gloo): a target that
concatenates its captures itself, a packer that writes them into slices of a buffer out of
order (tests/integration/scripts/lineage_boundaries.py)."""

import json

import pytest

from tt_helpers import ROOT, TORCHRUN, lineage_json, record, tt

pytestmark = pytest.mark.integration
SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "lineage_boundaries.py")
LAYERS = ["packer.target.layers.0:output", "packer.target.layers.1:output", "packer.target.layers.3:output"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Slots written in the time order 2,0,1 and 0,1,2 (same layout), and a run with layers 1
    and 0 swapped in the capture list."""
    d = tmp_path_factory.mktemp("lineage-boundaries")
    late, early, swapped = d / "late", d / "early", d / "swapped"
    record(late, [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "--write-order", "2,0,1"])
    record(early, [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "--write-order", "0,1,2"])
    record(swapped, [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "--aux", "1,0,3"])
    return d, late, early, swapped


def test_packed_captures_are_named_in_slice_order_with_their_ops(runs):
    _, late, _, _ = runs
    res = lineage_json(late, "draft.fc:input.0")
    assert res["op"] == "slices(dim=2)" and res["inside"] == ["packer:output.2"]
    assert [s["point"] for s in res["sources"]] == LAYERS
    assert [s["op"] for s in res["sources"]] == [
        "copy_(dim=2, 0:8)", "index_copy_(dim=2, 8:16)", "setitem(dim=2, 16:24)"]
    for s in res["sources"]:
        assert set(s) >= {"point", "op", "shapes", "placement"}
        assert s["shapes"] == {"0": [2, 3, 8], "1": [2, 3, 8]} and s["placement"] == "replicate"
    assert res["shapes"] == {"0": [2, 3, 24], "1": [2, 3, 24]}


def test_a_concatenation_inside_the_target_is_followed(runs):
    _, late, _, _ = runs
    res = lineage_json(late, "draft_cat.fc:input.0")
    assert res["op"] == "cat(dim=-1)" and res["inside"] == ["packer.target:output.1"]
    assert [s["point"] for s in res["sources"]] == LAYERS
    text = tt("query", "lineage", "draft_cat.fc:input.0", "--trace", str(late))
    assert text.returncode == 0 and "(inside packer.target:output.1)" in text.stdout


def test_contract_and_diff_follow_the_place_not_the_time(runs):
    d, late, early, swapped = runs
    contract = d / "draft.json"
    r = tt("contract", "save", "draft.fc:input.0", "-o", str(contract), "--trace", str(late))
    assert r.returncode == 0, r.stderr
    saved = json.loads(contract.read_text())
    assert [s["module"] for s in saved["sources"]] == [p.split(":")[0] for p in LAYERS]
    assert saved["op"] == "slices(dim=2)" and saved["inside"] == ["packer:output.2"]
    ok = tt("contract", "check", str(contract), "--trace", str(early))
    assert ok.returncode == 0 and "matches" in ok.stdout
    bad = tt("contract", "check", str(contract), "--trace", str(swapped))
    assert bad.returncode == 1
    assert "- source packer.target.layers.1:output moved from position 1 to 0" in [
        l.strip() for l in bad.stdout.splitlines()]
    diff = json.loads(tt("query", "diff", str(late), str(swapped), "--json").stdout)
    changed = {c["point"]: c for c in diff["changed"]}
    for point in ("draft.fc:input.0", "draft_cat.fc:input.0"):
        (f,) = [f for f in changed[point]["fields"] if f["field"] == "lineage"]
        assert f["a"] == LAYERS and f["b"] == [LAYERS[1], LAYERS[0], LAYERS[2]]
    same = json.loads(tt("query", "diff", str(late), str(early), "--json").stdout)
    assert not any(f["field"] == "lineage" for c in same["changed"] for f in c["fields"])
