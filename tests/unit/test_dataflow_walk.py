"""The lineage walk (exporters/analysis/dataflow.py) from a module's input back through recorded
ops to a parameter's declared split: transformers' grouped experts, as the tracer records them
(node ids, refs and attrs as in a store), judged by lineage_ops."""

from types import SimpleNamespace

from tensor_trace.exporters.analysis import dataflow
from tensor_trace.exporters.analysis.evidence import Verdict
from tensor_trace.exporters.analysis.rules_dataflow import lineage_ops

EXPERTS = "model.layers.0.mlp.experts"
STRIDED = {"kind": "DTensor", "placements": ["_StridedShard(dim=1, sf=2)"], "mesh_dim_names": ["tp"],
           "mesh_shape": [2], "mesh_ranks": [0, 1]}
# act_fn:input.0 = chunk(grouped_mm(x[perm], gate_up_proj.view_as().transpose(-2, -1)), 2, -1)[0]
NODES = {
    0: ("getitem", {"dims": [0, 1], "part": [0]}, [[0, 0, 3, 0]]),  # the experts' input, rows picked
    1: ("view", {"shape": [4, 64, 48]}, [[4, EXPERTS, "gate_up_proj"]]),  # to_local()'s view
    2: ("transpose", {"dims": [0, 2, 1]}, [[1, 0, 1]]),
    3: ("grouped_mm", {"ndims": [2, 3]}, [[1, 0, 0], [1, 0, 2]]),
    4: ("chunk", {"dim": -1, "index": 0, "of": 2}, [[1, 0, 3]]),
}
HIDDEN = (EXPERTS, 0, "input.0")
ACT_IN = (EXPERTS + ".act_fn", 0, "input.0")


def _judge(hidden_placement="replicate", meta=STRIDED, nodes=NODES):
    obs = {HIDDEN: {0: SimpleNamespace(shape=(20, 48))}, ACT_IN: {0: SimpleNamespace(shape=(40, 32))}}
    view = SimpleNamespace(step=0, procs=[0, 1], points=obs, slot_key={(0, 3, 0): HIDDEN},
                           times={ACT_IN: (10, 5, 0)}, lineage=lambda: (nodes, {(5, 0): [1, 0, 4]}),
                           node_points=lambda: {4: [ACT_IN]})  # (the point judged: not its own evidence)
    per_rank = [[("gate_up_proj", (4, 64, 48), (1.0 + r, 2.0), meta), ("down_proj", (4, 48, 32), (1.0, 2.0), None)]
                for r in (0, 1)]  # each rank's own slice: different values
    return SimpleNamespace(v=view, done={HIDDEN: Verdict(hidden_placement, "no-reduction", "r", [])},
                           name=lambda k: f"{k[0]}:{k[2]}", module_params=lambda m, procs: per_rank)


def _pt(equal=False):
    return SimpleNamespace(key=ACT_IN, procs=[0, 1], ndim=2, items=[], equal=equal)


def test_the_experts_act_fn_input_is_the_shard_of_the_packed_weight():
    placement, ops, block, read, *_ = dataflow.placement_from_lineage(_judge(), _pt())
    assert placement == "shard(1)" and not read
    assert ops.startswith("chunk, grouped_mm([...], from model.layers.0.mlp.experts:input.0 (replicate); ")
    assert "gate_up_proj (shard(1): a DTensor _StridedShard(dim=1, sf=2))" in ops
    verdict = lineage_ops(_judge(), _pt())
    assert (verdict.placement, verdict.reduction, verdict.rule) == ("shard(1)", "no-reduction", "lineage-ops")


def test_no_answer_without_a_declared_split_or_from_a_sharded_input():
    assert dataflow.placement_from_lineage(_judge(meta=None), _pt()) is None  # plain weight, unequal values
    assert dataflow.placement_from_lineage(_judge(hidden_placement="shard(1)"), _pt()) is None


def test_ops_that_say_replicate_do_not_decide_values_that_differ():
    # x[perm] @ W with a replicated W: replicate by the ops, but the point's values differ
    replicated = dict(STRIDED, placements=["Replicate()"])
    assert dataflow.placement_from_lineage(_judge(meta=replicated), _pt())[0] == "replicate"
    assert lineage_ops(_judge(meta=replicated), _pt(equal=False)) is None


