"""Smoke tests of a real SGLang 0.5.23 server on CPU, untraced (tests/sglang/server.py drives it).

Needs the SGLang venv: `bash tests/sglang/setup.sh` (about 2 minutes); skipped without it.
Each test starts one server (about 20-40 s on 2 cores), generates 8 tokens and stops it with SIGINT.

TP=1 and TP=2 must return the same tokens. Not with `--load-format dummy`: SGLang seeds each
rank's shard separately, so TP=2 serves a different model, and its +-1e-3 weights make every
logit a near tie (see server.make_seeded_checkpoint). Both servers load one seeded safetensors
checkpoint instead, and must both reproduce transformers' greedy output for it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("tt_sglang_server", Path(__file__).with_name("server.py"))
server = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = server
_spec.loader.exec_module(server)

_ready, _why = server.venv_ready()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not _ready, reason=f"no SGLang venv: {_why}"),
]

HIDDEN = 64  # tests/data/tiny-llama/config.json
# Exit codes of a clean SIGINT stop: the launcher re-raises SIGINT (KeyboardInterrupt), or
# exits 0; 130 is what `tensor-trace record` reports for a child killed by SIGINT.
CLEAN_EXIT = (0, -2, 130)


def _report(srv, what: str) -> None:
    print(f"\n[{what}] ready in {srv.startup_s:.1f} s, {srv.n_processes} processes, "
          f"peak RSS {srv.peak_rss / 2**30:.2f} GiB, exit {srv.exit_code}")


def _check_stopped(srv) -> None:
    assert not srv.killed, f"server needed SIGKILL after SIGINT\n{srv.log_tail()}"
    assert srv.exit_code in CLEAN_EXIT, f"exit code {srv.exit_code}\n{srv.log_tail()}"
    assert not srv.pids(), f"processes left: {srv.pids()}"


@pytest.fixture(scope="module")
def seeded_model(tmp_path_factory):
    return server.make_seeded_checkpoint(tmp_path_factory.mktemp("tiny-llama-seeded"))


_tokens_by_tp: dict[int, list[int]] = {}


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_same_tokens_at_tp(tp, seeded_model, tmp_path):
    srv = server.SGLangServer(tp, model_path=seeded_model, load_format="safetensors",
                              log_path=tmp_path / f"sglang-tp{tp}.log")
    with srv:
        result = srv.generate(server.DEFAULT_INPUT_IDS, max_new_tokens=8)
        tokens = server.output_ids(result)
    _report(srv, f"tp={tp}")
    _check_stopped(srv)
    _tokens_by_tp[tp] = tokens
    assert len(tokens) == 8, result
    assert tokens == server.SEEDED_REFERENCE_TOKENS, (
        f"TP={tp} tokens {tokens} differ from transformers' greedy output "
        f"{server.SEEDED_REFERENCE_TOKENS} for the same checkpoint")
    for other, other_tokens in _tokens_by_tp.items():
        assert tokens == other_tokens, f"TP={tp} {tokens} != TP={other} {other_tokens}"


def test_eagle3_aux_hidden_states_come_back(tmp_path):
    """Dummy weights, TP=2, EAGLE-3 aux capture without a draft model (layer ids 0)."""
    srv = server.SGLangServer(2, extra_args=server.EAGLE3_AUX_ARGS, log_path=tmp_path / "sglang-aux.log")
    with srv:
        result = srv.generate(server.DEFAULT_INPUT_IDS, max_new_tokens=8, return_hidden_states=True)
        plain = srv.generate(server.DEFAULT_INPUT_IDS, max_new_tokens=8)
    _report(srv, "tp=2 eagle3 aux")
    _check_stopped(srv)

    assert len(server.output_ids(result)) == 8
    meta = result["meta_info"]
    hs = meta.get("hidden_states")
    assert hs, f"no hidden_states in meta_info: {sorted(meta)}"
    # One entry per generated token: the prefill's [prompt_len][hidden], then one [hidden] per decode step.
    assert len(hs) == meta["completion_tokens"] == 8, [server._shape(h) for h in hs]
    rows = [hs[0][i] for i in range(len(hs[0]))] + [h[0] if isinstance(h[0], list) else h for h in hs[1:]]
    assert len(hs[0]) == len(server.DEFAULT_INPUT_IDS), server._shape(hs[0])
    for row in rows:
        assert len(row) == HIDDEN, len(row)  # one captured layer (id 0) of width hidden_size
        assert all(isinstance(x, float) and math.isfinite(x) for x in row)
    assert any(x != 0.0 for row in rows for x in row)

    assert "hidden_states" not in plain["meta_info"], "hidden states came back without being asked for"
