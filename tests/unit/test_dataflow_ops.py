"""Placement through the ops that carry a parameter's split (exporters/analysis/dataflow_ops.py):
a parameter's declared split, dimension moves and matrix products, as DTensor's propagation
rules give them for local tensors; anything not listed gives no answer."""

import pytest

from tensor_trace.exporters.analysis.dataflow_ops import dims_placement, param_placement, product_placement


def _dtensor(*placements):
    return {"kind": "DTensor", "placements": list(placements), "mesh_dim_names": ["tp"], "mesh_shape": [2],
            "mesh_ranks": [0, 1]}


@pytest.mark.parametrize("meta, want", [
    (_dtensor("_StridedShard(dim=1, sf=2)"), "shard(1)"),  # transformers' packed_colwise gate_up_proj
    (_dtensor("Shard(2)"), "shard(2)"),  # its rowwise down_proj
    (_dtensor("Shard(-1)"), "shard(2)"),
    (_dtensor("Replicate()"), "replicate"),
    (_dtensor("Partial(sum)"), None),
])
def test_a_parameter_placement_is_the_split_its_dtensor_declares(meta, want):
    rows = [((4, 64, 48), (1.0, 2.0), meta), ((4, 64, 48), (3.0, 4.0), meta)]
    got = param_placement(rows)
    assert (got[0] if got else None) == want


def test_a_plain_parameter_is_replicate_only_where_every_rank_holds_equal_values():
    same = [((8, 4), (1.5, 2.25), None), ((8, 4), (1.5, 2.25), None)]
    assert param_placement(same)[0] == "replicate"
    differ = [((8, 4), (1.5, 2.25), None), ((8, 4), (-0.5, 3.0), None)]
    assert param_placement(differ) is None
    assert param_placement([((8, 4), None, None), ((8, 4), None, None)]) is None


@pytest.mark.parametrize("placement, attrs, want", [
    # W[expert_ids] of a [E, 2I/tp, H] shard(1): rows picked along dim 0, the shard stays on dim 1
    ("shard(1)", {"dims": [0, 1, 2], "part": [0]}, "shard(1)"),
    # W[expert_idx] (a 0-d index): dim 0 gone, the shard moves to dim 0
    ("shard(1)", {"dims": [-1, 0, 1]}, "shard(0)"),
    # transpose(-2, -1) of [E, H, 2I/tp] shard(2) -> [E, 2I/tp, H] shard(1)
    ("shard(2)", {"dims": [0, 2, 1]}, "shard(1)"),
    # unsqueeze(1) / squeeze(1) renumber
    ("shard(1)", {"dims": [0, 2]}, "shard(2)"),
    ("shard(2)", {"dims": [0, -1, 1]}, "shard(1)"),
    # the sharded dim indexed away, sliced or repeated: no answer
    ("shard(1)", {"dims": [0, -1]}, None),
    ("shard(1)", {"dims": [0, 1], "part": [1]}, None),
    # no dims recorded (an index form not read): only whole placements pass
    ("shard(0)", None, None),
    ("replicate", None, "replicate"),
    ("partial", {"dims": [0, 1], "part": [0]}, "partial"),
])
def test_dimension_moves_carry_a_shard_to_its_new_dim(placement, attrs, want):
    assert dims_placement(placement, attrs or {}) == want


@pytest.mark.parametrize("op, placements, ndims, want", [
    # transformers' grouped experts: x [S, H] replicate @ W^T [E, H, 2I/tp] shard(2)
    ("grouped_mm", ["replicate", "shard(2)"], [2, 3], "shard(1)"),
    ("grouped_mm", ["shard(1)", "shard(1)"], [2, 3], "partial"),  # contracted on both sides
    ("grouped_mm", ["replicate", "shard(0)"], [2, 3], None),  # whole experts per rank: not a TP slice
    ("grouped_mm", ["replicate", "shard(2)"], [3, 3], None),
    # batched experts: bmm(W [S, 2I/tp, H] shard(1), x [S, H, 1] replicate)
    ("bmm", ["shard(1)", "replicate"], [3, 3], "shard(1)"),
    ("bmm", ["replicate", "shard(2)"], [3, 3], "shard(2)"),
    ("bmm", ["shard(2)", "shard(1)"], [3, 3], "partial"),
    ("matmul", ["replicate", "shard(1)"], [3, 2], "shard(2)"),
    ("matmul", ["partial", "replicate"], [2, 2], "partial"),
    ("matmul", ["partial", "partial"], [2, 2], None),
    ("matmul", ["replicate", "shard(0)"], [1, 2], None),  # a 1-D operand: not handled
    ("mm", ["shard(0)", "replicate"], [2, 2], "shard(0)"),
    ("mm", ["shard(1)", "shard(1)"], [2, 2], None),  # mixed dims
    # eager experts: linear(x [T, H] replicate, W [2I/tp, H] shard(0))
    ("linear", ["replicate", "shard(0)"], [2, 2], "shard(1)"),
    ("linear", ["replicate", "shard(0)", "shard(0)"], [2, 2, 1], "shard(1)"),
    ("linear", ["replicate", "shard(0)", "replicate"], [2, 2, 1], None),
    ("linear", ["shard(2)", "shard(1)"], [3, 2], "partial"),
    ("linear", ["shard(2)", "shard(1)", "replicate"], [3, 2, 1], None),  # a bias added on every rank
    ("linear", ["shard(0)", "replicate"], [2, 2], "shard(0)"),
    ("linear", ["replicate", "replicate"], [2, 2], "replicate"),
    ("linear", ["replicate", "shard(1)"], [2, 2], None),
    ("linear", [None, "shard(0)"], [2, 2], None),
    # DeepSeek's absorbed MLA: bmm(q_nope [heads/tp, T, d] shard(0), w_kc [heads/tp, d, r]), a
    # weight made after loading that no record places: each head's rows stay on its rank
    ("bmm", ["shard(0)", None], [3, 3], "shard(0)"),
    ("matmul", ["shard(1)", None], [4, 3], "shard(1)"),
    ("bmm", ["shard(1)", None], [3, 3], None),  # the rows, not a batch: b decides
    ("bmm", [None, "shard(0)"], [3, 3], None),
    ("add", ["replicate", "replicate"], [2, 2], None),
    # Megatron's core attention: baddbmm(buffer, q [b * np, sq, hn], k^T, beta=0): the buffer
    # is no operand; each rank's heads stay its batch rows
    ("baddbmm", ["shard(0)", "shard(0)"], [3, 3], "shard(0)"),
    ("baddbmm", ["replicate", "replicate", "replicate"], [3, 3, 3], "replicate"),
    ("baddbmm", ["shard(0)", "shard(0)", "replicate"], [3, 3, 3], None),  # something added
])
def test_products_follow_dtensor_matmul_propagation(op, placements, ndims, want):
    assert product_placement(op, placements, ndims) == want
