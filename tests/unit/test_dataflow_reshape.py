"""Where a shard lies after a view or reshape (dataflow.reshape_shard): DTensor's rule for
view, from local shapes alone."""

import pytest

import torch

from tensor_trace.exporters.analysis.dataflow import merged_left, reshape_shard, strided_shard
from tensor_trace.exporters.analysis.rules_dataflow import _derived_dim


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
    # Megatron's scores, one head per rank: [b * np, sq, sk] (the rank's head interleaved with
    # the batch, runs of one) viewed [b, np, sq, sk]: the size-1 heads dim, not the queries'
    ("shard(0)", 1, [2, 8, 8], [2, 1, 8, 8], None, ("shard(1)", None)),
    ("shard(0)", 1, [2, 8, 8], [2, 1, 64], None, ("shard(1)", None)),
    # one token's one KV head per rank, rows [1, 16] (view(-1, head_dim)) viewed back to
    # [1, 16]: the 1 is the token (what is left of dim 0 above the rank), the columns the heads
    ("shard(0)", 1, [1, 16], [1, 16], None, ("shard(1)", None)),
])
def test_interleaved_shards_through_reshapes(placement, block, old, new, asked, want):
    assert reshape_shard(placement, old, new, block, asked) == want


@pytest.mark.parametrize("placement, old, new, asked, want", [
    # a decode step's one token: [1, heads, head_dim] back to [1, heads * head_dim] (the -1 is
    # the tokens, size 1 here, which says nothing) keeps the heads' columns; with more tokens
    # the same view gives the same answer
    ("shard(1)", [1, 2, 16], [1, 32], [-1, 32], "shard(1)"),
    ("shard(1)", [3, 2, 16], [3, 32], [-1, 32], "shard(1)"),
    # ... and split into heads (Gemma3's q.unflatten(-1, (heads, head_dim))), one head per rank
    ("shard(1)", [1, 32], [1, 2, 16], [1, 2, 16], "shard(1)"),
    ("shard(1)", [1, 16], [1, 1, 16], [1, -1, 16], "shard(1)"),
    ("shard(1)", [1, 16], [1, 1, 16], None, "shard(1)"),
    ("shard(1)", [4, 16], [4, 1, 16], None, "shard(1)"),
    # with no size-1 dim before it, a new leading size-1 dim is still the outermost
    ("shard(0)", [16], [1, 16], None, "shard(0)"),
    # one token's two q heads as rows [2, 16] (Qwen3's reshape(-1, head_dim)) viewed back to
    # [1, 32]: the 1 is the token; the heads' columns hold the ranks
    ("shard(0)", [2, 16], [1, 32], None, "shard(1)"),
    # ... and one KV head per rank, one token: [1, 16] to [1, 1, 16], the heads dim
    ("shard(1)", [1, 16], [1, 1, 16], [1, 1, 16], "shard(1)"),
    # view(1, -1) asks for the whole in one row: the -1 (size > 1) says where the ranks go
    ("shard(0)", [16], [1, 16], [1, -1], "shard(1)"),
    # a sequence shard of batch 1, flattened: still the rows
    ("shard(1)", [1, 5, 32], [5, 32], [-1, 32], "shard(0)"),
])
def test_size_one_dims_before_the_shard(placement, old, new, asked, want):
    assert reshape_shard(placement, old, new, None, asked)[0] == want


@pytest.mark.parametrize("src, d, shape, want", [
    ([3, 64], 1, [3, 2, 16], 1),  # heads split out of a column shard: the heads
    ([1, 64], 1, [1, 1, 16], 1),  # one token, one head per rank
    ([3, 2, 16], 1, [3, 32], 1),  # heads merged back: the columns
    ([2, 3, 12, 8], 1, [2, 12, 24], 2),  # transformers' [b, heads, s, d] back to [b, s, heads * d]
    ([2, 5, 32], 2, [10, 32], 1),  # tokens flattened: cannot tell where, the last dim
    (None, 1, [3, 2, 16], 2),
])
def test_where_a_shard_is_derived_without_recorded_ops(src, d, shape, want):
    assert _derived_dim(src, d, shape, len(shape)) == want


def _views(shape, make):
    base = torch.empty(*shape)
    view = make(base)
    return list(view.shape), list(view.stride()), list(base.shape), list(base.stride())


@pytest.mark.parametrize("placement, shape, make, want", [
    # DeepSeek's absorbed MLA: bmm(..., out=buf.view(t, heads, d).transpose(0, 1)), the heads'
    # shard (dim 0 of the written view) is the buffer's columns; the tokens its rows
    ("shard(0)", (3, 32), lambda b: b.view(-1, 2, 16).transpose(0, 1), ("shard(1)", None)),
    ("shard(1)", (3, 32), lambda b: b.view(-1, 2, 16).transpose(0, 1), ("shard(0)", None)),
    # head_dim sharded inside each head: the columns, interleaved in runs of 16 (one head's part)
    ("shard(2)", (3, 32), lambda b: b.view(-1, 2, 16).transpose(0, 1), ("shard(1)", 16)),
    ("replicate", (3, 32), lambda b: b.t(), ("replicate", None)),
])
def test_a_shard_written_through_a_view(placement, shape, make, want):
    assert strided_shard(placement, *_views(shape, make)) == want


@pytest.mark.parametrize("placement, block, old, new, want", [
    # one head per rank merged away: into the batch before it, the rank's head interleaved in
    # runs of one (Megatron's [sq, b, 1, hn] -> [sq, b * np, hn]; [sq, b * np] flattened)
    ("shard(2)", None, [8, 2, 1, 16], [8, 2, 16], ("shard(1)", 1)),
    ("shard(2)", 1, [8, 2, 1, 16], [8, 2, 16], ("shard(1)", 1)),
    ("shard(2)", None, [8, 2, 1, 16], [16, 16], ("shard(0)", 1)),
    # not that ambiguity: heads of size > 1, no dim before it to merge into, a size-1 dim
    # before it (one token: nothing to interleave with), a split rather than a merge
    ("shard(2)", None, [8, 2, 2, 16], [8, 4, 16], None),
    ("shard(0)", None, [1, 16], [16], None),
    ("shard(1)", None, [1, 1, 16], [1, 16], None),
    ("shard(1)", None, [8, 16], [8, 1, 16], None),
    ("replicate", None, [8, 2, 1, 16], [8, 2, 16], None),
])
def test_the_other_reading_of_a_size_one_shard_merged_away(placement, block, old, new, want):
    assert merged_left(placement, old, new, block) == want
