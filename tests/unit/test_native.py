"""tracer/native.py: the optional C++ fingerprint table, built here and checked against the
Python path through Triton's interpreter (tests/gpu checks nothing of it yet: it is opt-in)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "native_interpret.py"


def _build_env():
    env = dict(os.environ, TENSOR_TRACE_NATIVE="1", TRITON_INTERPRET="1",
               TENSOR_TRACE_MULTI_TENSOR="interpret")
    # ninja from the virtual environment (the dev extra) when it is not on PATH already
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def test_native_table_equals_the_python_path():
    pytest.importorskip("triton", reason="Triton is in the dev extra on Linux x86-64 only")
    env = _build_env()
    if not (shutil.which("ninja", path=env["PATH"]) and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("no C++ compiler or ninja to build the extension")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["table_True"] and not report["table_False"]
    assert report["values_equal"] == 30  # 15 fingerprints in each of two steps, all equal
    # the table is found at the first deferred tensor (which takes the Python path), so the
    # first step holds one tensor fewer in it
    assert report["held_in_table"] == [10, 11]
    assert report["stale_True"] == report["stale_False"] == 2
    assert report["mid_step_left"] == 2  # flushed past the bound, then two more held
    assert report["not_taken"] == [-1, -1, -1, 0]  # sparse, meta, integer: the Python path


def test_not_built_or_used_unless_asked(monkeypatch):
    import torch

    from tensor_trace.tracer import native
    from tensor_trace.tracer.fingerprint import StepFingerprints

    monkeypatch.delenv("TENSOR_TRACE_NATIVE", raising=False)
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    fps.add_one(torch.randn(4))
    assert fps._nt is None and not fps._native_wanted
    assert not native.enabled() and native.table_class() is None and not native._state["started"]