# A sequence-parallel layer under a DTensor plan: h = x + attention(...), out = h + ffn(...).
# x is the layer's input sliced by PrepareModuleInput (Replicate -> Shard(1)), a redistribution
# no recorded op shows: the walk finds the whole embedding output as h's first addend. h itself
# is the point ffn_norm:input.0, judged shard(1) from its values earlier in the step.
EMB, ATTN, NORM_IN, FFN, OUT = (("emb", 0, "output"), ("layer.attn", 0, "output"), ("layer.ffn_norm", 0, "input.0"),
                                ("layer.ffn", 0, "output"), ("layer", 0, "output"))
RESIDUAL_NODES = {
    0: ("add", {}, [[0, 0, 1, 0], [0, 0, 2, 0]], None),  # h = x + attn(...)
    1: ("add", {}, [[1, 0, 0], [0, 0, 4, 0]], None),  # out = h + ffn(...)
}


def _residual_judge(norm_in_placement="shard(1)"):
    shapes = {EMB: (2, 8, 32), ATTN: (2, 4, 32), NORM_IN: (2, 4, 32), FFN: (2, 4, 32), OUT: (2, 4, 32)}
    obs = {k: {0: SimpleNamespace(shape=s)} for k, s in shapes.items()}
    view = SimpleNamespace(step=0, procs=[0, 1], points=obs,
                           slot_key={(0, 1, 0): EMB, (0, 2, 0): ATTN, (0, 3, 0): NORM_IN, (0, 4, 0): FFN},
                           times={OUT: (50, 5, 1), NORM_IN: (20, 3, 0)},
                           lineage=lambda: (RESIDUAL_NODES, {(5, 1): [1, 0, 1], (3, 0): [1, 0, 0]}),
                           node_points=lambda: {0: [NORM_IN], 1: [OUT]})
    done = {EMB: Verdict("replicate", "post-reduction", "r", []), ATTN: Verdict("shard(1)", "post-reduction", "r", []),
            NORM_IN: Verdict(norm_in_placement, "no-reduction", "r", []), FFN: Verdict("shard(1)", "post-reduction", "r", [])}
    return SimpleNamespace(v=view, done=done, name=lambda k: f"{k[0]}:{k[2]}", module_params=lambda m, procs: None)


def test_an_intermediate_tensor_seen_at_a_judged_point_takes_that_points_verdict():
    pt = SimpleNamespace(key=OUT, procs=[0, 1], ndim=3, items=[], equal=False)
    placement, ops, *_ = dataflow.placement_from_lineage(_residual_judge(), pt)
    assert placement == "shard(1)"
    assert "as layer.ffn_norm:input.0 (shard(1))" in ops, ops
    # without a verdict there, the walk goes through the add and its hidden slice: no answer
    assert dataflow.placement_from_lineage(_residual_judge("unknown"), pt) is None


# Megatron-Core's DotProductAttention, as the tracer recorded it (real megatron-core 0.16.1, tp 2):
# q, k [sq, b, np, hn] reshaped to [sq, b * np, hn] (each rank's heads interleaved with the batch),
# transposed, torch.baddbmm(buffer, q, k^T, beta=0) and viewed as the scores [b, np, sq, sk].
Q, K = ("attn.core", 0, "input.0"), ("attn.core", 0, "input.1")
SCORES = ("attn.core.softmax", 0, "input.0")
CORE_NODES = {
    8: ("reshape", {"shape": [8, 4, 16], "asked": [8, 4, -1]}, [[0, 0, 3, 0]], [8, 4, 16]),
    9: ("view", {"shape": [8, 4, 16], "asked": [8, 4, -1]}, [[0, 0, 3, 1]], [8, 4, 16]),
    10: ("transpose", {"dims": [1, 0, 2]}, [[1, 0, 8]], [4, 8, 16]),
    11: ("transpose", {"dims": [1, 0, 2]}, [[1, 0, 9]], [4, 8, 16]),
    12: ("transpose", {"dims": [0, 2, 1]}, [[1, 0, 11]], [4, 16, 8]),
    13: ("baddbmm", {"ndims": [3, 3]}, [[1, 0, 10], [1, 0, 12]], [4, 8, 8]),
    14: ("view", {"shape": [2, 2, 8, 8]}, [[1, 0, 13]], [2, 2, 8, 8]),
}


