"""Data and tensor parallel on one device mesh: each TP group is judged on its own (its ranks
come from the DTensor parameters' mesh), so replicas fed different batches are not divergent.
The same with groups a program made itself (``dist.new_group``) and declared with
``tensor_trace.tracer.set_tp_group``; undeclared, the world is the TP group and the evidence
says how to declare."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main
from tt_helpers import TORCHRUN, record

SCRIPT = Path(__file__).parent / "scripts" / "tp_2d_mesh.py"


def test_a_dp_by_tp_mesh_is_judged_per_tp_group(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "4", SCRIPT], timeout=240)
    r = CliRunner().invoke(main, ["query", "placement", "*:*", "--trace", str(out), "--json"])
    assert r.exit_code == 0, r.output
    pts = {p["point"]: p for p in json.loads(r.stdout)}
    want = {"mlp.up:input.0": ("replicate", "no-reduction"), "mlp.up:output": ("shard(1)", "no-reduction"),
            "mlp.down:input.0": ("shard(1)", "no-reduction"), "mlp.down:output": ("replicate", "post-reduction"),
            "norm:output": ("replicate", "no-reduction")}
    got = {k: (pts[k]["placement"], pts[k]["reduction"]) for k in want}
    assert got == want, {k: pts[k]["evidence"] for k in want if got[k] != want[k]}
    assert all(len(p["shapes"]) == 2 for p in pts.values())  # two ranks per TP group, not four
    assert pts["mlp.down:output"]["collective"]["group_ranks"] in ([0, 1], [2, 3])


NEW_GROUP = Path(__file__).parent / "scripts" / "tp_dp_new_group.py"
WANT = {"mlp.up:input.0": ("replicate", "no-reduction"), "mlp.up:output": ("shard(1)", "no-reduction"),
        "mlp.down:input.0": ("shard(1)", "no-reduction"), "mlp.down:output": ("replicate", "post-reduction"),
        "norm:output": ("replicate", "no-reduction")}


def _placements(out):
    r = CliRunner().invoke(main, ["query", "placement", "*:*", "--trace", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return {p["point"]: p for p in json.loads(r.stdout)}


@pytest.mark.parametrize("tp_ranks", ["0,1/2,3", "0,2/1,3"])
def test_tp_groups_made_with_new_group_and_declared_are_judged_each_on_its_own(tmp_path, tp_ranks):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "4", NEW_GROUP, "--declare", "--tp-ranks", tp_ranks],
           timeout=240)
    pts = _placements(out)
    got = {k: (pts[k]["placement"], pts[k]["reduction"]) for k in WANT}
    assert got == WANT, {k: pts[k]["evidence"] for k in WANT if got[k] != WANT[k]}
    assert all(len(p["shapes"]) == 2 for p in pts.values())  # two ranks per TP group, not four
    groups = [[int(r) for r in g.split(",")] for g in tp_ranks.split("/")]
    assert pts["mlp.down:output"]["collective"]["group_ranks"] in groups


def test_undeclared_new_group_replicas_are_divergent_and_told_how_to_declare(tmp_path):
    out = tmp_path / "t"
    record(out, [TORCHRUN, "--standalone", "--nproc-per-node", "4", NEW_GROUP], timeout=240)
    p = _placements(out)["mlp.down:output"]
    assert p["placement"] == "divergent", p["evidence"]
    assert any("groups [0, 1], [2, 3]" in e and "set_tp_group" in e for e in p["evidence"]), p["evidence"]
