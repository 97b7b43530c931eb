"""Nothing synchronises the GPU inside a traced step: the example (bf16) runs blocks of steps
untraced and traced, with and without fingerprints, under ``set_sync_debug_mode("error")`` and
``torch.profiler`` (blocking CUDA runtime calls counted), on one GPU and, with two, at TP=2 over
NCCL; a deliberate ``.item()`` must be caught (scripts/sync_check.py does the running)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "sync_check.py")


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs"))])
def test_no_blocking_call_in_traced_steps(tmp_path, world):
    out = tmp_path / "sync.json"
    launch = [] if world == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    r = subprocess.run([sys.executable, *launch, SCRIPT, "--steps", "10", "--json", str(out)],
                       capture_output=True, text=True, timeout=400)
    print(r.stdout[-3000:])
    assert out.exists(), r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["world"] == world and len(rep["ranks"]) == world
    for rank in rep["ranks"]:
        assert rank["control"] == "caught", rank  # the check does see a synchronisation
        by_variant = {res["variant"]: res for res in rank["results"]}
        assert set(by_variant) == {"plain", "traced-nofp", "traced-fp"}
        for res in by_variant.values():
            assert not res["sync_calls"] and not res["raised"], res
        for v in ("traced-nofp", "traced-fp"):
            assert by_variant[v]["tracer_errors"] == 0 and by_variant[v]["traced_steps"] > 0, by_variant[v]
    assert rep["ok"] and r.returncode == 0
