"""The multi-tensor fingerprint kernel (tracer/multi_tensor.py), run by Triton's interpreter on
CPU tensors: a GPU's kernel, checked here without a GPU (tests/gpu checks it on one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "multi_tensor_interpret.py"


def test_kernel_values_and_bookkeeping_under_interpreter():
    pytest.importorskip("triton", reason="Triton is in the dev extra on Linux x86-64 only")
    # the Python path's bookkeeping (its table of held tensors): tracer/native.py's C++ table,
    # taken where the extension is built (or once it is, mid-script), is test_native.py's
    env = dict(os.environ, TRITON_INTERPRET="1", TENSOR_TRACE_MULTI_TENSOR="interpret", TENSOR_TRACE_NATIVE="0")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kernel_tensors"] == 10
    assert report["deferred_equal_immediate"] == 7
    assert report["deferred_row_strided_in_kernel"] == [[16, 40]]  # the split view, not stacked
    assert report["hook_table_launches"] == [4, 1]  # one kind: the hooks' table, launched once
    assert report["capture_table_filled"] == 5
    assert report["capture_chunks"] == 50  # one program per chunk, contiguous and row-strided
    assert report["gated_off_sums"] == 0.0  # a replay the schedule skips: the kernel reads nothing
    assert report["capture_chunks_short_arena"] == 7  # 16 times as long: the first that fits in 7


def test_kernel_not_used_without_opt_in_on_cpu():
    import torch

    from tensor_trace.tracer import multi_tensor

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on in this process")
    assert not multi_tensor.usable(torch.ones(3))


def test_replay_gate_of_an_arena_made_under_inference_mode_is_written_outside_it():
    """SGLang captures under inference_mode and may replay (and the tracer stops) outside it:
    the gate must stay writable, and is written only when its value changes."""
    import torch

    from tensor_trace.tracer import multi_tensor

    with torch.inference_mode():
        arena = multi_tensor.TableArena(torch.device("cpu"), 18)
    gate = arena.gate
    assert arena.buf[0].item() == 1 and gate.value == 1 and arena.used == 2
    flag, writes = gate.flag, []

    class Counting:  # the gate's one-element view, its device writes counted
        def fill_(self, v):
            writes.append(v)
            return flag.fill_(v)

    gate.flag = Counting()
    with torch.no_grad():
        gate.set(False)
        gate.set(False)
    assert arena.buf[0].item() == 0 and writes == [0]
    with torch.inference_mode():
        gate.set(True)
    assert arena.buf[0].item() == 1 and writes == [0, 1]
