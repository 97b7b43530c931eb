"""MoE models and expert parallel in real SGLang 0.5.23 on CPU, traced at TP=2 (issue #19).

Each configuration is served twice at once, traced and untraced, by one module-scoped fixture:
the tokens must be equal. Dummy weights are redrawn per shard (the ``wide_dummy`` stand-in), so the
ranks' partial sums differ and a partial is told from a replicated value by its values, not
only by its collectives. Stand-ins of tests/sglang/shims/tt_sglang_standins make the models run
on CPU (``mla_backend``: DeepSeek's MLA with torch_native; ``ep_ids``: router ids of experts
held by the other rank under ``--ep-size 2``; ``moe_kernels``: Qwen2-MoE's shared-expert gate).

Set ``TT_MOE_KEEP=DIR`` to keep the traces and logs in DIR (they are in pytest's tmp otherwise).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

import tt_sglang_server as server  # noqa: E402  (loaded by conftest.py)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

TT = str(server.VENV / "bin" / "tensor-trace")
MODELS = server.REPO_ROOT / "tests" / "data" / "sglang-models"
STANDINS = ("wide_dummy", "moe_kernels", "mla_backend", "ep_ids")
MAX_NEW_TOKENS = 3


def _serve(tp, model, extra, log, prefix=(), standins=STANDINS):
    return server.serve_once(tp, MODELS / model, log, prefix=prefix, standins=standins, extra_args=extra,
                             max_new_tokens=MAX_NEW_TOKENS)


def _traced_and_plain(name, model, extra, tmp_path_factory):
    keep = os.environ.get("TT_MOE_KEEP")
    d = Path(keep) / name if keep else tmp_path_factory.mktemp(name)
    d.mkdir(parents=True, exist_ok=True)
    out = d / "trace"
    t0 = time.monotonic()
    (tokens, srv), (plain, _) = server.at_once(
        lambda: _serve(2, model, extra, d / "traced.log", [TT, "record", "--replace", "-o", str(out), "--"]),
        lambda: _serve(2, model, extra, d / "plain.log"))
    return dict(out=str(out), tokens=tokens, plain=plain, exit=srv.exit_code, wall_s=time.monotonic() - t0)


@pytest.fixture(scope="module")
def qwen3_tp2(tmp_path_factory):
    return _traced_and_plain("qwen3-moe-tp2", "qwen3-moe", [], tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek_tp2(tmp_path_factory):
    return _traced_and_plain("deepseek-v2-tp2", "deepseek-v2", [], tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek_dummy(tmp_path_factory):
    """DeepSeek-V2 traced with SGLang's own ``--load-format dummy`` weights (no wide_dummy):
    every rank's shards alike, so every point's values are equal on both ranks."""
    d = tmp_path_factory.mktemp("deepseek-v2-dummy")
    out = d / "trace"
    tokens, _ = _serve(2, "deepseek-v2", [], d / "traced.log", [TT, "record", "--replace", "-o", str(out), "--"],
                       standins=("moe_kernels", "mla_backend"))
    assert tokens
    return dict(out=str(out))


# DeepSeek's MLA attention at TP=2: q heads sharded from q_b_proj, the latent k/v and the rope
# key cut from the replicated fused_qkv_a_proj (whole on every rank)
MLA_POINTS = {"rotary_emb:input.1": "shard(1)", "rotary_emb:input.2": "replicate",
              "rotary_emb:output.0": "shard(1)", "rotary_emb:output.1": "replicate",
              "attn_mqa:input.0": "shard(1)", "attn_mqa:input.1": "replicate",
              "attn_mqa:input.2": "replicate", "attn_mqa:output": "shard(1)",
              # the absorbed v projection, written with bmm(..., out=a transposed view) of its buffer
              "o_proj:input.0": "shard(1)"}


def _check_mla(run):
    pts = placements(run, "model.layers.1.self_attn.*:*")
    for point, placement in MLA_POINTS.items():
        p = pts[f"model.layers.1.self_attn.{point}"]
        assert verdict(pts, f"model.layers.1.self_attn.{point}") == (placement, "no-reduction"), (point, p["evidence"])


@pytest.fixture(scope="module")
def qwen3_ep2(tmp_path_factory):
    return _traced_and_plain("qwen3-moe-ep2", "qwen3-moe", ["--ep-size", "2"], tmp_path_factory)


def q(*args):
    r = CliRunner().invoke(main, ["query", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def placements(run, pattern="model.layers.1.*"):
    return {p["point"]: p for p in q("placement", pattern, "--trace", run["out"])}


def verdict(pts, point):
    p = pts[point]
    return p["placement"], p["reduction"]


def _check_run(run):
    """Tokens unchanged by tracing, both ranks traced, no tracer errors."""
    assert run["tokens"] == run["plain"], run
    assert len(run["tokens"]) == MAX_NEW_TOKENS
    traces = [load_rank_file(f) for f in rank_files(run["out"])]
    assert sorted(t.identity.get("rank") for t in traces if t.steps) == [0, 1]
    for t in traces:
        if t.steps:
            assert not t.errors, t.errors


def _check_common(pts):
    """What every MoE block shows at TP=2: the router and top-k are replicated, the decoder
    layer's attention output is a partial sum that the layer boundary reduces."""
    gate = [p for p in pts if p.split(":")[0] == "model.layers.1.mlp.gate" and ":output" in p]
    assert gate and all(verdict(pts, p) == ("replicate", "no-reduction") for p in gate), gate
    topk = [p for p in pts if p.startswith("model.layers.1.mlp.topk:output")]
    assert topk and all(pts[p]["placement"] == "replicate" for p in topk), {p: pts[p]["placement"] for p in topk}
    assert verdict(pts, "model.layers.1.self_attn.o_proj:output.0") == ("partial", "pre-reduction")


