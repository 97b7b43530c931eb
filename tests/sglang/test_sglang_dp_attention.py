"""Real SGLang 0.5.23 with DP attention: `--tp 2 --enable-dp-attention --dp-size 2` (Qwen3-MoE).

Needs the SGLang venv (`bash tests/sglang/setup.sh`); skipped without it. Stand-ins: wide_dummy
(shards differ, so partial sums are visible) and dp_attention (the torch_native backend's missing
``get_cpu_graph_seq_len_fill_value``). One traced and one untraced server, started together,
the same requests: one prompt alone (one DP rank runs it, the other is idle: tokens [n, 0]),
then two prompts of different lengths at once (round robin: one per DP rank; here they run in
different forward passes, each while the other DP rank is idle).

At TP=2 with two attention-DP ranks each attention-TP group has one rank: attention, norms and
the residual stream hold each DP rank's own tokens (nothing to compare across ranks, a data
split), while the MoE block runs on the tokens of both, gathered, across the TP group.
DeepSeek-V2 (MLA) runs the same requests under DP attention, traced only.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

import tt_sglang_server as server  # noqa: E402  (loaded by conftest.py)

pytestmark = [pytest.mark.sglang]

TT = str(server.VENV / "bin" / "tensor-trace")
MODEL = server.REPO_ROOT / "tests" / "data" / "sglang-models" / "qwen3-moe"
ARGS = ["--enable-dp-attention", "--dp-size", "2"]
STANDINS = ("wide_dummy", "dp_attention")
NEW_TOKENS = 3
ALONE = [1, 2, 3]
TOGETHER = [[5, 6, 7, 8, 9], [10, 11]]
# three at once: two on one DP rank, one on the other, so the decode steps are [2, 1], which
# SGLang pads to [2, 2] (MAX_LEN): a DP rank holding tokens runs padding rows too
THREE = [[20, 21, 22], [23, 24, 25, 26], [27, 28]]
THREE_NEW_TOKENS = 6  # decode steps enough that both DP ranks decode in some, whatever the timing
# 25-45 s on an idle 2-core machine with its 4 processes (launcher, DP controller, 2 schedulers)
STARTUP_S = float(os.environ.get("TT_SGLANG_STARTUP_S", "600"))


def _serve(log, prefix=()):
    srv = server.SGLangServer(2, model_path=MODEL, extra_args=ARGS, standins=STANDINS, log_path=log,
                              prefix=list(prefix), startup_timeout=STARTUP_S)
    with srv:
        alone = server.output_ids(srv.generate(ALONE, max_new_tokens=NEW_TOKENS))
        both = srv.request("/generate", {"input_ids": TOGETHER,
                                         "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
        three = srv.request("/generate", {"input_ids": THREE,
                                          "sampling_params": {"max_new_tokens": THREE_NEW_TOKENS, "temperature": 0}})
        tokens = [alone] + [server.output_ids(r) for r in both] + [server.output_ids(r) for r in three]
    assert not srv.killed, srv.log_tail()
    return tokens


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang-dp-attention")
    out = d / "trace"
    # every step fingerprinted: each step's verdicts are compared, the padded ones included
    tokens, plain = server.at_once(lambda: _serve(d / "traced.log", [TT, "record", "--fingerprint-every", "1",
                                                                   "-o", str(out), "--"]),
                                   lambda: _serve(d / "plain.log"))
    return dict(out=str(out), tokens=tokens, plain=plain)


def q(*args):
    r = CliRunner().invoke(main, ["query", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _ranks(traced):
    return [t for t in (load_rank_file(f) for f in rank_files(traced["out"])) if t.steps]


def test_tokens_unchanged_and_no_tracer_errors(traced):
    assert traced["tokens"] == traced["plain"]
    assert [len(t) for t in traced["tokens"]] == [NEW_TOKENS] * 3 + [THREE_NEW_TOKENS] * 3, traced["tokens"]
    traces = _ranks(traced)
    assert sorted(t.identity["rank"] for t in traces) == [0, 1]
    for t in traces:
        assert not t.errors, t.errors


def test_groups_recorded_on_each_rank(traced):
    for t in _ranks(traced):
        rank, groups = t.identity["rank"], t.identity["groups"]
        assert t.identity["dp_attention"] is True
        assert groups["tp"] == dict(size=2, rank=rank, ranks=[0, 1])
        assert groups["attn_tp"] == dict(size=1, rank=0, ranks=[rank])
        assert groups["attn_dp"] == dict(size=2, rank=rank, ranks=[0, 1])
        assert groups["moe_tp"]["size"] * groups["moe_ep"]["size"] == 2
        assert groups["pp"] == dict(size=1, rank=0, ranks=[rank])


def test_tokens_split_unevenly_and_one_dp_rank_empty(traced):
    """The steps record each DP rank's tokens. SGLang's warm-up runs the same prompt on both DP
    ranks ([n, n]); the requests are dispatched round robin, so a DP rank runs a forward pass
    while the other is idle ([n, 0] or [0, m]: one rank empty), and requests that meet in one
    forward split unevenly ([1, 5]). Which rank is idle when depends on the timing of the
    requests (and of the launcher's /health polls), so only that some rank is."""
    splits = set()
    for t in _ranks(traced):
        for s in t.steps.values():
            if s.attrs.get("dp_tokens"):
                splits.add(tuple(s.attrs["dp_tokens"]))
                assert s.attrs["tokens"] == s.attrs["dp_tokens"][t.identity["groups"]["attn_dp"]["rank"]]
    assert any(min(split) == 0 < max(split) for split in splits), splits  # one DP rank empty
    assert any(min(split) > 0 for split in splits), splits  # and steps both DP ranks ran


def test_dp_local_points_are_a_data_split_never_unknown(traced):
    pts = q("placement", "*:*", "--trace", traced["out"])
    local = [p for p in pts if p.get("data_split")]
    assert local, [p["point"] for p in pts][:20]
    for p in local:
        assert p["group"]["name"] == "attn_tp" and p["group"]["size"] == 1, p
        assert p["data_split"]["over"] == "attn_dp" and p["data_split"]["dim"] == 0, p
        assert p["placement"] != "unknown" and not any("other steps disagree" in e for e in p["evidence"]), p
    # Steps of different token splits agree on every point, of either group. The experts'
    # intermediate (one SiluAndMul call per expert, moe-TP sharded) is not judged right yet at
    # all (issue #19's MoE part): its verdicts are left out here.
    unknown = [p["point"] for p in pts if (p["placement"] == "unknown" or "other steps disagree" in " ".join(p["evidence"]))
               and ".mlp.experts.SiluAndMul" not in p["point"]]
    assert not unknown, unknown


def test_embedding_and_o_proj_whole_on_their_dp_rank(traced):
    """Under DP attention the embedding is not vocab-parallel and o_proj's attention-TP group has
    one rank: both are whole per DP rank (replicate in a one-rank group), split across DP ranks."""
    for name in ("model.embed_tokens", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"):
        (p,) = q("placement", name, "--trace", traced["out"])
        assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]
        assert p["group"]["name"] == "attn_tp" and p["data_split"]["over"] == "attn_dp", p


def test_moe_block_judged_across_the_tp_group(traced):
    """The MoE block runs on both DP ranks' tokens, gathered: its input is whole on every rank
    (gathered by an all_reduce over zero-filled buffers: a gather), its experts' output a partial
    sum that the layer's reduction completes."""
    (inp,) = q("placement", "model.layers.0.mlp:input.0", "--trace", traced["out"])
    assert inp["group"]["name"] == "tp" and inp["data_split"] is None, inp
    assert (inp["placement"], inp["reduction"]) == ("replicate", "no-reduction"), inp["evidence"]
    (experts,) = q("placement", "model.layers.0.mlp.experts", "--trace", traced["out"])
    assert experts["group"]["name"] == "tp" and experts["data_split"] is None, experts
    assert (experts["placement"], experts["reduction"]) == ("partial", "pre-reduction"), experts["evidence"]


def test_dp_gather_all_reduce_judged_a_gather(traced):
    pts = q("placement", "*:*", "--trace", traced["out"])
    gathered = [p for p in pts if p["rule"] == "gathered-by-all-reduce"]
    assert gathered, sorted({p["rule"] for p in pts})
    for p in gathered:
        assert p["collective"]["op"] == "all_reduce" and p["reduction"] == "no-reduction", p


def _padded_steps(traced, idle=True) -> list:
    """Steps where SGLang padded a DP rank to the others' rows (MAX_LEN): an idle one, that ran
    rows though it held no tokens (a request decoding alone, ALONE, has such steps), or
    (``idle`` false) one holding fewer tokens than another (THREE's decode steps)."""
    padded = set()
    for t in _ranks(traced):
        for s, st in t.steps.items():
            a = st.attrs
            if a.get("dp_padding") == "max_len" and a.get("rows", 0) > a.get("tokens", 0) \
                    and (a.get("tokens") == 0) == idle:
                padded.add(s)
    return sorted(padded)


def test_padded_ranks_recorded_with_the_rows_they_ran(traced):
    for idle in (True, False):
        padded = _padded_steps(traced, idle)
        assert padded, f"no step padded a DP rank (idle: {idle})"
        for t in _ranks(traced):
            st = t.steps[padded[0]]
            assert st.attrs["dp_rows"] == [max(st.attrs["dp_tokens"])] * 2, st.attrs


def _each_step_alone(out, padded=()) -> tuple:
    """(point -> {(placement, reduction): steps} over every step judged alone (``--step``),
    unknown left out; the padded steps whose DP-local points were judged to say their padding)."""
    by_point: dict = {}
    said_padding = set()
    steps = sorted({s for t in _ranks(dict(out=out)) for s in t.steps})
    for step in steps:
        for p in q("placement", "*:*", "--trace", out, "--step", step):
            if (p["placement"], p["reduction"]) != ("unknown", "unknown") and ".mlp.experts.SiluAndMul" not in p["point"]:
                by_point.setdefault(p["point"], {}).setdefault((p["placement"], p["reduction"]), []).append(step)
            if step in padded and p["point"] == "model.layers.0.post_attention_layernorm:output.0" \
                    and p["placement"] != "unknown":  # (a padded step not fingerprinted: unknown there)
                assert p["data_split"] and p["data_split"].get("padding"), p
                said_padding.add(step)
    return by_point, said_padding


def test_every_step_alone_agrees_with_the_others(traced):
    """Each step judged alone (``--step``) gives every point one verdict: which steps the
    analysis samples depends on the requests' timing (a padded DP rank's step among them or
    not), so none may disagree. The padded steps' DP-local points are a data split whose rows
    on the padded rank are partly or all padding."""
    padded = _padded_steps(traced) + _padded_steps(traced, idle=False)
    by_point, said_padding = _each_step_alone(traced["out"], padded)
    assert said_padding == set(padded), (said_padding, padded)  # every step fingerprinted
    split = {point: said for point, said in by_point.items() if len(said) > 1}
    assert not split, split


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek-V2 (MLA attention, a dense first layer, routed and shared experts) under DP
    attention, as Kimi-K2 and DeepSeek-V3 servers often run: traced only, the same requests."""
    d = tmp_path_factory.mktemp("sglang-dp-attention-deepseek")
    out = d / "trace"
    srv = server.SGLangServer(2, model_path=MODEL.parent / "deepseek-v2", extra_args=ARGS,
                              standins=STANDINS + ("moe_kernels", "mla_backend"), log_path=d / "traced.log",
                              prefix=[TT, "record", "-o", str(out), "--"], startup_timeout=STARTUP_S)
    with srv:
        srv.generate(ALONE, max_new_tokens=NEW_TOKENS)
        srv.request("/generate", {"input_ids": TOGETHER, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
    assert not srv.killed, srv.log_tail()
    return str(out)


def test_deepseek_mla_is_dp_local_and_its_mlp_judged_across_the_tp_group(deepseek):
    for t in _ranks(dict(out=deepseek)):
        assert not t.errors, t.errors
    by_point, _ = _each_step_alone(deepseek)
    split = {point: said for point, said in by_point.items() if len(said) > 1}
    assert not split, split
    pts = {p["point"]: p for p in q("placement", "*:*", "--trace", deepseek)}
    for name in ("model.layers.0.self_attn.fused_qkv_a_proj_with_mqa:output.0", "model.layers.0.self_attn.attn_mqa:output",
                 "model.layers.1.self_attn.o_proj:output.0", "model.layers.1.post_attention_layernorm:output.0"):
        p = pts[name]
        assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), (name, p["evidence"])
        assert p["group"]["name"] == "attn_tp" and p["data_split"]["over"] == "attn_dp", (name, p)
    # the dense first layer's MLP and the second's experts run on every DP rank's tokens, TP-sharded
    for name, want in (("model.layers.0.mlp.gate_up_proj:output.0", ("shard(1)", "no-reduction")),
                       ("model.layers.0.mlp:output", ("partial", "pre-reduction")),
                       ("model.layers.1.mlp.shared_experts.down_proj:output.0", ("partial", "pre-reduction")),
                       ("model.layers.1.mlp.experts:output", ("partial", "pre-reduction"))):
        p = pts[name]
        assert (p["placement"], p["reduction"]) == want, (name, p["evidence"])
        assert p["group"]["name"] == "tp" and not p.get("data_split"), (name, p)
