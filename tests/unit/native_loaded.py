"""The native extension loaded in this test process, the process's state as it was put back after
the test (the extension's load state, its event, the layout keys spans.py took, the readers
host_values.py took)."""

import os
import shutil
import sys
import threading

import pytest


def load_native_in_process(monkeypatch):
    """Build or load tracer/native.py here with TENSOR_TRACE_NATIVE=1 (skip where no compiler
    or ninja can build it); return the ``native`` module."""
    env_path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    if not (shutil.which("ninja", path=env_path) and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("no C++ compiler or ninja to build the extension")
    from tensor_trace.tracer import host_values, native, spans

    monkeypatch.setenv("TENSOR_TRACE_NATIVE", "1")
    monkeypatch.setenv("PATH", env_path)
    for key, value in list(native._state.items()):
        monkeypatch.setitem(native._state, key, value)
    monkeypatch.setattr(native, "_done", native._done)
    if not native._state["started"]:  # (a load of its own to wait for; one begun by an earlier
        native._done = threading.Event()  # test, or done, sets the event it has)
    monkeypatch.setattr(spans, "pair_key", spans.pair_key)
    monkeypatch.setattr(spans, "call_key", spans.call_key)
    monkeypatch.setattr(host_values, "native_pair", host_values.native_pair)
    monkeypatch.setattr(host_values, "native_rows", host_values.native_rows)
    monkeypatch.setattr(host_values, "native_add", host_values.native_add)
    native.ensure(block=True, timeout=900)
    assert native.traced_call() is not None, native.error()
    return native
