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
