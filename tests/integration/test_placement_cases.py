"""Verdicts for TP patterns that are not the example: they must come from evidence alone."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
VENV_BIN = os.path.dirname(sys.executable)


def _run_cases(out, tp, *options):
    cmd = [os.path.join(VENV_BIN, "tensor-trace"), "record", "-o", str(out), *options, "--",
           os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc-per-node", str(tp),
           os.path.join(HERE, "scripts", "tp_cases.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = CliRunner().invoke(main, ["query", "placement", "*:*", "--trace", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return {p["point"]: p for p in json.loads(r.stdout)}


@pytest.fixture(scope="module", params=[2, 4])
def cases(request, tmp_path_factory):
    return _run_cases(tmp_path_factory.mktemp(f"cases{request.param}") / "t", request.param)


def verdict(pts, name):
    return pts[name]["placement"], pts[name]["reduction"]


def test_replicated_weights_give_a_replicate_output(cases):
    assert verdict(cases, "replicated:output") == ("replicate", "no-reduction")


def test_partial_behind_a_clone_and_a_scaling(cases):
    assert verdict(cases, "scaled_partial:output") == ("partial", "pre-reduction")
    assert cases["scaled_partial:output"]["collective"]["op"] == "all_reduce"
    assert verdict(cases, "averaged:output") == ("replicate", "post-reduction")


def test_reduce_scatter_output_is_a_reduced_shard_and_gathers_back(cases):
    assert verdict(cases, "row_shard:output") == ("shard(0)", "post-reduction")
    assert cases["row_shard:output"]["collective"]["op"] == "reduce_scatter_tensor"
    assert verdict(cases, "gather0:input.0")[0] == "shard(0)"
    assert verdict(cases, "gather0:output")[0] == "replicate"


def test_rank_dependent_noise_is_divergent(cases):
    assert verdict(cases, "noisy:output")[0] == "divergent"
    assert any("disagree" in e for e in cases["noisy:output"]["evidence"])


def test_layer_semantics_that_disagree_with_the_evidence_are_reported(cases):
    p = cases["mislabeled:output"]
    assert (p["placement"], p["reduction"]) == ("partial", "pre-reduction")  # the evidence wins
    sem = p["layer_semantics"]
    assert sem["placement"] == "replicate" and sem["agrees"] is False
    assert any("DISAGREES" in e for e in p["evidence"])


def test_an_all_reduce_of_zero_padded_slices_is_a_gather(cases):
    p = cases["dp_gather:output"]
    assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]
    assert p["rule"] == "gathered-by-all-reduce" and p["collective"]["op"] == "all_reduce"
    assert any("a gather, not a reduction" in e for e in p["evidence"])


def test_one_head_per_rank_split_out_by_a_view_is_sharded_along_the_heads(cases):
    """A view of a column shard into (heads, head_dim) with one head per rank: the shard lies
    along the heads dimension (local size 1), not along head_dim."""
    assert verdict(cases, "kv.k_proj:output") == ("shard(1)", "no-reduction")
    assert verdict(cases, "kv.k_norm:input.0") == ("shard(1)", "no-reduction")
    assert verdict(cases, "kv.k_norm:output") == ("shard(1)", "no-reduction")


def test_heads_viewed_as_rows_are_an_interleaved_shard_of_the_rows(cases):
    """SGLang's per-head q/k norms: ``reshape(-1, head_dim)`` of a column shard puts each rank's
    heads among the rows (dim 0), between the other ranks' (head_dim is whole on every rank);
    viewed back, the heads' columns again. One KV head per rank: the reshape leaves the local
    shape as it was, and its -1 says the heads went into the rows."""
    for name in ("q_norm", "k_norm"):
        for slot in ("input.0", "output"):
            assert verdict(cases, f"qk.{name}:{slot}") == ("shard(0)", "no-reduction"), cases[f"qk.{name}:{slot}"]["evidence"]
    assert any("interleaved" in e for e in cases["qk.q_norm:input.0"]["evidence"])
    assert verdict(cases, "qk.rope:input.0") == ("shard(1)", "no-reduction")
    assert verdict(cases, "qk.rope:input.1") == ("shard(1)", "no-reduction")


@pytest.mark.parametrize("path", ["heads", "heads_one"])
def test_heads_unflattened_from_a_column_shard_are_sharded_along_the_heads(cases, path):
    """Gemma3's ``unflatten(-1, (heads, head_dim))`` of a column shard: sharded along the heads
    (dim 1; one KV head per rank, local size 1), head_dim whole; the attention's output viewed
    back to ``(-1, heads * head_dim)`` is the column shard again, contiguous. The same with one
    token (``heads_one``), where the tokens dim is size 1 too."""
    for point in ("q_norm:input.0", "q_norm:output", "k_norm:input.0", "k_norm:output", "attn:output"):
        p = cases[f"{path}.{point}"]
        assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), (point, p["evidence"])
    p = cases[f"{path}.o:input.0"]
    assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]
    assert not any("interleaved" in e for e in p["evidence"]), p["evidence"]


def test_a_decode_steps_no_op_view_does_not_outvote_the_steps_whose_shapes_place_it(cases):
    """SGLang's torch_native attention returns [1, heads * head_dim] for one token: its view
    ``(-1, heads * head_dim)`` is then a local no-op whose -1 alone would put the ranks in the
    tokens; a step with 8 tokens, whose shapes show the heads' columns, decides."""
    p = cases["heads_decode.o:input.0"]
    assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]
    assert any("from a reshape's -1 alone" in e for e in p["evidence"]), p["evidence"]
    assert not any("other steps disagree" in e for e in p["evidence"]), p["evidence"]


