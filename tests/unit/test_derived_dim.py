"""Where a shard lies in a tensor derived from it with no recorded op between them
(rules_dataflow._derived_dim): cases from programs written elsewhere (torchtitan's DeepSeek-V3
attention, transformers' nanochat), where the answer was once the last dim."""

from tensor_trace.exporters.analysis.rules_dataflow import _derived_dim


def test_heads_split_out_of_a_column_shard_keep_its_dim():
    assert _derived_dim((2, 8, 64), 2, (2, 8, 2, 32), 4) == 2  # [b, s, heads * hd] -> [b, s, heads, hd]


def test_heads_of_another_width_than_the_source_are_the_shard():
    # torchtitan's MLA: q's heads [b, s, 2, 24] beside the kv projection's [b, s, 2 * 32]
    assert _derived_dim((2, 8, 64), 2, (2, 8, 2, 24), 4) == 2


def test_heads_moved_before_the_sequence_by_a_transpose_are_the_shard():
    # nanochat's q after view(b, s, -1, hd).transpose(1, 2) and a rotary embedding
    assert _derived_dim((2, 8, 32), 2, (2, 2, 8, 16), 4) == 1


def test_heads_merged_back_are_the_last_dim():
    assert _derived_dim((2, 8, 2, 16), 2, (2, 8, 32), 3) == 2
    assert _derived_dim((2, 2, 8, 16), 1, (2, 8, 32), 3) == 2
