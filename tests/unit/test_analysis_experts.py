"""Mixture-of-experts verdicts (exporters/analysis/experts.py) on small synthetic traces shaped
as SGLang's FusedMoE runs on CPU: a router, an experts layer whose per-expert activations run
as ``SiluAndMul`` calls inside it, a shared expert whose ``down_proj`` does not reduce, the two
partial sums added together and all-reduced at the layer boundary.

Values are real products: under tensor parallel each rank holds a slice of every expert's
intermediate dimension (w13 rows, w2 columns), under expert parallel whole experts of its own.
"""

import numpy as np

from synthetic_trace import SyntheticTrace, arrays, check, gen, items, names_param, point, pos, same

R = [0, 1]
H, I, E = 4, 6, 4  # hidden, full expert intermediate, experts


def _silu_mul(gu):
    g, u = np.split(gu, 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


def _moe_layer(tr, rng, *, ep: bool):
    """One MoE block: gate, experts (with per-expert SiluAndMul calls), shared expert
    down_proj, and the layer boundary's all_reduce of their sum."""
    x = pos(rng, 3, H)
    w13 = pos(rng, E, 2 * I, H)
    w2 = pos(rng, E, H, I)
    ws = pos(rng, H, I)
    if ep:  # rank r holds experts 2r, 2r+1 whole
        local = {r: list(range(2 * r, 2 * r + 2)) for r in R}
        w13_r = {r: w13[local[r]] for r in R}
        w2_r = {r: w2[local[r]] for r in R}
        attrs = {"sglang_class": "FusedMoE", "moe_tp_size": 1, "moe_ep_size": 2, "num_experts": E,
                 "num_local_experts": 2, "intermediate_size_per_partition": I, "reduce_results": False}
    else:  # rank r holds half of every expert's intermediate dimension
        half = I // 2
        sl = {r: slice(r * half, (r + 1) * half) for r in R}
        w13_r = {r: np.concatenate([w13[:, :I][:, sl[r]], w13[:, I:][:, sl[r]]], axis=1) for r in R}
        w2_r = {r: w2[:, :, sl[r]] for r in R}
        attrs = {"sglang_class": "FusedMoE", "moe_tp_size": 2, "moe_ep_size": 1, "num_experts": E,
                 "num_local_experts": E, "intermediate_size_per_partition": half, "reduce_results": False}
    tr.layer("mlp.experts", attrs)
    tr.layer("mlp.shared.down_proj", {"sglang_class": "RowParallelLinear", "reduce_results": False})
    tr.param("mlp.experts", "w13_weight", arrays(w13_r))
    tr.param("mlp.experts", "w2_weight", arrays(w2_r))
    tr.param("mlp.shared.down_proj", "weight", arrays({r: ws[:, 3 * r:3 * r + 3] for r in R}))
    # every token goes to expert 0 and 3: under EP rank 0 runs expert 0, rank 1 expert 3, and
    # rank 1 also expert 2 for the first token only (its own extra call)
    routes = {0: [[0, 1, 2]], 1: [[0, 1, 2], [0]]} if ep else {r: [[0, 1, 2], [0, 1, 2]] for r in R}
    experts_of = {0: [0], 1: [3, 2]} if ep else {r: [0, 3] for r in R}
    routed = {r: np.zeros((3, H)) for r in R}
    calls = []
    for k in range(max(len(v) for v in routes.values())):
        per = {}
        for r in R:
            if k < len(routes[r]):
                e = experts_of[r][k] - (2 * r if ep else 0)
                toks = routes[r][k]
                gu = x[toks] @ w13_r[r][e].T
                act = _silu_mul(gu)
                routed[r][toks] += act @ w2_r[r][e].T
                per[r] = (gu, act)
        calls.append(per)
    shared_in = {r: pos(gen(10 + r), 3, 3) for r in R}  # the shared expert's act_fn output
    shared = {r: shared_in[r] @ ws[:, 3 * r:3 * r + 3].T for r in R}
    with tr.call("mlp.gate", same(x, R)) as c:
        c.returns(same(x @ pos(gen(7), E, H).T, R))
    with tr.call("mlp.shared.down_proj", arrays(shared_in)) as c:
        c.returns(arrays(shared))
    with tr.call("mlp.experts", same(x, R)) as c:
        for per in calls:
            ranks = sorted(per)
            if ranks == R:
                with tr.call("mlp.experts.SiluAndMul", arrays({r: per[r][0] for r in R})) as a:
                    a.returns(arrays({r: per[r][1] for r in R}))
        c.returns(arrays(routed))
    total = {r: shared[r] + routed[r] for r in R}
    tr.coll("all_reduce", [arrays(total)], [same(total[0] + total[1], R)])
    return routed, shared


def test_tensor_parallel_experts_output_is_partial_and_their_intermediate_a_shard(tmp_path):
    tr = SyntheticTrace(2)
    with tr.step():
        _moe_layer(tr, gen(), ep=False)
    con = tr.merge(tmp_path)
    check(point(con, "mlp.gate:output"), "replicate", "no-reduction", "equal-values")
    # Not the all_reduce's input (the shared expert's output is added in first), and its
    # weights alone would call it a slice: the layer class tells the composite product.
    p = point(con, "mlp.experts:output")
    check(p, "partial", "pre-reduction", "declared-partial")
    names_param(p, "mlp.experts.w13_weight")
    assert p["layer_semantics"]["agrees"] is True
    for k in (0, 1):
        for slot in ("input.0", "output"):
            q = point(con, f"mlp.experts.SiluAndMul#{k}:{slot}")
            check(q, "shard(1)", "no-reduction", "expert-tp-slice")
            assert any("intermediate" in i["text"] for i in items(q, "semantics")), q["evidence"]
    p = point(con, "mlp.shared.down_proj:output")
    assert (p["placement"], p["reduction"]) == ("partial", "pre-reduction"), p["evidence"]


def test_expert_parallel_inside_the_experts_is_local_not_divergent(tmp_path):
    tr = SyntheticTrace(2)
    with tr.step():
        _moe_layer(tr, gen(), ep=True)
    con = tr.merge(tmp_path)
    check(point(con, "mlp.experts:output"), "partial", "pre-reduction", "declared-partial")
    # Call 0: a different expert on each rank, on as many tokens (shapes equal, values differ).
    for slot in ("input.0", "output"):
        q = point(con, f"mlp.experts.SiluAndMul:{slot}")
        check(q, "local", "no-reduction", "expert-parallel-local")
        assert any("not comparable" in i["text"] for i in items(q, "semantics")), q["evidence"]


def test_a_dense_layer_with_the_same_shapes_is_not_judged_as_experts(tmp_path):
    """Without a FusedMoE declaration the same values stay with the general rules: a
    replicated input and a weight split across ranks make a slice, and an unexplained
    difference inside a call is divergent."""
    tr = SyntheticTrace(2)
    rng = gen()
    x, W = pos(rng, 3, H), pos(rng, 6, H)
    tr.param("mlp.experts", "w13_weight", arrays({r: W[3 * r:3 * r + 3] for r in R}))
    with tr.step():
        with tr.call("mlp.experts", same(x, R)) as c:
            with tr.call("mlp.experts.SiluAndMul", arrays({r: pos(gen(20 + r), 2, 6) for r in R})) as a:
                a.returns(arrays({r: pos(gen(30 + r), 2, 3) for r in R}))
            c.returns(arrays({r: x @ W[3 * r:3 * r + 3].T for r in R}))
    con = tr.merge(tmp_path)
    check(point(con, "mlp.experts:output"), "shard(1)", "no-reduction", "sharded-weight")
    assert point(con, "mlp.experts.SiluAndMul:output")["placement"] == "divergent"
