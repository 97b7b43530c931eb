"""Start tracing from the environment that ``tensor-trace record`` prepared.

Called by the bootstrap ``sitecustomize`` right after ``import torch`` completes. Also arranges
that the rank file is completed on exit, SIGTERM, and in multiprocessing children (forked ones
leave through ``os._exit``, which skips ``atexit``; multiprocessing runs its own finalizers).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading


def start_from_env() -> None:
    from tensor_trace import tracer
    from tensor_trace.tracer.config import TraceConfig

    config = TraceConfig.from_env()
    if config is None:
        return
    tr = tracer.start(config)
    atexit.register(tracer.stop, "exit")
    _register_mp_finalizer(tr)
    tr.after_fork_callbacks.append(lambda: _register_mp_finalizer(tr))
    _install_sigterm(tr)


def _register_mp_finalizer(tr) -> None:
    try:
        from multiprocessing import util

        util.Finalize(None, tr.stop, args=("exit",), exitpriority=-1000)
    except Exception:
        pass


def _install_sigterm(tr) -> None:
    # Only where nobody else handles SIGTERM: complete the trace, then die as SIGTERM would.
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
    except Exception:
        return

    def on_sigterm(signum, frame):
        try:
            tr.stop("SIGTERM")
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def report_failure(exc: BaseException) -> None:
    try:
        sys.stderr.write(f"tensor-trace: tracing not started in pid {os.getpid()}: {exc}\n")
    except Exception:
        pass
