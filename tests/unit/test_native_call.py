"""tracer/native_call.py: the C call wrapper records what the Python one does, record for record.

One program (tests/unit/scripts/native_call_record.py: bench/call_patterns.py's models and a
model of unusual calls, in four tracer sessions) recorded with TENSOR_TRACE_NATIVE=1 (the C
wrapper, built here once per run as tests/unit/test_native.py builds it) and =0 (the Python
wrapper); the rank files must hold the same spans, times apart."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tensor_trace.exporters.analysis.tolerance import Observed, fp_equal
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

SCRIPT = Path(__file__).parent / "scripts" / "native_call_record.py"


def _record(out: Path, native: str) -> dict:
    env = dict(os.environ, TENSOR_TRACE_NATIVE=native, OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spans(folder: Path):
    """Per step: the spans as (index, parent, path, class, call, tensors, flags, fingerprint
    refs), and apart the times and the tensors' fingerprints; the rank file's errors."""
    (path,) = rank_files(str(folder))
    rt = load_rank_file(path)
    steps, times, fps = {}, {}, {}
    for n, step in sorted(rt.steps.items()):
        spans = sorted(step.spans, key=lambda s: s.index)
        steps[n] = [(s.index, s.parent, s.path, s.cls, s.call,
                     [(t.slot, t.shape, t.dtype, t.device, t.meta, t.fp is None) for t in s.tensors],
                     s.flags, s.fp_refs) for s in spans]
        times[n] = {s.index: (s.parent, s.t0, s.dur) for s in spans}
        fps[n] = [Observed(t.shape, t.dtype, t.fp) for s in spans for t in s.tensors if t.fp is not None]
    return steps, times, fps, rt.errors


def test_the_c_call_wrapper_records_what_the_python_one_does(tmp_path):
    env_path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    if not (shutil.which("ninja", path=env_path) and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("no C++ compiler or ninja to build the extension")
    native = _record(tmp_path / "native", "1")
    python = _record(tmp_path / "python", "0")
    in_c_nofp, in_c_fp = native["nofp"]["in_c"], native["fp"]["in_c"]
    for session in ("nofp", "fp", "fp-lineage", "limit"):
        in_c = native[session].pop("in_c")
        assert python[session].pop("in_c") == 0 and in_c > 0
        for report in (native, python):  # (times take more or fewer bytes)
            report[session]["stats"].pop("bytes")
        assert native[session] == python[session], session  # stats (spans, drops), no errors
        assert native[session]["errors"] == 0
        got, got_times, got_fps, got_errors = _spans(tmp_path / "native" / session)
        want, _, want_fps, want_errors = _spans(tmp_path / "python" / session)
        assert got == want, session
        assert got_errors == want_errors == []
        # (values read in C, tracer/native_host.py, against numpy's: the same within the merge's
        # tolerance, not to the last bit)
        assert got_fps.keys() == want_fps.keys()
        for n in got_fps:
            assert len(got_fps[n]) == len(want_fps[n])
            assert all(fp_equal(a, b) for a, b in zip(got_fps[n], want_fps[n])), (session, n)
        for step in got_times.values():  # times: from the step's start, each inside its parent
            for parent, t0, dur in step.values():
                assert t0 >= 0 and dur >= 0
                if parent >= 0:
                    p_t0, p_dur = step[parent][1:]
                    assert p_t0 <= t0 and t0 + dur <= p_t0 + p_dur
    # 8 steps of the decode models (388 spans each), 3 of the unusual calls (20 spans: the
    # excluded module has none, and the limit set inside the step drops three): in C, all but the
    # first step of each model, each layout's first span, and the calls handed an unregistered
    # ForwardBatch (97 a step)
    assert native["nofp"]["stats"]["spans"] == 8 * 388 + 3 * 20
    assert native["nofp"]["stats"]["dropped_spans"] == 3 * 3
    assert in_c_nofp >= 2 * (385 + 385 + 290)
    # with fingerprints, the second step of each decode model in C too: calls of several tensors
    # (SGLang's attention with its ForwardBatch, (x, residual) layers) included
    assert in_c_fp >= 385 + 385
    assert native["limit"]["stats"]["dropped_spans"] == 2 * (388 - 50)


@pytest.mark.parametrize("fingerprint", [False, True])
def test_python_calls_per_traced_module_call_with_the_c_wrapper(tmp_path, monkeypatch, fingerprint):
    """tests/unit/test_hot_path_calls.py's count with the C wrapper: a traced one-tensor module
    call runs no Python function of the tracer's, without fingerprints and with them (immediate
    CPU fingerprints: StepFingerprints.add_one's common case is tracer/native_host.py's
    add_one_host, in C)."""
    from native_loaded import load_native_in_process
    from test_hot_path_calls import calls_with_tracer

    load_native_in_process(monkeypatch)

    def check(tr):
        (wrapper,) = tr.global_handles
        assert wrapper.native_call is not None and wrapper.native_call.recorded > 0

    with_tracer, plain = calls_with_tracer(tmp_path, check, fingerprint=fingerprint)
    added = with_tracer["call"] - plain["call"]
    print(f"fingerprint={fingerprint}: +{added:g} Python calls per module call")
    assert added == 0
