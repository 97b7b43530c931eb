"""Where a shard lies after a view or reshape (dataflow.reshape_placement): DTensor's rule for
view, from local shapes alone."""

import pytest

from tensor_trace.exporters.analysis.dataflow import reshape_placement


@pytest.mark.parametrize("placement, old, new, want", [
    # heads split out of a column shard of the hidden dimension: the outermost new dimension
    ("shard(2)", [2, 10, 24], [2, 10, 3, 8], "shard(2)"),
    ("shard(1)", [2, 10, 8], [2, 5, 2, 8], "shard(1)"),
    ("shard(0)", [6, 4], [2, 3, 4], "shard(0)"),
    ("shard(1)", [3, 8], [3, -1, 4], "shard(1)"),  # view(-1, ...): the inferred size
    # one head per rank (GQA's KV heads at TP = their count): the size-1 heads dimension
    ("shard(2)", [2, 10, 8], [2, 10, 1, 8], "shard(2)"),
    ("shard(1)", [10, 4], [10, 1, 4], "shard(1)"),
    # a view that keeps the size-1 heads dimension keeps the shard on it
    ("shard(2)", [2, 10, 1, 8], [2, 10, 1, 8], "shard(2)"),
    # merged into the dimension before, or with the one after
    ("shard(1)", [2, 10, 8], [20, 8], "shard(0)"),
    ("shard(0)", [4, 8], [32], "shard(0)"),
    ("shard(2)", [2, 10, 1, 8], [2, 10, 8], "shard(2)"),
    # a trailing size-1 dimension does not move it
    ("shard(2)", [2, 10, 8], [2, 10, 8, 1], "shard(2)"),
    # not a shard: unchanged; sizes that do not match: no answer
    ("replicate", [2, 3], [6], "replicate"),
    ("shard(1)", [2, 3], [7], None),
])
def test_shard_after_reshape(placement, old, new, want):
    assert reshape_placement(placement, old, new) == want