def test_without_recorded_ops_heads_split_from_a_shard_are_taken_along_the_heads(tmp_path):
    """``--no-lineage``: no op is seen between the column shard [t, 8] and the norm's input
    [t, 2, 4]; the shard is derived where the shapes first differ (the heads), not in the
    last dim (head_dim, whole on every rank)."""
    pts = _run_cases(tmp_path / "t", 2, "--no-lineage")
    for path in ("heads", "heads_one"):
        for point in ("q_norm:input.0", "k_norm:input.0"):
            p = pts[f"{path}.{point}"]
            assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), (path, point, p["evidence"])


def test_heads_transposed_for_sdpa_and_merged_back_are_the_column_shard(cases):
    """transformers' Gemma3 attention: the heads' norms on [b, heads, s, head_dim] (shard(1));
    SDPA's output is linked to nothing recorded, so o_proj's input [b, s, heads * head_dim] is
    derived from the last shard before it: the merged heads' columns (dim 2), not dim 1 (the
    sequence here, where the heads were before the transpose back)."""
    for point in ("q_norm:input.0", "k_norm:output"):
        p = cases[f"hf_heads.{point}"]
        assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), (point, p["evidence"])
    p = cases["hf_heads.o:input.0"]
    assert (p["placement"], p["reduction"]) == ("shard(2)", "no-reduction"), p["evidence"]


def test_identical_shards_follow_the_dataflow_past_norms_and_unrecorded_ops(cases):
    """Dummy weights: every point of the attention has equal values on every rank. The
    projection is a shard by its layer class; the heads split from it, their norms (a module
    with a weight), the rotated heads (built by products no lineage records, of the norms'
    shape) and the attention's output stay shards; o_proj's output is no reduction here."""
    for point in ("qkv_proj:output", "q_norm:input.0", "q_norm:output", "k_norm:output",
                  "attn:input.0", "attn:input.1", "attn:output", "o:input.0"):
        p = cases[f"dummy_heads.{point}"]
        assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), (point, p["evidence"])
        assert p["fingerprint"] is None or any("identical shards" in e for e in p["evidence"]), (point, p["evidence"])


def test_equal_values_beside_a_shard_of_another_shape_stay_replicate(cases):
    """The guard of the rule above: a whole tensor given to a module after the shards of the
    same call (equal on every rank, of none of their shapes) is not made a shard."""
    p = cases["dummy_heads.whole:input.0"]
    assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]


def test_identical_shards_through_modules_of_shards_and_whole_tensors(cases):
    """Dummy weights, DeepSeek's MLA pattern: a rotary embedding of sharded q heads and a whole
    k gives a sharded q and a whole k; an attention of sharded q and whole k is sharded."""
    want = {"rope:output.0": "shard(1)", "rope:output.1": "replicate", "mla_attn:output": "shard(1)",
            "mla_attn:input.1": "replicate"}
    for point, placement in want.items():
        p = cases[f"dummy_heads.{point}"]
        assert (p["placement"], p["reduction"]) == (placement, "no-reduction"), (point, p["evidence"])


def test_an_add_that_leaves_a_reduced_tensor_unchanged_in_value_is_no_reduction(cases):
    """design.md: post-reduction is a reduction's output carried unchanged (a view, clone, cast,
    common scale); an add is not, even where the addend is lost to rounding."""
    p = cases["residual_add:input.0"]
    assert (p["placement"], p["reduction"]) == ("replicate", "post-reduction"), p["evidence"]
    p = cases["residual_add:output"]
    assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]
    assert any("built it by an add" in e for e in p["evidence"]), p["evidence"]


def test_a_product_written_with_out_into_a_transposed_view_keeps_its_heads(cases):
    """``torch.bmm(q_heads, w, out=buf.view(t, heads, d).transpose(0, 1))``: the buffer o_proj
    reads is built by that write; the heads' shard (dim 0 of the product) is the buffer's
    columns (dim 1), by the view's strides."""
    p = cases["out_written.o:input.0"]
    assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]
    assert any("copy_(into" in e and "bmm(" in e for e in p["evidence"]), p["evidence"]


def test_a_fused_add_norms_residual_output_is_a_sum_whatever_its_values(cases):
    """SGLang's RMSNorm(x, residual) returns x + residual second (EAGLE-3 captures it as the
    residual stream): no-reduction, though under dummy weights its values equal the reduced
    residual's (the layer's output lost to bf16 rounding)."""
    p = cases["fused_norm:output.1"]
    assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]
    assert any("returns x + residual" in e for e in p["evidence"]), p["evidence"]
    p = cases["fused_norm:input.1"]
    assert (p["placement"], p["reduction"]) == ("replicate", "post-reduction"), p["evidence"]
