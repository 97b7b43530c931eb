"""Gemma3 in real SGLang 0.5.23 on CPU, traced at TP=2: per-head norms of 3-D heads.

SGLang's Gemma3 attention splits each rank's column shard into heads with
``q.unflatten(-1, (heads, head_dim))`` and norms each head (``q_norm`` / ``k_norm`` of
``[tokens, heads, head_dim]``; two q heads and one KV head per rank here); its torch_native
attention returns ``[tokens, heads, head_dim]`` for a prefill and ``[1, heads * head_dim]`` for a
decode step, viewed ``(-1, q_size)`` before ``o_proj``. Every rank holds whole heads: the shard
is the heads dim, never head_dim. Served traced and untraced at once; the tokens must agree.
A third server, traced, runs SGLang's own dummy weights (identical shards on every rank).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main

import tt_sglang_server as server  # noqa: E402  (loaded by conftest.py)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

TT = str(server.VENV / "bin" / "tensor-trace")
MODEL = server.REPO_ROOT / "tests" / "data" / "sglang-models" / "gemma3"


def _serve(log, prefix=(), standins=("wide_dummy",)):
    return server.serve_once(2, MODEL, log, prefix=prefix, standins=standins)[0]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    out = d / "trace"
    dummy = d / "dummy-trace"
    traced, plain, _ = server.at_once(
        lambda: _serve(d / "traced.log", [TT, "record", "--replace", "-o", str(out), "--"]),
        lambda: _serve(d / "plain.log"),
        lambda: _serve(d / "dummy.log", [TT, "record", "--replace", "-o", str(dummy), "--"], standins=()))
    return dict(out=str(out), tokens=traced, plain=plain, dummy=str(dummy))


def placements(run, pattern, trace="out"):
    r = CliRunner().invoke(main, ["query", "placement", pattern, "--trace", run[trace], "--json"])
    assert r.exit_code == 0, r.output
    return {p["point"]: p for p in json.loads(r.stdout)}


def test_tracing_changes_no_token(gemma3):
    assert gemma3["tokens"] == gemma3["plain"]


def test_per_head_norms_of_unflattened_heads_are_sharded_along_the_heads(gemma3):
    pts = placements(gemma3, "model.layers.*.self_attn.*:*")
    for layer in (0, 1):
        at = f"model.layers.{layer}.self_attn"
        for point in ("q_norm:input.0", "q_norm:output", "k_norm:input.0", "k_norm:output",
                      "attn:input.0", "attn:input.1", "attn:output"):
            p = pts[f"{at}.{point}"]
            assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), (point, p["evidence"])
        assert pts[f"{at}.q_norm:input.0"]["shapes"]["0"][1:] == [2, 16]
        # the attention's output viewed back for o_proj: the heads' columns in every kind of
        # step (a decode step's view is a local no-op, which its -1 alone does not decide)
        p = pts[f"{at}.o_proj:input.0"]
        assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]
        assert not any("other steps disagree" in e or "interleaved" in e for e in p["evidence"]), p["evidence"]
        p = pts[f"{at}.o_proj:output.0"]
        assert (p["placement"], p["reduction"]) == ("replicate", "post-reduction"), p["evidence"]


def test_with_plain_dummy_weights_the_heads_are_shards_too(gemma3):
    """``--load-format dummy`` as it is: SGLang seeds each parameter by its shape, so the ranks'
    shards are identical and every point's values are equal on both ranks. The projection is
    a shard by its layer class; the dataflow carries that through the norms (modules with a
    weight), the rotary products no lineage records and the attention, not equal values."""
    pts = placements(gemma3, "model.layers.*.self_attn*:*", trace="dummy")
    for layer in (0, 1):
        at = f"model.layers.{layer}.self_attn"
        for point in ("qkv_proj:output.0", "q_norm:input.0", "q_norm:output", "k_norm:input.0", "k_norm:output",
                      "attn:input.0", "attn:input.1", "attn:input.2", "attn:output", "o_proj:input.0"):
            p = pts[f"{at}.{point}"]
            assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), (point, p["evidence"])
        p = pts[f"{at}:input.hidden_states"]
        assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]
