"""One rank's stale norm weight (a held-out planted bug, not written here: rank 1's layer-1 RMSNorm
weight times 1.5 in a Megatron-style TP Llama and in a PyTorch TP API plan): a weight of one dim
as long as its input's whole last dim applies element by element, so weights that differ across
ranks are no slices of a larger one. The norm's output was judged shard(2) ("each rank holds a
slice") and `check` said nothing; it is divergent, and check finds it."""

import json

from click.testing import CliRunner

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same
from tensor_trace.cli import main as cli_main

R = [0, 1]


def _trace(tmp_path, scale, input_placement="replicate"):
    rng = gen(12)
    x = pos(rng, 2, 6, 8)
    w = pos(rng, 8)
    ws = {0: w, 1: w * scale}
    tr = SyntheticTrace(2, root="run")
    tr.param("norm", "weight", arrays(ws))
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            xs = same(x, R) if input_placement == "replicate" else arrays({r: x + r for r in R})
            with tr.call("norm", xs) as c:
                c.returns(arrays({r: x * ws[r] for r in R}))
            root.returns(same(x, R))
    return tr.merge(tmp_path), tmp_path


def test_a_norm_weight_that_differs_on_one_rank_makes_its_output_divergent(tmp_path):
    con, trace = _trace(tmp_path, 1.5)
    p = point(con, "norm:output")
    check(p, "divergent", "unknown", "divergent-weight")
    assert any("no slice of a larger weight" in e for e in p["evidence"]), p["evidence"]
    r = CliRunner().invoke(cli_main, ["check", "--trace", str(trace)])
    assert r.exit_code == 1 and "norm:output" in r.output, r.output


def test_an_input_not_known_whole_along_its_last_dim_leaves_the_weight_a_possible_slice(tmp_path):
    """An input whose values differ with no shard found (its last dim may be each rank's
    slice, as a column-parallel output's is) times a weight of that length that differs across
    ranks: the weight can be each rank's slice; not called a divergent weight."""
    con, _ = _trace(tmp_path, 1.5, input_placement="shard")
    p = point(con, "norm:output")
    assert p["rule"] != "divergent-weight", p


def _replicated(tmp_path, scale):
    rng = gen(13)
    x = pos(rng, 2, 3, 8)
    w = pos(rng, 8)
    meta = {"kind": "DTensor", "placements": ["Replicate()"], "mesh_dim_names": ["tp"], "mesh_shape": [2],
            "mesh_ranks": [0, 1], "global_shape": [8]}
    tr = SyntheticTrace(2, root="run")
    tr.param("norm", "weight", arrays({0: w, 1: w * scale}), meta)
    with tr.step():
        with tr.call("run", arrays({r: x + r for r in R})) as root:
            with tr.call("norm", arrays({r: x + r for r in R})) as c:
                c.returns(arrays({r: (x + r) * w for r in R}))
            root.returns(arrays({r: x + r for r in R}))
    tr.merge(tmp_path)
    return CliRunner().invoke(cli_main, ["check", "--trace", str(tmp_path), "--json"])


def test_a_replicate_dtensor_weight_that_differs_on_a_rank_is_a_finding(tmp_path):
    """Under sequence parallelism (a held-out PyTorch TP plan with a planted bug: rank 1's
    layer-1 norm weight x1.5) the norm's output is a shard of the sequence either way, and
    check said nothing; the weight, a DTensor declared Replicate(), tells."""
    r = _replicated(tmp_path, 1.5)
    found = [f for f in json.loads(r.output) if f["kind"] == "divergent-parameter"]
    assert r.exit_code == 1 and [f["point"] for f in found] == ["norm.weight"], r.output
    assert "differ on rank(s) [1]" in found[0]["detail"]


def test_a_replicate_dtensor_weight_equal_everywhere_is_no_finding(tmp_path):
    r = _replicated(tmp_path, 1.0)
    assert not [f for f in json.loads(r.output) if f["kind"] == "divergent-parameter"], r.output