def test_qwen3_moe_tp2(qwen3_tp2):
    _check_run(qwen3_tp2)
    r = q("reduction", "model.embed_tokens", "--trace", qwen3_tp2["out"])
    assert (r["verdict"], r["placement"]) == ("post-reduction", "replicate")
    pts = placements(qwen3_tp2)
    _check_common(pts)
    # The routed experts' sum: every rank holds a slice of each expert's intermediate
    # dimension (moe_tp), so its output is a partial sum that the layer boundary completes.
    assert verdict(pts, "model.layers.1.mlp.experts:output") == ("partial", "pre-reduction")
    assert pts["model.layers.1.mlp.experts:output"]["layer_semantics"]["agrees"] is True
    # Inside it, each expert's SiluAndMul sees that rank's slice of the intermediate.
    acts = [p for p in pts if p.startswith("model.layers.1.mlp.experts.SiluAndMul#")]
    assert acts
    for p in acts:
        assert pts[p]["placement"] == "shard(1)", pts[p]
        assert pts[p]["reduction"] == "no-reduction", pts[p]
    # The per-head q and k norms (apply_qk_norm: reshape(-1, head_dim) of the column shard; two
    # q heads and one KV head per rank here): each rank's heads are rows among the other
    # ranks' (dim 0), head_dim whole on every rank.
    attn = placements(qwen3_tp2, "model.layers.1.self_attn.*:*")
    for name in ("q_norm", "k_norm"):
        for slot in ("input.0", "output"):
            point = f"model.layers.1.self_attn.{name}:{slot}"
            assert verdict(attn, point) == ("shard(0)", "no-reduction"), attn[point]["evidence"]


def test_deepseek_v2_tp2(deepseek_tp2):
    _check_run(deepseek_tp2)
    r = q("reduction", "model.embed_tokens", "--trace", deepseek_tp2["out"])
    assert (r["verdict"], r["placement"]) == ("post-reduction", "replicate")
    pts = placements(deepseek_tp2)
    _check_common(pts)
    # The routed experts' output and the shared expert's are both partial sums; SGLang adds the
    # routed output into the shared one in place and all-reduces the sum at the layer boundary.
    assert verdict(pts, "model.layers.1.mlp.experts:output")[0] == "partial"
    for point in ("model.layers.1.mlp.shared_experts.down_proj:output.0",
                  "model.layers.1.mlp.shared_experts:output"):
        assert pts[point]["placement"] == "partial", pts[point]
    assert pts["model.layers.1.mlp.shared_experts.down_proj:output.0"]["layer_semantics"]["agrees"] is True
    # MLA: the replicated latent projection, the column-parallel q_b_proj.
    assert verdict(pts, "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa:output.0")[0] == "replicate"
    assert pts["model.layers.1.self_attn.q_b_proj:output.0"]["placement"].startswith("shard(")
    _check_mla(deepseek_tp2)


def test_deepseek_v2_with_plain_dummy_weights(deepseek_dummy):
    """Identical shards: the projection is a shard by its layer class, and the dataflow (the
    rotary embedding's own-shape outputs, the absorbed bmm of the sharded q heads, the
    attention of sharded q and whole latent) carries it, not the equal values."""
    _check_mla(deepseek_dummy)
    pts = placements(deepseek_dummy, "model.layers.1.self_attn.*:*")
    assert verdict(pts, "model.layers.1.self_attn.q_b_proj:output.0") == ("shard(1)", "no-reduction")


def test_qwen3_moe_ep2(qwen3_ep2):
    _check_run(qwen3_ep2)
    pts = placements(qwen3_ep2)
    _check_common(pts)
    # Each rank sums its own experts' outputs: a partial sum across the EP ranks, which the
    # all_reduce at the layer boundary combines (CPU has no all_to_all dispatch).
    assert verdict(pts, "model.layers.1.mlp.experts:output") == ("partial", "pre-reduction")
    # Inside, each rank runs different experts on different tokens: not comparable across
    # ranks, and said so, never "divergent".
    inside = [p for p in pts if p.startswith("model.layers.1.mlp.experts.")]
    assert inside
    for p in inside:
        assert pts[p]["placement"] == "local", pts[p]
    ops = {r["op"] for r in q("collectives", "--trace", qwen3_ep2["out"])}
    assert "all_reduce" in ops
