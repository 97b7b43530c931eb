"""Where a shard lies after a view or reshape (dataflow.reshape_shard): DTensor's rule for
view, from local shapes alone."""

import pytest

from tensor_trace.exporters.analysis.dataflow import reshape_shard


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
    assert (reshape_shard(placement, old, new) or (None,))[0] == want


@pytest.mark.parametrize("placement, block, old, new, asked, want", [
    # SGLang's per-head q norm: q [tokens, 2 local heads x 16] viewed (-1, 16): each rank's heads
    # are rows of every token, between the other ranks' (3 runs of 2)
    ("shard(1)", None, [3, 32], [6, 16], [-1, 16], ("shard(0)", 2)),
    ("shard(1)", None, [3, 32], [6, 16], None, ("shard(0)", 2)),
    # ... and viewed back: the heads' columns again, a contiguous slice
    ("shard(0)", 2, [6, 16], [3, 32], None, ("shard(1)", None)),
    ("shard(0)", 2, [6, 16], [3, 2, 16], None, ("shard(1)", None)),
    # one KV head per rank, view(-1, head_dim): the local shape stays, the heads go into dim 0
    ("shard(1)", None, [3, 16], [3, 16], [-1, 16], ("shard(0)", 1)),
    ("shard(0)", 1, [3, 16], [3, 16], None, ("shard(1)", None)),
    # the same view without a -1 says nothing new: the shard stays where it was
    ("shard(1)", None, [3, 16], [3, 16], None, ("shard(1)", None)),
    # tokens flattened, the hidden shard kept by an explicit (local) size: the stride decides
    ("shard(2)", None, [2, 5, 32], [10, 32], [-1, 32], ("shard(1)", None)),
    # sequence parallel: a shard of the sequence flattened with the batch is interleaved
    ("shard(1)", None, [2, 5, 32], [10, 32], [-1, 32], ("shard(0)", 5)),
    ("shard(1)", None, [1, 5, 32], [5, 32], [-1, 32], ("shard(0)", None)),
    # heads split out with view(B, S, -1, hd): the -1 dim is the heads
    ("shard(2)", None, [3, 5, 32], [3, 5, 2, 16], [3, 5, -1, 16], ("shard(2)", None)),
    ("shard(2)", None, [3, 5, 16], [3, 5, 1, 16], [3, 5, -1, 16], ("shard(2)", None)),
])
def test_interleaved_shards_through_reshapes(placement, block, old, new, asked, want):
    assert reshape_shard(placement, old, new, block, asked) == want
