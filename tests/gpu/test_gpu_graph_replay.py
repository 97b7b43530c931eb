"""CUDA-graph replays traced on a real GPU: the example captured in a graph and replayed with new
inputs gives the fingerprints, outputs and verdicts of eager steps (bench/graph_check.py does
the comparing). Skipped without CUDA; run on the lent H200 by bench/gpu_graphs.sh."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (CUDA-graph capture and replay); the CPU "
                                       "bookkeeping is tests/unit/test_cuda_graph_replay.py")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "tp_llama.py")


def _run(args, timeout=300):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replays_match_eager_steps_of_the_same_inputs(tmp_path, dtype):
    common = ["--device", "cuda", "--dtype", dtype, "--steps", "5", "--batch", "4", "--seq", "8"]
    plain, traced = tmp_path / "plain.json", tmp_path / "traced.json"
    _run([EXAMPLE, *common, "--cuda-graph", "--out", str(plain)])
    _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / "graph"), "--",
          sys.executable, EXAMPLE, *common, "--cuda-graph", "--out", str(traced)])
    _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / "eager"), "--",
          sys.executable, EXAMPLE, *common, "--out", str(tmp_path / "eager.json")])
    report = tmp_path / "check.json"
    out = _run([os.path.join(ROOT, "bench", "graph_check.py"), "--eager", str(tmp_path / "eager"),
                "--graph", str(tmp_path / "graph"), "--plain-out", str(plain), "--traced-out", str(traced),
                "--json", str(report)])
    rep = json.loads(report.read_text())
    assert rep["ok"], out
    assert rep["replayed_steps"] == 4 and rep["fingerprints_equal"] == rep["fingerprints"] > 0


def test_compare_eager_with_replays_and_name_a_stale_input_buffer(tmp_path):
    """`tensor-trace compare` of eager steps against CUDA-graph replays of the same inputs finds
    no divergence; with the planted bug (replays never refresh the static input buffer) it names
    the first point that parts. Example step k is graph-run step k + 1 (step 1 is the capture)."""
    common = ["--device", "cuda", "--dtype", "float32", "--steps", "5", "--batch", "4", "--seq", "8"]
    runs = {"eager": [], "graph": ["--cuda-graph"], "stale": ["--cuda-graph", "--bug-stale-graph-input"]}
    for name, extra in runs.items():
        _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / name), "--",
              sys.executable, EXAMPLE, *common, *extra])

    def compare(b):
        r = subprocess.run([sys.executable, "-m", "tensor_trace", "compare", str(tmp_path / "eager"),
                            str(tmp_path / b), "--steps", "1-4:2", "--json"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode in (0, 1), r.stderr[-3000:]
        out = json.loads(r.stdout)
        statuses = [p["status"] for p in out["points"]]
        worst = max((p for p in out["points"] if p.get("rel_error") is not None),
                    key=lambda p: p["rel_error"], default=None)
        print(f"compare eager {b}: exit {r.returncode}, {len(statuses)} points "
              f"{ {s: statuses.count(s) for s in set(statuses)} }, first divergence "
              f"{out['first_divergence'] and {k: out['first_divergence'][k] for k in ('point', 'rel_error', 'tolerance')}}"
              f", largest relative error {worst and (worst['point'], worst['rel_error'], worst.get('tolerance'))}")
        return r.returncode, out

    code, same = compare("graph")
    assert code == 0 and same["first_divergence"] is None, same["first_divergence"]
    assert same["points"] and all(p["status"] == "same" for p in same["points"])
    code, stale = compare("stale")
    first = stale["first_divergence"]
    assert code == 1 and first is not None
    # The replays read the captured step's ids: the first point in execution order that parts
    # is the step's input itself (the root module's ``:input.0``), the ids of the wrong step.
    assert first["point"] == ":input.0" and (first["step_a"], first["step_b"]) == (1, 2), first
