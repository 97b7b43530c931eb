"""`tensor-trace record -- python -m sglang.launch_server ...` on a real SGLang 0.5.23 server (CPU).

Needs the SGLang venv (`bash tests/sglang/setup.sh`); skipped without it. The server loads the
seeded tiny Llama checkpoint (see server.make_seeded_checkpoint), so TP=1 and TP=2 serve the
same model and must give the tokens transformers gives (server.SEEDED_REFERENCE_TOKENS), traced.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

import tt_sglang_server as server  # noqa: E402  (loaded by conftest.py)

pytestmark = [pytest.mark.sglang]

LAYERS = 2  # tests/data/tiny-llama/config.json
MAX_NEW_TOKENS = 8  # of the traced fixture's request
TT = str(server.VENV / "bin" / "tensor-trace")


@pytest.fixture(scope="module")
def seeded_model(tmp_path_factory):
    return server.make_seeded_checkpoint(tmp_path_factory.mktemp("seeded"))


def _serve(tp, model, log, prefix=()):
    # A generous start-up deadline: on a shared 2-core host a server can take minutes to come up.
    srv = server.SGLangServer(tp, model_path=model, load_format="safetensors", log_path=log, prefix=list(prefix),
                              startup_timeout=600)
    with srv:  # stopped (SIGINT) as soon as the response is in
        tokens = server.output_ids(srv.generate(server.DEFAULT_INPUT_IDS, max_new_tokens=MAX_NEW_TOKENS))
    assert not srv.killed, srv.log_tail()
    return tokens, srv


@pytest.fixture(scope="module")
def traced(seeded_model, tmp_path_factory):
    """TP=2 traced. No untraced server for comparison: the seeded model's tokens are known
    (SEEDED_REFERENCE_TOKENS, from transformers), so the traced run is held against them."""
    d = tmp_path_factory.mktemp("sglang-tp2")
    out = d / "trace"
    tokens, srv = _serve(2, seeded_model, d / "traced.log", [TT, "record", "-o", str(out), "--"])
    return dict(out=str(out), tokens=tokens, exit=srv.exit_code)


def q(*args):
    r = CliRunner().invoke(main, ["query", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_both_ranks_traced_and_tokens_unchanged(traced):
    assert traced["tokens"] == server.SEEDED_REFERENCE_TOKENS
    assert traced["exit"] == 130  # SIGINT, forwarded by record, propagated
    traces = [load_rank_file(f) for f in rank_files(traced["out"])]
    ranks = sorted(t.identity.get("rank") for t in traces if t.steps)
    assert ranks == [0, 1], [(t.path, t.identity) for t in traces]
    for t in traces:
        if t.steps:
            assert not t.errors, t.errors
            assert t.identity["tp_rank"] == t.identity["rank"] and t.identity["tp_ranks"] == [0, 1]
            modes = {s.attrs.get("forward_mode") for s in t.steps.values()}
            assert {"extend", "decode"} <= modes
            step = next(s for s in t.steps.values() if s.attrs.get("forward_mode") == "decode")
            assert step.attrs["batch_size"] == 1 and step.attrs["tokens"] == 1
            paths = {s.path for s in step.spans}
            assert {"model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "logits_processor"} <= paths
            assert "lm_head" not in paths  # the logits processor reads lm_head.weight directly
            # One rotary module serves every layer (get_rope caches it): each call is named by
            # its call site, the layer whose attention calls it, never as layer 0's repeat.
            rotary = sorted((s.path, s.call) for s in step.spans if s.path.endswith("rotary_emb"))
            assert rotary == [(f"model.layers.{i}.self_attn.rotary_emb", 0) for i in range(LAYERS)]


def test_the_last_request_is_on_disk_after_an_immediate_ctrl_c(traced):
    # The fixture stops the server right after the response, as README's recipe does with no
    # pause; SGLang SIGKILLs its schedulers about a second after SIGINT. Every step the ranks
    # ran must be in their files, complete: the server's warm-up request (3 tokens, 8 new) and
    # /health generations (1 token, 1 new), then this request's extend (its 4 prompt tokens)
    # and a decode per further token (TP ranks run the same steps).
    runs = []
    for t in (load_rank_file(f) for f in rank_files(traced["out"])):
        if not t.steps:
            continue
        assert t.report.problems() == [], t.report.problems()
        steps = [t.steps[n] for n in sorted(t.steps)]
        assert [s.step for s in steps] == list(range(len(steps)))
        assert all(s.t_end is not None for s in steps), [s.step for s in steps if s.t_end is None]
        modes = [(s.attrs.get("forward_mode"), s.attrs.get("tokens")) for s in steps]
        ours = [i for i, m in enumerate(modes) if m == ("extend", len(server.DEFAULT_INPUT_IDS))]
        assert len(ours) == 1, modes
        assert modes[ours[0] + 1:] == [("decode", 1)] * (MAX_NEW_TOKENS - 1), modes
        runs.append(modes)
    assert len(runs) == 2 and runs[0] == runs[1], runs


def test_embedding_is_post_reduction(traced):
    r = q("reduction", "model.embed_tokens", "--trace", traced["out"])
    assert r["verdict"] == "post-reduction" and r["placement"] == "replicate"
    c = r["collective"]
    assert c["op"] == "all_reduce" and c["group"] == "tp" and c["group_ranks"] == [0, 1]
    assert c["module"] == "model.embed_tokens"


def test_layer_boundaries_defer_the_row_parallel_reductions(traced):
    pts = {p["point"]: p for p in q("placement", "model.layers.0.*", "--trace", traced["out"])}
    assert pts["model.layers.0.self_attn.qkv_proj:output.0"]["placement"].startswith("shard(")
    for point in ("model.layers.0.self_attn.o_proj:output.0", "model.layers.0.mlp.down_proj:output.0"):
        assert (pts[point]["placement"], pts[point]["reduction"]) == ("partial", "pre-reduction"), pts[point]
        r = q("reduction", point, "--trace", traced["out"])
        assert r["verdict"] == "pre-reduction" and r["collective"]["op"] == "all_reduce"
        # Paid at a layer boundary, outside o_proj's and down_proj's forward.
        assert r["collective"]["module"] in ("model.layers.0", "model.layers.1")
    # SGLang's own layer classes say the same, and the cross-check is reported.
    for point in ("model.layers.0.self_attn.qkv_proj:output.0", "model.layers.0.self_attn.o_proj:output.0"):
        assert pts[point]["layer_semantics"]["agrees"] is True, pts[point]
    # The decoder layer hands its MLP's partial sum on as an owed-output handle.
    owed = q("placement", "model.layers.0:output.*", "--trace", traced["out"])
    partial = [p for p in owed if "owed" in p["point"]]
    assert partial and partial[0]["placement"] == "partial"


def test_collectives_per_decode_step(traced):
    # Complete steps only: Ctrl-C can land in the middle of a forward the scheduler had started.
    steps = q("sql", "SELECT step, attrs FROM steps WHERE proc = 0 AND interrupted = 0", "--trace", traced["out"])
    decode = {s["step"] for s in steps if json.loads(s["attrs"]).get("forward_mode") == "decode"}
    assert decode
    rows = q("collectives", "--trace", traced["out"])
    per_step = {}
    assert rows and all(r["group"] == "tp" for r in rows)
    for r in rows:
        for step, n in r["per_step"].items():
            if int(step) in decode:
                per_step.setdefault(r["op"], {}).setdefault(int(step), 0)
                per_step[r["op"]][int(step)] += n
    # What SGLang 0.5.23 issues for this 2-layer Llama at TP=2: the embedding's all_reduce and
    # one per row-parallel output (paid at layer boundaries), and the logits' all_gather.
    assert set(per_step["all_reduce"].values()) == {1 + 2 * LAYERS}
    assert set(per_step["all_gather"].values()) == {1}
    assert all(r["group"] == "tp" for r in rows)


def _serve_tp1(seeded_model, d):
    """TP=1 traced, the same seeded model: the reference `compare` holds TP=2 against."""
    out = d / "trace"
    tokens, _ = _serve(1, seeded_model, d / "tp1.log", [TT, "record", "-o", str(out), "--"])
    return dict(out=str(out), tokens=tokens)


DUMMY_WINDOW = (0, 3)  # of the dummy server's recording: its warm-up request's first steps


def _serve_dummy(d):
    """TP=2 with `--load-format dummy`, the usual quick way to run SGLang: every rank's shards
    are identical, so values alone cannot tell a partial sum or a shard from a whole tensor.
    Recorded with a `--steps` window that closes inside the warm-up request, so that the server
    runs on with the tracer taken out (Tracer.go_dormant) and must still answer."""
    out = d / "trace"
    window = "%d:%d" % DUMMY_WINDOW
    srv = server.SGLangServer(2, log_path=d / "dummy.log",
                              prefix=[TT, "record", "-o", str(out), "--steps", window, "--"],
                              startup_timeout=600)
    with srv:
        tokens = server.output_ids(srv.generate(server.DEFAULT_INPUT_IDS, max_new_tokens=4))
    assert tokens and not srv.killed, srv.log_tail()
    return str(out)


@pytest.fixture(scope="module")
def tp1_and_dummy(seeded_model, tmp_path_factory):
    """The TP=1 and the dummy-weight servers, started together (server.at_once). The TP=2
    seeded server runs alone: its test stops it right after the response, and asks that the
    ranks' last steps are on disk, which a second server's start-up should not slow."""
    tp1, dummy = server.at_once(lambda: _serve_tp1(seeded_model, tmp_path_factory.mktemp("sglang-tp1")),
                                lambda: _serve_dummy(tmp_path_factory.mktemp("sglang-dummy")))
    return dict(tp1=tp1, dummy=dummy)


@pytest.fixture(scope="module")
def traced_tp1(tp1_and_dummy):
    return tp1_and_dummy["tp1"]


def test_tp1_gives_the_same_tokens_and_everything_replicate(traced_tp1):
    assert traced_tp1["tokens"] == server.SEEDED_REFERENCE_TOKENS
    pts = q("placement", "*:*", "--trace", traced_tp1["out"])
    assert pts and {p["placement"] for p in pts} == {"replicate"}


def test_compare_tp1_against_tp2_finds_no_divergence(traced, traced_tp1):
    """The same seeded model at TP=1 and TP=2: every point unsharded by its placement (shards
    summed, partial sums by their reduced sum) agrees within the tolerance of bfloat16 rounding
    in another reduction order."""
    r = CliRunner().invoke(main, ["compare", traced_tp1["out"], traced["out"], "--json"])
    assert r.exit_code == 0, r.output[-3000:]
    res = json.loads(r.stdout)
    assert res["first_divergence"] is None
    assert res["groups"]["a"]["size"] == 1 and res["groups"]["b"]["size"] == 2
    assert "TP 1 against TP 2" in res["tolerance"]["reason"]
    # Steps paired by forward mode and token count: the prefill and the decode steps.
    assert len(res["steps"]) >= 2
    by = {p["point"]: p for p in res["points"]}
    counts = {}
    for p in res["points"]:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    assert counts.get("same", 0) >= 50, counts
    # Compared across placements: a shard against the whole, a partial sum by its reduced sum.
    qkv = by["model.layers.0.self_attn.qkv_proj:output.0"]
    assert qkv["status"] == "same" and qkv["placement_b"].startswith("shard("), qkv
    o = by["model.layers.0.self_attn.o_proj:output.0"]
    assert o["status"] == "same" and o["placement_b"] == "partial", o
    # Whatever was not compared says why.
    assert all(p.get("reason") for p in res["points"] if p["status"] == "not comparable")


@pytest.fixture(scope="module")
def traced_dummy(tp1_and_dummy):
    return tp1_and_dummy["dummy"]


def test_dummy_weights_follow_the_collectives_and_the_layer_classes(traced_dummy):
    pts = {p["point"]: p for p in q("placement", "model.layers.*", "--trace", traced_dummy)}
    for layer in range(LAYERS):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            point = f"model.layers.{layer}.{name}:output.0"
            p = pts[point]
            # Equal on both ranks, yet the very input of the all_reduce that completes it.
            assert p["shapes"]["0"] == p["shapes"]["1"] and p["fingerprint"] is not None
            assert (p["placement"], p["reduction"]) == ("partial", "pre-reduction"), p
            r = q("reduction", point, "--trace", traced_dummy)
            assert r["collective"]["op"] == "all_reduce" and r["collective"]["group"] == "tp", r
            assert any(i["kind"] == "values" and "identical shards" in i["text"] for i in r["evidence_items"]), r
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            p = pts[f"model.layers.{layer}.{name}:output.0"]
            assert p["placement"] == f"shard({len(p['shapes']['0']) - 1})", p
            assert p["reduction"] == "no-reduction" and p["layer_semantics"]["agrees"] is True, p
            assert any("dummy weights" in e for e in p["evidence"]), p
    r = q("reduction", "model.embed_tokens", "--trace", traced_dummy)
    assert (r["verdict"], r["placement"]) == ("post-reduction", "replicate"), r
    # The residual stream entering each later layer (RMSNorm(x, residual)'s second output,
    # what EAGLE-3 captures): x + residual, no-reduction, though with these weights the layer's
    # x is lost to bf16 rounding and the values equal the embedding's all_reduce output.
    for layer in range(1, LAYERS):
        p = pts[f"model.layers.{layer}.input_layernorm:output.1"]
        assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p


def test_a_closed_window_leaves_the_server_serving(traced_dummy):
    # Each TP worker traced the window's steps, then took its hooks and collective wrappers out
    # (SGLang's GroupCoordinator methods pass calls straight on) and served the rest of the
    # warm-up and the fixture's request untraced: the fixture got its tokens.
    traces = [t for t in map(load_rank_file, rank_files(traced_dummy)) if t.steps]
    assert sorted(t.identity.get("tp_rank") for t in traces) == [0, 1]
    for t in traces:
        assert not t.errors, t.errors
        assert t.header["config"]["steps"] == list(DUMMY_WINDOW)
        assert sorted(t.steps) == list(range(*DUMMY_WINDOW))
        assert all(s.collectives for s in t.steps.values())
        if t.end is not None:  # (SGLang may SIGKILL its schedulers before they write it)
            assert t.end["stats"]["dormant_after_step"] == DUMMY_WINDOW[1] - 1