def test_attention_scores_from_heads_interleaved_with_the_batch_hold_the_heads():
    """The shard of q's heads (dim 2) lands in the merged [b * np] dim as an interleaved slice,
    stays there through the batched product, and is the heads dim (1) of the scores again:
    shard(1), not the queries' dim 2 that a same-rank guess gave."""
    obs = {Q: {0: SimpleNamespace(shape=(8, 2, 2, 16))}, K: {0: SimpleNamespace(shape=(8, 2, 2, 16))},
           SCORES: {0: SimpleNamespace(shape=(2, 2, 8, 8))}}
    view = SimpleNamespace(step=0, procs=[0, 1], points=obs, slot_key={(0, 3, 0): Q, (0, 3, 1): K},
                           times={SCORES: (10, 5, 0)}, lineage=lambda: (CORE_NODES, {(5, 0): [1, 0, 14]}),
                           node_points=lambda: {14: [SCORES]})
    done = {k: Verdict("shard(2)", "no-reduction", "r", []) for k in (Q, K)}
    j = SimpleNamespace(v=view, done=done, name=lambda k: f"{k[0]}:{k[2]}", module_params=lambda m, procs: [])
    pt = SimpleNamespace(key=SCORES, procs=[0, 1], ndim=4, items=[], equal=False)
    placement, ops, block, *_ = dataflow.placement_from_lineage(j, pt)
    assert (placement, block) == ("shard(1)", None), ops
    assert "baddbmm(" in ops, ops


# The same at TP = the number of heads (megatron-core at tp 4 with 4 heads): one head per rank,
# q and k [sq, b, 1, hn] reshaped to [sq, b, hn], which local shapes read two ways.
ONE_HEAD_NODES = {
    8: ("reshape", {"shape": [8, 2, 16], "asked": [8, 2, -1]}, [[0, 0, 3, 0]], [8, 2, 16]),
    9: ("view", {"shape": [8, 2, 16], "asked": [8, 2, -1]}, [[0, 0, 3, 1]], [8, 2, 16]),
    10: ("transpose", {"dims": [1, 0, 2]}, [[1, 0, 8]], [2, 8, 16]),
    11: ("transpose", {"dims": [1, 0, 2]}, [[1, 0, 9]], [2, 8, 16]),
    12: ("transpose", {"dims": [0, 2, 1]}, [[1, 0, 11]], [2, 16, 8]),
    13: ("baddbmm", {"ndims": [3, 3]}, [[1, 0, 10], [1, 0, 12]], [2, 8, 8]),
    14: ("view", {"shape": [2, 1, 8, 8]}, [[1, 0, 13]], [2, 1, 8, 8]),
}


def _one_head_judge(reductions=()):
    obs = {Q: {0: SimpleNamespace(shape=(8, 2, 1, 16))}, K: {0: SimpleNamespace(shape=(8, 2, 1, 16))},
           SCORES: {0: SimpleNamespace(shape=(2, 1, 8, 8))}}
    view = SimpleNamespace(step=0, procs=[0, 1], points=obs, slot_key={(0, 3, 0): Q, (0, 3, 1): K},
                           times={SCORES: (10, 5, 0)}, lineage=lambda: (ONE_HEAD_NODES, {(5, 0): [1, 0, 14]}),
                           node_points=lambda: {14: [SCORES]}, after=lambda t, ops: list(reductions))
    done = {k: Verdict("shard(2)", "no-reduction", "r", [], block=1) for k in (Q, K)}
    return SimpleNamespace(v=view, done=done, name=lambda k: f"{k[0]}:{k[2]}", module_params=lambda m, procs: [])


def _scores_pt():
    return SimpleNamespace(key=SCORES, procs=[0, 1], ndim=4, items=[], equal=False, t_point=10,
                           tref=SimpleNamespace(shape=(2, 1, 8, 8), numel=128))


def test_one_head_per_rank_scores_take_the_reading_that_no_reduction_contradicts():
    """Merged into hn, the heads make the product over hn a partial sum, which no sum-reduction
    completes: the other reading (the head merged into the batch) gives the heads dim."""
    j = _one_head_judge()
    hit = dataflow.placement_from_lineage(j, _scores_pt())
    assert (hit.placement, hit.ambiguous) == ("partial", True), hit
    verdict = lineage_ops(j, _scores_pt())
    assert (verdict.placement, verdict.reduction) == ("shard(1)", "no-reduction")
    assert any("merged a sharded size-1 dim away" in str(i) for i in verdict.items), verdict.items


def test_one_head_per_rank_partial_that_a_reduction_completes_stays_partial():
    """Where a sum-reduction of the product's size follows, the partial reading stands."""
    t = SimpleNamespace(numel=128, shape=(2, 1, 8, 8), dtype="float32")
    c = SimpleNamespace(sums=True, ins={0: [t], 1: [t]}, outs={}, op="all_reduce", reduce_op="sum", group_name="0",
                        group_ranks=[0, 1], seq=3, bytes=512, module="attn")
    verdict = lineage_ops(_one_head_judge([c]), _scores_pt())
    assert (verdict.placement, verdict.reduction) == ("partial", "pre-reduction")
