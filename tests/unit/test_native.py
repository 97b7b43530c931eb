"""tracer/native.py: the C++ extension (fingerprint table, layout keys, call wrapper), built
here, when it is built and used, and the table checked against the Python path through Triton's
interpreter."""

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


@pytest.fixture
def cold_build(tmp_path, monkeypatch):
    """TORCH_EXTENSIONS_DIR for a cold build: the session's (tests/conftest.py), where nothing is
    built yet when the run's first test, this one, runs (the tests after it then load that
    build); a fresh folder if something was built there already."""
    from tensor_trace.tracer import native

    if native._built(native.build_directory()):
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return native.build_directory()


# First in the run (tests/conftest.py): its build is the one the other tests of the run load.
def test_a_build_begun_by_a_process_that_exits_at_once_finishes_for_the_next(cold_build):
    """A short traced run starts the build and exits: the compiler runs detached, so the build
    finishes and the next process loads it without compiling."""
    env = _build_env()
    if not (shutil.which("ninja", path=env["PATH"]) and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("no C++ compiler or ninja to build the extension")
    import time

    from tensor_trace.tracer import native

    folder = cold_build
    # A traced process has imported torch before its first step starts the build (the build
    # thread needs torch to find its folder, and a cold import can take longer than the 3 s):
    # gone long before a compile could end.
    short = ("import os, time\nimport torch\nfrom tensor_trace.tracer import native\nnative.ensure()\n"
             "time.sleep(3)\nos._exit(0)\n")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", short], env=env, timeout=120, check=True)
    assert time.monotonic() - t0 < 60 and not native._built(folder)
    deadline = time.monotonic() + 600
    while not native._built(folder) and time.monotonic() < deadline:
        time.sleep(1)
    assert native._built(folder), open(os.path.join(folder, "tensor_trace.build.log")).read()[-2000:]
    code = ("import time\nfrom tensor_trace.tracer import native\nt0 = time.monotonic()\n"
            "native.ensure(block=True, timeout=600)\n"
            "print(native.pair_key() is not None, round(time.monotonic() - t0, 1))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=700)
    ok, seconds = proc.stdout.split()
    assert ok == "True" and float(seconds) < 15, proc.stdout + proc.stderr[-2000:]


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
    assert report["not_taken"] == [-2, -2, -2, -1, 0]  # sparse, meta, nested; integer: the Python path
    # a subclass, an empty tensor, no such table, not a tensor; then a float tensor: 16 bytes held
    assert report["hold_in_not_taken"] == [-1, -1, -1, -1, 0] and report["hold_in_taken"]
    keys = report["pair_key"]
    assert keys["same"] and keys["order"] and keys["distinct"] == 8
    assert keys["unread"] == [-1, -1, -1]  # nested, not a tensor, one argument
    calls = report["call_key"]
    # 7 calls, 5 layouts: plain values and a context leave no slot (as in spans' Python key), so
    # (x, 3, None, ...) -> y and (x, ctx) -> y are one; a tuple result and a list are one
    assert calls["same"] and calls["distinct"] == 5 and calls["tuple_is_list"]
    assert calls["unread"] == [-1] * 5  # an object, a list in a keyword, a dict, a subclass
    assert report["native_key_taken"] and report["tracer_layouts_equal"]
    assert report["spans"] == 3 * (1 + 1 + 2 * 6)  # root, embed, 2 blocks of (block, norm, 2 x (Lin, Linear))
    assert report["call_layouts"] >= 3  # the (x, residual) norm, the (output, bias) Lins: by call_key


def _fresh_state(monkeypatch, cuda: bool, missing: str | None):
    """native.py's process state as in a process that has not asked yet, on a machine with or
    without CUDA and lacking ``missing`` of the build's toolchain (restored after the test)."""
    import torch

    from tensor_trace.tracer import native, spans

    for key, value in list(native._state.items()):
        monkeypatch.setitem(native._state, key, value)
    for key in ("table", "hold_in", "pair_key", "call_key", "traced_call", "patch_call_slots", "error",
                "auto"):
        monkeypatch.setitem(native._state, key, None)
    monkeypatch.setitem(native._state, "started", False)
    monkeypatch.setattr(spans, "pair_key", spans._py_pair_key)
    monkeypatch.setattr(spans, "call_key", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(native, "missing_toolchain", lambda: missing)
    monkeypatch.delenv("TENSOR_TRACE_NATIVE", raising=False)


def test_not_built_or_used_on_a_cpu_without_a_toolchain_unless_asked(monkeypatch, tmp_path):
    import torch

    from tensor_trace import tracer
    from tensor_trace.tracer import native, spans
    from tensor_trace.tracer.fingerprint import StepFingerprints

    _fresh_state(monkeypatch, cuda=False, missing="ninja")
    fps = StepFingerprints(defer_cuda=False, defer_cpu=True)
    fps.add_one(torch.randn(4))
    assert fps._nt is None and not fps._native_wanted
    tr = tracer.start(out_dir=str(tmp_path), fingerprint=False, lineage=False)
    try:
        torch.nn.Linear(2, 2)(torch.randn(1, 2))
        assert not tr.native_pending and spans.uses_python_keys()
    finally:
        tracer.stop()
    assert not native.enabled() and native.table_class() is None and not native._state["started"]


def test_auto_means_where_cuda_is_or_the_machine_can_build_it(monkeypatch, tmp_path):
    from tensor_trace.tracer import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # (no failed build marked there)
    for cuda, missing, auto in ((True, None, True), (True, "ninja", True), (False, None, True),
                                (False, "a C++ compiler (c++)", False), (False, "ninja", False)):
        _fresh_state(monkeypatch, cuda, missing)
        for value, expect in ((None, auto), ("auto", auto), ("1", True), ("0", False)):
            if value is None:
                monkeypatch.delenv("TENSOR_TRACE_NATIVE", raising=False)
            else:
                monkeypatch.setenv("TENSOR_TRACE_NATIVE", value)
            assert native.enabled() is expect, (cuda, missing, value)
    # a failed build of this source marked in the folder: not tried again under auto on a CPU
    os.makedirs(native.build_directory())
    with open(os.path.join(native.build_directory(), "tensor_trace.failed"), "w") as f:
        f.write(native._stamp())
    _fresh_state(monkeypatch, cuda=False, missing=None)
    assert native.enabled() is False and native.enabled("1") is True


def test_a_failed_build_is_reported_once_and_not_tried_again_under_auto(tmp_path):
    """A build that fails (here a compiler that fails at once) says so on stderr with its log,
    and marks the folder: the next traced process under auto takes the Python path at once,
    silently, with no compiler run; TENSOR_TRACE_NATIVE=1 tries again."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no false(1) to stand for a broken compiler")
    env = dict(_build_env(), TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=false)
    env.pop("TENSOR_TRACE_NATIVE")
    code = ("import torch\nfrom tensor_trace.tracer import native\n"
            "native.missing_toolchain = lambda: None  # (on a machine lacking one: as if it had it)\n"
            "print(native.enabled())\nnative.ensure(block=True, timeout=600)\n"
            "print(native.pair_key() is None, native.error() is not None)\n")

    def run(**extra):
        proc = subprocess.run([sys.executable, "-c", code], env=dict(env, **extra), capture_output=True,
                              text=True, timeout=700)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split(), [line for line in proc.stderr.splitlines() if "tensor-trace" in line]

    out, said = run()
    (folder,) = [str(p) for p in tmp_path.iterdir()]
    log = os.path.join(folder, "tensor_trace.build.log")
    assert out == ["True", "True", "True"] and len(said) == 1 and log in said[0], (out, said)
    assert os.path.exists(os.path.join(folder, "tensor_trace.failed"))
    size = os.path.getsize(log)
    out, said = run()  # auto: not enabled, nothing said, no build run
    assert out == ["False", "True", "False"] and said == [] and os.path.getsize(log) == size
    out, said = run(TENSOR_TRACE_NATIVE="1")  # asked for: tried again (and failed again)
    assert out == ["True", "True", "True"] and len(said) == 1 and os.path.getsize(log) > size


def test_a_build_lock_left_by_a_killed_process_does_not_stop_later_builds(tmp_path):
    """torch's build lock is a plain file: a traced process that exits while its background
    build runs leaves it, and torch then waits for it forever. native.py's flock clears it."""
    env = _build_env()
    if not (shutil.which("ninja", path=env["PATH"]) and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("no C++ compiler or ninja to build the extension")
    from tensor_trace.tracer import native

    folder = native.build_directory()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "lock"), "w"):
        pass  # what a process killed mid-build leaves
    code = ("from tensor_trace.tracer import native\n"
            "native.ensure(block=True, timeout=600)\n"
            "print(native.pair_key() is not None, native.error())\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "True", proc.stdout + proc.stderr[-2000:]
    assert not os.path.exists(os.path.join(folder, "lock"))


def test_a_session_that_says_no_takes_the_python_path_after_one_that_took_the_extension(
        tmp_path, monkeypatch):
    """The layout keys are module globals: a tracer session with TENSOR_TRACE_NATIVE=0 in a
    process whose earlier session took the extension keys in Python and calls modules through
    the Python wrapper, as a fresh process would (tests that pin the Python path rely on it)."""
    import torch

    from native_loaded import load_native_in_process
    from tensor_trace import tracer
    from tensor_trace.tracer import spans

    load_native_in_process(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    wrappers = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("TENSOR_TRACE_NATIVE", setting)
        tr = tracer.start(out_dir=str(tmp_path / setting), fingerprint=False, lineage=False)
        try:
            for _ in range(3):
                model(x)
            (wrappers[setting],) = tr.global_handles
            wrappers[setting] = (wrappers[setting].native_call, spans.uses_python_keys())
            recorded = 0 if wrappers[setting][0] is None else wrappers[setting][0].recorded
        finally:
            tracer.stop()
        assert tr.errors == 0
        if setting == "1":
            assert recorded > 0 and not wrappers["1"][1]
    assert wrappers["0"] == (None, True)
