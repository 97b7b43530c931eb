"""Expert parallel declared by DTensor weights rather than by a framework's layer class: the
case from held-out transformers programs (not written here; Qwen3-MoE and GLM-4-MoE under
``DistributedConfig(enable_expert_parallel=True)``). The experts' grouped weights ([experts,
in, out]) are DTensors ``Shard(0)``: each rank holds whole experts of its own. The router's
post-forward hook zeroes the other ranks' experts' scores and renumbers the ids locally, so the
routing the experts take, and the activation inside them, differ across ranks by design:
``local``, not ``divergent``, and no ``check`` finding."""

import json

import numpy as np
from click.testing import CliRunner

from synthetic_trace import SyntheticTrace, arrays, check, gen, point, pos, same
from tensor_trace.cli import main as cli_main

R = [0, 1]


def _meta(shape, global_shape, placement="Shard(0)"):
    return {"kind": "DTensor", "placements": [placement], "mesh_dim_names": ["tp"], "mesh_shape": [2],
            "mesh_ranks": [0, 1], "global_shape": list(global_shape)}


def _ep_block(tmp_path, placement="Shard(0)"):
    rng = gen(81)
    x = pos(rng, 4, 6)
    w = pos(rng, 4, 6, 8)  # 4 experts
    tr = SyntheticTrace(2, root="run")
    split = placement == "Shard(0)"
    tr.param("mlp.experts", "gate_up_proj", arrays({r: w[2 * r:2 * r + 2] if split else w for r in R}),
             _meta((2, 6, 8), (4, 6, 8), placement))
    # the local ids (2: another rank's expert) and the scores zeroed where the expert is not local
    ids = {0: np.array([[0, 1], [2, 2], [1, 2], [0, 2]]), 1: np.array([[2, 2], [0, 1], [2, 0], [2, 2]])}
    scores = {r: np.where(ids[r] < 2, pos(rng, 4, 2), 0.0) for r in R}
    acts = {r: pos(rng, 5, 8) for r in R}
    out = pos(rng, 4, 6)
    with tr.step():
        with tr.call("run", same(x, R)) as root:
            with tr.call("mlp.gate", same(x, R)) as c:
                c.returns(same(pos(rng, 4, 4), R), arrays(scores), arrays(ids, "int64"))
            with tr.call("mlp.experts", same(x, R), arrays(ids, "int64"), arrays(scores)) as c:
                with tr.call("mlp.experts.act_fn", arrays(acts)) as a:
                    a.returns(arrays({r: acts[r] * 2 for r in R}))
                tr.coll("all_reduce", [arrays({0: out * 0.25, 1: out * 0.75})], [same(out, R)])
                c.returns(same(out, R))
            root.returns(same(out, R))
    return tr.merge(tmp_path)


def test_routing_and_activations_of_dtensor_expert_parallel_are_local(tmp_path):
    con = _ep_block(tmp_path)
    for name in ("mlp.gate:output.1", "mlp.gate:output.2"):
        check(point(con, name), "local", "no-reduction", "expert-parallel-routing")
    for name in ("mlp.experts:input.1", "mlp.experts:input.2"):  # (the router's very values: theirs)
        p = point(con, name)
        assert (p["placement"], p["reduction"]) == ("local", "no-reduction"), p["evidence"]
    check(point(con, "mlp.experts.act_fn:output"), "local", "no-reduction", "expert-parallel-local")
    check(point(con, "mlp.gate:output.0"), "replicate", "no-reduction", "equal-values")
    r = CliRunner().invoke(cli_main, ["check", "--trace", str(tmp_path), "--json"])
    assert not [f for f in json.loads(r.output) if f["kind"] == "divergent"], r.output


def test_expert_weights_split_along_another_dim_are_not_expert_parallel(tmp_path):
    """Tensor-parallel experts (each rank a slice of every expert): the routing is the same on
    every rank there, so routing that differs is no design of the layer: divergent."""
    con = _ep_block(tmp_path, placement="Shard(2)")
    assert point(con, "mlp.gate:output.2")["placement"] == "divergent"
    assert point(con, "mlp.experts.act_fn:output")["placement"] != "local"
