"""A TP program whose blocks are compiled (torchtitan's torch.compile per block): the blocks'
boundaries are judged as in eager mode, what torch.compile traces inside them is no collective
of the run, the collectives their graphs run are spans of their calls, and tracing changes no
result."""

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tensor_trace.cli import main as cli_main
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tt_helpers import TORCHRUN, base_env, record, run_cmd

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "tp_api_compiled.py"
sys.path[:0] = [str(HERE / "scripts")]

import tp_api_llama  # noqa: E402
import truth_corpus as truth  # noqa: E402

pytestmark = pytest.mark.integration
TP, STEPS = 2, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("compiled")
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(TP), SCRIPT, "--plan", "plain", "--steps", str(STEPS)]
    plain = run_cmd(cmd + ["--dump", work / "plain"], timeout=300, env=base_env())
    assert plain.returncode == 0, plain.stderr[-3000:]
    traced = record(work / "trace", cmd + ["--dump", work / "traced"], timeout=300, check=False)
    assert traced.returncode == 0, traced.stderr[-3000:]
    return work, traced


def test_no_tracer_error_from_what_torch_compile_traces(runs):
    work, traced = runs
    traces = [load_rank_file(f) for f in rank_files(work / "trace")]
    assert len(traces) == TP
    for t in traces:
        assert len(t.steps) == STEPS
        assert not t.errors, t.errors  # (were: FunctionalTensors held for fingerprints)
    assert "tensor-trace: error in" not in traced.stderr, traced.stderr[-2000:]


def test_the_compiled_blocks_outputs_are_judged_as_the_plan_says(runs):
    work, _ = runs
    r = CliRunner().invoke(cli_main, ["query", "placement", "layers.*", "--trace", str(work / "trace"), "--json"])
    assert r.exit_code == 0, r.output
    got = {p["point"]: p for p in json.loads(r.stdout)}
    walk = truth.titan_truth("plain", TP, plan_styles=tp_api_llama.plan_styles, sizes=tp_api_llama.SIZES)
    for i in range(tp_api_llama.SIZES["layers"]):
        point = f"layers.{i}:output"
        want = walk.points[point]
        assert (got[point]["placement"], got[point]["reduction"]) == (want.placement, want.reduction), got[point]["evidence"]


def test_tracing_changes_no_result(runs):
    work, _ = runs
    for rank in range(TP):
        plain = torch.load(work / "plain" / "plain" / f"rank{rank}.pt")
        traced = torch.load(work / "traced" / "plain" / f"rank{rank}.pt")
        assert len(plain) == len(traced) == STEPS
        for a, b in zip(plain, traced):
            assert torch.equal(a, b)


