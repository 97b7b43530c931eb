"""EAGLE-3 speculative decoding in real SGLang 0.5.23 (CPU, TP=2), traced: the project's story.

An engineer's EAGLE-3 draft was trained on hidden states captured after layers 2, 30 and 58,
and was fed the embedding plus layers 2 and 30. Here the target is a 4-layer Llama and there
are two drafts: aux layer ids [0, 1, 2] (the right wiring: the residual stream after layers 0,
1, 2) and [-1, 0, 1] (the miswiring: the embedding and layers 0, 1). The test asks the trace,
as the engineer would, in two commands: what feeds the draft's ``fc``
(``query lineage`` / ``contract save`` on the right run) and what changed
(``contract check`` on the miswired run).

Three servers, one per configuration, started together (module-scoped fixtures): plain
decoding untraced (the reference tokens), and EAGLE-3 traced with each draft. Weights: ``wide_dummy`` (per-shard
draws wide enough that greedy decoding meets no near-ties), the EAGLE-3 stand-ins ``eagle3``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

import tt_sglang_server as server  # noqa: E402  (loaded by conftest.py)

# The first test starts all three servers at once (about 40 s each alone on an idle 2-core
# machine, over ten minutes each on a shared one).
pytestmark = [pytest.mark.sglang,
              pytest.mark.timeout(4800)]

TT = str(server.VENV / "bin" / "tensor-trace")
MODELS = server.REPO_ROOT / "tests" / "data" / "sglang-models"
TARGET = MODELS / "llama-4layer"
STANDINS = ("wide_dummy", "eagle3")
NEW_TOKENS = 6
FC_INPUT = "LlamaForCausalLMEagle3.model.fc:input.0"  # the draft model's fc, its input
TIMINGS: dict = {}


def _eagle3_args(draft: str) -> list[str]:
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(MODELS / draft),
            "--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]


def _serve(d: Path, name: str, extra=(), traced=True):
    out = d / name
    prefix = [TT, "record", "-o", str(out), "--"] if traced else []
    t0 = time.monotonic()
    srv = server.SGLangServer(2, model_path=TARGET, extra_args=list(extra), standins=STANDINS, prefix=prefix,
                              log_path=d / f"{name}.log", startup_timeout=1500)
    with srv:
        tokens = server.output_ids(srv.generate(server.DEFAULT_INPUT_IDS, max_new_tokens=NEW_TOKENS, timeout=300))
        time.sleep(3)  # let the ranks' writers flush the last request's steps before SIGINT
    assert not srv.killed, srv.log_tail()
    TIMINGS[name] = dict(startup_s=round(srv.startup_s, 1), wall_s=round(time.monotonic() - t0, 1))
    return dict(out=str(out), tokens=tokens, exit=srv.exit_code, log=srv.log_path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("eagle3")


@pytest.fixture(scope="module")
def served(workdir):
    """The three servers, started together (server.at_once)."""
    plain, wired, miswired = server.at_once(
        lambda: _serve(workdir, "plain", traced=False),
        lambda: _serve(workdir, "wired-012", _eagle3_args("eagle3-draft-012")),
        lambda: _serve(workdir, "miswired-m101", _eagle3_args("eagle3-draft-m101")))
    return dict(plain=plain, wired=wired, miswired=miswired)


@pytest.fixture(scope="module")
def plain(served):
    """Plain decoding of the same target, untraced: the tokens speculative decoding must give."""
    return served["plain"]


@pytest.fixture(scope="module")
def wired(served):
    return served["wired"]


@pytest.fixture(scope="module")
def miswired(served):
    return served["miswired"]


def q(*args, ok=True):
    r = CliRunner().invoke(main, [*map(str, args), "--json"])
    if ok:
        assert r.exit_code == 0, r.output
    return r.exit_code, json.loads(r.stdout)


def test_speculative_tokens_equal_plain_decoding(wired, miswired, plain):
    assert len(plain["tokens"]) == NEW_TOKENS
    assert wired["tokens"] == plain["tokens"]
    assert miswired["tokens"] == plain["tokens"]
    print("timings:", TIMINGS)


@pytest.mark.parametrize("run", ["wired", "miswired"])
def test_both_ranks_traced_without_errors(run, request):
    out = request.getfixturevalue(run)["out"]
    traces = [load_rank_file(f) for f in rank_files(out)]
    traced = [t for t in traces if t.steps]
    assert sorted(t.identity.get("rank") for t in traced) == [0, 1]
    for t in traced:
        assert not t.errors, t.errors


def test_draft_and_verify_steps_are_tagged(wired):
    _, verify = q("query", "steps", "--where", "forward_mode=target_verify", "--trace", wired["out"])
    assert verify and all(s["attrs"]["model"] == "LlamaForCausalLM" and "draft" not in s["attrs"] for s in verify)
    _, draft = q("query", "steps", "--where", "draft=true", "--trace", wired["out"])
    assert draft and all(s["attrs"]["model"] == "LlamaForCausalLMEagle3" for s in draft)
    modes = {s["attrs"]["forward_mode"] for s in draft}
    assert {"extend", "decode", "draft_extend_v2"} <= modes, modes
    # Every step is one or the other, on both ranks.
    _, every = q("query", "steps", "--trace", wired["out"])
    assert len(every) == len(verify) + len(draft) + sum(
        1 for s in every if s["attrs"].get("forward_mode") in ("extend", "decode") and "draft" not in s["attrs"])
    assert {s["rank"] for s in draft} == {0, 1}


def test_fc_input_lineage_reaches_the_captures_and_their_layers(wired):
    _, lin = q("query", "lineage", FC_INPUT, "--trace", wired["out"])
    print(json.dumps(lin, indent=1))
    assert [s["point"] for s in lin["sources"]] == [f"capture:eagle3.aux.{k}" for k in range(3)]
    # Crossed a step: the target's logits processor concatenated them, the draft got the result.
    assert any("logits_processor" in p for p in lin.get("inside", [])), lin
    # Aux layer ids [0, 1, 2]: the residual stream after layers 0, 1, 2, i.e. entering layers
    # 1, 2, 3, where SGLang's fused add+norm returns it (the input norm's second output).
    for k, s in enumerate(lin["sources"]):
        c = s["captured"]
        assert c["points"] == [f"model.layers.{k + 1}.input_layernorm:output.1"], (k, c)
        assert f"after model.layers.{k})" in c["what"], c


def test_contract_check_names_the_embedding_and_the_missing_layer(wired, miswired, workdir):
    contract = workdir / "eagle3-fc.json"
    r = CliRunner().invoke(main, ["contract", "save", FC_INPUT, "-o", str(contract), "--trace", wired["out"]])
    assert r.exit_code == 0, r.output
    print(r.output)
    ok = CliRunner().invoke(main, ["contract", "check", str(contract), "--trace", wired["out"]])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, ["contract", "check", str(contract), "--trace", miswired["out"]])
    print(bad.output)
    assert bad.exit_code == 1, bad.output
    _, res = q("contract", "check", str(contract), "--trace", miswired["out"], ok=False)
    kinds = {m["kind"]: m for m in res["mismatches"]}
    assert kinds["capture_extra"]["point"].startswith("model.embed_tokens:output")
    assert kinds["capture_extra"]["source"].startswith("capture:eagle3.aux.0")
    assert kinds["capture_missing"]["point"] == "model.layers.3.input_layernorm:output.1"
    assert "after model.layers.2" in kinds["capture_missing"]["message"]
    assert "model.embed_tokens" in bad.output and "after model.layers.2" in bad.output


def test_aux_captures_are_whole_residual_streams(wired):
    # What the draft is fed: the residual stream entering layers 1, 2, 3 (aux ids 0, 1, 2), a
    # reduced layer output plus the residual added locally: whole values that are not a
    # reduction's output (design.md: no-reduction), of the target's hidden width.
    _, pts = q("query", "placement", "capture:*", "--trace", wired["out"])
    by_point = {p["point"]: p for p in pts}
    assert sorted(by_point) == [f"capture:eagle3.aux.{k}" for k in range(3)]
    for k in range(3):
        p = by_point[f"capture:eagle3.aux.{k}"]
        assert p["capture"]["layer"] == f"model.layers.{k + 1}" and p["capture"]["eagle3_layer_id"] == k, p
        assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p
        assert list(p["shapes"].values())[0][-1] == 64
