"""Data and tensor parallel on one device mesh: each TP group is judged on its own (its ranks
come from the DTensor parameters' mesh), so replicas fed different batches are not divergent."""

import json
from pathlib import Path

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