def test_tracing_changes_no_result_under_inductor(tmp_path):
    """Inductor registers its lowerings of the functional collectives on what it finds in
    ``torch.ops._c10d_functional``: the tracer's wrappers there must pass for the packets."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(TP), SCRIPT, "--plan", "plain", "--steps", "1"]
    env = base_env(TT_COMPILE_BACKEND="inductor")
    plain = run_cmd(cmd + ["--dump", tmp_path / "plain"], timeout=600, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    traced = record(tmp_path / "trace", cmd + ["--dump", tmp_path / "traced"], timeout=600, check=False, env=env)
    assert traced.returncode == 0, traced.stderr[-3000:]
    for rank in range(TP):
        a = torch.load(tmp_path / "plain" / "plain" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "traced" / "plain" / f"rank{rank}.pt")
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fullgraph", ["0", "1"])
def test_c10d_all_reduce_inside_compiled_blocks(tmp_path, fullgraph):
    """``dist.all_reduce`` inside a compiled block (Megatron-style layers, not DTensor): dynamo
    makes it a collective of the graph, even through the tracer's wrapper and with
    ``fullgraph=True``; results stay bit-equal and the blocks' outputs are judged."""
    script = HERE / "scripts" / "c10d_compiled.py"
    env = base_env(TT_FULLGRAPH=fullgraph)
    (tmp_path / "plain").mkdir()
    (tmp_path / "traced").mkdir()
    plain = run_cmd([TORCHRUN, "--standalone", "--nproc-per-node", str(TP), script, tmp_path / "plain"],
                    timeout=300, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    traced = record(tmp_path / "trace", [TORCHRUN, "--standalone", "--nproc-per-node", str(TP), script,
                                         tmp_path / "traced"], timeout=300, check=False, env=env)
    assert traced.returncode == 0, traced.stderr[-3000:]
    for rank in range(TP):
        a = torch.load(tmp_path / "plain" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "traced" / f"rank{rank}.pt")
        assert len(a) == len(b) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    traces = [load_rank_file(f) for f in rank_files(tmp_path / "trace")]
    assert len(traces) == TP and all(not t.errors and len(t.steps) == 3 for t in traces)
    r = CliRunner().invoke(cli_main, ["query", "placement", "layers.*", "--trace", str(tmp_path / "trace"), "--json"])
    assert r.exit_code == 0, r.output
    got = {p["point"]: p for p in json.loads(r.stdout)}
    for i in range(2):  # x + the reduced MLP output: whole on every rank, a sum, not the reduction's output
        p = got[f"layers.{i}:output"]
        assert (p["placement"], p["reduction"]) == ("replicate", "no-reduction"), p["evidence"]
    # the all_reduce that ran inside each compiled block's graph, a span of that block's call
    # (not of aot_eager's graph module, one object for both blocks, that it runs)
    assert _collectives(tmp_path / "trace") == {("layers.0", "sum"): [1, 1, 1], ("layers.1", "sum"): [1, 1, 1]}


def _collectives(trace) -> dict:
    r = CliRunner().invoke(cli_main, ["query", "collectives", "--trace", str(trace), "--json"])
    assert r.exit_code == 0, r.output
    return {(c["module"], c["reduce_op"]): list(c["per_step"].values()) for c in json.loads(r.stdout)
            if c["op"].startswith("all_reduce")}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_module_that_ends_with_its_all_reduce_is_post_reduction(tmp_path, backend):
    """The row-parallel modules compiled alone (from a held-out program: attention and MLP
    compiled one by one): their graphs call the functional all_reduce's overload, which the
    tracer sees there, so what they return is that reduction's output (it was judged
    no-reduction when the collective inside was not seen), and tracing changes no result."""
    script = HERE / "scripts" / "c10d_compiled.py"
    env = base_env(TT_COMPILE="down", TT_COMPILE_BACKEND=backend)
    (tmp_path / "plain").mkdir()
    (tmp_path / "traced").mkdir()
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(TP), script]
    plain = run_cmd(cmd + [tmp_path / "plain"], timeout=600, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    traced = record(tmp_path / "trace", cmd + [tmp_path / "traced"], timeout=600, check=False, env=env)
    assert traced.returncode == 0, traced.stderr[-3000:]
    for rank in range(TP):
        a = torch.load(tmp_path / "plain" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "traced" / f"rank{rank}.pt")
        assert len(a) == len(b) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    r = CliRunner().invoke(cli_main, ["query", "placement", "layers.*:*", "--trace", str(tmp_path / "trace"), "--json"])
    assert r.exit_code == 0, r.output
    got = {p["point"]: p for p in json.loads(r.stdout)}
    for i in range(2):
        p = got[f"layers.{i}.down:output"]
        assert (p["placement"], p["reduction"]) == ("replicate", "post-reduction"), p["evidence"]
        p = got[f"layers.{i}.down:input.0"]
        assert (p["placement"], p["reduction"]) == ("shard(1)", "no-reduction"), p["evidence"]
    assert _collectives(tmp_path / "trace") == {("layers.0.down", "sum"): [1, 1, 1],
                                                ("layers.1.down", "sum"): [1, 1, 1]}
